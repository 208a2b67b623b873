"""Driving a board under Textual's pilot, shared by the board tests that reserve from it:
its notifications kept, the fixed fleet loaded, a row reserved with the dialog's defaults."""

from __future__ import annotations

from typing import Any

from textual.pilot import Pilot

from gputop.ui.app import GputopApp
from gputop.ui.table import BoardTable
from tests.support.board_data import fixed_snapshots

#: The row of the fixed fleet's gpu-h100 GPU 2 (an idle GPU).
H100_GPU2 = f"gpu-h100\x00GPU-{2:08d}-test"


def keep_notices(app: GputopApp) -> list[str]:
    """The messages ``app`` notifies from now on (still shown too)."""
    seen: list[str] = []
    orig = app.notify

    def notify(message: str, **kw: Any) -> None:
        seen.append(str(message))
        orig(message, **kw)

    app.notify = notify  # type: ignore[method-assign]
    return seen


async def load_fixed(app: GputopApp, pilot: Pilot[Any]) -> BoardTable:
    """The fixed fleet's snapshots ingested and the store read: the board drawn."""
    for snap in fixed_snapshots():
        app.ingest(snap)
    app.reservations.reload()
    app.render_board()
    await pilot.pause()
    return app.query_one(BoardTable)


async def reserve_row(app: GputopApp, pilot: Pilot[Any], row: str = H100_GPU2) -> None:
    """``r`` on ``row`` and the dialog's OK (its defaults), the write done."""
    table = app.query_one(BoardTable)
    table.move_cursor(row=table.get_row_index(row))
    await pilot.press("r")
    await pilot.pause()
    await pilot.click("#reserve-ok")
    await app.workers.wait_for_complete()
    await pilot.pause()
