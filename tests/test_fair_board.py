"""The board's `r` follows the queue's one order rule (issue 19, finding 4): a GPU a waiter
could use is refused naming the waiter, as `gputop reserve HOST:GPU` refuses it.

Hosts come from the fixed snapshots of board_data (no SSH needed); the file is real."""

from __future__ import annotations

from dataclasses import replace
from datetime import timedelta
from pathlib import Path

from gputop.model import utcnow
from gputop.reservations.records import Waiter
from gputop.reservations.store import Store
from gputop.ui.app import GputopApp
from tests.support.board_data import NOW, board_config
from tests.support.board_pilot import keep_notices, load_fixed, reserve_row


async def _press_r(tmp_path: Path, seen: list[str]) -> None:
    app = GputopApp(board_config(tmp_path), feed=False, clock=lambda: NOW, user="ann")
    notices = keep_notices(app)
    async with app.run_test(size=(120, 40)) as pilot:
        await load_fixed(app, pilot)
        await reserve_row(app, pilot)
    seen.extend(notices)


async def test_the_boards_r_does_not_take_a_gpu_a_waiter_waits_for(tmp_path: Path) -> None:
    store = Store(tmp_path / "reservations.json")
    now = utcnow()
    bob = Waiter(id="w1", user="bob", machine="ws-bob", count=1, created=now,
                 lease=now + timedelta(seconds=60), hosts=("gpu-h100",))
    store.update(lambda s, _n: replace(s, queue=(bob,)))
    seen: list[str] = []
    await _press_r(tmp_path, seen)
    assert any("refused" in m and "first who could use it: bob" in m for m in seen), seen
    assert store.read().active() == []
    # A waiter whose own gputop cannot be granted there (it reaches none of its hosts)
    # blocks nothing.
    store.update(lambda s, _n: replace(s, queue=(replace(bob, sees=()),)))
    seen.clear()
    await _press_r(tmp_path, seen)
    assert [r.target for r in store.read().active()] == ["gpu-h100:2"], seen
