"""The board at fleet scale: keypress-to-screen latency and time to first paint.

``keys``: the Textual app, headless under the pilot, fed N hosts x G GPUs by simulated
sources (``gputop.sources.demo.DemoSource``, new load every refresh) through the real poller while
keys are pressed: cursor moves (j/k, page down/up) and filter keystrokes. Each sample is
the time from the key event being sent through the headless driver (as ``pilot.press``
sends it) to the first frame written that shows its effect (the cursor on the next row,
the filter text applied). ``pilot.press`` itself waits until the whole process is idle,
which under a live feed of 1,000 hosts measures the feed, not the key.

``paint``: a config of N SSH hosts that never answer (TEST-NET-1 addresses: the
connections hang until the timeout), so the board must be on screen before any host
answers. Measures process start -> first frame, and ``App.run`` -> first frame.

Each mode prints one JSON line:

    python -m bench.board_scale keys --hosts 1000 --gpus 8
    python -m bench.board_scale paint --hosts 1000
"""

from __future__ import annotations

import time

T_START = time.monotonic()

import argparse  # noqa: E402
import asyncio  # noqa: E402
import json  # noqa: E402
import resource  # noqa: E402
import statistics  # noqa: E402
import tempfile  # noqa: E402
from collections.abc import Callable  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

from bench.demo_fleet import demo_fleet  # noqa: E402


def peak_rss_mb() -> float:
    return round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)


def p95(xs: list[float]) -> float:
    return round(sorted(xs)[max(0, round(0.95 * len(xs)) - 1)] * 1000, 1)


async def keys(hosts: int, gpus: int, rounds: int) -> dict[str, object]:
    from textual import events

    from gputop.ui.app import GputopApp
    from gputop.ui.table import BoardTable

    cfg, sources = demo_fleet(hosts, gpus, Path(tempfile.mkdtemp()) / "r.json")
    app = GputopApp(cfg, sources=sources, user="bench", long_running=True)  # as run_board
    move: list[float] = []
    typing: list[float] = []
    async with app.run_test(size=(160, 50)) as pilot:
        while len(app.model.snapshots) < hosts:  # every host answered once
            await asyncio.sleep(0.1)
        await pilot.pause(2.5)  # a render or two
        table = app.query_one(BoardTable)
        driver = app._driver
        assert driver is not None
        waiting: list[tuple[Callable[[], bool], float, list[float], asyncio.Event]] = []
        display = app._display

        def on_frame(screen: Any, renderable: Any) -> None:  # a frame goes to the terminal
            display(screen, renderable)
            if renderable is not None:
                for w in list(waiting):
                    if w[0]():  # this frame shows the key's effect
                        w[2].append(time.perf_counter() - w[1])
                        w[3].set()
                        waiting.remove(w)

        app._display = on_frame  # type: ignore[method-assign]

        async def timed(key: str, shown: Callable[[], bool], into: list[float]) -> None:
            done = asyncio.Event()
            char = key if len(key) == 1 else None
            waiting.append((shown, time.perf_counter(), into, done))
            driver.send_message(events.Key(key, char))  # as pilot.press sends it
            await asyncio.wait_for(done.wait(), 60)
            await asyncio.sleep(0.1)  # like a person: the feed runs in between

        for _ in range(rounds):
            for k in ("j",) * 8 + ("pagedown", "k", "k", "pageup"):
                row = table.cursor_row
                want = {"j": row + 1, "k": row - 1}.get(k)
                await timed(k, (lambda w=want, r=row: table.cursor_row == w) if want is not None
                            else (lambda r=row: table.cursor_row != r), move)
            await pilot.press("slash")
            for i, k in enumerate("node12"):
                await timed(k, lambda t="node12"[:i + 1]: app.model.filter_text == t, typing)
            for i in range(6):
                await timed("backspace",
                            lambda t="node12"[:5 - i]: app.model.filter_text == t, typing)
            await pilot.press("escape")
            await pilot.pause()
        assert table.row_count == hosts * (gpus + 1)
    return {"mode": "keys", "hosts": hosts, "gpus": gpus, "cursor_moves": len(move),
            "move_p50_ms": round(statistics.median(move) * 1000, 1),
            "move_p95_ms": p95(move), "move_max_ms": round(max(move) * 1000, 1),
            "filter_keys": len(typing),
            "filter_p50_ms": round(statistics.median(typing) * 1000, 1),
            "filter_p95_ms": p95(typing), "filter_max_ms": round(max(typing) * 1000, 1),
            "peak_rss_mb": peak_rss_mb()}


def paint(hosts: int) -> dict[str, object]:
    from gputop.config.load import load_config
    from gputop.ui.app import GputopApp

    root = Path(tempfile.mkdtemp())
    body = ("[defaults]\ntimeout = 10\ninterval = 2\n\n"
            f"[reservations]\npath = \"{root / 'r.json'}\"\n\n")
    body += "".join(f'[[hosts]]\nname = "n{i:04d}"\naddress = "192.0.2.{i % 250 + 1}"\n'
                    f"port = {2000 + i // 250}\n\n" for i in range(hosts))
    (root / "hosts.toml").write_text(body)
    config = load_config(str(root / "hosts.toml"))
    marks: dict[str, float] = {}

    class Timed(GputopApp):
        CSS_PATH = str(Path(__file__).resolve().parents[1] / "gputop" / "ui" / "gputop.tcss")

        def on_mount(self) -> None:  # (Textual runs GputopApp.on_mount too, after this)
            self.call_after_refresh(self.painted)

        def painted(self) -> None:
            marks["paint"] = time.monotonic()
            marks["answered"] = len(self.model.snapshots)
            marks["rows"] = self.query_one("#board").row_count  # type: ignore[attr-defined]
            self.exit()

    app = Timed(config, user="bench")
    marks["run"] = time.monotonic()
    app.run(headless=True, size=(160, 50))
    return {"mode": "paint", "hosts": hosts,
            "start_to_paint_s": round(marks["paint"] - T_START, 3),
            "run_to_paint_s": round(marks["paint"] - marks["run"], 3),
            "hosts_answered_at_paint": marks["answered"], "rows_at_paint": marks["rows"],
            "peak_rss_mb": peak_rss_mb()}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("mode", choices=["keys", "paint"])
    ap.add_argument("--hosts", type=int, default=1000)
    ap.add_argument("--gpus", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=4)
    args = ap.parse_args()
    if args.mode == "keys":
        out = asyncio.run(keys(args.hosts, args.gpus, args.rounds))
    else:
        out = paint(args.hosts)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
