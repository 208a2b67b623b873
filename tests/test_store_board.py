"""The board survives a hostile reservations file: it shows the problem and keeps running.

Hosts come from the fixed snapshots of board_data (no SSH needed); the file is real.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from gputop.reservations.store import Store
from gputop.ui.app import GputopApp
from tests.support.board_data import NOW, board_config, seed
from tests.support.board_pilot import keep_notices, load_fixed, reserve_row

HOSTILE = {
    "deep-nesting": '{"version": 1, "reservations": ' + "[" * 50_000 + "]" * 50_000 + "}",
    "time-out-of-range": ('{"version": 1, "reservations": [{"id": "a", "host": "gpu-h100", '
                          '"gpu": 0, "user": "u", "machine": "m", "created": '
                          '"0001-01-01T00:00:00+01:00", "expires": "9999-12-31T23:59:59-01:00"}]}'),
    "gpu-5000-digits": '{"version": 1, "reservations": [{"gpu": ' + "7" * 5000 + "}]}",
}


@pytest.mark.parametrize("kind", sorted(HOSTILE))
async def test_board_shows_a_hostile_store_and_keeps_running(tmp_path: Path, kind: str) -> None:
    path = tmp_path / "reservations.json"
    path.write_text(HOSTILE[kind])
    app = GputopApp(board_config(tmp_path), feed=False, clock=lambda: NOW, user="ann")
    seen = keep_notices(app)
    async with app.run_test(size=(120, 40)) as pilot:
        table = await load_fixed(app, pilot)
        assert table.row_count > 5  # the GPUs are shown
        problems = [m for m in seen if str(path) in m]
        assert len(problems) == 1 and "untouched" in problems[0], seen
        # Reserving is refused with the same message; the board goes on.
        await reserve_row(app, pilot)
        assert len([m for m in seen if str(path) in m]) == 2, seen
        assert path.read_text() == HOSTILE[kind]
        # Someone fixes the file: the board picks it up at the next re-read.
        path.unlink()
        seed(Store(path))
        app.reservations.reload()
        app.render_board()
        await pilot.pause()
        assert app.model.state.reservations
        assert app.is_running


async def test_the_periodic_reread_is_off_the_ui_thread_and_once_per_change(
        tmp_path: Path) -> None:
    """A teammate's large or hostile file must not freeze the board: the periodic re-read
    runs on a worker thread, and a file that did not change (broken or not) is not parsed
    again at every interval."""
    import os
    import threading

    path = tmp_path / "reservations.json"
    path.write_text(HOSTILE["gpu-5000-digits"])
    cfg = board_config(tmp_path).with_defaults(interval=0.5)
    app = GputopApp(cfg, feed=False, clock=lambda: NOW, user="ann")
    reads: list[str] = []
    read = app.reservations.store.read

    def counted() -> Any:
        reads.append(threading.current_thread().name)
        return read()

    app.reservations.store.read = counted  # type: ignore[method-assign]
    async with app.run_test(size=(120, 40)) as pilot:
        await pilot.pause(0.2)
        reads.clear()  # the first read, at start, is made on the UI thread
        await pilot.pause(2.2)  # four intervals: the file did not change
        assert reads == []
        seed_time = os.stat(path).st_mtime_ns + 1_000_000
        path.write_text(HOSTILE["gpu-5000-digits"] + " ")
        os.utime(path, ns=(seed_time, seed_time))
        for _ in range(40):
            await pilot.pause(0.1)
            if reads:
                break
        await app.workers.wait_for_complete()
        await pilot.pause(1.2)
        assert len(reads) == 1, reads
        assert reads[0] != threading.main_thread().name
        assert app.reservations.problem is not None and app.is_running
