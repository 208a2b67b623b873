"""A hub's reader alone (the board's feed, no board): its CPU and where it goes.

    python -m bench.hub demo-hub --hosts 200 --gpus 8 --listen 127.0.0.1:9871 &
    python -m bench.hub_reader --hub http://127.0.0.1:9871/ [--tree DIR] [--updates 8]

Reads the hub's event stream through ``HubPoller`` as the board does (the board's GC
thresholds, ``gputop.ui.intake.tune_gc``), and prints one JSON line: the process's CPU as a
share of a core, and per update the thread CPU of parsing, checking and building the
model. ``--tree``: the gputop checkout to import (e.g. a worktree of main, for a side by
side with the same hub in the same window).
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.checkout import load_gputop


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--hub", required=True)
    ap.add_argument("--tree", default=str(Path(__file__).resolve().parents[1]))
    ap.add_argument("--hosts", type=int, default=200)
    ap.add_argument("--updates", type=int, default=8)
    args = ap.parse_args()
    load_gputop(args.tree)
    import gputop.hubclient.client as hub
    from gputop.config.load import Config
    from gputop.config.tables import Defaults, Hub, Reservations
    from gputop.hubclient.poller import open_poller

    spent = {"parse": 0.0, "check": 0.0, "model": 0.0}

    def timed(name: str, f: Any) -> Any:
        def call(*a: Any, **k: Any) -> Any:
            t = time.thread_time()
            try:
                return f(*a, **k)
            finally:
                spent[name] += time.thread_time() - t
        return call

    hub.parse_json = timed("parse", hub.parse_json)  # type: ignore[assignment]
    hub.check_update = timed("check", hub.check_update)  # type: ignore[assignment]
    hub.host_from_dict = timed("model", hub.host_from_dict)  # type: ignore[assignment]
    cfg = Config(path=None, hosts=(), defaults=Defaults(interval=2.0, timeout=5.0),
                 hub=Hub(url=args.hub),
                 reservations=Reservations(path=Path(tempfile.mkdtemp()) / "r.json"))
    gc.set_threshold(50_000, 50, 20)  # as the board's tune_gc

    async def run() -> dict[str, Any]:
        poller = open_poller(cfg)
        stream = poller.updates()  # type: ignore[union-attr]
        n = 0
        async for _ in stream:  # the snapshot and one update: not counted
            n += 1
            if n == 2 * args.hosts:
                break
        for k in spent:
            spent[k] = 0.0
        cpu0, wall0 = time.process_time(), time.monotonic()
        async for _ in stream:
            n += 1
            if n >= (2 + args.updates) * args.hosts:
                break
        wall = time.monotonic() - wall0
        cpu = time.process_time() - cpu0
        await stream.aclose()
        await poller.aclose()
        return {"tree": args.tree, "seconds": round(wall, 1),
                "cpu_percent_of_core": round(100 * cpu / wall, 2),
                "ms_per_update": {k: round(1000 * v / args.updates, 1)
                                  for k, v in spent.items()}}

    print(json.dumps(asyncio.run(run())))


if __name__ == "__main__":
    main()
