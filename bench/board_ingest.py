"""What one host's answer costs the board's model, and what a frame's ``view()`` costs.

The board's thread takes each answer (``BoardModel.ingest``) and works out that host's rows
at once (``warmer``: its rows where it is on screen, else its counts and keys), a few
hundred answers a second at 1,000 hosts; every frame then asks for the whole view, and the
table looks at the rows on its screen. This times both on N simulated hosts x G GPUs
(``DemoSource``), with no Textual and no feed thread: the model's own cost, the best of a
few runs. Point ``--src`` at another checkout to compare. Prints one JSON line.

    python -m bench.board_ingest --hosts 1000 --gpus 8
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import inspect
import json
import time
from pathlib import Path

from bench.checkout import load_gputop
from bench.demo_fleet import demo_fleet


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--hosts", type=int, default=1000)
    ap.add_argument("--gpus", type=int, default=8)
    ap.add_argument("--answers", type=int, default=6, help="answers per host, per run")
    ap.add_argument("--runs", type=int, default=7)
    ap.add_argument("--on-screen", type=int, default=6,
                    help="hosts whose rows are on screen (a 60-line terminal shows about 6 "
                         "hosts of 8 GPUs); -1: all of them")
    ap.add_argument("--src", default=str(Path(__file__).resolve().parents[1]),
                    help="the checkout whose gputop to time")
    args = ap.parse_args()
    load_gputop(args.src)

    from gputop.model import HostSnapshot
    from gputop.poller import Poller
    from gputop.ui.board_model import BoardModel

    cfg, sources = demo_fleet(args.hosts, args.gpus, Path("/nonexistent/reservations.json"))
    names = [h.name for h in cfg.hosts]
    poller = Poller(cfg, sources)

    async def answers() -> list[HostSnapshot]:
        return [await poller.poll_host(s) for _ in range(args.answers) for s in sources]

    snaps = asyncio.run(answers())
    on_screen = set(names if args.on_screen < 0 else names[:args.on_screen])
    warm_args: tuple[object, ...] = (on_screen,)
    if inspect.signature(BoardModel.warm).parameters.keys() == {"self", "hosts"}:
        warm_args = ()  # (a checkout from before the rows off screen were made lazily)
    ingest_s, view_s = [], []
    gc.disable()
    for _ in range(args.runs):
        gc.collect()
        model = BoardModel(list(names), interval=2.0)
        start = time.perf_counter()
        for snap in snaps:  # as Intake.drain does
            model.ingest(snap)
            model.warmer()((snap.name,), *warm_args)
        ingest_s.append((time.perf_counter() - start) / len(snaps))
        start = time.perf_counter()
        for _ in range(10):
            rows, _summary = model.view()
            for i in range(min(len(rows), 60)):  # (what the table looks at: its screen)
                rows[i]
        view_s.append((time.perf_counter() - start) / 10)
    print(json.dumps({"hosts": args.hosts, "gpus": args.gpus, "src": args.src,
                      "us_per_answer": round(min(ingest_s) * 1e6, 1),
                      "ms_per_view": round(min(view_s) * 1e3, 2)}))


if __name__ == "__main__":
    main()
