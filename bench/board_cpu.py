"""CPU the board spends per refresh: the Textual app, headless, fed N hosts x G GPUs.

The hosts are simulated sources (``gputop.sources.demo.DemoSource``: load changes every refresh)
behind the real poller, so this measures the board's own work: ingesting snapshots, diffing
rows and redrawing. Prints one JSON line.

    python -m bench.board_cpu --hosts 200 --gpus 8 --seconds 30
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import tempfile
import threading
import time
from pathlib import Path

from gputop.config.load import Config
from gputop.config.tables import Defaults, HostConfig, Reservations
from gputop.sources.demo import DemoSource
from gputop.ui.app import GputopApp


def feed_only(cfg: Config, sources: list[DemoSource], args: argparse.Namespace
              ) -> dict[str, object]:
    """The same feed, consumed by nothing: what the board's numbers include that is not
    the board (the simulated sources and the poller)."""
    import asyncio

    from gputop.poller import Poller

    async def run() -> dict[str, object]:
        poller = Poller(cfg, sources)
        updates = 0
        marks: dict[str, float] = {}
        async for _snap in poller.updates():
            updates += 1
            now = time.monotonic()
            if "wall0" not in marks and updates >= 2 * args.hosts:
                marks["cpu0"], marks["wall0"], marks["u0"] = time.process_time(), now, updates
            if "wall0" in marks and now - marks["wall0"] >= args.seconds:
                break
        cpu, wall = time.process_time() - marks["cpu0"], time.monotonic() - marks["wall0"]
        await poller.aclose()
        return {"hosts": args.hosts, "gpus": args.gpus, "feed_only": True,
                "seconds": round(wall, 1),
                "refreshes": round((updates - marks["u0"]) / args.hosts, 1),
                "cpu_s": round(cpu, 3), "cpu_percent_of_core": round(100 * cpu / wall, 1)}

    return asyncio.run(run())


def reference_ms() -> float:
    """CPU milliseconds a fixed pure-Python workload takes here now (the best of five):
    this machine's speed swings by 1.5-2x between windows, and this says which window a
    run was in (runs are compared side by side, in one window, all the same)."""
    best = float("inf")
    for _ in range(5):
        t = time.process_time()
        rows = [{"host": f"node{i % 200:03d}", "index": i % 8, "util": (i * 7) % 101}
                for i in range(16_000)]
        rows.sort(key=lambda r: (-r["util"], r["host"], r["index"]))
        sum(len(r["host"]) + r["util"] for r in rows)
        best = min(best, time.process_time() - t)
    return round(best * 1000, 1)


def thread_cpu() -> dict[int, float]:
    """CPU seconds of each of this process's threads (Linux), by native thread id."""
    ticks = os.sysconf("SC_CLK_TCK")
    out: dict[int, float] = {}
    for task in Path("/proc/self/task").iterdir():
        try:
            fields = (task / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:  # the thread ended
            continue
        out[int(task.name)] = (int(fields[11]) + int(fields[12])) / ticks  # utime + stime
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--hosts", type=int, default=200)
    ap.add_argument("--gpus", type=int, default=8)
    ap.add_argument("--seconds", type=float, default=30.0)
    ap.add_argument("--interval", type=float, default=2.0)
    ap.add_argument("--profile", metavar="PATH",
                    help="write a CPU-time profile (cProfile) of the measured window")
    ap.add_argument("--feed-only", action="store_true",
                    help="the poller and simulated sources alone, no board: their share")
    ap.add_argument("--hub", metavar="URL",
                    help="read this hub instead (e.g. `python -m bench.hub demo-hub`): the "
                    "board's cost alone, the simulated hosts run in the hub's process")
    ap.add_argument("--default-gc", action="store_true",
                    help="keep Python's GC settings (the board tunes them, see tune_gc)")
    args = ap.parse_args()
    names = [f"node{i:03d}" for i in range(args.hosts)]
    cfg = Config(path=None, hosts=tuple(HostConfig(n) for n in names),
                 defaults=Defaults(interval=args.interval, timeout=5.0),
                 reservations=Reservations(path=Path(tempfile.mkdtemp()) / "reservations.json"))
    sources: list[DemoSource] | None = [
        DemoSource(n, "NVIDIA H100 80GB HBM3", args.gpus, 81559, 700.0) for n in names]
    if args.hub:
        from dataclasses import replace

        cfg, sources = replace(cfg.with_hub(url=args.hub), hosts=()), None
    if args.feed_only:
        assert sources is not None
        print(json.dumps(feed_only(cfg, sources, args)))
        return
    reference = reference_ms()
    app = GputopApp(cfg, sources=sources, user="bench", long_running=not args.default_gc)
    updates = 0
    original = app.intake.ingest

    def counting(snap):  # type: ignore[no-untyped-def]
        nonlocal updates
        updates += 1
        original(snap)

    app.intake.ingest = counting  # type: ignore[method-assign]
    marks: dict[str, float] = {}
    threads: dict[str, dict[int, float]] = {}

    import cProfile

    prof = cProfile.Profile(time.process_time)  # CPU time: other processes do not count

    def stop() -> None:
        threads["end"] = thread_cpu()
        if args.profile:
            prof.disable()
            prof.dump_stats(args.profile)
        app.exit()

    def start_clock() -> None:  # after startup, so import/mount cost is not counted
        marks["cpu0"], marks["wall0"] = time.process_time(), time.monotonic()
        marks["updates0"] = updates
        threads["start"] = thread_cpu()
        if args.profile:
            prof.enable()
        app.set_timer(args.seconds, stop)

    app.call_later(lambda: app.set_timer(args.interval * 2, start_clock))
    app.run(headless=True, size=(200, 60))
    cpu = time.process_time() - marks["cpu0"]
    wall = time.monotonic() - marks["wall0"]
    refreshes = (updates - marks["updates0"]) / args.hosts
    # Where the CPU went: the UI's thread, the feed's (the poller and the simulated
    # sources, see gputop.ui.feed) and Textual's others (input, output).
    t0, t1 = threads["start"], threads["end"]
    spent = {tid: t1[tid] - t0.get(tid, 0.0) for tid in t1}
    feed = app.intake.feed._thread.native_id if app.intake.feed else None
    ui = threading.main_thread().native_id
    by_thread = {"ui": spent.get(ui, 0.0), "feed": spent.get(feed, 0.0)}  # type: ignore[arg-type]
    by_thread["other"] = sum(spent.values()) - by_thread["ui"] - by_thread["feed"]
    print(json.dumps({
        "hosts": args.hosts, "gpus": args.gpus, "seconds": round(wall, 1),
        "refreshes": round(refreshes, 1), "cpu_s": round(cpu, 3),
        "cpu_per_refresh_s": round(cpu / refreshes, 4) if refreshes else None,
        "cpu_percent_of_core": round(100 * cpu / wall, 1),
        "cpu_percent_by_thread": {k: round(100 * v / wall, 1) for k, v in by_thread.items()},
        "peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
        "reference_ms": reference,
    }))


if __name__ == "__main__":
    main()
