"""The one stateful part of deciding: remembers what was sent, so that each occurrence is
told once, and a restarted sender (hub or ``gputop notify run``) sends no duplicates.

Its memory is a small JSON file (``sent.json`` beside the history database by default:
``default_path``), rewritten atomically after each pass that sent something, bounded to
the last ``MAX_KEYS`` keys. A hostile or broken file is read as empty: the worst case is a
repeat, never a crash.
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
from collections.abc import Iterable, Mapping
from dataclasses import replace
from datetime import datetime
from pathlib import Path
from typing import Any

from gputop.notify.events import (
    DIGEST_OVER,
    EXPIRY_WARNING_S,
    Seen,
    digest,
    flag_conditions,
    host_notice,
    iso,
    short_text,
    store_notices,
)
from gputop.notify.notice import Notice, Notifier
from gputop.reservations.records import parse_time
from gputop.reservations.state import StoreState

#: Sent keys remembered (oldest forgotten first); each is one occurrence, most of them
#: about a reservation that has long ended.
MAX_KEYS = 5000
#: A flag that comes back within this long of clearing is the same occurrence (a job that
#: starts and stops on someone's GPU is one notice, not one per start).
COOLDOWN_S = 1800.0
#: A host is told down only after it failed this long (a restart of sshd is not news).
HOST_GRACE_S = 5 * 60.0
#: The file is refused beyond this size (a planted huge file is not read).
MAX_FILE_BYTES = 1024 * 1024


def default_path() -> Path:
    """``$XDG_STATE_HOME/gputop/notify-sent.json`` (the history database's directory)."""
    base = os.environ.get("XDG_STATE_HOME") or os.path.join(
        os.path.expanduser("~"), ".local", "state")
    return Path(base) / "gputop" / "notify-sent.json"


class Watcher:
    """Feed it each look at the team (``observe``); it hands new notices to ``notifier``."""

    def __init__(self, notifier: Notifier, path: Path | None = None, *,
                 warn_s: float = EXPIRY_WARNING_S, host_grace_s: float = HOST_GRACE_S,
                 digest_over: int = DIGEST_OVER) -> None:
        self.notifier = notifier
        self.path = path
        self.warn_s = warn_s
        self.host_grace_s = host_grace_s
        self.digest_over = digest_over
        #: Keys sent, oldest first (a dict as an ordered set).
        self.sent: dict[str, None] = {}
        #: Flag conditions standing now, each with the key of its occurrence.
        self.open: dict[str, str] = {}
        #: Each open condition's host (not kept across restarts: a host failing its
        #: first look after one clears it, as before).
        self.where: dict[str, str] = {}
        #: Conditions cleared lately: their key and when (see COOLDOWN_S).
        self.closed: dict[str, tuple[str, datetime]] = {}
        #: Hosts seen down, since when.
        self.down: dict[str, datetime] = {}
        self.last: Seen | None = None
        self._load()

    def _load(self) -> None:
        if self.path is None:
            return
        try:
            with open(self.path, "rb") as f:
                raw = f.read(MAX_FILE_BYTES + 1)
            doc = json.loads(raw) if len(raw) <= MAX_FILE_BYTES else {}
        except (OSError, ValueError):
            return
        if not isinstance(doc, dict):
            return
        sent, opened, down = doc.get("sent"), doc.get("open"), doc.get("down")
        if isinstance(sent, list):
            self.sent = dict.fromkeys(k for k in sent[-MAX_KEYS:] if isinstance(k, str))
        if isinstance(opened, dict):
            self.open = {k: v for k, v in opened.items() if isinstance(v, str)}
        if isinstance(down, dict):
            for host, t in down.items():
                try:
                    self.down[host] = parse_time(t, "down")
                except ValueError:
                    continue

    def _save(self) -> None:
        if self.path is None:
            return
        doc = {"sent": list(self.sent), "open": self.open,
               "down": {h: iso(t) for h, t in self.down.items()}}
        self.path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        fd, tmp = tempfile.mkstemp(dir=self.path.parent, prefix=".notify-sent.")
        try:
            with os.fdopen(fd, "w") as f:
                json.dump(doc, f)
            os.replace(tmp, self.path)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise

    def _fresh(self, notices: Iterable[Notice]) -> list[Notice]:
        return [n for n in notices if n.key not in self.sent]

    def _flags(self, hosts: Iterable[Mapping[str, Any]], now: datetime) -> list[Notice]:
        hosts = list(hosts)
        standing = flag_conditions(hosts)
        # Only a host that answered can clear its flags: one that failed this look shows
        # no GPUs, which is not a flag gone (each failed poll was a new occurrence).
        failed = {short_text(str(h.get("name"))) for h in hosts if h.get("status") != "ok"}
        out = []
        for cond, n in standing.items():
            key = self.open.get(cond)
            if key is None:
                was = self.closed.pop(cond, None)
                back = was is not None and (now - was[1]).total_seconds() < COOLDOWN_S
                key = self.open[cond] = was[0] if was is not None and back \
                    else f"{cond}:{iso(now)}"
            self.where[cond] = n.fields.get("host", "")
            out.append(replace(n, key=key))
        for cond in [c for c in self.open if c not in standing]:
            if self.where.get(cond) in failed:
                continue
            # cleared: its next appearance, past the cool-down, is a new occurrence
            self.closed[cond] = (self.open.pop(cond), now)
            self.where.pop(cond, None)
        for cond, (_, at) in list(self.closed.items()):
            if (now - at).total_seconds() >= COOLDOWN_S:
                del self.closed[cond]
        return out

    def _hosts(self, hosts: Iterable[Mapping[str, Any]], now: datetime) -> list[Notice]:
        out = []
        for h in hosts:
            name, err = str(h.get("name")), h.get("error")
            if isinstance(err, dict) and err.get("kind") == "starting":
                continue
            if h.get("status") == "ok":
                since = self.down.pop(name, None)
                if since is not None and f"host-down:{name}:{iso(since)}" in self.sent:
                    out.append(host_notice("host-up", name, since))
                continue
            since = self.down.setdefault(name, now)
            if (now - since).total_seconds() >= self.host_grace_s:
                out.append(host_notice("host-down", name, since))
        return out

    def derive(self, state: StoreState | None, hosts: Iterable[Mapping[str, Any]],
               now: datetime) -> list[Notice]:
        """What this look adds (not yet marked sent). ``state`` None: the file could not
        be read now; the store's part waits for the next good read."""
        hosts = list(hosts)
        out: list[Notice] = []
        if state is not None:
            new = Seen(state, now)
            out += store_notices(self.last, new, self.warn_s)
            self.last = new
        out += self._flags(hosts, now) + self._hosts(hosts, now)
        return self._fresh(out)

    def observe(self, state: StoreState | None, hosts: Iterable[Mapping[str, Any]],
                now: datetime) -> list[Notice]:
        """Derive, digest per person, submit, remember. Returns what was submitted."""
        before = (dict(self.open), dict(self.down))
        fresh = self.derive(state, hosts, now)
        sending = digest(fresh, self.digest_over)
        for n in fresh:
            self.sent[n.key] = None
        for n in sending:
            self.sent[n.key] = None
            self.notifier.submit(n)
        # Oldest first, but never a key whose condition still stands (forgotten, it
        # would be sent again): those go to the back.
        standing = set(self.open.values())
        for _ in range(len(self.sent)):
            if len(self.sent) <= MAX_KEYS:
                break
            oldest = next(iter(self.sent))
            del self.sent[oldest]
            if oldest in standing:
                self.sent[oldest] = None
        if fresh or before != (self.open, self.down):
            self._save()
        return sending

