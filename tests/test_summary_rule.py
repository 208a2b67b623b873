"""The fleet summary's rule on hand-built snapshots: every GPU (and MIG instance) in
exactly one class, the odd cases placed first, in the middle and last of a host."""

from __future__ import annotations

from datetime import datetime, timezone

import pytest

from gputop.hubclient.client import check_document
from gputop.hubclient.schema import check
from gputop.model import GpuInfo, HostError, HostSnapshot, MigInstance, ProcessInfo
from gputop.reservations.state import StoreState
from gputop.reservations.summary import fleet_summary
from gputop.reservations.terms import Target, Terms, new_reservation

NOW = datetime(2026, 12, 5, 1, 0, tzinfo=timezone.utc)
P = (ProcessInfo(pid=1, user="gtbob", command="python", gpu_memory_mib=4000),)


def _idle(i: int) -> GpuInfo:
    return GpuInfo(index=i, name="A100", memory_used_mib=0, memory_total_mib=40960,
                   utilization_percent=0)


def _busy(i: int) -> GpuInfo:
    return GpuInfo(index=i, name="A100", memory_used_mib=4000, memory_total_mib=40960,
                   utilization_percent=90, processes=P)


def _lost(i: int) -> GpuInfo:
    return GpuInfo(index=i, lost=True, lost_reason="GPU is lost")


def _mig(i: int, used: tuple[bool, ...]) -> GpuInfo:
    """A MIG GPU with one instance per item of ``used`` (True: a process runs on it)."""
    insts = tuple(MigInstance(gpu_instance_id=n + 1, compute_instance_id=0, profile="1g.10gb",
                              memory_used_mib=4000 if u else 0, memory_total_mib=9856,
                              processes=P if u else ()) for n, u in enumerate(used))
    procs = P if any(used) else ()
    return GpuInfo(index=i, name="H100", memory_used_mib=4000 * sum(used),
                   memory_total_mib=81559, mig_mode="Enabled", processes=procs,
                   instances=insts)


def _state(*specs: tuple[str, int, int | None, int | None]) -> StoreState:
    return StoreState(reservations=tuple(
        new_reservation(
            Target(h, g, None, inst), Terms(3600, user="gtalice", machine="ws", share_mib=share),
            NOW) for h, g, inst, share in specs))


def _host(name: str, *gpus: GpuInfo) -> HostSnapshot:
    return HostSnapshot(name=name, time=NOW, gpus=gpus)


def test_each_gpu_is_in_exactly_one_class_first_middle_and_last() -> None:
    hosts = (
        # odd cases first: a lost GPU, a MIG GPU with one free instance of two, a share
        _host("a", _lost(0), _mig(1, (True, False)), _idle(2), _idle(3), _busy(4)),
        # in the middle: a MIG GPU whose only use is a reserved instance; a share
        _host("b", _idle(0), _mig(1, (False, False)), _idle(2), _busy(3)),
        # last: an unknown memory, a whole reservation of a busy GPU, a lost reserved GPU
        _host("c", _idle(0), _busy(1), GpuInfo(index=2, memory_total_mib=100),
              _busy(3), _lost(4)),
        HostSnapshot(name="d", time=NOW, error=HostError("timeout", "no banner")),
        HostSnapshot(name="e", time=NOW, error=HostError("starting", "no answer yet")),
    )
    state = _state(("a", 3, None, 1000), ("b", 1, 2, None), ("b", 2, None, 2000),
                   ("c", 3, None, None), ("c", 4, None, None), ("d", 0, None, None))
    s = fleet_summary(hosts, state, NOW)
    assert s["hosts"] == {"up": 3, "down": 1, "waiting": 1}
    # a: down, busy (MIG, one instance free), free, shared, busy
    # b: free, reserved (its one instance reservation), shared, busy
    # c: free, busy, unknown, reserved, down (lost wins over its reservation)
    assert s["gpus"] == {"total": 14, "free": 3, "busy": 4, "reserved": 2, "shared": 2,
                         "down": 2, "unknown": 1}
    assert s["instances"] == {"total": 4, "free": 2, "busy": 1, "reserved": 1, "down": 0,
                              "unknown": 0}
    assert sum(v for k, v in s["gpus"].items() if k != "total") == s["gpus"]["total"]
    check(s, "summary", "$.summary")  # what the schema says a summary is


def test_a_whole_reservation_of_a_mig_gpu_reserves_its_instances() -> None:
    s = fleet_summary([_host("m", _mig(0, (False, False, False)))],
                      _state(("m", 0, None, None)), NOW)
    assert s["gpus"]["reserved"] == 1 and s["instances"]["reserved"] == 3
    # Without it, all of it idle: free, by GPU and by instance.
    s = fleet_summary([_host("m", _mig(0, (False, False, False)))], None, NOW)
    assert s["gpus"]["free"] == 1 and s["instances"]["free"] == 3


def test_an_idle_gpu_that_reports_busy_load_is_busy_and_no_index_is_unknown() -> None:
    hot = GpuInfo(index=0, memory_used_mib=0, memory_total_mib=100, utilization_percent=50)
    noindex = GpuInfo(index=None, memory_used_mib=0, memory_total_mib=100)
    s = fleet_summary([_host("x", hot, noindex)], None, NOW)
    assert s["gpus"]["busy"] == 1 and s["gpus"]["unknown"] == 1


def test_a_version_4_document_is_refused_saying_the_hub_may_be_another_version() -> None:
    with pytest.raises(ValueError, match=r"expected 5 .*is the hub another version\?"):
        check_document({"version": 4, "time": "2026-12-05T01:00:00Z", "hosts": []})
