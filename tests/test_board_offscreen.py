"""The board puts off a frame whose only news is answers from hosts not on screen
(``GputopApp._frame_due``): never one that changes what is on screen. An answer that moves
the rows on screen (a host above them going down or coming back, gaining or losing GPUs
or MIG instances), a host that has no rows yet (a hub names its hosts as they come), or
an answer in a filtered or free-only view (it can bring rows in or take them out) is
drawn at the next tick, as an answer from a host on screen is; and answers put off are
drawn at the next tick once a scroll or the cursor brings their hosts on screen."""

from __future__ import annotations

import time
from dataclasses import replace
from datetime import timedelta
from pathlib import Path

from gputop.model import HostError, HostSnapshot, MigInstance, ProcessInfo
from gputop.ui.app import GputopApp
from gputop.ui.table import BoardTable
from tests.support.board_data import NOW, board_config, fixed_snapshots
from tests.test_board import make_app, on_screen

BASE = fixed_snapshots()[0]  # gpu-h100: 4 GPUs
LATER = BASE.time + timedelta(seconds=2)


def _fleet(n: int) -> list[HostSnapshot]:
    return [replace(BASE, name=f"n{i:02d}") for i in range(n)]


def _frames(app: GputopApp) -> list[int]:
    """A list that grows by one per frame drawn (render_board wrapped)."""
    frames: list[int] = []
    real = app.render_board

    def counted() -> None:
        frames.append(1)
        real()

    app.render_board = counted  # type: ignore[method-assign]
    return frames


async def _board(app: GputopApp, pilot: object, fleet: list[HostSnapshot]) -> BoardTable:
    for snap in fleet:
        app.ingest(snap)
    app.render_board()
    await pilot.pause()  # type: ignore[attr-defined]
    return app.query_one(BoardTable)


async def test_the_first_answers_of_hosts_a_hub_names_are_drawn_at_once(
        tmp_path: Path) -> None:
    """No host configured (a hub names them): the board starts empty, so no host is on
    screen; its first answers are the board, not news for the summary bar only."""
    app = GputopApp(replace(board_config(tmp_path), hosts=()), feed=False,
                    clock=lambda: NOW, user="ann")
    async with app.run_test(size=(120, 30)) as pilot:
        app.render_board()
        await pilot.pause()
        table = app.query_one(BoardTable)
        assert table.row_count == 0
        frames = _frames(app)
        for snap in _fleet(3):
            app.ingest(snap)
        app.intake.tick()
        assert frames == [1]
        assert table.row_count == 3 * 5
        # ...and a host the hub adds later, in the room below the last row.
        app.ingest(replace(BASE, name="n99"))
        app.intake.tick()
        assert frames == [1, 1]
        assert "n99" in on_screen(app, table, table.row_keys[-5])


async def test_a_host_above_the_screen_that_goes_down_moves_the_rows_on_it_now(
        tmp_path: Path) -> None:
    app = make_app(tmp_path)
    fleet = _fleet(30)
    app.model.host_order[:] = [s.name for s in fleet]
    async with app.run_test(size=(120, 24)) as pilot:
        table = await _board(app, pilot, fleet)
        table.move_cursor(row=table.row_count - 1)  # (scrolls there: the cursor's host
        await pilot.pause()  # is on screen too)
        assert "n00" not in table.hosts_on_screen()
        frames = _frames(app)
        bottom = table.row_keys[-1]
        app.ingest(HostSnapshot(name="n00", time=LATER, error=HostError(
            "timeout", "no answer"), last_ok=BASE.time))  # its 5 rows become 1
        app.intake.tick()
        assert frames == [1]
        await pilot.pause()
        assert on_screen(app, table, bottom).rstrip().endswith(
            table.get_cell(bottom, table.column_keys[-1]).plain.rstrip())
        # Back with its GPUs: the rows move again, drawn now too.
        app.ingest(replace(BASE, name="n00", time=LATER))
        app.intake.tick()
        assert frames == [1, 1]
        # A GPU's MIG instances appear (a row each, under it): the rows below move.
        gpus = list(BASE.gpus)
        gpus[1] = replace(gpus[1], mig_mode="Enabled", instances=(MigInstance(
            gpu_instance_id=3, compute_instance_id=0, device_index=0, uuid="MIG-3",
            profile="1g.10gb", memory_used_mib=0, memory_total_mib=9856,
            utilization_percent=None, processes=()),))
        app.ingest(replace(BASE, name="n01", time=LATER, gpus=tuple(gpus)))
        app.intake.tick()
        assert frames == [1, 1, 1]
        # Only numbers moved on a host above: nothing on screen changes; it waits.
        app.ingest(replace(BASE, name="n02", time=LATER + timedelta(seconds=2)))
        app.intake._last_render = time.monotonic()  # (the last frame just now, whatever the load)
        app.intake.tick()
        assert frames == [1, 1, 1]


async def test_in_a_filtered_or_free_only_view_an_answer_is_drawn_at_once(
        tmp_path: Path) -> None:
    """A host none of whose rows is shown (the filter left none) answers with a process
    of the user filtered for: its rows come in now, not an interval later."""
    app = make_app(tmp_path)
    fleet = _fleet(30)
    app.model.host_order[:] = [s.name for s in fleet]
    async with app.run_test(size=(120, 24)) as pilot:
        table = await _board(app, pilot, fleet)
        app.model.filter_text = "zed"
        app.render_board()
        await pilot.pause()
        assert table.row_count == 0
        frames = _frames(app)
        gpus = list(BASE.gpus)
        gpus[2] = gpus[2].with_processes((ProcessInfo(99, "zed", "python z.py", 100, 5),))
        app.ingest(replace(BASE, name="n29", time=LATER, gpus=tuple(gpus)))
        app.intake.tick()
        assert frames == [1]
        assert table.row_count == 2 and "zed" in on_screen(app, table, table.row_keys[1])
        app.model.filter_text = ""
        app.model.free_only = True
        app.render_board()
        await pilot.pause()
        free_rows = table.row_count
        frames.clear()
        gpus = [g.with_processes(()) for g in BASE.gpus]
        gpus = [replace(g, utilization_percent=0, memory_used_mib=0) for g in gpus]
        app.ingest(replace(BASE, name="n29", time=LATER, gpus=tuple(gpus)))  # all free now
        app.intake.tick()
        assert frames == [1]
        assert table.row_count > free_rows


async def test_answers_put_off_are_drawn_once_a_scroll_brings_their_rows_on_screen(
        tmp_path: Path) -> None:
    """A host off screen answered (put off); then the user scrolls (or moves the cursor)
    to it: its rows on screen are drawn from that answer at the next tick, not from the
    one before it for up to an interval more."""
    app = make_app(tmp_path)
    fleet = _fleet(30)
    app.model.host_order[:] = [s.name for s in fleet]
    async with app.run_test(size=(120, 24)) as pilot:
        table = await _board(app, pilot, fleet)
        assert "n29" not in table.hosts_on_screen()
        frames = _frames(app)
        gpus = list(BASE.gpus)
        gpus[0] = replace(gpus[0], utilization_percent=7)
        app.ingest(replace(BASE, name="n29", time=LATER, gpus=tuple(gpus)))
        app.intake._last_render = time.monotonic()  # (the last frame just now, whatever the load)
        app.intake.tick()
        assert frames == []  # (off screen: put off)
        table.scroll_end(animate=False)
        await pilot.pause()
        app.intake.tick()
        assert frames == [1]
        await pilot.pause()
        key = next(k for k in table.row_keys if k.startswith("n29\x00"))
        assert " 7%" in on_screen(app, table, key)
        # The same by the cursor (a key: Home), from the bottom back to the top.
        table.move_cursor(row=table.row_count - 1)
        await pilot.pause()
        assert "n00" not in table.hosts_on_screen()
        app.ingest(replace(BASE, name="n00", time=LATER, gpus=tuple(gpus)))
        app.intake._last_render = time.monotonic()
        app.intake.tick()
        assert frames == [1]
        table.move_cursor(row=0)
        await pilot.pause()
        app.intake.tick()
        assert frames == [1, 1]


async def test_rows_of_hosts_off_screen_are_made_when_they_come_on_screen(
        tmp_path: Path) -> None:
    """An answer from a host off screen gives its share of the summary and its rows'
    keys only (``HostRows``); its rows are made when the table looks at them, and then
    show that answer."""
    app = make_app(tmp_path)
    fleet = _fleet(30)
    app.model.host_order[:] = [s.name for s in fleet]
    async with app.run_test(size=(120, 30)) as pilot:
        table = await _board(app, pilot, fleet)
        for snap in fleet:  # a refresh, as the feed delivers it: through the drain
            gpus = (replace(snap.gpus[0], utilization_percent=37), *snap.gpus[1:])
            app.intake._inbox.put(replace(snap, gpus=gpus, time=LATER))
        app.intake.drain()
        app.render_board()
        await pilot.pause()
        shown = table.hosts_on_screen()
        assert 0 < len(shown) < 10
        made = {h for h, rows in app.model._row_cache.items() if rows.built}
        assert made == set(shown)
        assert app.model.summary().gpus == 30 * 4  # (counted without their rows)
        last = fleet[-1].name
        table.action_scroll_bottom()
        key = table.row_keys[table.get_row_index(last) + 1]
        for _ in range(30):  # (made, and drawn, at the table's next paint after the scroll)
            await pilot.pause(0.1)
            if app.model._row_cache[last].built and "37%" in on_screen(app, table, key):
                break
        assert app.model._row_cache[last].built
        assert "37%" in on_screen(app, table, key)


async def test_opening_the_filter_makes_every_hosts_rows_before_the_first_key(
        tmp_path: Path) -> None:
    """A filtered view can show any host's rows: they are made as the filter box opens,
    not by the first key typed in it (at 1,000 hosts that key waited 50 ms longer)."""
    app = make_app(tmp_path)
    fleet = _fleet(30)
    app.model.host_order[:] = [s.name for s in fleet]
    async with app.run_test(size=(120, 30)) as pilot:
        await _board(app, pilot, fleet)
        assert not all(rows.built for rows in app.model._row_cache.values())
        await pilot.press("slash")
        await pilot.pause()
        assert all(app.model._row_cache[s.name].built for s in fleet)
