"""Snapshots in, rows out: the recorder behind ``gputop record`` (and ``--record``).

Each host snapshot becomes one raw row. A host that did not answer is recorded as *no
data* for the GPUs it last had, never as zeros. Rows are committed in batches (at most
every ``commit_every`` seconds), so a killed recorder loses at most that much and the
database stays valid (SQLite WAL). ``maintain`` rolls complete minutes and hours up and
drops raw samples, minutes and hours past their keep windows.

Which user names get rows of their own is ``names``' rule: a name seen for a single
refresh, or beyond the new-name limit, counts under ``(other names)``, and a rollup keeps
the 16 busiest names per GPU and bucket, so history's size does not grow with the names
that arrive; new GPUs of a host are admitted at a bounded rate (``names.GpuGate``), so
that a host reporting new uuids every refresh does not grow the ``gpus`` table without
bound. A host that is down before any of its GPUs was seen is recorded as one
pseudo GPU with key ``""`` (no uuid is empty): the report counts it as the host's time with
no data and GPUs unknown, not as GPU-hours.

A GPU held in memory shares is recorded with its shares (holder, fraction of its memory;
see ``accounting``), also while its host is down: a share is reserved either way.

A MIG GPU whose instances are known is recorded with one part per instance (its GI id,
fraction, users and holder; see ``accounting``), so that each instance counts for its
fraction. If a process on it cannot be placed on an instance, or an instance's size is
unknown, the GPU is recorded whole, as before: fractions need to know who runs where.
"""

from __future__ import annotations

import json
import sqlite3
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from itertools import groupby

from gputop.history.accounting import UNKNOWN_USER, account, mig_fraction
from gputop.history.db import GPU_METRICS, USER_METRICS, HistoryDB, HistoryError
from gputop.history.names import MAX_NAMED, OTHER_NAMES, GpuGate, NameGate, fold
from gputop.model import GpuInfo, HostSnapshot, ProcessInfo
from gputop.reservations.records import Reservation
from gputop.reservations.state import StoreState

RAW_KEEP_S = 2 * 86400.0
MINUTE_KEEP_S = 30 * 86400.0
#: A minute is rolled up this long after it ends (late rows of a slow host still land).
ROLLUP_DELAY_S = 30.0
#: The key of a down host's GPUs while none of them is known (a GPU's key is its uuid or
#: ``index:N``, never empty).
UNKNOWN_GPUS_KEY = ""
#: Samples remembered for writing again when a name in them is kept (see ``_revisit``).
REVISITS_MAX = 1024


@dataclass
class _Revisit:
    t: int
    hid: int
    snap: HostSnapshot
    current: list[int]
    held: dict[tuple[str, int], Reservation]
    inst_held: dict[tuple[str, int, int], Reservation]
    waiting: set[str]  # names in it not kept yet
    shares: dict[tuple[str, int], list[Reservation]] = field(default_factory=dict)


def _ms(t: datetime) -> int:
    return int(t.timestamp() * 1000)


class Recorder:
    def __init__(self, db: HistoryDB, *, interval: float, timeout: float = 10.0,
                 raw_keep_s: float = RAW_KEEP_S, minute_keep_s: float = MINUTE_KEEP_S,
                 hour_keep_s: float | None = None, commit_every: float = 1.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.db = db
        self.interval = interval
        #: A gap longer than this (recorder stopped) is not attributed to the next sample.
        self.max_gap_ms = int(1000 * max(2 * interval, interval + timeout))
        self.raw_keep_s, self.minute_keep_s = raw_keep_s, minute_keep_s
        self.hour_keep_s = hour_keep_s  # None: forever
        self.commit_every = commit_every
        self._clock = clock
        self._hosts: dict[str, int] = {}
        self._users: dict[str, int] = {}
        self._gpus: dict[tuple[int, str], int] = {}
        self._gpu_meta: dict[int, tuple[int | None, str | None, int | None]] = {}
        self._current: dict[int, list[int]] = {}
        self._last: dict[int, int] = {}
        self._held: dict[tuple[str, int], Reservation] = {}
        self._inst_held: dict[tuple[str, int, int], Reservation] = {}
        self._shares: dict[tuple[str, int], list[Reservation]] = {}
        self._revisits: list[_Revisit] = []
        self._minute_done = 0
        self._state: StoreState | None = None
        self._last_commit = clock()
        try:
            with db.transaction() as c:  # the report's chart is no finer than the samples
                c.execute("INSERT OR REPLACE INTO meta VALUES ('interval_ms', ?)",
                          (int(interval * 1000),))
            self._load()
            self._minute_done = db.meta("minute_done")
        except HistoryError:
            db.abandon()
            raise
        self.new_gpus = GpuGate()
        self.names = NameGate(self._users, lambda n: self._id("users", self._users, n),
                              interval_ms=int(interval * 1000), max_gap_ms=self.max_gap_ms)

    def _load(self) -> None:
        with self.db.errors():
            c = self.db.conn
            self._hosts = {n: i for i, n in c.execute("SELECT id, name FROM hosts")}
            self._users = {n: i for i, n in c.execute("SELECT id, name FROM users")}
            for gid, host, key, idx, name, mem, cur in c.execute(
                    "SELECT id, host, key, idx, name, memory_total_mib, current FROM gpus"):
                self._gpus[(host, key)] = gid
                self._gpu_meta[gid] = (idx, name, mem)
                if cur:
                    self._current.setdefault(host, []).append(gid)
            # The latest sample of any host (fast: the table is ordered by time) stands for
            # each host's: after a restart the first gap is capped at max_gap_ms anyway.
            last = c.execute("SELECT MAX(t) FROM samples").fetchone()[0]
            if last is not None:
                self._last = dict.fromkeys(self._hosts.values(), int(last))
            c.execute("SELECT COUNT(*) FROM gpu_minute").fetchone()  # reads the tables:
            c.execute("SELECT COUNT(*) FROM user_hour").fetchone()  # corrupt pages show now

    # -- ids ------------------------------------------------------------------------------

    def _id(self, table: str, cache: dict[str, int], name: str) -> int:
        got = cache.get(name)
        if got is None:
            cur = self.db.conn.execute(f"INSERT INTO {table} (name) VALUES (?)", (name,))
            got = cache[name] = int(cur.lastrowid or 0)
        return got

    def _gpu_id(self, host: int, key: str, idx: int | None, name: str | None,
                mem: int | None) -> int:
        gid = self._gpus.get((host, key))
        if gid is None:
            cur = self.db.conn.execute(
                "INSERT INTO gpus (host, key, idx, name, memory_total_mib) VALUES (?,?,?,?,?)",
                (host, key, idx, name, mem))
            gid = self._gpus[(host, key)] = int(cur.lastrowid or 0)
            self._gpu_meta[gid] = (idx, name, mem)
        elif self._gpu_meta.get(gid) != (idx, name, mem):
            self.db.conn.execute("UPDATE gpus SET idx = ?, name = ?, memory_total_mib = ? "
                                 "WHERE id = ?", (idx, name, mem, gid))
            self._gpu_meta[gid] = (idx, name, mem)
        return gid

    # -- recording ------------------------------------------------------------------------

    def set_reservations(self, state: StoreState | None) -> None:
        """The reservations file as last read (None: unreadable, so nobody holds anything)."""
        self._state = state
        rs = () if state is None else state.reservations
        self._held = {(r.host, r.gpu): r for r in rs
                      if r.instance is None and r.share_mib is None}
        self._inst_held = {(r.host, r.gpu, r.instance): r for r in rs if r.instance is not None}
        self._shares = {}
        for r in rs:
            if r.share_mib is not None:
                self._shares.setdefault((r.host, r.gpu), []).append(r)

    def _reservation(self, host: str, idx: int | None, at: datetime,
                     instance: int | None = None) -> Reservation | None:
        """The GPU's reservation (or, with ``instance``, that MIG GPU instance's: its own,
        else the whole GPU's)."""
        if idx is None:
            return None
        r = None if instance is None else self._inst_held.get((host, idx, instance))
        if r is None or not self._active(r, at):
            r = self._held.get((host, idx))
        if r is None or not self._active(r, at):
            return None
        return r

    def _share_parts(self, host: str, idx: int | None, at: datetime, mem: int | None
                     ) -> list[list[object]] | None:
        """A shared GPU's shares: [[holder id, fraction of the GPU's memory], ...] (a
        fraction is its share of ``mem``, the GPU's total; together at most 1). None when
        the GPU has no active share, or its total is unknown (then nobody holds it)."""
        if idx is None or not self._shares:
            return None
        rs = [r for r in self._shares.get((host, idx), ()) if self._active(r, at)]
        if not rs or not mem:
            return None
        total = sum(r.share_mib or 0 for r in rs)
        scale = 1.0 if total <= mem else mem / total  # (a file that overcommits it)
        # One part per name kept, the MAX_NAMED largest shares by name and the rest as
        # (other names): a hand-written file with thousands of shares of one GPU must not
        # make every sample of it that large (the GPU's reserved time stays exact).
        rs = sorted(rs, key=lambda r: -(r.share_mib or 0))
        parts: dict[int, float] = {}
        for n, r in enumerate(rs):
            uid = self.names.resolve(r.user, _ms(at)) if n < MAX_NAMED else self.names.others()
            parts[uid] = parts.get(uid, 0.0) + (r.share_mib or 0) / mem * scale
        return [[uid, frac] for uid, frac in parts.items()]

    def _active(self, r: Reservation, at: datetime) -> bool:
        # An expiry beyond max_duration counts until created + max_duration.
        return (r.active(at) if self._state is None else self._state.ends(r, at) > at)

    def _holder(self, host: str, idx: int | None, at: datetime,
                instance: int | None = None) -> int | None:
        """Who holds the GPU (see ``_reservation``)."""
        r = self._reservation(host, idx, at, instance)
        return None if r is None else self.names.resolve(r.user, _ms(at))

    def _user_ids(self, procs: tuple[ProcessInfo, ...], t_ms: int,
                  r: Reservation | None = None,
                  shares: Sequence[Reservation] = ()) -> list[int]:
        """Process owners; the holder's login on the host (``Reservation.login``) counts
        as the holder, so the holder's own job is credited to the holder (on a shared
        GPU: the share whose holder it is)."""
        if not procs:
            return []
        holders = ((r,) if r is not None else ()) + tuple(shares)
        return self.names.user_ids([
            next((h.user for h in holders if p.user and h.is_holder(p.user)), None)
            or p.user or UNKNOWN_USER for p in procs], t_ms)

    def _active_shares(self, host: str, idx: int | None, at: datetime
                       ) -> tuple[Reservation, ...]:
        if idx is None or not self._shares:
            return ()
        return tuple(r for r in self._shares.get((host, idx), ()) if self._active(r, at))

    def _parts(self, host: str, g: GpuInfo, at: datetime) -> list[list[object]] | None:
        """One part per MIG instance, or None to record the GPU whole (see the module)."""
        if not g.instances or g.lost:
            return None
        if sum(len(i.processes) for i in g.instances) != len(g.processes):
            return None  # a process the inventory could not place
        fracs = [mig_fraction(i.profile, g.name, i.memory_total_mib, g.memory_total_mib)
                 for i in g.instances]
        if any(f is None for f in fracs):
            return None
        total = sum(f for f in fracs if f is not None)
        scale = 1.0 if total <= 1.0 else 1.0 / total  # instances that claim more than all
        return [[i.gpu_instance_id, (f or 0.0) * scale, i.utilization_percent,
                 self._user_ids(i.processes, _ms(at),
                                self._reservation(host, g.index, at, i.gpu_instance_id)),
                 self._holder(host, g.index, at, i.gpu_instance_id)]
                for i, f in zip(g.instances, fracs)]

    def record(self, snap: HostSnapshot) -> None:
        """Buffer one host snapshot (committed by ``flush`` or the next timely ``record``)."""
        with self.db.errors():
            self._record(snap)
        if self._clock() - self._last_commit >= self.commit_every:
            self.flush()

    def _record(self, snap: HostSnapshot) -> None:
        if not self.db.conn.in_transaction:
            self.db.conn.execute("BEGIN IMMEDIATE")
        hid = self._id("hosts", self._hosts, snap.name)
        t = _ms(snap.time)
        prev = self._last.get(hid)
        if prev is not None and t <= prev:
            return  # a clock step back, or the same sample twice
        dt = int(self.interval * 1000) if prev is None else min(t - prev, self.max_gap_ms)
        self._last[hid] = t
        current = self._current.get(hid, [])
        self.names.waiting.clear()
        entries = self._entries(hid, snap)
        if self.names.waiting:  # written as (other names) for now: see _revisit
            self._revisits.append(_Revisit(t, hid, snap, current, self._held,
                                           self._inst_held, set(self.names.waiting),
                                           self._shares))
            del self._revisits[:-REVISITS_MAX]
        error = None if snap.error is None else snap.error.kind
        self.db.conn.execute(
            "INSERT OR IGNORE INTO samples (t, host, dt, ok, error, gpus) VALUES (?,?,?,?,?,?)",
            (t, hid, dt, int(snap.ok), error, json.dumps(entries, separators=(",", ":"))))
        if self.names.admitted:
            self._revisit(set(self.names.admitted))
            self.names.admitted.clear()

    def _revisit(self, admitted: set[str]) -> None:
        """Names just kept had their first refreshes written as (other names): write those
        samples again with what is known now, while they are not rolled up yet."""
        live = (self._held, self._inst_held, self._shares)
        self.names.replaying = True
        try:
            keep = []
            for r in self._revisits:
                if r.t < self._minute_done * 1000:
                    continue  # rolled up (or about to be): it stays as it is
                if r.waiting & admitted:
                    self._held, self._inst_held, self._shares = r.held, r.inst_held, r.shares
                    entries = self._entries(r.hid, r.snap, r.current)
                    self.db.conn.execute("UPDATE samples SET gpus = ? WHERE t = ? AND host = ?",
                                         (json.dumps(entries, separators=(",", ":")), r.t,
                                          r.hid))
                    r.waiting -= admitted
                if r.waiting:
                    keep.append(r)
            self._revisits = keep
        finally:
            self.names.replaying = False
            self._held, self._inst_held, self._shares = live

    def _entries(self, hid: int, snap: HostSnapshot, current: list[int] | None = None
                 ) -> list[list[object]]:
        """The sample's GPU entries; ``current``: replaying, the host's GPUs back then."""
        entries: list[list[object]] = []
        t_ms = _ms(snap.time)
        if snap.ok:
            ids = []
            for g in snap.gpus:
                key = g.uuid or (f"index:{g.index}" if g.index is not None else None)
                if key is None or ((hid, key) not in self._gpus and (
                        current is not None or not self.new_gpus.take(hid, t_ms))):
                    continue  # not admitted (yet): see names.GpuGate
                gid = self._gpu_id(hid, key, g.index, g.name, g.memory_total_mib)
                ids.append(gid)
                util = None if g.lost else g.utilization_percent
                entry: list[object] = [gid, util, g.memory_used_mib,
                                       self._user_ids(g.processes, t_ms, self._reservation(
                                           snap.name, g.index, snap.time),
                                           self._active_shares(snap.name, g.index,
                                                               snap.time)),
                                       self._holder(snap.name, g.index, snap.time),
                                       int(g.lost)]
                parts = self._parts(snap.name, g, snap.time)
                shares = self._share_parts(snap.name, g.index, snap.time, g.memory_total_mib)
                if parts is not None or shares is not None:
                    entry.append(parts)
                if shares is not None:
                    entry.append(shares)
                entries.append(entry)
            if current is None and ids != self._current.get(hid):
                self.db.conn.execute("UPDATE gpus SET current = 0 WHERE host = ?", (hid,))
                self.db.conn.executemany("UPDATE gpus SET current = 1 WHERE id = ?",
                                         [(i,) for i in ids])
                self._current[hid] = ids
        else:
            gids = (self._current.get(hid) if current is None else current) or [
                self._gpu_id(hid, UNKNOWN_GPUS_KEY, None, None, None)]  # no GPU seen yet
            for gid in gids:
                idx, _name, mem = self._gpu_meta.get(gid, (None, None, None))
                entry = [gid, None, None, [], self._holder(snap.name, idx, snap.time), 1]
                shares = self._share_parts(snap.name, idx, snap.time, mem)
                if shares is not None:  # a share is reserved while its host is down too
                    entry += [None, shares]
                entries.append(entry)
        return entries

    def flush(self) -> None:
        with self.db.errors():
            if self.db.conn.in_transaction:
                self.db.conn.execute("COMMIT")
        self._last_commit = self._clock()

    # -- rollups --------------------------------------------------------------------------

    def maintain(self, now: float) -> None:
        """Roll up complete minutes and hours, then drop what is past its keep window.
        ``now`` is UTC epoch seconds."""
        self.flush()
        self.names.purge(int(now * 1000))
        with self.db.transaction() as c:
            minute_done = rollup_minutes(c, self.db.meta("minute_done"),
                                         int(now - ROLLUP_DELAY_S) // 60 * 60)
            self._minute_done = minute_done
            hour_done = rollup_up(c, "minute", "hour", 3600, self.db.meta("hour_done"),
                                  minute_done)
            day_done = rollup_up(c, "hour", "day", 86400, self.db.meta("day_done"), hour_done)
            raw_cut = min(int(now - self.raw_keep_s) // 60 * 60, minute_done)
            c.execute("DELETE FROM samples WHERE t < ?", (raw_cut * 1000,))
            minute_cut = min(int(now - self.minute_keep_s) // 3600 * 3600, hour_done)
            if minute_cut > self.db.meta("minute_from"):
                c.execute("DELETE FROM gpu_minute WHERE b < ?", (minute_cut,))
                c.execute("DELETE FROM user_minute WHERE b < ?", (minute_cut,))
                c.execute("UPDATE meta SET value = ? WHERE key = 'minute_from'", (minute_cut,))
            if self.hour_keep_s is None:
                return
            hour_cut = min(int(now - self.hour_keep_s) // 86400 * 86400, day_done)
            if hour_cut > self.db.meta("hour_from"):
                c.execute("DELETE FROM gpu_hour WHERE b < ?", (hour_cut,))
                c.execute("DELETE FROM user_hour WHERE b < ?", (hour_cut,))
                c.execute("INSERT OR REPLACE INTO meta VALUES ('hour_from', ?)", (hour_cut,))


def rollup_up(c: sqlite3.Connection, finer: str, coarser: str, size: int, done: int,
              finer_done: int) -> int:
    """Sum the complete ``coarser`` buckets (hour, day) of [done, finer_done) from the
    ``finer`` tier; the new mark."""
    target = finer_done // size * size
    if target <= done:
        return done
    sums = ", ".join(f"SUM({m})" for m in GPU_METRICS)
    add = ", ".join(f"{m} = {m} + excluded.{m}" for m in GPU_METRICS)
    c.execute(f"INSERT INTO gpu_{coarser} SELECT b / {size} * {size} AS cb, gpu, {sums} "
              f"FROM gpu_{finer} WHERE b >= ? AND b < ? GROUP BY cb, gpu "
              f"ON CONFLICT (b, gpu) DO UPDATE SET {add}", (done, target))
    # Users: summed by SQLite, then each GPU's bucket folded to its busiest names.
    others = others_uid(c)
    usums = ", ".join(f"SUM({m})" for m in USER_METRICS)
    rows = c.execute(f"SELECT b / {size} * {size} AS cb, gpu, user, {usums} FROM "
                     f"user_{finer} WHERE b >= ? AND b < ? GROUP BY cb, gpu, user "
                     "ORDER BY cb, gpu", (done, target))
    insert = upsert(f"user_{coarser}", ("b", "gpu", "user"), USER_METRICS)
    for (b, g), group in groupby(rows, key=lambda r: (r[0], r[1])):
        users = {r[2]: list(r[3:]) for r in group}
        if others is not None:
            users = fold(users, others)
        c.executemany(insert, [(b, g, u, *s) for u, s in users.items()])
    c.execute(f"UPDATE meta SET value = ? WHERE key = '{coarser}_done'", (target,))
    return target


def upsert(table: str, keys: tuple[str, ...], metrics: tuple[str, ...]) -> str:
    """INSERT of one row of sums that adds to the row already there, if any."""
    cols = ", ".join((*keys, *metrics))
    marks = ", ".join("?" * (len(keys) + len(metrics)))
    add = ", ".join(f"{m} = {m} + excluded.{m}" for m in metrics)
    return (f"INSERT INTO {table} ({cols}) VALUES ({marks}) "
            f"ON CONFLICT ({', '.join(keys)}) DO UPDATE SET {add}")


def _uid(conn: object, name: str) -> int | None:
    assert isinstance(conn, sqlite3.Connection)
    row = conn.execute("SELECT id FROM users WHERE name = ?", (name,)).fetchone()
    return None if row is None else int(row[0])


def unknown_uid(conn: object) -> int | None:
    return _uid(conn, UNKNOWN_USER)


def others_uid(conn: object) -> int | None:
    return _uid(conn, OTHER_NAMES)


def rollup_minutes(c: object, done: int, target: int) -> int:
    """Fold raw samples of minutes [done, target) into the minute tables; the new mark."""
    import sqlite3

    assert isinstance(c, sqlite3.Connection)
    if target <= done:
        return done
    unknown = unknown_uid(c)
    gpu: dict[tuple[int, int], list[float]] = {}
    user: dict[tuple[int, int], dict[int, list[float]]] = {}
    for t, dt, packed in c.execute("SELECT t, dt, gpus FROM samples WHERE t >= ? AND t < ?",
                                   (done * 1000, target * 1000)):
        b = t // 60000 * 60
        for entry in json.loads(packed):
            key = (b, entry[0])
            sums = gpu.get(key)
            if sums is None:
                sums = gpu[key] = [0.0] * len(GPU_METRICS)
            account(dt / 1000, entry, unknown, sums, user.setdefault(key, {}))
    c.executemany(upsert("gpu_minute", ("b", "gpu"), GPU_METRICS),
                  [(b, g, *s) for (b, g), s in gpu.items()])
    others = others_uid(c)
    c.executemany(upsert("user_minute", ("b", "gpu", "user"), USER_METRICS),
                  [(b, g, u, *s) for (b, g), us in user.items()
                   for u, s in (us if others is None else fold(us, others)).items()])
    c.execute("UPDATE meta SET value = ? WHERE key = 'minute_done'", (target,))
    return target
