"""The board driven by its keys (Textual pilot), on the fixed fleet and on the real one."""

from __future__ import annotations

import json
import os
import pwd
import subprocess
import sys
import time
from dataclasses import replace
from datetime import timedelta
from pathlib import Path

import pytest
from rich.text import Text

from gputop.model import HostSnapshot
from gputop.reservations.store import Store
from gputop.reservations.terms import Target, Terms
from gputop.ui.app import GputopApp
from gputop.ui.board_rows import GpuRow, HostRow
from gputop.ui.table import BoardTable
from gputop.ui.widgets import DetailPane
from tests.support.board_data import HOSTILE_USER, NOW, board_config, fixed_snapshots, seed


def make_app(tmp_path: Path, user: str = "ann", clock: object = lambda: NOW,
             **kw: object) -> GputopApp:
    return GputopApp(board_config(tmp_path), feed=False, clock=clock, user=user,  # type: ignore[arg-type]
                     **kw)  # type: ignore[arg-type]


async def load(app: GputopApp, pilot: object) -> BoardTable:
    for snap in fixed_snapshots():
        app.ingest(snap)
    app.reservations.reload()
    app.render_board()
    await pilot.pause()  # type: ignore[attr-defined]
    return app.query_one(BoardTable)


def cell(table: BoardTable, key: str, col: str) -> str:
    value = table.get_cell(key, col)
    return value.plain if isinstance(value, Text) else str(value)


def on_screen(app: GputopApp, table: BoardTable, key: str) -> str:
    """The row's line as the screen has it now (lines not marked for a redraw come from
    Textual's caches: a change that was not redrawn is not there)."""
    strips = app.screen._compositor.render_strips()
    return strips[table.region.y + 1 + table.get_row_index(key) - int(table.scroll_y)].text


def keys(table: BoardTable) -> list[str]:
    return table.row_keys


def goto(app: GputopApp, table: BoardTable, key: str) -> None:
    table.move_cursor(row=table.get_row_index(key))


K = "\x00"


def gk(host: str, index: int) -> str:
    """The row key of a fixture GPU: host + uuid (board_data numbers the uuids)."""
    return f"{host}{K}GPU-{index:08d}-test"


def fk(host: str, index: int) -> str:
    """The row key of a GPU of the real test fleet (tests/support/fleet.py numbers its uuids)."""
    return f"{host}{K}GPU-{host[:8]:0>8}-0000-4000-8000-{index:012d}"


async def test_rows_grouped_by_host_with_error_and_stale(tmp_path: Path) -> None:
    seed(Store(tmp_path / "reservations.json"))
    app = make_app(tmp_path)
    async with app.run_test(size=(120, 40)) as pilot:
        table = await load(app, pilot)
        ks = keys(table)
        assert ks[:6] == ["gpu-h100", gk("gpu-h100", 0), gk("gpu-h100", 1), gk("gpu-h100", 2),
                          gk("gpu-h100", 3), "gpu-mixed"]
        # A host in error keeps its place (config order), between its neighbours.
        assert ks[-3:] == ["gpu-down", "gpu-stale", f"gpu-stale{K}#0"]
        assert cell(table, "gpu-down", "mem") == "unreachable"
        # its reason spans the columns after its kind (the details show it whole)
        assert cell(table, "gpu-down", "users") == "seen 7m ago  connection refused"
        assert "connection refused" in cell(table, "gpu-down", "flags")
        assert "stale" in cell(table, "gpu-stale", "flags")
        stale = table.get_cell(f"gpu-stale{K}#0", "util")
        assert isinstance(stale, Text) and any("dim" in str(s.style) for s in stale.spans)
        assert cell(table, gk("gpu-h100", 0), "users") == "alice"
        assert cell(table, gk("gpu-h100", 1), "resv") == "bob 3h00m"
        assert "unreserved use" not in cell(table, gk("gpu-h100", 1), "flags")
        assert "MIG" in cell(table, gk("gpu-mixed", 2), "gpu")


async def test_hostile_strings_stay_literal(tmp_path: Path) -> None:
    app = make_app(tmp_path)
    async with app.run_test(size=(120, 40)) as pilot:
        table = await load(app, pilot)
        users = cell(table, gk("gpu-h100", 3), "users")
        assert users == "[red]x[/]"  # the OSC title sequence is gone, markup stays literal
        goto(app, table, gk("gpu-h100", 3))
        await pilot.press("enter")
        await pilot.pause()
        text = app.query_one("#detail-procs").render()
        plain = text.plain if isinstance(text, Text) else str(text)
        assert "[link=http://evil]click[/link]" in plain
        assert "\x1b" not in plain and "\u202e" not in plain
        assert HOSTILE_USER not in plain


async def test_reserve_writes_the_store_and_the_row_shows_it(tmp_path: Path) -> None:
    from gputop.model import utcnow

    app = make_app(tmp_path, clock=utcnow)  # the store stamps real times
    async with app.run_test(size=(120, 40)) as pilot:
        table = await load(app, pilot)
        goto(app, table, gk("gpu-h100", 2))
        await pilot.press("r")
        await pilot.pause()
        dur = app.screen.query_one("#reserve-duration")
        dur.value = "2h"  # type: ignore[attr-defined]
        app.screen.query_one("#reserve-note").value = "eval run"  # type: ignore[attr-defined]
        await pilot.click("#reserve-ok")
        await app.workers.wait_for_complete()
        await pilot.pause()
        (r,) = [r for r in Store(tmp_path / "reservations.json").read().reservations
                if r.host == "gpu-h100" and r.gpu == 2]
        assert r.user == "ann" and r.note == "eval run" and r.uuid == "GPU-00000002-test"
        assert cell(table, gk("gpu-h100", 2), "resv").startswith("ann ")
        # Just reserved: not "idle" before the grace period without the holder's processes.
        assert "idle reservation" not in cell(table, gk("gpu-h100", 2), "flags")


async def test_conflict_shows_the_holder(tmp_path: Path) -> None:
    """A GPU someone else holds says so (who, how long, their note) before any dialog."""
    seed(Store(tmp_path / "reservations.json"))
    app = make_app(tmp_path)
    seen: list[str] = []
    async with app.run_test(size=(120, 40)) as pilot:
        app.notify = lambda msg, **kw: seen.append(str(msg))  # type: ignore[method-assign]
        table = await load(app, pilot)
        goto(app, table, gk("gpu-h100", 1))
        await pilot.press("r")
        await pilot.pause()
        assert type(app.screen).__name__ == "Screen"  # no dialog opened
    assert seen and "reserved by bob" in seen[-1] and "ablation [i]sweep[/i]" in seen[-1]
    assert "gpu-h100:1" in seen[-1]
    assert [r.user for r in Store(tmp_path / "reservations.json").read().reservations
            if r.gpu == 1 and r.host == "gpu-h100"] == ["bob"]


async def test_store_race_is_refused_with_the_holder(tmp_path: Path) -> None:
    """Someone reserves the GPU while our dialog is open: the write is refused, naming them."""
    from gputop.reservations.ops import Target, reserve

    app = make_app(tmp_path, user="erin")
    seen: list[str] = []
    async with app.run_test(size=(120, 40)) as pilot:
        app.notify = lambda msg, **kw: seen.append(str(msg))  # type: ignore[method-assign]
        table = await load(app, pilot)
        goto(app, table, gk("gpu-h100", 2))
        await pilot.press("r")
        await pilot.pause()
        reserve(Store(tmp_path / "reservations.json"), [Target("gpu-h100", 2)], seconds=60,
                max_seconds=3600, note="mine [b]now[/b]", user="bob")
        await pilot.press("enter")
        await app.workers.wait_for_complete()
        await pilot.pause()
    refused = [m for m in seen if m.startswith("refused")]
    assert refused and "bob" in refused[0] and "mine [b]now[/b]" in refused[0]


async def test_release_own_but_not_others(tmp_path: Path) -> None:
    seed(Store(tmp_path / "reservations.json"))
    app = make_app(tmp_path, user="erin")
    async with app.run_test(size=(120, 40)) as pilot:
        table = await load(app, pilot)
        goto(app, table, gk("gpu-h100", 1))  # bob's
        await pilot.press("u")
        await app.workers.wait_for_complete()
        goto(app, table, gk("gpu-mixed", 1))  # erin's own
        await pilot.press("u")
        await app.workers.wait_for_complete()
        await pilot.pause()
        left = Store(tmp_path / "reservations.json").read().reservations
        assert [(r.host, r.gpu) for r in left] == [("gpu-h100", 1)]
        assert cell(table, gk("gpu-mixed", 1), "resv") == "—"


async def test_filter_sort_and_free_only(tmp_path: Path) -> None:
    app = make_app(tmp_path)
    async with app.run_test(size=(120, 40)) as pilot:
        table = await load(app, pilot)
        await pilot.press("slash", "c", "a", "r", "o", "l")
        await pilot.pause()
        assert keys(table) == ["gpu-mixed", gk("gpu-mixed", 2)]  # carol runs only there
        await pilot.press("escape")
        await pilot.pause()
        assert len(keys(table)) == 12
        stale = fixed_snapshots()[3]  # a 0 % GPU on a host named after the n/a one's
        app.ingest(replace(stale, gpus=(replace(stale.gpus[0], utilization_percent=0),)))
        await pilot.press("s")  # utilisation, flat
        await pilot.pause()
        ks = keys(table)
        assert "gpu-h100" not in ks and ks[0] == gk("gpu-h100", 0)
        utils = [app.model.find(k).gpu.utilization_percent  # type: ignore[union-attr]
                 for k in ks if K in k]
        known = [u for u in utils if u is not None]
        assert None in utils and 0 in known  # n/a (a MIG GPU) sorts after every 0 %
        assert utils == sorted(known, reverse=True) + [None] * (len(utils) - len(known))
        await pilot.press("s")  # free memory
        await pilot.pause()
        frees = [app.model.find(k).free_mib for k in keys(table) if K in k]  # type: ignore[union-attr]
        assert frees == sorted(frees, reverse=True)
        await pilot.press("s", "f")  # back to host order, free GPUs only
        await pilot.pause()
        assert keys(table) == ["gpu-h100", gk("gpu-h100", 2), "gpu-mixed", gk("gpu-mixed", 0),
                               gk("gpu-mixed", 1)]


async def test_collapse_a_host(tmp_path: Path) -> None:
    app = make_app(tmp_path)
    async with app.run_test(size=(120, 40)) as pilot:
        table = await load(app, pilot)
        goto(app, table, "gpu-h100")
        await pilot.press("enter")
        await pilot.pause()
        assert keys(table)[:2] == ["gpu-h100", "gpu-mixed"]
        assert cell(table, "gpu-h100", "gpu").startswith("▸")


async def test_a_row_redrawn_alone_after_an_animated_scroll_lines_up(tmp_path: Path) -> None:
    """Review finding: the table mapped screen lines with int(scroll_y), Textual repaints
    when round(scroll_y) changes. A click on the scrollbar's track scrolls with an
    animation (... 12.99, 13.0): the screen stayed a row off, and once only changed lines
    were redrawn, one update showed a GPU twice with two different loads."""
    from gputop.model import GpuInfo
    from gputop.ui.board_rows import gpu_keys

    app = make_app(tmp_path)
    async with app.run_test(size=(120, 16)) as pilot:
        for snap in fixed_snapshots():
            app.ingest(snap)
        for h in range(6):
            app.ingest(HostSnapshot(name=f"x{h}", time=NOW, gpus=tuple(
                GpuInfo(index=i, uuid=f"U{h}-{i}", name="H100", utilization_percent=10 * i,
                        memory_used_mib=1, memory_total_mib=80000) for i in range(4))))
        app.render_board()
        await pilot.pause()
        table = app.query_one(BoardTable)
        await pilot.click(BoardTable, offset=(table.region.width - 1, table.region.height - 2))
        await pilot.pause(0.5)  # the scroll's animation has ended
        assert table.scroll_y > 0
        key = table.row_keys[table.scroll_offset.y + 5]
        host = key.split("\x00")[0]
        snap = app.model.snapshots[host]
        app.ingest(replace(snap, gpus=tuple(
            replace(g, utilization_percent=99) if k == key else g
            for g, k in zip(snap.gpus, gpu_keys(host, snap.gpus), strict=True))))
        app.render_board()
        await pilot.pause()
        shown = [s.text for s in app.screen._compositor.render_strips()]
        table.refresh()  # what a full redraw shows
        await pilot.pause()
        assert shown == [s.text for s in app.screen._compositor.render_strips()]


async def test_updates_change_only_what_changed_and_keep_the_cursor(tmp_path: Path) -> None:
    app = make_app(tmp_path)
    async with app.run_test(size=(120, 40)) as pilot:
        table = await load(app, pilot)
        goto(app, table, gk("gpu-mixed", 1))
        before = table.cell_updates
        for snap in fixed_snapshots():  # the same data again: nothing to redraw
            app.ingest(snap)
        app.render_board()
        assert table.cell_updates == before
        snap = fixed_snapshots()[0]
        g0 = replace(snap.gpus[0], utilization_percent=3)
        changed = gk(snap.name, 0)
        was = on_screen(app, table, changed)
        assert cell(table, changed, "util") in was
        app.ingest(replace(snap, gpus=(g0, *snap.gpus[1:])))
        app.render_board()
        await pilot.pause()
        assert table.cell_updates == before + 1  # just the one utilisation cell
        # ...and the screen shows it (only changed lines are redrawn: this one is)
        now = on_screen(app, table, changed)
        assert now != was and cell(table, changed, "util") in now
        assert table.selected_key() == gk("gpu-mixed", 1)
        await pilot.press("s")  # re-sorting keeps the selected GPU selected
        await pilot.pause()
        assert table.selected_key() == gk("gpu-mixed", 1)


async def test_two_hundred_hosts_update_in_place(tmp_path: Path) -> None:
    """200 hosts x 8 GPUs: one host's refresh rewrites that host's cells only."""
    from gputop.config.tables import HostConfig

    base = fixed_snapshots()[0]
    gpus = tuple(replace(base.gpus[i % 4], index=i) for i in range(8))
    names = [f"node{i:03d}" for i in range(200)]
    cfg = replace(board_config(tmp_path), hosts=tuple(HostConfig(n) for n in names))
    app = GputopApp(cfg, feed=False, clock=lambda: NOW, user="ann")
    async with app.run_test(size=(120, 40)) as pilot:
        for n in names:
            app.ingest(HostSnapshot(name=n, time=NOW, gpus=gpus))
        app.render_board()
        await pilot.pause()
        table = app.query_one(BoardTable)
        assert table.row_count == 200 * 9
        table.move_cursor(row=table.get_row_index("node123") + 8)  # node123 on screen
        await pilot.pause()
        before, built = table.cell_updates, table.cells_built
        hot = tuple(replace(g, utilization_percent=(g.utilization_percent or 0) // 2 + 1)
                    for g in gpus)
        app.ingest(HostSnapshot(name="node123", time=NOW, gpus=hot))
        app.render_board()
        assert 0 < table.cell_updates - before <= 8 * 3  # util (+ power/temp) of 8 rows
        assert 0 < table.cells_built - built <= 9  # node123's rows, nobody else's
        # Hosts off screen answer: nothing is built or redrawn for them.
        before, built = table.cell_updates, table.cells_built
        for n in names[:100]:
            app.ingest(HostSnapshot(name=n, time=NOW, gpus=hot))
        app.render_board()
        await pilot.pause()
        assert (table.cell_updates, table.cells_built) == (before, built)
        assert app.model.find(f"node042{K}{gpus[0].uuid}").gpu.utilization_percent == (  # type: ignore[union-attr]
            hot[0].utilization_percent)


async def test_an_answer_rebuilds_only_the_gpus_that_moved(tmp_path: Path) -> None:
    """A hub's patch keeps the objects of the GPUs that did not change; the board keeps
    their rows and builds no cells for them, and a copy that is merely equal costs no
    cells either. The GPU that moved, and its host's header, are built again."""
    from gputop.config.tables import HostConfig

    base = fixed_snapshots()[0]
    gpus = tuple(replace(base.gpus[i % 4], index=i, uuid=f"GPU-{i}") for i in range(8))
    cfg = replace(board_config(tmp_path), hosts=(HostConfig("node"),))
    app = GputopApp(cfg, feed=False, clock=lambda: NOW, user="ann")
    async with app.run_test(size=(120, 40)) as pilot:
        app.ingest(HostSnapshot(name="node", time=NOW, gpus=gpus))
        app.render_board()
        await pilot.pause()
        table = app.query_one(BoardTable)
        rows = {k: app.model.find(k) for k in table.rows_by_key}
        built = table.cells_built
        moved = replace(gpus[5], utilization_percent=(gpus[5].utilization_percent or 0) + 7)
        app.ingest(HostSnapshot(name="node", time=NOW, gpus=(*gpus[:5], moved, *gpus[6:])))
        app.render_board()
        await pilot.pause()
        assert table.cells_built - built == 2  # GPU 5's row and the host's header
        kept = [k for k in table.rows_by_key if app.model.find(k) is rows[k]]
        assert len(kept) == 7  # the rows of the seven GPUs that did not move
        built = table.cells_built
        copies = tuple(replace(g) for g in (*gpus[:5], moved, *gpus[6:]))  # equal, new
        app.ingest(HostSnapshot(name="node", time=NOW, gpus=copies))
        app.render_board()
        await pilot.pause()
        assert table.cells_built - built == 1  # the header only


async def test_detail_pane_shows_processes_history_and_reservation(tmp_path: Path) -> None:
    seed(Store(tmp_path / "reservations.json"))
    app = make_app(tmp_path)
    async with app.run_test(size=(120, 40)) as pilot:
        table = await load(app, pilot)
        snap = fixed_snapshots()[0]
        for u in (10, 50, 90):
            app.ingest(replace(snap, gpus=(replace(snap.gpus[0], utilization_percent=u),
                                           *snap.gpus[1:])))
        goto(app, table, gk("gpu-h100", 1))
        await pilot.press("enter")
        await pilot.pause()
        detail = app.query_one(DetailPane)
        assert detail.display
        head = detail.query_one("#detail-head").render()
        assert "reserved by bob" in str(head) and "ablation [i]sweep[/i]" in str(head)
        procs = str(detail.query_one("#detail-procs").render())
        assert "4300" in procs and "finetune.py" in procs
        goto(app, table, gk("gpu-h100", 0))
        await pilot.pause()
        line = str(detail.query_one("#spark-util").render())
        assert line.endswith("▂▅▇")  # 10 %, 50 %, 90 % on a fixed 0-100 scale


async def test_detail_pane_says_a_run_reservation_ends_with_its_job(tmp_path: Path) -> None:
    """A `gputop run` reservation read like a plain one of its full time in the details."""
    from gputop.reservations.records import Job
    from gputop.reservations.state import StoreState

    store = Store(tmp_path / "reservations.json")
    seed(store)

    def tie(state: StoreState, _now: object) -> StoreState:
        return replace(state, reservations=tuple(
            replace(r, job=Job(4242, session=True)) if r.user == "bob" else r
            for r in state.reservations))

    store.update(tie)
    app = make_app(tmp_path)
    async with app.run_test(size=(120, 40)) as pilot:
        table = await load(app, pilot)
        goto(app, table, gk("gpu-h100", 1))
        await pilot.press("enter")
        await pilot.pause()
        head = str(app.query_one(DetailPane).query_one("#detail-head").render())
        assert "reserved by bob" in head and "ends with job 4242 on gpu-h100" in head, head


async def test_help_and_themes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import gputop.ui.themes as themes

    user_dir = tmp_path / "user-themes"
    user_dir.mkdir()
    (user_dir / "broken.toml").write_text('name = "broken"\nprimary = "not-a-colour"\n')
    (user_dir / "mine.toml").write_text('name = "mine"\nprimary = "#123456"\n')
    real = themes.theme_dirs()
    monkeypatch.setattr(themes, "theme_dirs", lambda: [*real, user_dir])
    seen: list[str] = []
    app = make_app(tmp_path, theme="no-such-theme")
    orig = app.notify
    app.notify = lambda msg, **kw: (seen.append(str(msg)), orig(msg, **kw))  # type: ignore[method-assign, func-returns-value]
    async with app.run_test(size=(120, 40)) as pilot:
        await load(app, pilot)
        assert app.theme == "gputop-dark"  # the fallback
        assert any("broken.toml" in m and "not a colour" in m for m in seen)
        assert any("unknown theme" in m for m in seen)
        names = []
        for _ in range(4):
            await pilot.press("t")
            names.append(app.theme)
        assert set(names) >= {"gputop-light", "gputop-contrast", "mine"}
        await pilot.press("question_mark")
        await pilot.pause()
        assert type(app.screen).__name__ == "HelpScreen"
        await pilot.press("escape")
        await pilot.pause()
        assert type(app.screen).__name__ != "HelpScreen"


async def test_board_on_the_real_fleet_and_a_teammates_reservation(
    fleet_home, tmp_path: Path  # type: ignore[no-untyped-def]
) -> None:
    """Fed by the real data layer over real sshd; a reservation made with the CLI (another
    terminal) appears on the board once the shared file is re-read."""
    from gputop.config.load import load_config

    cfg_path = fleet_home.write_config(["gpu-h100", "driver", "gpu-lost"], timeout=3.0)
    config = load_config(str(cfg_path))
    app = GputopApp(config, user="ann")
    async with app.run_test(size=(120, 40)) as pilot:
        table = app.query_one(BoardTable)
        def settled() -> bool:  # each host's answer, past "starting" (streams) and load
            snaps = app.model.snapshots
            d, h, g = (snaps.get(n) for n in ("driver", "gpu-h100", "gpu-lost"))
            return (d is not None and d.error is not None and d.error.kind == "driver"
                    and h is not None and bool(h.gpus) and g is not None and bool(g.gpus))

        for _ in range(600):
            if settled():
                break
            await pilot.pause(0.05)
        app.render_board()
        await pilot.pause()
        assert cell(table, "driver", "mem") == "driver"
        assert cell(table, fk("gpu-h100", 0), "gpu").endswith("H100 80GB HBM3")
        assert isinstance(app.model.find(f"gpu-lost{K}@0000:07:00.0"), GpuRow)
        env = fleet_home.env() | {"LOGNAME": "bob", "USER": "bob"}  # ignored: the uid counts
        r = subprocess.run([sys.executable, "-m", "gputop", "--config", str(cfg_path),
                            "reserve", "gpu-h100:1", "--note", "from the CLI"],
                           env=env, capture_output=True, text=True, timeout=60)
        assert r.returncode == 0, r.stderr
        app.reservations.reload()
        app.render_board()
        await pilot.pause()
        me = pwd.getpwuid(os.getuid()).pw_name
        assert cell(table, fk("gpu-h100", 1), "resv").startswith(f"{me} ")
        row = app.model.find("driver")
        assert isinstance(row, HostRow) and row.error
    listed = subprocess.run([sys.executable, "-m", "gputop", "--config", str(cfg_path),
                             "reservations", "--json"], env=fleet_home.env(),
                            capture_output=True, text=True, timeout=60)
    assert json.loads(listed.stdout)["reservations"][0]["note"] == "from the CLI"


def test_stale_threshold_is_a_few_intervals(tmp_path: Path) -> None:
    from gputop.ui.board_model import BoardModel

    m = BoardModel(host_order=[], interval=2.0, clock=lambda: NOW)
    fresh = HostSnapshot(name="a", time=NOW - timedelta(seconds=3))
    old = HostSnapshot(name="a", time=NOW - timedelta(seconds=60))
    assert not m.is_stale(fresh, NOW) and m.is_stale(old, NOW)


# -- the board never acts on a GPU the user did not choose ---------------------------------


def select(app: GputopApp, table: BoardTable, host: str, index: int | None = None) -> None:
    """Move the cursor to a host row (index None) or to GPU ``index`` of ``host``, found by
    what the rows show, not by their keys."""
    for key, row in app.query_one(BoardTable).rows_by_key.items():
        if row.host == host and ((isinstance(row, GpuRow) and row.gpu.index == index)
                                 or (isinstance(row, HostRow) and index is None)):
            table.move_cursor(row=table.get_row_index(key))
            return
    raise AssertionError(f"no row {host}:{index}")


def chosen(app: GputopApp) -> tuple[str, int | None, str | None] | None:
    row = app._selected()
    if row is None:
        return None
    return (row.host, row.gpu.index, row.gpu.uuid) if isinstance(row, GpuRow) else (
        row.host, None, None)


def down(name: str) -> HostSnapshot:
    from gputop.model import HostError

    return HostSnapshot(name=name, time=NOW, error=HostError("timeout", "no answer in 3s"),
                        last_ok=NOW - timedelta(seconds=30))


async def test_selection_stays_off_other_hosts_when_its_host_goes_down(tmp_path: Path) -> None:
    """gpu-h100:1 selected, gpu-h100 fails: the cursor goes to gpu-h100's own row (not to
    gpu-mixed:1, now at the same position, or any other GPU), `r` reserves nothing, and the
    GPU is selected again when the host comes back."""
    app = make_app(tmp_path)
    seen: list[str] = []
    async with app.run_test(size=(120, 40)) as pilot:
        table = await load(app, pilot)
        app.notify = lambda msg, **kw: seen.append(str(msg))  # type: ignore[method-assign]
        select(app, table, "gpu-h100", 1)
        await pilot.pause()
        assert chosen(app) == ("gpu-h100", 1, "GPU-00000001-test")
        for _ in range(2):  # the host in error keeps its place in the list
            app.ingest(down("gpu-h100"))
            app.render_board()
            await pilot.pause()
            assert chosen(app) == ("gpu-h100", None, None)
        await pilot.press("r")
        await pilot.pause()
        assert type(app.screen).__name__ == "Screen" and seen[-1] == "select a GPU row to reserve"
        assert not Store(tmp_path / "reservations.json").read().reservations
        app.ingest(fixed_snapshots()[0])  # back
        app.render_board()
        await pilot.pause()
        assert chosen(app) == ("gpu-h100", 1, "GPU-00000001-test")


async def test_selection_follows_the_uuid_through_sort_filter_and_renumbering(
        tmp_path: Path) -> None:
    app = make_app(tmp_path)
    async with app.run_test(size=(120, 40)) as pilot:
        table = await load(app, pilot)
        select(app, table, "gpu-h100", 2)
        for k in ("s", "s"):  # utilisation, then free memory: other positions
            await pilot.press(k)
            await pilot.pause()
            assert chosen(app) == ("gpu-h100", 2, "GPU-00000002-test")
        await pilot.press("s", "slash", "m", "i", "x")  # host order; filter hides gpu-h100
        await pilot.pause()
        assert chosen(app) is None  # nothing of its host is shown: nothing selected
        await pilot.press("escape")
        await pilot.pause()
        assert chosen(app) == ("gpu-h100", 2, "GPU-00000002-test")
        # The driver renumbers: the same GPU (uuid) is index 0 now; the selection follows it.
        snap = fixed_snapshots()[0]
        g = snap.gpus
        renumbered = (replace(g[2], index=0), replace(g[0], index=2), g[1], g[3])
        app.ingest(replace(snap, gpus=renumbered))
        app.render_board()
        await pilot.pause()
        assert chosen(app) == ("gpu-h100", 0, "GPU-00000002-test")


async def test_a_gpu_gone_from_a_sorted_view_leaves_nothing_selected(tmp_path: Path) -> None:
    app = make_app(tmp_path)
    seen: list[str] = []
    async with app.run_test(size=(120, 40)) as pilot:
        table = await load(app, pilot)
        app.notify = lambda msg, **kw: seen.append(str(msg))  # type: ignore[method-assign]
        await pilot.press("s")  # flat: no host rows to fall back on
        await pilot.pause()
        select(app, table, "gpu-mixed", 0)
        await pilot.pause()
        snap = fixed_snapshots()[1]
        app.ingest(replace(snap, gpus=snap.gpus[1:]))  # GPU 0 fell off the bus
        app.render_board()
        await pilot.pause()
        assert chosen(app) is None and not table.show_cursor
        await pilot.press("r")
        assert seen[-1] == "select a GPU row to reserve"
        await pilot.press("j")  # a key brings the cursor back, on a row the user sees
        await pilot.pause()
        assert table.show_cursor and chosen(app) is not None


async def test_sorted_view_names_each_gpus_host_and_no_match_says_so(tmp_path: Path) -> None:
    from gputop.ui.widgets import SummaryBar

    app = make_app(tmp_path)
    async with app.run_test(size=(120, 40)) as pilot:
        table = await load(app, pilot)
        await pilot.press("s")
        await pilot.pause()
        assert cell(table, gk("gpu-mixed", 2), "gpu").startswith("gpu-mixed:2 ")
        assert cell(table, gk("gpu-h100", 0), "gpu").startswith("gpu-h100:0 ")
        await pilot.press("s", "s", "slash", "z", "z", "z")
        await pilot.pause()
        assert table.row_count == 0
        assert "zzz: nothing matches" in str(app.query_one(SummaryBar).render())
        await pilot.press("escape")
        await pilot.pause()
        assert cell(table, gk("gpu-h100", 0), "gpu").startswith("  0 ")  # headers again


async def test_detail_pane_shows_only_the_selected_rows_own_data(tmp_path: Path) -> None:
    """A host header or a down host never shows the previous GPU's history; an unknown
    value is a gap in the sparkline, not a 0 % bar."""
    app = make_app(tmp_path)
    async with app.run_test(size=(120, 40)) as pilot:
        table = await load(app, pilot)
        snap = fixed_snapshots()[0]
        g0 = snap.gpus[0]
        for u in (100, None, 100):
            app.ingest(replace(snap, gpus=(replace(g0, utilization_percent=u), *snap.gpus[1:])))
        select(app, table, "gpu-h100", 0)
        await pilot.press("enter")
        await pilot.pause()
        detail = app.query_one(DetailPane)
        assert str(detail.query_one("#spark-util").render()).endswith("█ █")
        select(app, table, "gpu-h100")  # the host header
        await pilot.pause()
        assert str(detail.query_one("#spark-util").render()).strip() == ""
        assert str(detail.query_one("#detail-head").render()).startswith("gpu-h100  4 GPUs")
        select(app, table, "gpu-down")
        await pilot.pause()
        assert str(detail.query_one("#spark-util").render()).strip() == ""
        assert "gpu-down is down: unreachable" in str(detail.query_one("#detail-head").render())
        app.ingest(down("gpu-h100"))  # no answer: a gap in each of its GPUs' history
        select(app, table, "gpu-mixed", 0)
        app.ingest(fixed_snapshots()[0])
        select(app, table, "gpu-h100", 0)
        await pilot.pause()
        assert str(detail.query_one("#spark-util").render())[-5:-1] == "█ █ "
        await pilot.press("escape")  # esc closes the pane
        await pilot.pause()
        assert not detail.display


# -- reserving: confirm someone else's GPU, re-check on submit -----------------------------


async def test_reserving_a_gpu_someone_else_uses_asks_first(tmp_path: Path) -> None:
    from gputop.model import utcnow

    app = make_app(tmp_path, clock=utcnow)
    async with app.run_test(size=(120, 40)) as pilot:
        table = await load(app, pilot)
        select(app, table, "gpu-h100", 0)  # alice runs train.py there
        await pilot.press("r")
        await pilot.pause()
        assert type(app.screen).__name__ == "ConfirmScreen"
        assert "in use by alice" in str(app.screen.query_one("#confirm-text").render())
        await pilot.press("n")
        await pilot.pause()
        assert type(app.screen).__name__ == "Screen"
        await pilot.press("r", "y")
        await pilot.pause()
        assert type(app.screen).__name__ == "ReserveScreen"
        about = str(app.screen.query_one("#reserve-about").render())
        assert "GPU-00000000-test" in about and "H100" in about
        await pilot.press("enter")
        await app.workers.wait_for_complete()
        await pilot.pause()
        (r,) = Store(tmp_path / "reservations.json").read().reservations
        assert (r.host, r.gpu, r.uuid, r.user) == ("gpu-h100", 0, "GPU-00000000-test", "ann")
        select(app, table, "gpu-h100", 3)  # a hostile user and command: shown inert
        await pilot.press("r")
        await pilot.pause()
        text = app.screen.query_one("#confirm-text").render()
        assert "in use by [red]x[/]" in str(text) and "[link=http://evil]click[/link]" in str(text)
        assert "\x1b" not in str(text) and "\u202e" not in str(text)


async def test_a_lasting_problem_stays_in_the_bar_not_over_the_rows(tmp_path: Path) -> None:
    """An unreadable reservations file is shown in the summary bar for as long as it lasts;
    the notification about it goes away after a few seconds."""
    from gputop.ui.widgets import SummaryBar

    path = tmp_path / "reservations.json"
    app = make_app(tmp_path)
    timeouts: list[float] = []
    async with app.run_test(size=(80, 24)) as pilot:
        orig = app.notify

        def notify(msg: str, **kw: object) -> None:
            timeouts.append(kw.get("timeout") or app.NOTIFICATION_TIMEOUT)  # type: ignore[arg-type]
            orig(msg, **kw)  # type: ignore[arg-type]

        app.notify = notify  # type: ignore[method-assign, assignment]
        await load(app, pilot)
        path.write_text('{"version": 1, "reservations": [{"host": 7}]}')
        app.reservations.reload()
        app.render_board()
        await pilot.pause()
        assert "reservations unreadable" in str(app.query_one(SummaryBar).render())
        assert timeouts and max(timeouts) <= 6
        app.reservations.reload()  # still broken: no second notification, the bar keeps saying it
        app.render_board()
        assert len(timeouts) == 1
        path.write_text('{"version": 1, "reservations": []}')
        app.reservations.reload()
        app.render_board()
        await pilot.pause()
        assert "reservations unreadable" not in str(app.query_one(SummaryBar).render())


async def test_submit_rechecks_the_gpu_against_the_latest_data(tmp_path: Path) -> None:
    """The dialog was open while the host renumbered its GPUs, then while it went down:
    neither submit reserves a GPU the user did not choose."""
    from gputop.model import utcnow

    app = make_app(tmp_path, clock=utcnow)
    seen: list[str] = []
    async with app.run_test(size=(120, 40)) as pilot:
        table = await load(app, pilot)
        app.notify = lambda msg, **kw: seen.append(str(msg))  # type: ignore[method-assign]
        select(app, table, "gpu-mixed", 0)
        await pilot.press("r")
        await pilot.pause()
        snap = fixed_snapshots()[1]
        g = snap.gpus
        app.ingest(replace(snap, gpus=(replace(g[1], index=0), replace(g[0], index=1), g[2])))
        await pilot.press("enter")
        await app.workers.wait_for_complete()
        await pilot.pause()
        assert "not reserved: gpu-mixed:0 is now gpu-mixed:1 (renumbered)" in seen
        select(app, table, "gpu-mixed", 1)  # (the same GPU, by uuid)
        await pilot.press("r")
        await pilot.pause()
        app.ingest(down("gpu-mixed"))
        await pilot.press("enter")
        await app.workers.wait_for_complete()
        assert "not reserved: gpu-mixed is down now" in seen
        assert not Store(tmp_path / "reservations.json").read().reservations


# -- keys, small terminals, the per-user view ----------------------------------------------


async def test_keys_move_close_and_quit(tmp_path: Path) -> None:
    from gputop.ui.screens import HELP

    app = make_app(tmp_path)
    async with app.run_test(size=(120, 40)) as pilot:
        table = await load(app, pilot)
        await pilot.press("end")
        assert table.cursor_row == table.row_count - 1
        await pilot.press("home", "j", "j")
        assert table.cursor_row == 2
        await pilot.press("k")
        assert table.cursor_row == 1
        for b in app.BINDINGS:  # the help names every key
            key = b.key_display or b.key  # type: ignore[union-attr]
            shown = {"question_mark": "?", "escape": "esc", "enter": "enter"}.get(key, key)
            assert f"{shown} " in HELP, key
        assert set(app.available_themes) == {"gputop-dark", "gputop-light", "gputop-contrast"}
        await pilot.press("ctrl+c")
        await pilot.pause()
    assert app.return_code == 130 and not app.is_running  # as an interrupted command


async def test_80x24_keeps_the_columns_that_matter(tmp_path: Path) -> None:
    seed(Store(tmp_path / "reservations.json"))
    app = make_app(tmp_path)
    async with app.run_test(size=(80, 24)) as pilot:
        table = await load(app, pilot)
        assert table.column_keys == ["gpu", "util", "mem", "users", "resv", "flags"]
        assert table.virtual_size.width <= table.size.width  # no sideways scrolling
        assert cell(table, "gpu-down", "mem") == "unreachable"
        # when it was seen, then its reason, across the columns after its kind
        assert cell(table, "gpu-down", "users") == "seen 7m ago  connection refused"
        assert cell(table, gk("gpu-h100", 1), "resv") == "bob 3h00m"
        await pilot.resize_terminal(160, 40)
        await pilot.pause()
        assert "power" in table.column_keys
        assert cell(table, gk("gpu-h100", 1), "resv") == "bob 3h00m"


async def test_per_user_view(tmp_path: Path) -> None:
    seed(Store(tmp_path / "reservations.json"))
    app = make_app(tmp_path)
    async with app.run_test(size=(120, 40)) as pilot:
        await load(app, pilot)
        await pilot.press("w")
        await pilot.pause()
        assert type(app.screen).__name__ == "UsersScreen"
        text = app.screen.query_one("#users-text").render()
        plain = text.plain if isinstance(text, Text) else str(text)
        lines = plain.splitlines()
        at = lines.index("bob  1 GPU  (1 process, 29G)")  # reserved gpu-h100:1, runs there
        assert lines[at + 1:at + 4] == ["    reserved  gpu-h100:1", "    runs on   gpu-h100:1",
                                        "    runs      python -m torch.distributed.run "
                                        "finetune.py"]
        at = lines.index("erin  1 GPU")
        assert lines[at + 1] == "    reserved  gpu-mixed:1"
        assert "[red]x[/]" in plain and "\x1b" not in plain  # inert
        await pilot.press("escape")
        await pilot.pause()
        assert type(app.screen).__name__ == "Screen"


async def test_reconnect_key_skips_the_backoff_on_the_real_fleet(
        small_fleet, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """alpha's sshd dies: the board shows alpha in its place, the selected GPU's host row
    selected; sshd comes back while gputop waits out its backoff; `c` on alpha's row
    connects at once instead of seconds later."""
    import asyncio
    import time

    from gputop.config.load import load_config

    monkeypatch.setenv("HOME", str(small_fleet.home))
    # No jitter: the backoff after the n-th failure is exactly 1 s x 2^(n-1).
    monkeypatch.setattr("gputop.ssh.transport.random.uniform", lambda _lo, hi: hi)
    config = load_config(str(small_fleet.write_config(timeout=3.0, interval=1.0)))
    app = GputopApp(config, user="ann")
    alpha = small_fleet.hosts["alpha"]

    async def until(pilot: object, ok: object, limit: float) -> float:
        start = time.monotonic()
        while not ok():  # type: ignore[operator]
            assert time.monotonic() - start < limit, "timed out"
            await asyncio.sleep(0.05)
        app.render_board()
        await pilot.pause()  # type: ignore[attr-defined]
        return time.monotonic() - start

    def alpha_ok() -> bool:
        s = app.model.snapshots.get("alpha")
        return s is not None and s.ok

    async with app.run_test(size=(120, 40)) as pilot:
        table = app.query_one(BoardTable)
        await until(pilot, lambda: len(app.model.snapshots) == 2 and alpha_ok(), 20)
        select(app, table, "alpha", 0)
        small_fleet.stop_sshd(alpha)
        assert app.poller is not None
        (source,) = [s for s in app.poller.sources if s.name == "alpha"]
        # Down, and retried until the backoff is long: 4 s (the third failure) or more.
        await until(pilot, lambda: source.link.retry_at - time.monotonic() > 3.5, 40)  # type: ignore[attr-defined]
        assert chosen(app) == ("alpha", None, None)
        assert keys(table).index("alpha") == 0  # kept its place, above beta
        small_fleet.restart_sshd(alpha)
        backoff_left = source.link.retry_at - time.monotonic()  # type: ignore[attr-defined]
        await pilot.press("c")
        took = await until(pilot, alpha_ok, backoff_left - 1.0)  # well before the retry
        assert took < backoff_left - 1.0
        assert chosen(app) is not None and chosen(app)[:2] == ("alpha", 0)  # type: ignore[index]


async def test_queue_key_shows_who_waits_in_order(tmp_path: Path) -> None:
    """`Q` lists the shared file's queue: position, who, for what, since when; markup in
    what a waiter typed stays inert text."""
    from gputop.reservations.records import Waiter
    from gputop.reservations.state import StoreState

    def w(i: int, user: str, count: int, want: str = "") -> Waiter:
        t = NOW - timedelta(minutes=10 - i)
        return Waiter(id=f"w{i}", user=user, machine="m", count=count, created=t,
                      lease=NOW + timedelta(minutes=4), want=want)

    # Written as it stands (the board's clock is NOW, in 2030; a write would drop leases
    # that far ahead of the real clock).
    (tmp_path / "reservations.json").write_text(StoreState(queue=(
        w(0, "bob", 2, "--tag a100"), w(1, "erin", 1, "[bold red]x[/]"), w(2, "ann", 4))
    ).to_json())
    app = make_app(tmp_path)
    async with app.run_test(size=(120, 40)) as pilot:
        await load(app, pilot)
        await pilot.press("Q")
        await pilot.pause()
        assert type(app.screen).__name__ == "QueueScreen"
        assert app.focused is not None and app.focused.id == "queue-count"  # enter joins
        text = app.screen.query_one("#queue-text").render()
        plain = text.plain if isinstance(text, Text) else str(text)
        lines = plain.splitlines()
        assert lines[0].split() == ["1.", "bob", "2", "GPUs", "(--tag", "a100)", "waiting",
                                    "10m"]
        assert lines[2].split()[:3] == ["3.", "ann", "4"]
        assert lines[1].split()[:5] == ["2.", "erin", "1", "GPU", "([bold"]
        await pilot.press("escape")
        await pilot.pause()
        assert type(app.screen).__name__ == "Screen"
async def test_detail_pane_shows_the_recorded_last_hour_and_day(tmp_path: Path) -> None:
    """With a history database ([history] path), the details add the GPU's (or the
    host's) recorded last hour and day, looked up off the UI thread."""
    from tests.test_history import record_recent

    record_recent(tmp_path / "history.sqlite3", "gpu-h100", "GPU-00000000-test", 0)
    app = make_app(tmp_path)
    async with app.run_test(size=(120, 40)) as pilot:
        table = await load(app, pilot)
        recent = app.query_one(DetailPane).query_one("#detail-recent")

        async def shows(needle: str) -> str:
            for _ in range(100):  # the lookup runs in a worker thread
                await pilot.pause(0.05)
                text = str(recent.render())
                if recent.display and needle in text:
                    break
            return text

        goto(app, table, gk("gpu-h100", 0))
        await pilot.press("enter")
        text = await shows("last day")
        assert "last hour: mean 40 %" in text and "min no data" in text
        assert "last day: mean 40 %" in text
        goto(app, table, gk("gpu-h100", 1))  # nothing recorded for this one
        assert "nothing for this GPU" in await shows("nothing")
        goto(app, table, "gpu-h100")  # the host: all its GPUs together
        assert "last hour: mean 40 %" in await shows("last hour")
        goto(app, table, "gpu-mixed")
        assert "nothing for this host" in await shows("nothing")


async def test_fleet_history_view(tmp_path: Path) -> None:
    """`h`: every host's recorded last hour and day; without a database, how to get one."""
    from tests.test_history import record_recent

    app = make_app(tmp_path)
    async with app.run_test(size=(120, 40)) as pilot:
        await load(app, pilot)
        await pilot.press("h")

        async def text(needle: str) -> str:
            for _ in range(100):  # read in a worker thread
                await pilot.pause(0.05)
                got = str(app.screen.query_one("#history-text").render())
                if needle in got:
                    break
            return got

        assert "gputop record" in await text("no history database")
        await pilot.press("escape")
        record_recent(tmp_path / "history.sqlite3", "gpu-h100", "GPU-00000000-test", 0)
        await pilot.press("h")
        got = await text("HOST")
        assert "last 24 h: of 1.50 GPU-hours, 100 % busy" in got
        line = next(ln for ln in got.splitlines() if ln.startswith("gpu-h100"))
        assert line.split()[1:3] == ["40", "%"]  # the last hour's mean load
        await pilot.press("h")  # h closes it again
        await pilot.pause()
        assert len(app.screen_stack) == 1


def test_the_fast_filter_agrees_with_the_rule_on_every_row(tmp_path: Path) -> None:
    """The filter skips rows where the host's own words decide and keeps a row's words
    joined: on every fixture row and a set of queries (terms split between the host and
    the row, a term spanning two words, a NUL, markup) it keeps exactly the rows the rule
    ``_matches`` keeps."""
    from gputop.ui.board_model import BoardModel

    seed(Store(tmp_path / "reservations.json"))
    m = BoardModel(host_order=[], clock=lambda: NOW, me="ann")
    for snap in fixed_snapshots():
        m.ingest(snap)
    m.set_state(Store(tmp_path / "reservations.json").read())
    queries = ["", "gpu-h100 alice", "h100 carol", "mixed bob", "alice bob", "[red]", "x[/]",
               "h100\x00alice", "\x00", "GPU-H100 ALICE", "100 a", "ali", "nobody", "rtx"]
    for free_only in (False, True):
        for q in queries:
            m.filter_text, m.free_only = q, free_only
            for host in m.host_order:
                rows = m.gpu_rows(host, NOW, {})
                want = [r for r in rows if (r.free or not free_only) and m._matches(host, r)]
                assert m._filtered(host, rows) == want, (q, host, free_only)
    m.filter_text, m.free_only = "h100 alice", False
    assert [r.key for r in m.rows() if isinstance(r, GpuRow)] == [gk("gpu-h100", 0)]


def test_cells_are_drawn_as_rich_draws_them() -> None:
    """The table puts a one-line cell together itself (Rich's layout path costs several
    times more): on every fixture cell, in both widths, and on cells made to be awkward
    (empty, wide characters, exactly full, too long, tabs, newlines, styled spans, markup
    and escapes kept literal), the segments equal Rich's ``Styled(Padding(...))``."""
    from rich.cells import cell_len
    from rich.console import Console
    from rich.padding import Padding
    from rich.segment import Segment
    from rich.style import Style
    from textual.renderables.styled import Styled

    from gputop.ui.board_model import BoardModel
    from gputop.ui.cells import Palette, row_cells
    from gputop.ui.table import cell_segments

    m = BoardModel(host_order=[], clock=lambda: NOW, me="ann")
    for snap in fixed_snapshots():
        m.ingest(snap)
    cells = [c for narrow in (False, True) for r in m.rows()
             for c in row_cells(r, NOW, Palette(), narrow)]
    odd = Text("ab", style="bold")
    odd.append("cd", style="red on blue")
    cells += [Text(""), Text("", style="bold"), Text("日本語テキスト"), Text("x" * 10),
              Text("y" * 11), Text("a\tb"), Text("a\nb"), odd, Text("[red]x[/] \x1b[31m"),
              Text("trailing   ", style="underline"), Text("é" * 3, style="dim")]
    console = Console(width=200, color_system="truecolor", force_terminal=True)
    pre = Style(color="white", bgcolor="black") + Style.from_meta({"row": 3, "column": 1})
    for cell in cells:
        for width, post in ((12, Style()), (5, Style.from_color(color=None)),
                            (30, Style(color="red"))):
            options = console.options.update_dimensions(width, 1).update(no_wrap=True)
            ref = cell  # too long: cut with an ellipsis, never silently
            if "\n" not in cell.plain and cell_len(cell.plain) > width - 2:
                ref = cell.copy()
                ref.truncate(width - 2, overflow="ellipsis")
                assert ref.plain.endswith("…")
            want = console.render_lines(Styled(Padding(ref, (0, 1)), pre_style=pre,
                                               post_style=post), options)[0]
            got = cell_segments(console, console.options, cell, width, pre, post)
            assert list(Segment.simplify(got)) == list(Segment.simplify(want)), (cell, width)


async def test_the_board_is_on_screen_before_any_host_is_polled(tmp_path: Path) -> None:
    """1,000 configured hosts: the first frame shows every one of them waiting, and no
    host is queried before it (a thousand connections starting must not delay it)."""
    from gputop.config.tables import HostConfig
    from gputop.sources.demo import DemoSource

    names = [f"node{i:04d}" for i in range(1000)]
    cfg = replace(board_config(tmp_path), hosts=tuple(HostConfig(n) for n in names))
    frames: list[int] = []
    polled_before_paint: list[str] = []

    class Probe(DemoSource):
        async def query(self):  # type: ignore[no-untyped-def]
            if not frames:
                polled_before_paint.append(self.name)
            return await super().query()

    app = GputopApp(cfg, sources=[Probe(n, "NVIDIA H100", 8, 81559, 700.0) for n in names],
                    clock=lambda: NOW, user="ann")
    display = app._display

    def on_frame(screen: object, renderable: object) -> None:
        if renderable is not None and not frames:
            frames.append(app.query_one(BoardTable).row_count)
        display(screen, renderable)  # type: ignore[arg-type]

    app._display = on_frame  # type: ignore[method-assign]
    async with app.run_test(size=(120, 40)) as pilot:
        while len(app.model.snapshots) < 1000:
            await pilot.pause(0.1)
    assert frames and frames[0] == 1000  # every host, waiting
    assert polled_before_paint == []


def test_rows_reused_between_answers_still_follow_the_clock(tmp_path: Path) -> None:
    """A host's rows are worked out once per answer and reused, yet what time alone changes
    still shows without a new answer: the host turns stale, a reservation runs out (the
    GPU is free again), an idle reservation gets its flag once the grace period passes."""
    from gputop.ui.board_model import BoardModel

    seed(Store(tmp_path / "reservations.json"))
    clock = [NOW]
    m = BoardModel(host_order=[], interval=2.0, clock=lambda: clock[0], me="ann")
    m.set_state(Store(tmp_path / "reservations.json").read())
    snaps = fixed_snapshots()
    m.ingest(snaps[0])  # gpu-h100, answered at NOW
    m.ingest(snaps[1])  # gpu-mixed: erin's reservation, unused for 30 min already

    def row(key: str) -> GpuRow:
        r = m.find(key)
        assert isinstance(r, GpuRow)
        return r

    assert not row(gk("gpu-h100", 1)).stale and row(gk("gpu-h100", 1)).reservation
    erin = row(gk("gpu-mixed", 1))
    assert erin.reservation is not None and "idle-reservation" in erin.flags
    clock[0] = NOW + timedelta(seconds=12)  # 3 intervals and more: stale, no new answer
    assert row(gk("gpu-h100", 1)).stale
    clock[0] = NOW + timedelta(hours=3, minutes=1)  # bob's 4 h (made 1 h ago) ran out
    r = row(gk("gpu-h100", 1))
    assert r.reservation is None and m.summary().reserved == 0
    # A reservation made 10 min ago, its holder never on the GPU: idle once the 15 min
    # grace has passed, with no new answer from the host in between.
    from gputop.reservations.state import StoreState
    from gputop.reservations.store import new_reservation

    clock[0] = NOW
    m.set_state(StoreState(reservations=(new_reservation(
        Target("gpu-mixed", 2), Terms(3600, user="ann", machine="ws"),
        NOW - timedelta(minutes=10)),)))
    assert row(gk("gpu-mixed", 2)).reservation is not None
    assert "idle-reservation" not in row(gk("gpu-mixed", 2)).flags
    clock[0] = NOW + timedelta(minutes=6)
    assert "idle-reservation" in row(gk("gpu-mixed", 2)).flags


async def test_with_no_answers_the_screen_still_follows_the_clock(tmp_path: Path) -> None:
    """A hub that hangs (or every host at once): no answer comes, so nothing marked the
    board for a redraw and a host's rows showed old data as current, unmarked, until a key
    (seen by a new user for 35 s). The frame's tick draws once a second while nothing
    answers: the host turns stale on screen, its answer's age counts."""
    clock = [NOW]
    app = make_app(tmp_path, clock=lambda: clock[0])
    async with app.run_test(size=(120, 40)) as pilot:
        snap = fixed_snapshots()[0]  # (answered a second before NOW)
        app.ingest(snap)
        app.render_board()
        await pilot.pause()
        table = app.query_one(BoardTable)
        assert "stale" not in on_screen(app, table, snap.name)
        clock[0] = NOW + timedelta(seconds=30)  # no answer since
        app.intake._last_ingest -= 30
        app.intake._last_render -= 1
        app.intake.tick()
        await pilot.pause()
        assert "stale: seen 31s ago" in on_screen(app, table, snap.name)
        clock[0] = NOW + timedelta(seconds=31)
        app.intake._last_render -= 1
        app.intake.tick()
        await pilot.pause()
        assert "stale: seen 32s ago" in on_screen(app, table, snap.name)
        # Answers flowing: the tick draws only what they changed (none here: no redraw).
        app.intake._last_ingest = app.intake._last_render = time.monotonic()
        clock[0] = NOW + timedelta(seconds=40)
        app.intake.tick()
        await pilot.pause()
        assert "stale: seen 32s ago" in on_screen(app, table, snap.name)


async def test_a_burst_taken_in_slices_is_drawn_once_it_is_all_in(tmp_path: Path) -> None:
    """A hub's patch brings every host at once; the drain takes them in slices (a key
    waits for one slice, not the burst). A tick that came between two slices drew half
    the burst and the rest half a second later: two frames for one answer. The tick now
    leaves its frame to the drain that empties the inbox, for at most BURST_WAIT_S."""
    from gputop.ui import intake as intake_module

    app = make_app(tmp_path)
    async with app.run_test(size=(120, 40)) as pilot:
        await pilot.pause()
        frames: list[int] = []
        real = app.render_board

        def counted() -> None:
            frames.append(app.intake._inbox.qsize())
            real()

        app.render_board = counted  # type: ignore[method-assign]
        for snap in fixed_snapshots():
            app.intake._inbox.put(snap)
        app.intake.dirty = True
        app.intake._last_render = time.monotonic()  # (the last frame just now, whatever the load)
        app.intake.tick()  # the burst is still in the inbox: no frame yet
        assert frames == [] and app.intake._frame_waits
        for _ in range(100):  # (one slice takes these few, unless the machine is loaded:
            app.intake.drain()  # then more; the slice that finds the inbox empty draws)
            if frames:
                break
        assert frames == [0] and not app.intake._frame_waits
        # A stream that never lets the inbox empty is still drawn, BURST_WAIT_S late at most.
        app.intake._inbox.put(fixed_snapshots()[0])
        app.intake.dirty = True
        app.intake._last_render -= intake_module.RENDER_PERIOD + intake_module.BURST_WAIT_S
        app.intake.tick()
        assert frames == [0, 1]
        app.render_board = real  # type: ignore[method-assign]


@pytest.mark.parametrize("size", [(120, 40), (80, 24)])
async def test_a_host_warning_shows_on_its_row_and_in_the_details(
        tmp_path: Path, size: tuple[int, int]) -> None:
    """A host that answered with something off (two GPUs with one index, a forged MIG
    block) says so on its header row, and the details list every warning."""
    app = make_app(tmp_path)
    async with app.run_test(size=size) as pilot:
        table = await load(app, pilot)
        snap = next(s for s in fixed_snapshots() if s.name == "gpu-h100")
        app.ingest(replace(snap, warnings=("two GPUs report index 0",
                                           "MIG layout \x1b[31mignored")))
        app.render_board()
        await pilot.pause()
        assert "⚠ two GPUs report index 0 (+1)" in cell(table, "gpu-h100", "flags")
        goto(app, table, gk("gpu-h100", 0))
        await pilot.press("enter")  # the details open; then the host's own row
        goto(app, table, "gpu-h100")
        await pilot.pause()
        head = str(app.query_one(DetailPane).query_one("#detail-head").render())
        assert "⚠ two GPUs report index 0" in head and "⚠ MIG layout ignored" in head
        assert "\x1b" not in head


async def test_a_host_whose_nvidia_smi_is_starting_is_not_shown_down(tmp_path: Path) -> None:
    """A slow nvidia-smi start (no persistence mode) is "starting", with its time, not a
    fault: neither "down" nor the red error style."""
    from gputop.model import HostError

    app = make_app(tmp_path)
    async with app.run_test(size=(120, 40)) as pilot:
        table = await load(app, pilot)
        app.ingest(HostSnapshot(name="gpu-h100", time=NOW,
                                error=HostError("starting", "starting nvidia-smi: 6 s")))
        app.render_board()
        await pilot.pause()
        assert cell(table, "gpu-h100", "util") == "starting"
        assert cell(table, "gpu-h100", "flags") == "starting nvidia-smi: 6 s"
        assert "down" not in cell(table, "gpu-h100", "gpu")


def test_row_keys_follow_the_index_when_a_uuid_is_listed_twice() -> None:
    """Review finding: the board reuses a host's row keys while its uuids stay the same;
    a uuid listed twice falls back to its index, so when that index changed the row kept
    the old key (reserving it from the board said the GPU was gone)."""
    from gputop.model import GpuInfo
    from gputop.ui.board_model import BoardModel
    from gputop.ui.board_rows import gpu_keys

    model = BoardModel(host_order=["h"], clock=lambda: NOW)

    def snap(*indices: int, t: int = 0) -> HostSnapshot:
        return HostSnapshot(name="h", time=NOW + timedelta(seconds=t), gpus=tuple(
            GpuInfo(index=i, uuid="GPU-dup", memory_used_mib=1, memory_total_mib=10)
            for i in indices))

    model.ingest(snap(0, 1))
    model.ingest(snap(0, 2, t=1))
    rows = [r for r in model.rows() if isinstance(r, GpuRow)]
    assert [r.key for r in rows] == gpu_keys("h", model.snapshots["h"].gpus)
    assert [r.label for r in rows] == ["h:0", "h:2"]


async def test_answers_from_hosts_off_screen_wait_for_a_frame_with_something_on_screen(
        tmp_path: Path) -> None:
    """An answer from a host whose rows are not on screen changes the summary bar's counts
    only: it is drawn with the next frame that has something on screen, or an interval
    after the last frame (at 200 hosts a third of the frames drew nothing else). An answer
    from a host on screen, a sorted view, or anything else (a reservation, a theme) is
    drawn at the next tick."""
    from gputop.ui import intake as intake_module

    base = fixed_snapshots()[0]
    fleet = [replace(base, name=f"n{i:02d}") for i in range(30)]
    app = make_app(tmp_path)
    app.model.host_order[:] = [s.name for s in fleet]
    async with app.run_test(size=(120, 24)) as pilot:
        for snap in fleet:
            app.ingest(snap)
        app.render_board()
        await pilot.pause()
        table = app.query_one(BoardTable)
        shown = table.hosts_on_screen()
        assert "n00" in shown and "n29" not in shown
        frames: list[str] = []
        real = app.render_board

        def counted() -> None:
            frames.append("frame")
            real()

        app.render_board = counted  # type: ignore[method-assign]

        def answer(name: str) -> None:
            app.ingest(replace(base, name=name, time=base.time + timedelta(seconds=2)))

        answer("n29")  # off screen: waits...
        app.intake._last_render = time.monotonic()  # (the last frame just now, whatever the load)
        app.intake.tick()
        assert frames == [] and app.intake.dirty
        app.intake._last_render -= (app.config.defaults.interval
                                    * intake_module.OFFSCREEN_WAIT_INTERVALS)
        app.intake.tick()  # ...an interval at most
        assert frames == ["frame"] and not app.intake.dirty
        answer("n29")
        answer("n00")  # on screen: this tick
        app.intake.tick()
        assert frames == ["frame"] * 2
        answer("n29")
        app.intake.dirty = True  # anything but an answer (a reservation, a theme): this tick
        app.intake.tick()
        assert frames == ["frame"] * 3
        table.scroll_end(animate=False)  # scrolled: what is on screen now counts
        await pilot.pause()
        assert "n29" in table.hosts_on_screen()
        answer("n29")
        app.intake.tick()
        assert frames == ["frame"] * 4
        app.model.sort_mode = "utilization"  # a sorted view: any answer can move rows
        answer("n00")
        app.intake.tick()
        assert frames == ["frame"] * 5
        app.render_board = real  # type: ignore[method-assign]


def test_a_frames_keys_are_its_rows_keys_in_every_view() -> None:
    """The model makes each host's header, rows and keys as the host answers, and a
    frame joins them: whatever the view (sorted, filtered, free only, collapsed, hosts
    in error, MIG instances), the keys it hands the table are its rows' own, in order."""
    from gputop.model import MigInstance
    from gputop.ui.board_model import BoardModel

    snaps = fixed_snapshots()
    mixed = next(i for i, s in enumerate(snaps) if s.name == "gpu-mixed")
    gpus = list(snaps[mixed].gpus)
    gpus[2] = replace(gpus[2], mig_mode="Enabled", instances=tuple(
        MigInstance(gpu_instance_id=gi, compute_instance_id=0, device_index=gi,
                    uuid=f"MIG-{gi}", profile="1g.10gb", memory_used_mib=10,
                    memory_total_mib=9856, utilization_percent=None, processes=())
        for gi in (7, 8)))
    snaps[mixed] = replace(snaps[mixed], gpus=tuple(gpus))
    model = BoardModel(host_order=[s.name for s in snaps], clock=lambda: NOW, me="ann")
    for snap in snaps:
        model.ingest(snap)
    seen = set()
    for sort in ("host", "utilization", "free"):
        for text, free_only, collapsed in (("", False, set()), ("h100", False, set()),
                                           ("", True, set()), ("", False, {"gpu-h100"})):
            model.sort_mode, model.filter_text, model.free_only = sort, text, free_only  # type: ignore[assignment]
            model.collapsed = set(collapsed)
            rows, keys, _summary = model.frame()
            assert keys == [r.key for r in rows], (sort, text, free_only, collapsed)
            seen.add(len(rows))
    assert len(seen) > 3  # (the views differ)
    assert any(s.error for s in snaps) and any(g.instances for s in snaps for g in s.gpus)


def test_a_host_that_never_answered_says_so() -> None:
    """Not "seen never": a host down from the start says it never answered (as --once
    does), one that answered before says when."""
    from gputop.model import HostError
    from gputop.ui.cells import Palette, host_cells

    snap = HostSnapshot("gpu-x", time=NOW, error=HostError("unreachable", "connection refused"))
    never = HostRow("gpu-x", snap, 0, False, False, None)
    assert host_cells(never, NOW, Palette())[3].plain == "never answered  connection refused"
    seen = replace(never, last_seen=NOW - timedelta(minutes=3))
    assert host_cells(seen, NOW, Palette())[3].plain == "seen 3m ago  connection refused"
