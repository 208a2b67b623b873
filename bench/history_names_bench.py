"""History's size when every refresh brings new user names, against honest names, for the
code of any checkout (``--tree``), so that two versions run side by side.

4 hosts x 8 GPUs at a 2 s interval for ``--hours`` simulated hours, fed to the real
``Recorder`` with an injected clock, rolled up as ``gputop record`` does (every 20 s of
recorded time), then summed into hours and days. Scenarios:

- ``honest``: 40 users, jobs lasting ten minutes, a reservation on one GPU in four;
- ``forged``: the same, and on every GPU a new holder name and a new process owner name
  every refresh (a forged reservation each refresh; a container with a new uid each
  refresh);
- ``lasting``: on every GPU a new owner name every third refresh, each staying three.

Bytes per table come from SQLite's page accounting (``dbstat``); rows per table are
counted; the report is ``gputop report`` (text) over the whole run, in lines.

    python -m bench.history_names_bench --tree . --out bench/results/history_names.json
    python -m bench.history_names_bench --tree /work/main --out /tmp/main.json
"""

from __future__ import annotations

import argparse
import io
import json
import random
import tempfile
import time
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

from bench.checkout import load_gputop, unload_gputop
from gputop.reservations.terms import Target, Terms

HOSTS, GPUS, INTERVAL = 4, 8, 2.0
USERS = [f"user{i:02d}" for i in range(40)]


def run(tree: Path, scenario: str, hours: float, tmp: Path) -> dict[str, Any]:
    gputop = load_gputop(tree)
    from gputop.history.db import HistoryDB
    from gputop.history.recorder import Recorder
    from gputop.history.render import write_text
    from gputop.history.report import collect, summarise
    from gputop.model import GpuInfo, HostSnapshot, ProcessInfo
    from gputop.reservations.state import StoreState
    from gputop.reservations.store import new_reservation

    path = tmp / f"{scenario}.sqlite3"
    t0 = datetime(2026, 11, 2, tzinfo=timezone.utc)
    rng = random.Random(3)
    rec = Recorder(HistoryDB(path, writer=True), interval=INTERVAL, timeout=10.0,
                   commit_every=0.0, raw_keep_s=1e12, minute_keep_s=1e12)
    honest = tuple(new_reservation(
        Target(f"node{h}", g), Terms(86400 * 6, user=USERS[(h * GPUS + g) % 40], machine="m"), t0)
                   for h in range(HOSTS) for g in range(0, GPUS, 4))
    refreshes = int(hours * 3600 / INTERVAL)
    cpu = 0.0
    for i in range(refreshes):
        t = t0 + timedelta(seconds=INTERVAL * (i + 1))
        held = honest
        if scenario == "forged":
            held = tuple(new_reservation(Target(f"node{h}", g),
                                         Terms(3600, user=f"f{i}x{h}x{g}", machine="m"), t)
                         for h in range(HOSTS) for g in range(GPUS))
        snaps = []
        for h in range(HOSTS):
            gpus = []
            for g in range(GPUS):
                k = h * GPUS + g + i // 300
                users = [USERS[k % 40]] if (h + g + i // 300) % 3 else []
                if scenario == "forged":
                    users.append(f"o{i}x{h}x{g}")
                elif scenario == "lasting":
                    users.append(f"l{i // 3}x{h}x{g}")
                gpus.append(GpuInfo(
                    index=g, uuid=f"GPU-{h:04d}{g:04d}-0000-4000-8000-000000000000",
                    name="NVIDIA H100 80GB HBM3", utilization_percent=rng.randint(0, 100),
                    memory_used_mib=1000, memory_total_mib=81559,
                    processes=tuple(ProcessInfo(pid=1000 + n, user=u)
                                    for n, u in enumerate(users))))
            snaps.append(HostSnapshot(name=f"node{h}", time=t, gpus=tuple(gpus)))
        c0 = time.process_time()
        rec.set_reservations(StoreState(reservations=held))
        for s in snaps:
            rec.record(s)
        rec.flush()
        if i % 10 == 9:  # every 20 s, as `gputop record` does
            rec.maintain(t.timestamp())
        cpu += time.process_time() - c0
    end = t0.timestamp() + INTERVAL * refreshes
    rec.maintain(end + 2 * 86400)  # everything into hours and days
    conn = rec.db.conn
    sizes = {n: int(b) for n, b in conn.execute(
        "SELECT name, SUM(pgsize) FROM dbstat GROUP BY name")}
    rows = {t: conn.execute(f"SELECT COUNT(*) FROM {t}").fetchone()[0]
            for t in ("users", "samples", "gpu_minute", "user_minute", "gpu_hour",
                      "user_hour", "gpu_day", "user_day")}
    rec.db.close()
    with HistoryDB(path) as db:
        doc = summarise(collect(db, t0.timestamp(), end + 1))
    out = io.StringIO()
    write_text(doc, "user", out)
    n = HOSTS * GPUS
    per_day = 86400 / (INTERVAL * refreshes)

    def tier(suffix: str) -> int:
        return sum(v for k, v in sizes.items() if k.endswith(suffix))

    unload_gputop()
    return {
        "code": str(Path(gputop.__file__).parent), "refreshes": refreshes, "gpus": n,
        "rows": rows,
        "bytes_per_gpu_per_day": {
            "raw": round(tier("samples") / n * per_day),
            "minute": round(tier("_minute") / n * per_day),
            "hour": round(tier("_hour") / n * per_day),
            # the one day's sums the run makes, as stored (not scaled)
            "day_as_stored": round(tier("_day") / n),
            "users": round(tier("users") / n * per_day),
        },
        "report_lines": len(out.getvalue().splitlines()),
        "report_users": len(doc["users"]),
        "cpu_ms_per_refresh": 1000 * cpu / refreshes,
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tree", default=str(Path(__file__).resolve().parents[1]))
    ap.add_argument("--hours", type=float, default=2.0)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    result: dict[str, Any] = {"tree": args.tree, "hours": args.hours}
    with tempfile.TemporaryDirectory() as d:
        for scenario in ("honest", "forged", "lasting"):
            result[scenario] = run(Path(args.tree), scenario, args.hours, Path(d))
    text = json.dumps(result, indent=2) + "\n"
    if args.out:
        Path(args.out).write_text(text)
    print(text)


if __name__ == "__main__":
    main()
