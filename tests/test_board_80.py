"""The board at 80 columns (issue 20) and the board's defects of issue 19: nothing a person
needs only at 110+ columns, nothing cut without an ellipsis, keys that go where they were
typed, and a demo queue that grants on the simulated fleet without connecting anywhere."""

from __future__ import annotations

import os
import pwd
from dataclasses import replace
from datetime import timedelta
from pathlib import Path

from rich.cells import cell_len
from rich.text import Text
from textual import events

from gputop.model import HostError, HostSnapshot, ProcessInfo
from gputop.reservations.state import StoreState
from gputop.reservations.store import Store
from gputop.reservations.terms import Target, Terms, new_reservation
from gputop.ui.app import GputopApp
from gputop.ui.board_model import BoardModel
from gputop.ui.table import BoardTable
from gputop.ui.widgets import DetailPane
from tests.support.board_data import NOW, board_config, fixed_snapshots, seed
from tests.test_board import cell, gk, goto, load, make_app


def screen_lines(app: GputopApp) -> list[str]:
    return [s.text for s in app.screen._compositor.render_strips()]


def static_text(app: GputopApp, selector: str) -> str:
    r = app.query_one(selector).render()
    return r.plain if isinstance(r, Text) else str(r)


def assert_no_silent_cut(app: GputopApp, table: BoardTable) -> None:
    """Every cell of every row on screen shows whole, or cut with an ellipsis."""
    lines = screen_lines(app)
    widths = table._widths()
    top = int(table.scroll_y)
    for i in range(top, min(table.row_count, top + table.size.height - 1)):
        key = table.row_keys[i]
        line = lines[table.region.y + 1 + i - top]
        cells = table._cells_of(key)
        ws = widths if len(cells) == len(widths) else [
            *widths[:len(cells) - 1], sum(widths[len(cells) - 1:])]
        for c, w in zip(cells, ws):
            text = c.plain.rstrip()
            if cell_len(text) <= w - 2:
                assert text in line, (key, text, line)
            else:
                assert "…" in line, (key, text, line)


async def test_80x24_shows_models_whole_and_cuts_nothing_silently(tmp_path: Path) -> None:
    seed(Store(tmp_path / "reservations.json"))
    app = make_app(tmp_path)
    async with app.run_test(size=(80, 24)) as pilot:
        table = await load(app, pilot)
        for i in range(4):
            assert cell(table, gk("gpu-h100", i), "gpu").strip() == f"{i} H100 80GB HBM3"
        mig = cell(table, gk("gpu-mixed", 2), "gpu")
        assert mig.endswith("… MIG")  # the model gives way to the MIG mark, with an ellipsis
        assert_no_silent_cut(app, table)
        summary = screen_lines(app)[0].rstrip()
        assert summary.endswith("│ mem 78/483G"), summary  # the summary shows all of itself
        for _ in range(100):  # the footer is drawn after the table on a loaded machine
            if "? Help q Quit" in screen_lines(app)[-1]:
                break
            await pilot.pause(0.05)
        assert "? Help q Quit" in screen_lines(app)[-1]  # the footer's keys too
        await pilot.press("s")  # a note in front: shorter words, then an ellipsis
        await pilot.pause()
        summary = screen_lines(app)[0].rstrip()
        assert summary.endswith(("G", "…")) and "│" in summary, summary
        assert_no_silent_cut(app, table)


async def test_details_show_temperature_and_power(tmp_path: Path) -> None:
    app = make_app(tmp_path)
    async with app.run_test(size=(80, 24)) as pilot:
        table = await load(app, pilot)
        assert "temp" not in table.column_keys  # no room at 80: the details have them
        goto(app, table, gk("gpu-h100", 1))
        await pilot.press("enter")
        await pilot.pause()
        head = static_text(app, "#detail-head")
        assert "59°C" in head and "power 632W/700W" in head, head
        assert "59°C" in "".join(screen_lines(app))  # on screen, not only in the widget
        await pilot.resize_terminal(160, 40)
        await pilot.pause()
        # units on both numbers ("632W/700" read as two different things)
        assert cell(table, gk("gpu-h100", 1), "power") == "632W/700W"


async def test_a_long_host_reason_is_cut_with_an_ellipsis_and_whole_in_the_details(
        tmp_path: Path) -> None:
    reason = ("host key verification failed: the key gpu-down offered is not the one in "
              "~/.ssh/known_hosts (line 12); run ssh-keygen -R gpu-down if it was changed "
              "on purpose, then connect once with ssh to review it")
    app = make_app(tmp_path)
    async with app.run_test(size=(80, 24)) as pilot:
        table = await load(app, pilot)
        app.ingest(HostSnapshot(name="gpu-down", time=NOW, error=HostError("host-key", reason),
                                last_ok=NOW - timedelta(minutes=7)))
        app.render_board()
        await pilot.pause()
        line = next(ln for ln in screen_lines(app) if "gpu-down" in ln)
        assert "host-key" in line and "seen 7m ago  host key verification" in line
        assert line.rstrip().endswith("…"), line
        goto(app, table, "gpu-down")
        await pilot.press("enter")
        await pilot.pause()
        shown = " ".join(ln.strip() for ln in screen_lines(app))
        assert " ".join(reason.split()) in " ".join(shown.split())  # wrapped, whole


async def test_details_never_push_processes_out_of_view(tmp_path: Path) -> None:
    app = make_app(tmp_path)
    async with app.run_test(size=(80, 24)) as pilot:
        table = await load(app, pilot)
        snap = fixed_snapshots()[0]
        many = tuple(ProcessInfo(6000 + i, "alice", f"python worker.py --rank {i}", 1000, 60)
                     for i in range(15))
        gpus = list(snap.gpus)
        gpus[0] = gpus[0].with_processes(many)
        app.ingest(replace(snap, gpus=tuple(gpus)))
        app.render_board()
        goto(app, table, gk("gpu-h100", 0))
        await pilot.press("enter")
        await pilot.pause()
        pane = app.query_one(DetailPane)
        lines = screen_lines(app)[pane.region.y:pane.region.bottom]
        text = "\n".join(lines)
        assert "PID  USER" in text and "6000  alice" in text, text
        more = [ln for ln in lines if "… and " in ln]
        assert more, text  # what does not fit is counted, on screen
        shown = sum(1 for ln in lines if "python worker.py" in ln)
        assert f"… and {15 - shown} more processes (15 in all" in more[0], (shown, more)


async def test_page_down_keeps_the_last_row_in_view(tmp_path: Path) -> None:
    app = make_app(tmp_path)
    async with app.run_test(size=(80, 24)) as pilot:
        base = fixed_snapshots()[0]
        for i in range(12):
            app.ingest(replace(base, name=f"h{i:02d}"))
        app.render_board()
        await pilot.pause()
        table = app.query_one(BoardTable)
        rows = table.size.height - 1  # less the header
        last = table.row_keys[rows - 1]
        assert on_screen_row(app, table, last) == rows - 1
        await pilot.press("pagedown")
        await pilot.pause()
        assert table.cursor_row == rows - 1  # a page: the rows shown, less one
        assert on_screen_row(app, table, last) == 0  # the page's last row is now the first
        await pilot.press("pageup")
        await pilot.pause()
        assert table.cursor_row == 0 and int(table.scroll_y) == 0


def on_screen_row(app: GputopApp, table: BoardTable, key: str) -> int:
    return table.get_row_index(key) - int(table.scroll_y)


async def test_enter_closes_the_filter_bar_and_keeps_the_filter(tmp_path: Path) -> None:
    app = make_app(tmp_path)
    async with app.run_test(size=(80, 24)) as pilot:
        table = await load(app, pilot)
        await pilot.press("slash", "m", "i", "x", "enter")
        await pilot.pause()
        box = app.query_one("#filter")
        assert not box.display and table.has_focus
        assert app.model.filter_text == "mix"
        assert "[filter: mix]" in screen_lines(app)[0]
        assert all(k.startswith("gpu-mixed") for k in table.row_keys)
        await pilot.press("escape")  # esc still clears it
        await pilot.pause()
        assert app.model.filter_text == "" and not box.display


async def test_keys_typed_before_the_filter_has_focus_go_to_the_filter(tmp_path: Path) -> None:
    """``/gpu-0`` typed in one burst right after the board opens: every key is the
    filter's; the ``u`` never reaches the board (there: a release of my reservation)."""
    store = Store(tmp_path / "reservations.json")
    store.update(lambda state, _now: StoreState(reservations=(
        new_reservation(Target("gpu-h100", 2), Terms(3600, user="ann", machine="ws-ann"), NOW),)))
    app = make_app(tmp_path)
    seen: list[str] = []
    app.notify = lambda message, **kw: seen.append(str(message))  # type: ignore[method-assign]
    async with app.run_test(size=(80, 24)) as pilot:
        table = await load(app, pilot)
        goto(app, table, gk("gpu-h100", 2))
        await pilot.pause()
        for ch in "/gpu-0":  # one burst, as the terminal sends it: nothing handled between
            key = events.Key("slash" if ch == "/" else "minus" if ch == "-" else ch, ch)
            key.set_sender(app)
            app._driver.send_message(key)  # type: ignore[union-attr]
        await pilot.pause()
        await app.workers.wait_for_complete()
        assert app.query_one("#filter").value == "gpu-0"  # type: ignore[attr-defined]
        assert not [m for m in seen if "releas" in m or "reservation" in m], seen
        assert [r.gpu for r in store.read().reservations] == [2]


def test_a_pid_seen_again_is_one_process() -> None:
    """A pid listed twice on a GPU (nvidia-smi's loop printing two iterations as one) is
    one process, and one process on two GPUs is one process in ``w``."""
    from gputop.sources.nvidia_smi import AppRow, Owner, attach_processes

    snap = fixed_snapshots()[1]  # gpu-mixed: carol runs pid 5000 on GPU 2
    g0, g1, g2 = snap.gpus
    rows = [AppRow(g2.uuid, 5000, 11000), AppRow(g2.uuid, 5000, 11000),
            AppRow(g0.uuid, 5000, 300)]
    owners = {5000: Owner(5000, "carol", 60)}
    gpus = attach_processes(snap.gpus, rows * 50, owners, {5000: "vllm serve model"})
    assert [len(g.processes) for g in gpus] == [1, 0, 1]
    m = BoardModel(host_order=[], clock=lambda: NOW)
    m.ingest(replace(snap, gpus=tuple(gpus)))
    (carol,) = [u for u in m.users() if u.user == "carol"]
    assert carol.processes == 1 and carol.memory_mib == 11300
    assert carol.commands == {"vllm serve model": 1}
    # and the board's own count does not trust its source: a GPU listing a pid twice
    twice = g2.with_processes(g2.processes * 3)
    m.ingest(replace(snap, gpus=(g0, g1, twice)))
    (carol,) = [u for u in m.users() if u.user == "carol"]
    assert carol.processes == 1 and carol.memory_mib == 11000


def test_w_cuts_a_long_command_with_an_ellipsis() -> None:
    from gputop.ui.board_rows import UserLoad
    from gputop.ui.screens import users_text

    cmd = "python train.py " + " ".join(f"--option-{i} value" for i in range(20))
    text = users_text([UserLoad("alice", ["h:0"], [], 1, 100, {cmd: 1})]).plain
    (line,) = [ln for ln in text.splitlines() if "train.py" in ln]
    assert line.rstrip().endswith("…") and cmd[:40] in line


async def test_the_demo_queue_grants_on_the_simulated_fleet(tmp_path: Path) -> None:
    """``Q`` in ``gputop --demo``: the waiter looks at the demo's fleet (what the board
    shows), never at hosts of those names over SSH; it is granted a free GPU."""
    from gputop.sources.demo import demo_session

    me = pwd.getpwuid(os.getuid()).pw_name
    with demo_session(interval=0.2) as (cfg, sources):
        app = GputopApp(cfg, sources=list(sources))
        async with app.run_test(size=(120, 40)) as pilot:
            for _ in range(200):
                if len(app.model.snapshots) == len(sources):
                    break
                await pilot.pause(0.05)
            await pilot.press("Q")
            await pilot.pause()
            await pilot.press("enter")  # one GPU (the dialog's default)
            store = Store(cfg.reservations.path)
            for _ in range(300):
                mine = [r for r in store.read().reservations if r.user == me]
                if mine:
                    break
                await pilot.pause(0.05)
            assert mine, "not granted within 15 s"
            assert mine[0].host in {s.name for s in sources}
        assert all(s.connects == 0 for s in sources)
    assert not board_config(tmp_path).reservations.path.exists()  # (the demo's own file)


async def test_a_key_typed_before_a_dialog_is_drawn_does_not_answer_it(tmp_path: Path) -> None:
    """``r`` then ``y`` in one burst on a GPU someone else uses: the ``y`` was typed
    before the question was on screen, so it does not say "reserve anyway"."""
    app = make_app(tmp_path)
    async with app.run_test(size=(80, 24)) as pilot:
        table = await load(app, pilot)
        goto(app, table, gk("gpu-h100", 0))  # alice runs there
        await pilot.pause()
        for ch in "ry":
            key = events.Key(ch, ch)
            key.set_sender(app)
            app._driver.send_message(key)  # type: ignore[union-attr]
        await pilot.pause()
        await pilot.pause()
        assert type(app.screen).__name__ == "ConfirmScreen"  # still asking
        await pilot.press("y")  # once it is drawn, y answers
        await pilot.pause()
        assert type(app.screen).__name__ == "ReserveScreen"


def test_a_lost_gpus_row_names_its_bus_whole_at_80_columns() -> None:
    from gputop.model import GpuInfo
    from gputop.ui.board_rows import GpuRow
    from gputop.ui.cells import NARROW, Palette, gpu_cells

    g = GpuInfo(index=None, bus_id="00000000:07:00.0", lost=True)
    label = gpu_cells(GpuRow("h", "h\x00@x", g, None, ("lost",), False, False), NOW,
                      Palette(), narrow=True)[0].plain
    assert label.strip() == "? lost 07:00.0" and len(label) <= (NARROW[0][2] or 0)


async def test_a_lost_gpus_details_say_what_the_driver_said(tmp_path: Path) -> None:
    from gputop.model import GpuInfo

    app = make_app(tmp_path)
    async with app.run_test(size=(80, 24)) as pilot:
        table = await load(app, pilot)
        snap = fixed_snapshots()[0]
        lost = GpuInfo(index=None, bus_id="00000000:07:00.0", lost=True,
                       lost_reason="Unknown Error")
        app.ingest(replace(snap, gpus=(*snap.gpus, lost)))
        app.render_board()
        await pilot.pause()
        goto(app, table, "gpu-h100\x00@00000000:07:00.0")
        await pilot.press("enter")
        await pilot.pause()
        head = static_text(app, "#detail-head")
        assert head.startswith("gpu-h100:?  lost: Unknown Error"), head
        assert "bus 00000000:07:00.0" in head and "temp ?" not in head


async def test_a_long_holder_name_gives_way_to_the_time_left(tmp_path: Path) -> None:
    store = Store(tmp_path / "reservations.json")
    store.update(lambda state, _now: StoreState(reservations=(
        new_reservation(
            Target("gpu-h100", 2), Terms(3 * 3600, user="mgarcia-long", machine="ws"), NOW),)))
    app = make_app(tmp_path)
    async with app.run_test(size=(80, 24)) as pilot:
        table = await load(app, pilot)
        assert cell(table, gk("gpu-h100", 2), "resv") == "mga… 3h00m"  # its 10 columns
        assert_no_silent_cut(app, table)


async def test_the_summary_fits_again_when_the_terminal_narrows(tmp_path: Path) -> None:
    app = make_app(tmp_path)
    async with app.run_test(size=(120, 24)) as pilot:
        await load(app, pilot)
        assert "0 reserved of 8 GPUs" in screen_lines(app)[0]
        await pilot.resize_terminal(60, 24)
        await pilot.pause()
        line = screen_lines(app)[0].rstrip()
        assert "resv of 8" in line and line.endswith("…"), line  # shorter words, then …


def test_w_wraps_a_long_list_under_itself() -> None:
    """At 80 columns a long list of commands wrapped back to the dialog's edge, under the
    labels and the user names; given the room, it wraps under its own first line."""
    from gputop.ui.board_rows import UserLoad
    from gputop.ui.screens import users_text

    cmds = {f"python job{i}.py --config runs/{i}/config.yaml": 1 for i in range(4)}
    text = users_text([UserLoad("alice", ["h:0", "h:1"], [], 2, 100, cmds)], 60).plain
    lines = text.splitlines()
    at = next(i for i, ln in enumerate(lines) if ln.startswith("    runs      "))
    assert len(lines) > at + 1 and all(ln.startswith(" " * 14) and len(ln) <= 60
                                       for ln in lines[at + 1:]), lines
    assert " ".join(ln.strip() for ln in lines[at:]).removeprefix("runs ").strip() == \
        ", ".join(cmds)
    assert users_text([UserLoad("alice", ["h:0"], [], 1, 100, cmds)]).plain.count("\n") == 3
