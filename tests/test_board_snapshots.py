"""SVG snapshots of the board (pytest-textual-snapshot): fixed fleet, fixed clock.

Update after a deliberate change with ``python -m pytest tests/test_board_snapshots.py
--snapshot-update`` and look at the result (``tests/__snapshots__``) before committing.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
from textual.widgets import Input

from gputop.reservations.store import Store
from gputop.ui.app import GputopApp
from gputop.ui.table import BoardTable
from tests.support.board_data import NOW, board_config, fixed_snapshots, seed

# The details show local times: the saved pictures are of a board in UTC, wherever run.
os.environ["TZ"] = "UTC"
time.tzset()

SIZES = {"120x40": (120, 40), "80x24": (80, 24)}
K = "\x00"


def gk(host: str, index: int) -> str:
    """The row key of a fixture GPU: host + uuid (board_data numbers the uuids)."""
    return f"{host}{K}GPU-{index:08d}-test"


def app_for(tmp_path: Path) -> GputopApp:
    seed(Store(tmp_path / "reservations.json"))
    return GputopApp(board_config(tmp_path), feed=False, clock=lambda: NOW, user="ann")


def loader(select: str | None = None, keys: tuple[str, ...] = ()):  # type: ignore[no-untyped-def]
    async def run_before(pilot) -> None:  # type: ignore[no-untyped-def]
        app = pilot.app
        for snap in fixed_snapshots():
            app.ingest(snap)
        app.reservations.reload()
        app.render_board()
        await pilot.pause()
        if select is not None:
            table = app.query_one(BoardTable)
            table.move_cursor(row=table.get_row_index(select), animate=False)
        for k in keys:
            await pilot.press(k)
        await pilot.pause()
        # A dialog's input cursor blinks every 0.5 s: on a loaded machine the picture was
        # taken in its off half once (CI-like run). Shown steadily, as it is half the time.
        for field in app.screen.query(Input):
            field.cursor_blink = False
        await pilot.pause()
    return run_before


SCENES = {
    "board": loader(),
    "detail": loader(gk("gpu-h100", 1), ("enter",)),
    "reserve-modal": loader(gk("gpu-h100", 2), ("r",)),
    "help": loader(None, ("question_mark",)),
    "host-error": loader("gpu-down", ("enter",)),
    "hostile-strings": loader(gk("gpu-h100", 3), ("enter",)),
    "sorted": loader(None, ("s",)),
    "users": loader(None, ("w",)),
    "confirm-in-use": loader(gk("gpu-h100", 0), ("r",)),
}


@pytest.mark.parametrize("size", sorted(SIZES))
@pytest.mark.parametrize("scene", sorted(SCENES))
def test_snapshot(snap_compare, tmp_path: Path, scene: str, size: str) -> None:  # type: ignore[no-untyped-def]
    assert snap_compare(app_for(tmp_path), terminal_size=SIZES[size],
                        run_before=SCENES[scene])
