"""The board driven by its keys (Textual pilot), on the fixed fleet and on the real one."""

from __future__ import annotations

import json
import os
import pwd
import subprocess
import sys
from dataclasses import replace
from datetime import timedelta
from pathlib import Path

import pytest
from board_data import HOSTILE_USER, NOW, board_config, fixed_snapshots, seed
from rich.text import Text

from gputop.model import HostSnapshot
from gputop.reservations import Store
from gputop.ui.app import GputopApp
from gputop.ui.board_model import GpuRow, HostRow
from gputop.ui.widgets import BoardTable, DetailPane


def make_app(tmp_path: Path, user: str = "ann", clock: object = lambda: NOW,
             **kw: object) -> GputopApp:
    return GputopApp(board_config(tmp_path), feed=False, clock=clock, user=user,  # type: ignore[arg-type]
                     **kw)  # type: ignore[arg-type]


async def load(app: GputopApp, pilot: object) -> BoardTable:
    for snap in fixed_snapshots():
        app.ingest(snap)
    app.reload_store()
    app.render_board()
    await pilot.pause()  # type: ignore[attr-defined]
    return app.query_one(BoardTable)


def cell(table: BoardTable, key: str, col: str) -> str:
    value = table.get_cell(key, col)
    return value.plain if isinstance(value, Text) else str(value)


def keys(table: BoardTable) -> list[str]:
    return [table.coordinate_to_cell_key((i, 0)).row_key.value  # type: ignore[arg-type]
            for i in range(table.row_count)]


def goto(app: GputopApp, table: BoardTable, key: str) -> None:
    table.move_cursor(row=table.get_row_index(key))


K = "\x00"


async def test_rows_grouped_by_host_with_error_and_stale(tmp_path: Path) -> None:
    seed(Store(tmp_path / "reservations.json"))
    app = make_app(tmp_path)
    async with app.run_test(size=(120, 40)) as pilot:
        table = await load(app, pilot)
        ks = keys(table)
        assert ks[:6] == ["gpu-h100", f"gpu-h100{K}0", f"gpu-h100{K}1", f"gpu-h100{K}2",
                          f"gpu-h100{K}3", "gpu-mixed"]
        assert ks[-1] == "gpu-down"  # hosts in error after the healthy ones
        assert cell(table, "gpu-down", "mem") == "unreachable"
        assert cell(table, "gpu-down", "users") == "seen 7m ago"
        assert "connection refused" in cell(table, "gpu-down", "flags")
        assert "stale" in cell(table, "gpu-stale", "flags")
        stale = table.get_cell(f"gpu-stale{K}0", "util")
        assert isinstance(stale, Text) and any("dim" in str(s.style) for s in stale.spans)
        assert cell(table, f"gpu-h100{K}0", "users") == "alice"
        assert cell(table, f"gpu-h100{K}1", "resv") == "bob 3h00m"
        assert "unreserved use" not in cell(table, f"gpu-h100{K}1", "flags")
        assert "MIG" in cell(table, f"gpu-mixed{K}2", "gpu")


async def test_hostile_strings_stay_literal(tmp_path: Path) -> None:
    app = make_app(tmp_path)
    async with app.run_test(size=(120, 40)) as pilot:
        table = await load(app, pilot)
        users = cell(table, f"gpu-h100{K}3", "users")
        assert users == "[red]x[/]"  # the OSC title sequence is gone, markup stays literal
        goto(app, table, f"gpu-h100{K}3")
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
        goto(app, table, f"gpu-h100{K}2")
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
        assert cell(table, f"gpu-h100{K}2", "resv").startswith("ann ")
        # Just reserved: not "idle" before the grace period without the holder's processes.
        assert "idle reservation" not in cell(table, f"gpu-h100{K}2", "flags")


async def test_conflict_shows_the_holder(tmp_path: Path) -> None:
    seed(Store(tmp_path / "reservations.json"))
    app = make_app(tmp_path)
    seen: list[str] = []
    async with app.run_test(size=(120, 40)) as pilot:
        app.notify = lambda msg, **kw: seen.append(str(msg))  # type: ignore[method-assign]
        table = await load(app, pilot)
        goto(app, table, f"gpu-h100{K}1")
        await pilot.press("r")
        await pilot.pause()
        await pilot.press("enter")  # accept the default duration
        await app.workers.wait_for_complete()
        await pilot.pause()
    refused = [m for m in seen if m.startswith("refused")]
    assert refused and "bob" in refused[0] and "ablation [i]sweep[/i]" in refused[0]
    assert [r.user for r in Store(tmp_path / "reservations.json").read().reservations
            if r.gpu == 1 and r.host == "gpu-h100"] == ["bob"]


async def test_release_own_but_not_others(tmp_path: Path) -> None:
    seed(Store(tmp_path / "reservations.json"))
    app = make_app(tmp_path, user="erin")
    async with app.run_test(size=(120, 40)) as pilot:
        table = await load(app, pilot)
        goto(app, table, f"gpu-h100{K}1")  # bob's
        await pilot.press("u")
        await app.workers.wait_for_complete()
        goto(app, table, f"gpu-mixed{K}1")  # erin's own
        await pilot.press("u")
        await app.workers.wait_for_complete()
        await pilot.pause()
        left = Store(tmp_path / "reservations.json").read().reservations
        assert [(r.host, r.gpu) for r in left] == [("gpu-h100", 1)]
        assert cell(table, f"gpu-mixed{K}1", "resv") == "—"


async def test_filter_sort_and_free_only(tmp_path: Path) -> None:
    app = make_app(tmp_path)
    async with app.run_test(size=(120, 40)) as pilot:
        table = await load(app, pilot)
        await pilot.press("slash", "c", "a", "r", "o", "l")
        await pilot.pause()
        assert keys(table) == ["gpu-mixed", f"gpu-mixed{K}2"]  # carol runs only there
        await pilot.press("escape")
        await pilot.pause()
        assert len(keys(table)) == 12
        await pilot.press("s")  # utilisation, flat
        await pilot.pause()
        ks = keys(table)
        assert "gpu-h100" not in ks and ks[0] == f"gpu-h100{K}0"
        utils = [app.model.find(k).gpu.utilization_percent or 0  # type: ignore[union-attr]
                 for k in ks if K in k]
        assert utils == sorted(utils, reverse=True)
        await pilot.press("s")  # free memory
        await pilot.pause()
        frees = [app.model.find(k).free_mib for k in keys(table) if K in k]  # type: ignore[union-attr]
        assert frees == sorted(frees, reverse=True)
        await pilot.press("s", "f")  # back to host order, free GPUs only
        await pilot.pause()
        assert keys(table) == ["gpu-h100", f"gpu-h100{K}2", "gpu-mixed", f"gpu-mixed{K}0",
                               f"gpu-mixed{K}1"]


async def test_collapse_a_host(tmp_path: Path) -> None:
    app = make_app(tmp_path)
    async with app.run_test(size=(120, 40)) as pilot:
        table = await load(app, pilot)
        goto(app, table, "gpu-h100")
        await pilot.press("enter")
        await pilot.pause()
        assert keys(table)[:2] == ["gpu-h100", "gpu-mixed"]
        assert cell(table, "gpu-h100", "gpu").startswith("▸")


async def test_updates_change_only_what_changed_and_keep_the_cursor(tmp_path: Path) -> None:
    app = make_app(tmp_path)
    async with app.run_test(size=(120, 40)) as pilot:
        table = await load(app, pilot)
        goto(app, table, f"gpu-mixed{K}1")
        before = table.cell_updates
        for snap in fixed_snapshots():  # the same data again: nothing to redraw
            app.ingest(snap)
        app.render_board()
        assert table.cell_updates == before
        snap = fixed_snapshots()[0]
        g0 = replace(snap.gpus[0], utilization_percent=3)
        app.ingest(replace(snap, gpus=(g0, *snap.gpus[1:])))
        app.render_board()
        await pilot.pause()
        assert table.cell_updates == before + 1  # just the one utilisation cell
        assert table.selected_key() == f"gpu-mixed{K}1"
        await pilot.press("s")  # re-sorting keeps the selected GPU selected
        await pilot.pause()
        assert table.selected_key() == f"gpu-mixed{K}1"


async def test_two_hundred_hosts_update_in_place(tmp_path: Path) -> None:
    """200 hosts x 8 GPUs: one host's refresh rewrites that host's cells only."""
    from gputop.config import HostConfig

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
        before = table.cell_updates
        hot = tuple(replace(g, utilization_percent=(g.utilization_percent or 0) // 2 + 1)
                    for g in gpus)
        app.ingest(HostSnapshot(name="node123", time=NOW, gpus=hot))
        app.render_board()
        assert 0 < table.cell_updates - before <= 8 * 3  # util (+ power/temp) of 8 rows


async def test_detail_pane_shows_processes_history_and_reservation(tmp_path: Path) -> None:
    seed(Store(tmp_path / "reservations.json"))
    app = make_app(tmp_path)
    async with app.run_test(size=(120, 40)) as pilot:
        table = await load(app, pilot)
        snap = fixed_snapshots()[0]
        for u in (10, 50, 90):
            app.ingest(replace(snap, gpus=(replace(snap.gpus[0], utilization_percent=u),
                                           *snap.gpus[1:])))
        goto(app, table, f"gpu-h100{K}1")
        await pilot.press("enter")
        await pilot.pause()
        detail = app.query_one(DetailPane)
        assert detail.display
        head = detail.query_one("#detail-head").render()
        assert "reserved by bob" in str(head) and "ablation [i]sweep[/i]" in str(head)
        procs = str(detail.query_one("#detail-procs").render())
        assert "4300" in procs and "finetune.py" in procs
        goto(app, table, f"gpu-h100{K}0")
        await pilot.pause()
        line = str(detail.query_one("#spark-util").render())
        assert line.endswith("▂▅▇")  # 10 %, 50 %, 90 % on a fixed 0-100 scale


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
    from gputop.config import load_config

    cfg_path = fleet_home.write_config(["gpu-h100", "driver", "gpu-lost"], timeout=3.0)
    config = load_config(str(cfg_path))
    app = GputopApp(config, user="ann")
    async with app.run_test(size=(120, 40)) as pilot:
        table = app.query_one(BoardTable)
        while len(app.model.snapshots) < 3:  # wait for each host's first answer
            await pilot.pause(0.05)
        app.render_board()
        await pilot.pause()
        assert cell(table, "driver", "mem") == "driver"
        assert cell(table, f"gpu-h100{K}0", "gpu").endswith("H100 80GB HBM3")
        assert isinstance(app.model.find(f"gpu-lost{K}0000:07:00.0"), GpuRow)
        env = fleet_home.env() | {"LOGNAME": "bob", "USER": "bob"}  # ignored: the uid counts
        r = subprocess.run([sys.executable, "-m", "gputop", "--config", str(cfg_path),
                            "reserve", "gpu-h100:1", "--note", "from the CLI"],
                           env=env, capture_output=True, text=True, timeout=60)
        assert r.returncode == 0, r.stderr
        app.reload_store()
        app.render_board()
        await pilot.pause()
        me = pwd.getpwuid(os.getuid()).pw_name
        assert cell(table, f"gpu-h100{K}1", "resv").startswith(f"{me} ")
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
