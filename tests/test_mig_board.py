"""MIG instances on the board: rows under their GPU, fed by the real data layer over real
sshd (the stand-in replays the real H100 MIG captures); an instance is reserved by key."""

from __future__ import annotations

import os
import pwd
from collections.abc import Callable
from pathlib import Path
from typing import Any

from gputop.reservations.store import Store
from gputop.ui.app import GputopApp
from gputop.ui.board_rows import GpuRow
from gputop.ui.table import BoardTable
from tests.test_board import K, cell, fk, goto, keys


async def until(pilot: Any, ok: Callable[[], bool]) -> None:
    for _ in range(400):
        if ok():
            return
        await pilot.pause(0.05)
    raise AssertionError("not within 20 s")


async def test_instance_rows_under_their_gpu_and_reserved_by_key(
    fleet_home, tmp_path: Path  # type: ignore[no-untyped-def]
) -> None:
    from gputop.config.load import load_config

    cfg_path = fleet_home.write_config(["gpu-mixed"], timeout=5.0)
    text = cfg_path.read_text().replace(str(fleet_home.root / "reservations.json"),
                                        str(tmp_path / "reservations.json"))
    cfg_path = tmp_path / "hosts.toml"
    cfg_path.write_text(text)
    app = GputopApp(load_config(str(cfg_path)), user=pwd.getpwuid(os.getuid()).pw_name)
    gpu0 = fk("gpu-mixed", 0)
    async with app.run_test(size=(120, 40)) as pilot:
        table = app.query_one(BoardTable)
        for _ in range(600):  # its first answer with the MIG inventory (a loaded machine...)
            snap = app.model.snapshots.get("gpu-mixed")
            if snap is not None and snap.ok and snap.gpus[0].instances:
                break
            await pilot.pause(0.05)
        app.render_board()
        await pilot.pause()
        ks = keys(table)
        at = ks.index(gpu0)
        inst = [f"{gpu0}{K}/{gi}" for gi in (2, 3, 9, 10)]
        assert ks[at + 1:at + 5] == inst  # right under their GPU, in device order
        assert ks[at + 5] == fk("gpu-mixed", 1)
        assert cell(table, inst[0], "gpu").strip() == "/2 3g.40gb"
        assert cell(table, inst[2], "gpu").strip() == "/9 1g.10gb"
        assert cell(table, inst[0], "util").strip() == "n/a"  # none per instance: never 0
        assert cell(table, inst[0], "mem").endswith(" 11/40G")  # 11091 of 40448 MiB
        assert app.model.summary().gpus == 4  # instances are not more GPUs
        # ... nor does the host's row count them as GPUs: it says each apart
        assert cell(table, "gpu-mixed", "util").startswith("4 GPUs, 4 MIG instances")
        goto(app, table, inst[2])
        await pilot.press("r")
        await pilot.pause()
        app.screen.query_one("#reserve-duration").value = "1h"  # type: ignore[attr-defined]
        await pilot.click("#reserve-ok")
        store = Store(tmp_path / "reservations.json")
        await until(pilot, lambda: bool(store.read().reservations))  # the feed never ends
        (r,) = store.read().reservations
        assert (r.host, r.gpu, r.instance) == ("gpu-mixed", 0, 9)
        app.render_board()
        await pilot.pause()
        me = pwd.getpwuid(os.getuid()).pw_name
        assert cell(table, inst[2], "resv").startswith(f"{me} ")
        assert cell(table, gpu0, "resv").strip() == "—"  # the GPU itself is not reserved
        row = app.model.find(inst[2])
        assert isinstance(row, GpuRow) and row.label == "gpu-mixed:0/9"
        await pilot.press("u")  # release it from its row
        await until(pilot, lambda: not store.read().reservations)
