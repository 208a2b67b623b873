"""History: the recorder's CPU per refresh and bytes per GPU per day, and the time and
memory of ``gputop report --since 30d`` over 1,600 GPUs' rollups.

Recorder: 200 hosts x 8 GPUs of simulated snapshots (varying load, 1-3 users per busy GPU,
a few reservations, one host in 50 down) fed to the real ``Recorder`` with an injected
clock at a 2 s interval, one commit per refresh, rollups once a simulated minute. CPU is
this process's CPU time in record + commit + rollup only (building the snapshots is not
counted). Bytes per GPU per day come from SQLite's own page accounting (``dbstat``) per
table, scaled from the refreshes recorded to a day.

Report: 30 days of hourly rollups, the last hours of minute rollups and the last minutes of
raw samples for 1,600 GPUs are written directly (the recorder could not simulate 30 days of
2 s samples here), then ``gputop report --since 30d`` runs as a separate process: wall time
and its peak RSS.

    python -m bench.history_bench [--refreshes 150] [--out bench/results/history.json]
"""

from __future__ import annotations

import argparse
import json
import random
import resource
import sqlite3
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timedelta, timezone
from pathlib import Path

from gputop.history.db import GPU_METRICS, USER_METRICS, HistoryDB
from gputop.history.recorder import Recorder, rollup_up, upsert
from gputop.model import GpuInfo, HostError, HostSnapshot, ProcessInfo
from gputop.reservations.state import StoreState
from gputop.reservations.terms import Target, Terms, new_reservation

HOSTS, GPUS, INTERVAL = 200, 8, 2.0
USERS = [f"user{i:02d}" for i in range(40)]


def fleet_snapshot(rng: random.Random, t: datetime, i: int) -> list[HostSnapshot]:
    out = []
    for h in range(HOSTS):
        name = f"node{h:03d}"
        if h % 50 == 7:
            out.append(HostSnapshot(name=name, time=t, error=HostError("timeout", "x")))
            continue
        gpus = []
        for g in range(GPUS):
            busy = (h + g + i // 300) % 3 != 0
            # jobs last ten minutes; one GPU in four is shared by two users
            k = h * GPUS + g + i // 300
            users = [USERS[k % 40], USERS[(k + 7) % 40]][: 1 + (g % 4 == 3)] if busy else []
            gpus.append(GpuInfo(
                index=g, uuid=f"GPU-{h:04d}{g:04d}-0000-4000-8000-000000000000",
                name="NVIDIA H100 80GB HBM3",
                utilization_percent=rng.randint(0, 100) if busy else 0,
                memory_used_mib=rng.randint(1000, 80000) if busy else 0,
                memory_total_mib=81559,
                processes=tuple(ProcessInfo(pid=1000 + k, user=u) for k, u in enumerate(users))))
        out.append(HostSnapshot(name=name, time=t, gpus=tuple(gpus)))
    return out


def table_bytes(conn: sqlite3.Connection) -> dict[str, int]:
    rows = conn.execute("SELECT name, SUM(pgsize) FROM dbstat GROUP BY name").fetchall()
    return {n: int(b) for n, b in rows}


def bench_recorder(refreshes: int, tmp: Path) -> dict[str, object]:
    path = tmp / "rec.sqlite3"
    t0 = datetime(2026, 11, 2, tzinfo=timezone.utc)
    rng = random.Random(1)
    rec = Recorder(HistoryDB(path, writer=True), interval=INTERVAL, timeout=10.0,
                   commit_every=0.0, raw_keep_s=1e12)
    rec.set_reservations(StoreState(reservations=tuple(
        new_reservation(
            Target(f"node{h:03d}", g), Terms(86400 * 6, user=USERS[h % 40], machine="m"), t0)
        for h in range(0, HOSTS, 4) for g in range(2))))
    cpu, maint = [], []
    for i in range(refreshes):
        t = t0 + timedelta(seconds=INTERVAL * (i + 1))
        snaps = fleet_snapshot(rng, t, i)
        c0 = time.process_time()
        for s in snaps:
            rec.record(s)
        rec.flush()
        cpu.append(time.process_time() - c0)
        if i % 30 == 29:  # once a minute, as `gputop record` does
            c0 = time.process_time()
            rec.maintain(t.timestamp())
            maint.append(time.process_time() - c0)
    # the rollup of the last minutes, then everything into hours
    end = t0.timestamp() + INTERVAL * refreshes
    rec.maintain(end + 120)
    sizes = table_bytes(rec.db.conn)
    minutes = (INTERVAL * refreshes) / 60
    rec.maintain(end + 2 * 3600)  # the hours too (raw kept: raw_keep_s is huge)
    hour_sizes = table_bytes(rec.db.conn)
    rec.db.close()
    n_gpus = HOSTS * GPUS
    per_day = 86400 / (INTERVAL * refreshes)
    raw = (sizes.get("samples", 0) + sizes.get("sqlite_autoindex_samples_1", 0))
    minute = sum(v for k, v in sizes.items() if k.endswith("_minute"))
    hour = sum(v for k, v in hour_sizes.items() if k.endswith("_hour"))
    raw_day = raw / n_gpus * per_day
    minute_day = minute / n_gpus * (1440 / minutes)
    hours_recorded = max(1.0, minutes / 60)
    hour_day = hour / n_gpus * (24 / hours_recorded)
    cpu.sort()
    return {
        "hosts": HOSTS, "gpus_per_host": GPUS, "interval_s": INTERVAL, "refreshes": refreshes,
        "cpu_ms_per_refresh_median": 1000 * cpu[len(cpu) // 2],
        "cpu_ms_per_refresh_p95": 1000 * cpu[int(len(cpu) * 0.95)],
        "cpu_percent_of_one_core": 100 * (sum(cpu) + sum(maint)) / (refreshes * INTERVAL),
        "rollup_cpu_ms_per_minute": 1000 * max(maint, default=0.0),
        "bytes_per_gpu_per_day": {"raw": round(raw_day), "minute": round(minute_day),
                                  "hour": round(hour_day)},
        "steady_state_bytes_per_gpu": round(2 * raw_day + 30 * minute_day),
        "steady_state_hour_bytes_per_gpu_per_year": round(365 * hour_day),
        "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
    }


def build_month(path: Path, gpus: int = 1600, days: int = 30) -> float:
    """30 days of hourly sums (and the daily sums made from them), the last hour's minute
    sums and 2 minutes of raw samples (the most a running recorder leaves unrolled)."""
    rng = random.Random(2)
    db = HistoryDB(path, writer=True)
    now = time.time() // 60 * 60
    hour_done = int(now // 3600 * 3600 - 3600)
    start = hour_done - days * 86400
    c = db.conn
    with db.transaction():
        c.executemany("INSERT INTO hosts (id, name) VALUES (?, ?)",
                      [(h, f"node{h:03d}") for h in range(gpus // GPUS)])
        c.executemany("INSERT INTO users (id, name) VALUES (?, ?)",
                      [(i + 1, u) for i, u in enumerate(USERS)])
        c.executemany("INSERT INTO gpus (id, host, key, idx, name, current) "
                      "VALUES (?, ?, ?, ?, 'H100', 1)",
                      [(g, g // GPUS, f"GPU-{g}", g % GPUS) for g in range(gpus)])

    def rows(tier: str, b0: int, b1: int, step: int, secs: float) -> None:
        grow, urow = [], []
        for b in range(b0, b1, step):
            for g in range(gpus):
                busy = rng.random() < 0.6
                util = rng.uniform(0, 100) if busy else 0.0
                grow.append((b, g, secs, 0.0, secs if busy else 0.0,
                             0.0 if busy else secs, 0.0, util * secs, secs))
                if busy:  # users change every 8 hours: about 3 a day per GPU
                    urow.append((b, g, 1 + (g + b // (8 * 3600)) % 40, secs, 0.0, 0.0, secs,
                                 0.0, util * secs, secs))
        c.executemany(upsert(f"gpu_{tier}", ("b", "gpu"), GPU_METRICS), grow)
        c.executemany(upsert(f"user_{tier}", ("b", "gpu", "user"), USER_METRICS), urow)

    for day in range(days + 1):
        with db.transaction():
            rows("hour", start + day * 86400, min(hour_done, start + (day + 1) * 86400),
                 3600, 3600.0)
    with db.transaction():
        rows("minute", int(hour_done), int(now), 60, 60.0)
        c.execute("UPDATE meta SET value = ? WHERE key = 'hour_done'", (hour_done,))
        c.execute("UPDATE meta SET value = ? WHERE key = 'minute_done'", (int(now),))
        c.execute("UPDATE meta SET value = ? WHERE key = 'minute_from'", (start,))
        rollup_up(c, "hour", "day", 86400, 0, hour_done)
    rec = Recorder(db, interval=INTERVAL, timeout=10.0)
    snaps_t = datetime.fromtimestamp(now, timezone.utc)
    for i in range(60):  # two minutes of raw samples
        for s in fleet_snapshot(rng, snaps_t + timedelta(seconds=INTERVAL * (i + 1)), i):
            rec.record(s)
    rec.flush()
    db.close()
    return now


def bench_report(tmp: Path) -> dict[str, object]:
    path = tmp / "month.sqlite3"
    c0 = time.monotonic()
    build_month(path)
    built = time.monotonic() - c0
    out = {"database_mib": path.stat().st_size / 2**20, "build_s": built}
    for form in ("--json", "--csv", None):
        args = [sys.executable, "-m", "gputop", "report", "--db", str(path), "--since", "30d"]
        if form:
            args.append(form)
        walls, cpus = [], []
        for _ in range(3):
            t = time.monotonic()
            before = resource.getrusage(resource.RUSAGE_CHILDREN)
            r = subprocess.run(args, capture_output=True, text=True)
            after = resource.getrusage(resource.RUSAGE_CHILDREN)
            walls.append(time.monotonic() - t)
            cpus.append(after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime)
            assert r.returncode == 0, r.stderr
        name = (form or "--text").lstrip("-")
        out[f"wall_s_{name}"] = min(walls)
        out[f"cpu_s_{name}"] = min(cpus)
    out["peak_rss_mib"] = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024
    # the same in-process, without interpreter start-up
    from gputop.history.report import collect, summarise

    with HistoryDB(path) as db:
        t = time.monotonic()
        doc = summarise(collect(db, time.time() - 30 * 86400, time.time()))
        out["in_process_s"] = time.monotonic() - t
    out["gpu_hours"] = doc["headline"]["gpu_hours"]
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--refreshes", type=int, default=150)
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "history.json"))
    args = ap.parse_args()
    import os

    with tempfile.TemporaryDirectory() as d:
        result = {"cpus": os.cpu_count(), "loadavg_before": os.getloadavg(),
                  "recorder": bench_recorder(args.refreshes, Path(d)),
                  "report": bench_report(Path(d))}
    result["loadavg_after"] = os.getloadavg()
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
