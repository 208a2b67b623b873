"""The GPUs of hosts that do not answer now, as gputop knows them: a reservation is
accepted only for a GPU known to exist (see ``reservations.targets.check_targets``).

Two sources: the history database, when one is there and readable (the GPUs of the
host's latest good answer, and the MIG instances of its latest raw sample), and
``gpus = N`` in the host's ``[[hosts]]`` entry. A host in neither has no GPU known.
"""

from __future__ import annotations

import json
import sqlite3
from collections.abc import Collection

from gputop.config.load import Config
from gputop.history.db import HistoryDB, HistoryError
from gputop.reservations.targets import Known


def known_gpus(config: Config, hosts: Collection[str]) -> dict[str, Known]:
    """``hosts``' GPUs as known from the history and the config (both, where both know)."""
    out = _from_history(config, hosts)
    for h in config.hosts:
        if h.name in hosts and h.gpus is not None:
            said = frozenset(range(h.gpus))
            seen = out.get(h.name)
            out[h.name] = Known(said, f"gpus = {h.gpus} in {config.path or 'hosts.toml'}") \
                if seen is None else Known(seen.gpus | said, f"{seen.source} and gpus = "
                                           f"{h.gpus} in {config.path or 'hosts.toml'}",
                                           seen.instances)
    return out


def _from_history(config: Config, hosts: Collection[str]) -> dict[str, Known]:
    path = config.history.path
    if not hosts or not path.is_file():
        return {}
    try:
        db = HistoryDB(path)
    except HistoryError:
        return {}
    out: dict[str, Known] = {}
    try:
        with db.errors():
            for name in hosts:
                row = db.conn.execute("SELECT id FROM hosts WHERE name = ?", (name,)).fetchone()
                if row is None:
                    continue
                idx = {int(gid): int(i) for gid, i in db.conn.execute(
                    "SELECT id, idx FROM gpus WHERE host = ? AND current = 1 AND idx IS NOT "
                    "NULL", (row[0],))}
                if idx:
                    out[name] = Known(frozenset(idx.values()), f"the history in {path}",
                                      _instances(db.conn, row[0], idx))
    except (HistoryError, sqlite3.Error):
        return {}
    finally:
        db.close()
    return out


def _instances(conn: sqlite3.Connection, host: int, idx: dict[int, int]
               ) -> dict[int, frozenset[int]]:
    """Each GPU's MIG instances in the host's latest good raw sample (none: unknown)."""
    row = conn.execute("SELECT gpus FROM samples WHERE host = ? AND ok = 1 ORDER BY t DESC "
                       "LIMIT 1", (host,)).fetchone()
    if row is None:
        return {}
    out: dict[int, frozenset[int]] = {}
    try:
        entries = json.loads(row[0])
    except ValueError:
        return {}
    for e in entries if isinstance(entries, list) else ():
        if not isinstance(e, list) or not e or type(e[0]) is not int or e[0] not in idx:
            continue
        parts = e[6] if len(e) > 6 else None
        out[idx[e[0]]] = frozenset(p[0] for p in parts if isinstance(p, list) and p
                                   and type(p[0]) is int) if isinstance(parts, list) \
            else frozenset()
    return out
