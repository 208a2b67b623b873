"""The summary line on a refresh: redrawn when it changed, and then without a layout of
the whole screen (it is one line as wide as the screen whatever it says; a layout per
refresh was a third of the board's drawing at 200 hosts x 8 GPUs, bench/results/hub.md)."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

from gputop.ui.app import GputopApp
from tests.support.board_data import NOW, board_config, fixed_snapshots


async def test_a_changed_summary_is_drawn_without_a_layout(tmp_path: Path) -> None:
    app = GputopApp(board_config(tmp_path), feed=False, clock=lambda: NOW, user="ann")
    async with app.run_test(size=(120, 40)) as pilot:
        for snap in fixed_snapshots():
            app.ingest(snap)
        app.reservations.reload()
        app.render_board()
        await pilot.pause()
        screen = app.screen
        layouts: list[int] = []
        original = screen._refresh_layout

        def counting(*a: Any, **k: Any) -> Any:
            layouts.append(1)
            return original(*a, **k)

        screen._refresh_layout = counting  # type: ignore[method-assign]
        # A layout the first frame asked for may still be pending on a loaded machine
        # (seen once in a CI-like run): settled first, then counted.
        for _ in range(50):
            before = len(layouts)
            await pilot.pause(0.05)
            if len(layouts) == before:
                break
        layouts.clear()
        was = screen._compositor.render_strips()[0].text
        snap = fixed_snapshots()[0]
        busy = tuple(replace(g, utilization_percent=100, memory_used_mib=g.memory_total_mib)
                     for g in snap.gpus)
        app.ingest(replace(snap, gpus=busy))
        app.render_board()
        await pilot.pause()
        now = screen._compositor.render_strips()[0].text
        assert now != was, now  # the summary says what changed...
        assert layouts == []  # ...and nothing was laid out again for it
        app.render_board()  # the same again: not even redrawn
        await pilot.pause()
        assert screen._compositor.render_strips()[0].text == now and layouts == []
