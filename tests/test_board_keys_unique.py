"""Every row of the board has its own key: the table places, draws and selects rows by key
(``BoardTable._index``), so two rows with one key draw the second's values on both lines.
Two compute instances of one MIG GPU instance (``nvidia-smi mig -cci`` twice: one
``gpu_instance_id``) are two rows, as are two shares of one GPU by one holder (the shared
file is anyone's to write) and GPUs whose uuids are hostile strings that look like the
board's own fallback keys (``%2``: a position)."""

from __future__ import annotations

from dataclasses import replace
from datetime import timedelta
from pathlib import Path

from gputop.model import GpuInfo, MigInstance
from gputop.reservations.state import StoreState
from gputop.reservations.terms import Target, Terms, new_reservation
from gputop.ui.board_model import BoardModel
from gputop.ui.board_rows import GpuRow, gpu_keys, split_instance, split_share
from gputop.ui.table import BoardTable
from tests.support.board_data import NOW, fixed_snapshots
from tests.test_board import make_app, on_screen

BASE = fixed_snapshots()[0]  # gpu-h100: 4 GPUs


def _ci(gi: int, ci: int, used: int) -> MigInstance:
    return MigInstance(gpu_instance_id=gi, compute_instance_id=ci, device_index=ci,
                       uuid=f"MIG-{gi}-{ci}", profile="1c.2g.20gb", memory_used_mib=used,
                       memory_total_mib=20480, utilization_percent=None, processes=())


def _two_cis() -> GpuInfo:
    return replace(BASE.gpus[0], mig_mode="Enabled", processes=(),
                   instances=(_ci(1, 0, 1024), _ci(1, 1, 15360), _ci(2, 0, 0)))


def test_two_compute_instances_of_one_gpu_instance_are_two_rows() -> None:
    model = BoardModel(host_order=[BASE.name], clock=lambda: NOW, me="ann")
    model.ingest(replace(BASE, gpus=(_two_cis(), *BASE.gpus[1:])))
    rows, keys, summary = model.frame()
    assert len(keys) == len(set(keys)) == len(rows)
    assert keys == [r.key for r in rows]
    insts = [r for r in rows if isinstance(r, GpuRow) and r.instance is not None]
    assert [(i.instance.gpu_instance_id, i.instance.compute_instance_id)  # type: ignore[union-attr]
            for i in insts] == [(1, 0), (1, 1), (2, 0)]
    assert summary.gpus == 4
    for r in insts:  # each row is found by its own key, and names its GPU instance
        assert model.find(r.key) is r
        assert split_instance(r.key) == (keys[1], r.instance.gpu_instance_id)  # type: ignore[union-attr]


def test_uuids_that_look_like_fallback_keys_never_share_a_key() -> None:
    g = BASE.gpus
    hostile = (replace(g[0], uuid="%2"), replace(g[1], uuid=None, index=7),
               replace(g[2], uuid=None, index=7), replace(g[3], uuid="%2"))
    keys = gpu_keys("h", hostile)
    assert len(set(keys)) == len(keys)
    model = BoardModel(host_order=["h"], clock=lambda: NOW, me="ann")
    model.ingest(replace(BASE, name="h", gpus=hostile))
    rows, row_keys, _summary = model.frame()
    assert len(set(row_keys)) == len(row_keys) == len(rows) == 5


async def test_each_compute_instance_row_draws_its_own_memory(tmp_path: Path) -> None:
    app = make_app(tmp_path)
    async with app.run_test(size=(120, 30)) as pilot:
        app.ingest(replace(BASE, gpus=(_two_cis(), *BASE.gpus[1:])))
        app.render_board()
        await pilot.pause()
        table = app.query_one(BoardTable)
        lines = [on_screen(app, table, k) for k in table.row_keys[2:5]]
        assert " 1.0/20G" in lines[0] and " 15/20G" in lines[1] and " 0.0/20G" in lines[2], lines


def _two_shares_of_bob() -> StoreState:
    made = NOW - timedelta(minutes=1)
    return StoreState(reservations=(
        new_reservation(
            Target(BASE.name, 2), Terms(3600, user="bob", machine="ws", share_mib=1024), made),
        new_reservation(
            Target(BASE.name, 2), Terms(3600, user="bob", machine="ws2", share_mib=8192), made)))


def test_two_shares_of_one_holder_on_one_gpu_are_two_rows() -> None:
    """The shared file is anyone's to write: two shares of one GPU by one holder (two
    machines, or a hand edit) are two rows, each found by its key, each the holder's."""
    model = BoardModel(host_order=[BASE.name], clock=lambda: NOW, me="ann")
    model.ingest(BASE)
    model.set_state(_two_shares_of_bob())
    rows, keys, _summary = model.frame()
    assert len(keys) == len(set(keys)) == len(rows) == 7
    shares = [r for r in rows if isinstance(r, GpuRow) and r.share is not None]
    assert [r.share.share_mib for r in shares] == [1024, 8192]  # type: ignore[union-attr]
    for r in shares:
        assert model.find(r.key) is r
        assert split_share(r.key) == (keys[3], "bob")


async def test_each_share_row_of_one_holder_draws_its_own_size(tmp_path: Path) -> None:
    app = make_app(tmp_path)
    async with app.run_test(size=(120, 30)) as pilot:
        app.ingest(BASE)
        app.model.set_state(_two_shares_of_bob())
        app.render_board()
        await pilot.pause()
        table = app.query_one(BoardTable)
        lines = [on_screen(app, table, k) for k in table.row_keys[4:6]]
        assert "share 1G" in lines[0] and "share 8G" in lines[1], lines
