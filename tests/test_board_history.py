"""The board's sparkline history (``BoardHistory``): one sample per host per answer, read
back per GPU. A GPU keeps its series while GPUs come and go around it; a host that did not
answer is a gap in each series, as is an unknown value; nothing is kept past HISTORY."""

from __future__ import annotations

from dataclasses import replace

from gputop.model import HostError, HostSnapshot
from gputop.ui.board_history import HISTORY, BoardHistory
from gputop.ui.board_model import BoardModel
from gputop.ui.board_rows import gpu_keys
from tests.support.board_data import fixed_snapshots

HOST = fixed_snapshots()[0]  # gpu-h100: 4 GPUs


def _with(util: list[int | None], used: int | None = 8000) -> HostSnapshot:
    gpus = tuple(replace(g, utilization_percent=u, memory_used_mib=used)
                 for g, u in zip(HOST.gpus, util))
    return replace(HOST, gpus=gpus, error=None)


def test_each_gpu_gets_its_own_series_back_through_gaps_and_gpus_coming_and_going() -> None:
    model = BoardModel(host_order=[HOST.name])
    keys = gpu_keys(HOST.name, HOST.gpus)
    total = HOST.gpus[1].memory_total_mib
    assert total
    model.ingest(_with([10, 20, 30, 40]))
    model.ingest(replace(HOST, error=HostError("timeout", "no answer"), gpus=()))
    model.ingest(_with([11, None, 31, 41], used=None))
    two = _with([12, 22, 32, 42])
    model.ingest(replace(two, gpus=two.gpus[1:]))  # GPU 0 gone
    model.ingest(_with([13, 23, 33, 43]))  # ...and back
    util, mem = model.history.series(keys[1], HOST.name)
    assert util == [20.0, None, None, 22.0, 23.0]
    assert mem == [100.0 * 8000 / total, None, None, 100.0 * 8000 / total,
                   100.0 * 8000 / total]
    util0, _ = model.history.series(keys[0], HOST.name)
    assert util0 == [10.0, None, 11.0, 13.0]  # (no sample while it was not listed)
    assert model.history.series("no such key", HOST.name) == ([], [])
    assert model.history.series(keys[0], "no such host") == ([], [])


def test_nothing_is_kept_past_history_samples() -> None:
    history = BoardHistory()
    keys = gpu_keys(HOST.name, HOST.gpus)
    for i in range(HISTORY + 30):
        history.add(_with([i % 101] * 4), keys)
    util, mem = history.series(keys[2], HOST.name)
    assert len(util) == len(mem) == HISTORY
    assert util[-1] == float((HISTORY + 29) % 101) and util[0] == float(30 % 101)
