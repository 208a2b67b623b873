"""What memory shares cost ``--json --watch``'s document: ``dumps(annotate(...))`` of N
simulated hosts x G GPUs, with a reservations file of a few whole reservations (the common
case: no share) or with S shared GPUs. ``--watch`` builds this document every interval.
Point ``--src`` at another checkout (one without shares) to compare; run the two
alternately. Prints one JSON line: the best of ``--runs``, per document.

    python -m bench.shares_annotate --hosts 200 --gpus 4 [--shares 20] [--src ../main]
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import time
from pathlib import Path

from bench.checkout import load_gputop
from bench.demo_fleet import demo_fleet
from gputop.reservations.terms import Target, Terms


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--hosts", type=int, default=200)
    ap.add_argument("--gpus", type=int, default=4)
    ap.add_argument("--shares", type=int, default=0, help="shared GPUs (3 shares each)")
    ap.add_argument("--runs", type=int, default=9)
    ap.add_argument("--docs", type=int, default=20, help="documents per run")
    ap.add_argument("--src", default=str(Path(__file__).resolve().parents[1]),
                    help="the checkout whose gputop to time")
    args = ap.parse_args()
    load_gputop(args.src)

    from gputop.model import FleetSnapshot, utcnow
    from gputop.output import dumps
    from gputop.poller import Poller
    from gputop.reservations.flags import IdleTracker, annotate
    from gputop.reservations.state import StoreState
    from gputop.reservations.store import new_reservation

    cfg, sources = demo_fleet(args.hosts, args.gpus, Path("/nonexistent/reservations.json"))
    names = [h.name for h in cfg.hosts]
    poller = Poller(cfg, sources)

    async def answers() -> FleetSnapshot:
        return FleetSnapshot(tuple([await poller.poll_host(s) for s in sources]))

    snap = asyncio.run(answers())
    now = utcnow()
    rs = [new_reservation(Target(names[i], 0), Terms(3600, user=f"user{i}", machine="m"), now)
          for i in range(0, args.hosts, 10)]
    for i in range(args.shares):
        for k in range(3):
            rs.append(new_reservation(
                Target(names[(i * 7 + 3) % args.hosts], 1),
                Terms(3600, user=f"sharer{k}", machine="m", share_mib=16384), now))
    state = StoreState(tuple(rs))
    tracker = IdleTracker(1800, 900)
    for h in snap.hosts:
        tracker.observe(h)
    best = []
    gc.disable()
    for _ in range(args.runs):
        gc.collect()
        start = time.perf_counter()
        for _ in range(args.docs):
            dumps(annotate(snap, state, tracker))
        best.append((time.perf_counter() - start) / args.docs)
    print(json.dumps({"src": args.src, "hosts": args.hosts, "gpus": args.gpus,
                      "shares": args.shares, "doc_ms_best": round(min(best) * 1000, 3),
                      "doc_ms_median": round(sorted(best)[len(best) // 2] * 1000, 3)}))


if __name__ == "__main__":
    main()
