"""``gputop report``: GPU-hours per user, host and GPU from the history database.

A range reads the coarsest tier that answers it exactly: whole days and hours from the
daily and hourly rollups, the rest from minute rollups, and the minutes not rolled up yet
from raw samples, each span from one tier only. Ranges of 7 days or more start on a whole
hour, so they read no minutes but the last hour's. Every tier carries the same sums (see
``accounting``), so the totals do not depend on which tier answered.

The chart's columns start on a multiple of their width (UTC), and no column is narrower
than the rows that fill it (a minute where minute sums answer), so time recorded without
a break has no blank column. A host down before any of its GPUs was seen has no GPU-hours
to count: it is reported with its hours down and its GPUs unknown.
"""

from __future__ import annotations

import json
import math
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from gputop.history.accounting import (
    BUSY,
    DATA,
    HELD_IDLE,
    IDLE,
    N_USER,
    NODATA,
    RESERVED,
    RESERVED_IDLE,
    SHARED,
    SHARED_IDLE,
    U_HELD_IDLE,
    U_UTIL_SECS,
    U_UTIL_SUM,
    UNRESERVED,
    USED,
    UTIL_SECS,
    UTIL_SUM,
    account,
)
from gputop.history.db import GPU_METRICS, USER_METRICS, HistoryDB
from gputop.history.recorder import UNKNOWN_GPUS_KEY, unknown_uid

#: Ranges longer than these are answered from daily / hourly rollups (and so is the chart).
DAILY_OVER_S = 7 * 86400
HOURLY_OVER_S = 12 * 3600
CHART_POINTS = 60
_STEPS = (1, 2, 5, 10, 15, 30, 60, 120, 300, 600, 900, 1800, 3600, 7200, 10800, 21600,
          43200, 86400, 172800, 604800)


@dataclass
class History:
    """Sums over one time range, in seconds: per GPU, per (chart bucket, host) for the
    charts, per user, and the user sums per GPU. Chart bucket ``i`` is
    ``[origin + i * step, origin + (i + 1) * step)``."""

    start: float
    end: float
    step: int
    origin: float = 0.0
    hosts: dict[int, str] = field(default_factory=dict)
    gpus: dict[int, tuple[int, int | None, str | None, str]] = field(default_factory=dict)
    users: dict[int, str] = field(default_factory=dict)
    gpu_tot: dict[int, list[float]] = field(default_factory=dict)
    series: dict[tuple[int, int], list[float]] = field(default_factory=dict)
    user_tot: dict[int, list[float]] = field(default_factory=dict)
    gpu_user: dict[int, list[float]] = field(default_factory=dict)
    #: The spans the recorder was running in, merged: what the range has data for.
    recorded: list[tuple[float, float]] = field(default_factory=list)

    @property
    def n_buckets(self) -> int:
        return max(1, math.ceil((self.end - self.origin) / self.step))


def _add(table: dict[Any, list[float]], key: Any, sums: Iterable[float],
         n: int | None = None) -> None:
    sums = list(sums)
    cur = table.get(key)
    if cur is None:
        cur = table[key] = [0.0] * (len(sums) if n is None else n)
    for i, v in enumerate(sums):
        cur[i] += v


def _step(span: float, minimum: int) -> int:
    want = span / CHART_POINTS
    for s in _STEPS:
        if s >= want and s >= minimum:
            return s
    return _STEPS[-1]


def collect(db: HistoryDB, start: float, end: float) -> History:
    """Everything the report shows for ``[start, end)`` (UTC epoch seconds)."""
    with db.errors():
        return _collect(db, start, end)


def _collect(db: HistoryDB, start: float, end: float) -> History:
    c = db.conn
    c.execute("BEGIN")  # one consistent view while the recorder goes on writing
    try:
        marks = {k: db.meta(k) for k in ("minute_done", "hour_done", "day_done",
                                          "minute_from", "hour_from")}
        first_raw = c.execute("SELECT MIN(t) FROM samples").fetchone()[0]
        # raw samples are dropped by whole minutes: from this minute on, all are there
        marks["raw_from"] = 2 ** 62 if first_raw is None else first_raw // 60000 * 60
        span = max(1.0, end - start)
        level = 0 if span >= DAILY_OVER_S else 1 if span > HOURLY_OVER_S else 2
        if start < marks["minute_from"]:
            level = min(level, 1)
        if start < marks["hour_from"]:
            level = 0
        if level == 0:
            # Long ranges start on a whole hour: hour and day sums answer all of them but
            # the time since the last hour was rolled up (minutes, then raw samples).
            start = math.floor(start / 3600) * 3600
        parts: list[tuple[str, float, float]] = []
        _cover(parts, marks, start, end, level)
        # A column is no narrower than the coarsest rows in it: a column of 30 s where
        # minute sums answer would be blank every other time.
        finest = max(1, math.ceil(db.meta("interval_ms") / 1000))
        for tier, a, z in parts:
            if a < z:
                finest = max(finest, {"raw": 1, "minute": 60, "hour": 3600, "day": 86400}[tier])
        step = _step(span, max(finest, (86400, 3600, 1)[level]))
        h = History(start, end, step, origin=math.floor(start / step) * step)
        h.hosts = {i: n for i, n in c.execute("SELECT id, name FROM hosts")}
        h.users = {i: n for i, n in c.execute("SELECT id, name FROM users")}
        h.gpus = {i: (host, idx, name, key) for i, host, idx, name, key in c.execute(
            "SELECT id, host, idx, name, key FROM gpus")}
        _tiers(h, c, [p for p in parts if p[0] != "raw" and p[1] < p[2]], db.user_columns())
        for tier, a, z in parts:
            if tier == "raw":
                _raw(h, c, a, z)
        interval = max(1.0, (db.meta("interval_ms") or 10_000) / 1000)
        h.recorded = _recorded(c, parts, start, end, GAP_INTERVALS * interval)
    finally:
        c.execute("COMMIT")
    return h


#: Time without a sample longer than this many intervals is a gap: the recorder was not
#: running. A shorter one is a late refresh.
GAP_INTERVALS = 3
_SIZES = {"day": 86400, "hour": 3600, "minute": 60}


def _recorded(c: Any, parts: list[tuple[str, float, float]], start: float, end: float,
              gap: float) -> list[tuple[float, float]]:
    """The spans of ``[start, end)`` something was recorded in: each raw sample stands for
    the ``dt`` before it, a rollup row for its bucket; holes and edges up to ``gap`` long
    count as recorded. The rollups answer to their bucket only: an hour with a sample
    counts whole."""
    spans: list[tuple[float, float]] = []
    for tier, a, z in parts:
        if a >= z:
            continue
        if tier == "raw":
            spans += [(max(a, (t - dt) / 1000), t / 1000) for t, dt in c.execute(
                "SELECT DISTINCT t, dt FROM samples WHERE t >= ? AND t < ?",
                (int(a * 1000), int(z * 1000)))]
        else:
            size = _SIZES[tier]
            spans += [(b, min(z, b + size)) for (b,) in c.execute(
                f"SELECT DISTINCT b FROM gpu_{tier} WHERE b >= ? AND b < ?", (a, z))]
    merged: list[tuple[float, float]] = []
    for a, z in sorted(spans):
        if merged and a - merged[-1][1] <= gap:
            merged[-1] = (merged[-1][0], max(merged[-1][1], z))
        else:
            merged.append((a, z))
    if merged and merged[0][0] - start <= gap:
        merged[0] = (start, merged[0][1])
    if merged and end - merged[-1][1] <= gap:
        merged[-1] = (merged[-1][0], end)
    return merged


#: (tier, bucket size, the mark it is rolled up to, the mark its finer tier is kept from)
_TIERS = (("day", 86400, "day_done", "hour_from"), ("hour", 3600, "hour_done", "minute_from"),
          ("minute", 60, "minute_done", "raw_from"))


def _cover(parts: list[tuple[str, float, float]], marks: dict[str, int], a: float, z: float,
           level: int) -> None:
    """[a, z) from tier ``level`` (0 days, 1 hours, 2 minutes, 3 raw): its whole buckets,
    the edges from the next finer tier. Where that finer tier is gone (past its keep
    window), the range is rounded out to this tier's buckets instead."""
    if a >= z:
        return
    if level == 3:
        parts.append(("raw", a, z))
        return
    name, size, done, finer = _TIERS[level]
    finer_from = marks.get(finer, 0)
    lo = math.ceil(a / size) * size
    if a < finer_from:
        lo = math.floor(a / size) * size
    hi = min(math.floor(z / size) * size, marks[done])
    if hi < z and hi < finer_from:
        hi = min(math.ceil(z / size) * size, marks[done])
    if lo < hi:
        parts.append((name, lo, hi))
        _cover(parts, marks, a, lo, level + 1)
        _cover(parts, marks, hi, z, level + 1)
    else:
        _cover(parts, marks, a, z, level + 1)


def _tiers(h: History, c: Any, parts: list[tuple[str, float, float]],
           user_columns: list[str]) -> None:
    """The rollup rows of every (tier, from, to) part, summed by SQLite: per GPU, per
    chart bucket and host, per user, per GPU of the user sums (few rows come back)."""
    if not parts:
        return
    args = [x for _, a, z in parts for x in (a, z)]

    def union(kind: str, cols: str) -> str:
        return " UNION ALL ".join(f"SELECT b, gpu, {cols} FROM {kind}_{tier} "
                                  "WHERE b >= ? AND b < ?" for tier, _, _ in parts)

    sums = ", ".join(f"SUM({m})" for m in GPU_METRICS)
    for gpu, *row in c.execute(f"SELECT gpu, {sums} FROM ({union('gpu', ', '.join(GPU_METRICS))})"
                               " GROUP BY gpu", args):
        _add(h.gpu_tot, gpu, row)
    last = h.n_buckets - 1
    for bucket, host, *row in c.execute(
            "SELECT CAST((u.b - ?) / ? AS INTEGER), g.host, SUM(u.util_sum), "
            f"SUM(u.util_secs) FROM ({union('gpu', 'util_sum, util_secs')}) AS u "
            "JOIN gpus AS g ON g.id = u.gpu GROUP BY 1, 2", (h.origin, h.step, *args)):
        _add(h.series, (max(0, min(last, bucket)), host), row, 2)
    usums = ", ".join(f"SUM({m})" for m in USER_METRICS)
    ucols = ", ".join(user_columns)
    for user, *row in c.execute(
            f"SELECT user, {usums} FROM ({union('user', 'user, ' + ucols)}) GROUP BY user",
            args):
        _add(h.user_tot, user, row)
    for gpu, *row in c.execute(
            f"SELECT gpu, {usums} FROM ({union('user', ucols)}) GROUP BY gpu", args):
        _add(h.gpu_user, gpu, row)


def _raw(h: History, c: Any, a: float, z: float) -> None:
    if a >= z:
        return
    unknown = unknown_uid(c)
    last = h.n_buckets - 1
    buckets: dict[tuple[int, int], list[float]] = {}
    users: dict[int, dict[int, list[float]]] = {}
    for t, dt, packed in c.execute("SELECT t, dt, gpus FROM samples WHERE t >= ? AND t < ?",
                                   (int(a * 1000), int(z * 1000))):
        bucket = max(0, min(last, int((t / 1000 - h.origin) // h.step)))
        for entry in json.loads(packed):
            gpu = entry[0]
            sums = buckets.get((bucket, gpu))
            if sums is None:
                sums = buckets[(bucket, gpu)] = [0.0] * 7
            per_user = users.get(gpu)
            if per_user is None:
                per_user = users[gpu] = {}
            account(dt / 1000, entry, unknown, sums, per_user)
    for (bucket, gpu), sums in buckets.items():
        _add(h.gpu_tot, gpu, sums)
        host = h.gpus[gpu][0] if gpu in h.gpus else 0
        _add(h.series, (bucket, host), (sums[UTIL_SUM], sums[UTIL_SECS]), 2)
    for gpu, per_user in users.items():
        for uid, sums in per_user.items():
            _add(h.user_tot, uid, sums)
            _add(h.gpu_user, gpu, sums)


# --- the numbers -----------------------------------------------------------------------


def _hours(seconds: float) -> float:
    return seconds / 3600


def _mean(total: float, secs: float) -> float | None:
    return None if secs <= 0 else total / secs


def summarise(h: History) -> dict[str, Any]:
    """The report as one JSON-ready document (hours; utilisation in percent)."""
    per_gpu, per_user, gpu_user = h.gpu_tot, h.user_tot, h.gpu_user
    series: dict[int, dict[int, list[float]]] = {}
    for (bucket, host), cell in h.series.items():
        series.setdefault(host, {})[bucket] = cell

    def gpu_row(s: list[float], u: list[float]) -> dict[str, Any]:
        return {"gpu_hours": _hours(s[DATA] + s[NODATA]), "busy_hours": _hours(s[BUSY]),
                "idle_hours": _hours(s[IDLE]), "held_idle_hours": _hours(s[HELD_IDLE]),
                "no_data_hours": _hours(s[NODATA]),
                "mean_utilization": _mean(s[UTIL_SUM], s[UTIL_SECS]),
                "used_hours": _hours(u[USED]), "reserved_hours": _hours(u[RESERVED]),
                "reserved_idle_hours": _hours(u[RESERVED_IDLE]),
                "shared_hours": _hours(u[SHARED]),
                "shared_idle_hours": _hours(u[SHARED_IDLE])}

    zero, uzero = [0.0] * 7, [0.0] * N_USER
    gpus = []
    per_host: dict[int, tuple[list[float], list[float]]] = {}
    unknown: dict[int, float] = {}  # host -> seconds down with its GPUs unknown
    for gpu in sorted(set(per_gpu) | set(gpu_user),
                      key=lambda g: (h.hosts.get(h.gpus[g][0], ""), h.gpus[g][1] or 0)):
        host, idx, name, key = h.gpus[gpu]
        s, u = per_gpu.get(gpu, zero), gpu_user.get(gpu, uzero)
        if key == UNKNOWN_GPUS_KEY:  # not a GPU: how many were down is not known
            unknown[host] = unknown.get(host, 0.0) + s[NODATA]
            per_host.setdefault(host, ([0.0] * 7, [0.0] * N_USER))
            continue
        gpus.append({"host": h.hosts.get(host, "?"), "index": idx, "name": name,
                     "uuid": None if key.startswith("index:") else key} | gpu_row(s, u))
        hs, hu = per_host.setdefault(host, ([0.0] * 7, [0.0] * N_USER))
        for i in range(7):
            hs[i] += s[i]
        for i in range(N_USER):
            hu[i] += u[i]
    counts = Counter(h.gpus[g][0] for g in set(per_gpu) | set(gpu_user)
                     if h.gpus[g][3] != UNKNOWN_GPUS_KEY)
    hosts = [{"host": h.hosts.get(host, "?"), "gpus": counts.get(host),
              **gpu_row(s, u), "unknown_gpus_hours": _hours(unknown.get(host, 0.0))}
             for host, (s, u) in sorted(per_host.items(), key=lambda kv: h.hosts.get(kv[0], ""))]
    users: list[dict[str, Any]] = sorted(({
                     "user": h.users.get(uid, "?"), "used_hours": _hours(s[USED]),
                     "reserved_hours": _hours(s[RESERVED]),
                     "reserved_idle_hours": _hours(s[RESERVED_IDLE]),
                     "shared_hours": _hours(s[SHARED]),
                     "shared_idle_hours": _hours(s[SHARED_IDLE]),
                     "unreserved_hours": _hours(s[UNRESERVED]),
                     "held_idle_hours": _hours(s[U_HELD_IDLE]),
                     "mean_utilization_used": _mean(s[U_UTIL_SUM], s[U_UTIL_SECS])}
                    for uid, s in per_user.items()),
                   key=lambda r: (-float(r["used_hours"]), -float(r["reserved_hours"]),
                                  str(r["user"])))
    fleet = [0.0] * 7
    for gpu, s in per_gpu.items():
        if h.gpus[gpu][3] == UNKNOWN_GPUS_KEY:
            continue
        for i in range(7):
            fleet[i] += s[i]
    data = fleet[DATA]

    def pct(x: float) -> float | None:
        return None if data <= 0 else 100 * x / data

    def line(cells: dict[int, list[float]]) -> list[float | None]:
        return [_mean(*cells[b]) if b in cells else None for b in range(h.n_buckets)]

    fleet_cells: dict[int, list[float]] = {}
    for cells in series.values():
        for b, (us, sec) in cells.items():
            fc = fleet_cells.setdefault(b, [0.0, 0.0])
            fc[0] += us
            fc[1] += sec
    return {
        "version": 1,
        "from": _iso(h.start), "to": _iso(h.end),
        # What of it has data (null: nothing), and the gaps inside that (no recorder).
        "recorded": None if not h.recorded else {
            "from": _iso(h.recorded[0][0]), "to": _iso(h.recorded[-1][1]),
            "gaps": [{"from": _iso(z), "to": _iso(a)}
                     for (_, z), (a, _) in zip(h.recorded, h.recorded[1:])]},
        "headline": {"gpu_hours": _hours(data), "busy_percent": pct(fleet[BUSY]),
                     "idle_percent": pct(fleet[IDLE]),
                     "held_idle_percent": pct(fleet[HELD_IDLE]),
                     "no_data_hours": _hours(fleet[NODATA]),
                     "mean_utilization": _mean(fleet[UTIL_SUM], fleet[UTIL_SECS]),
                     # host-hours, not GPU-hours: hosts down before any GPU of theirs was seen
                     "unknown_gpus_hours": _hours(sum(unknown.values())),
                     "hosts_with_unknown_gpus": sum(1 for v in unknown.values() if v > 0)},
        "users": users, "hosts": hosts, "gpus": gpus,
        "series": {"start": _iso(h.origin), "step_s": h.step,
                   "fleet": line(fleet_cells),
                   "hosts": {h.hosts.get(host, "?"): line(series.get(host, {}))
                             for host in sorted(set(series) | set(per_host),
                                                key=lambda k: h.hosts.get(k, ""))}},
    }


def _iso(t: float) -> str:
    from datetime import datetime, timezone

    from gputop.model import iso

    return iso(datetime.fromtimestamp(t, timezone.utc)) or ""
