"""Misuse flags and "free" as ``--json``, ``gputop free`` and the board compute them."""

from __future__ import annotations

from dataclasses import replace
from datetime import timedelta

from gputop.model import FleetSnapshot, GpuInfo, HostSnapshot, ProcessInfo, utcnow
from gputop.reservations.flags import (
    IdleTracker,
    annotate,
    free_gpus,
    gpu_flags,
    is_free,
    other_users,
)
from gputop.reservations.state import StoreState
from gputop.reservations.terms import Target, Terms, new_reservation

T0 = utcnow()
IDLE_JOB = GpuInfo(index=0, uuid="GPU-a", utilization_percent=0, memory_used_mib=30000,
                   memory_total_mib=81559, processes=(ProcessInfo(1, "sam", "sleep", 30000),))


def host(at_s: float, *gpus: GpuInfo) -> HostSnapshot:
    return HostSnapshot(name="h", time=T0 + timedelta(seconds=at_s), gpus=gpus)


def test_idle_holder_needs_a_long_stretch_and_resets_on_work() -> None:
    tr = IdleTracker(after_s=600)
    tr.observe(host(0, IDLE_JOB))
    tr.observe(host(300, IDLE_JOB))
    assert not tr.is_idle_holder("h", 0, T0 + timedelta(seconds=300))
    tr.observe(host(600, IDLE_JOB))
    assert tr.is_idle_holder("h", 0, T0 + timedelta(seconds=600))
    tr.observe(host(620, replace(IDLE_JOB, utilization_percent=80)))  # it woke up
    assert not tr.is_idle_holder("h", 0, T0 + timedelta(seconds=620))
    tr.observe(host(700, replace(IDLE_JOB, processes=())))  # memory freed
    assert tr.idle_for("h", 0, T0 + timedelta(seconds=700)) == 0


def test_flags_for_reserved_gpus() -> None:
    r = new_reservation(Target("h", 0, "GPU-a"), Terms(3600, user="ann", machine="m"), T0)
    assert gpu_flags(IDLE_JOB, r, False) == ["unreserved-use"]  # sam runs on ann's GPU
    assert gpu_flags(replace(IDLE_JOB, processes=()), r, False, True) == ["idle-reservation"]
    mine = replace(IDLE_JOB, processes=(ProcessInfo(2, "ann", "python", 10),))
    assert gpu_flags(mine, r, True) == ["idle-holder"]
    assert "renumbered" in gpu_flags(replace(mine, uuid="GPU-b"), r, False)
    assert gpu_flags(GpuInfo(index=None, lost=True), None, False) == ["lost"]


def test_annotate_puts_reservation_and_flags_on_each_gpu() -> None:
    r = new_reservation(Target("h", 0), Terms(3600, note="note", user="ann", machine="m"), T0)
    tr = IdleTracker(after_s=0)
    snap = host(0, IDLE_JOB, replace(IDLE_JOB, index=1, processes=()))
    tr.observe(snap)
    doc = annotate(FleetSnapshot(hosts=(snap,), time=T0), StoreState((r,)), tr)
    g0, g1 = doc["hosts"][0]["gpus"]
    assert g0["reservation"]["user"] == "ann"
    assert g0["flags"] == ["unreserved-use", "idle-holder"]
    assert g1["reservation"] is None and g1["flags"] == []


def test_free_is_idle_and_unreserved_best_first() -> None:
    small = GpuInfo(index=0, utilization_percent=0, memory_used_mib=3, memory_total_mib=24564)
    big = replace(small, index=1, memory_total_mib=81559)
    busy = replace(small, index=2, utilization_percent=90)
    unknown_mem = replace(small, index=3, memory_used_mib=None)
    assert is_free(small) and not is_free(busy) and not is_free(unknown_mem)
    snap = host(0, small, big, busy, unknown_mem)
    assert [f.gpu.index for f in free_gpus([snap], None)] == [1, 0]
    held = StoreState((new_reservation(
        Target("h", 1), Terms(3600, user="bob", machine="m"), utcnow()),))
    assert [f.gpu.index for f in free_gpus([snap], held, user="ann")] == [0]
    assert [f.gpu.index for f in free_gpus([snap], held, user="bob")] == [1, 0]
    assert [f.gpu.index for f in free_gpus([snap], None, min_free_mib=30000)] == [1]


EMPTY = replace(IDLE_JOB, processes=(), memory_used_mib=3, utilization_percent=0)


def test_idle_reservation_only_after_the_grace_period() -> None:
    """A reservation is not "idle" the moment it is made: only once no process of its
    holder was seen on the GPU for the grace period (since creation or since last seen)."""
    r = new_reservation(Target("h", 0), Terms(4 * 3600, user="ann", machine="m"), T0)
    tr = IdleTracker(after_s=1800, grace_s=900)

    def flags(at_s: float, g: GpuInfo) -> list[str]:
        snap = host(at_s, g)
        tr.observe(snap)
        now = T0 + timedelta(seconds=at_s)
        return gpu_flags(g, r, False, tr.reservation_idle("h", g, r, now))

    assert flags(0, EMPTY) == []  # just reserved: the holder is starting the job
    assert flags(899, EMPTY) == []
    assert flags(900, EMPTY) == ["idle-reservation"]
    ann = replace(EMPTY, processes=(ProcessInfo(7, "ann", "python", 900),))
    assert flags(1000, ann) == []  # the holder's job runs
    assert flags(1500, EMPTY) == []  # finished 500 s ago: still within the grace period
    assert flags(1900, EMPTY) == ["idle-reservation"]
    sam = replace(EMPTY, processes=(ProcessInfo(8, "sam", "python", 900),))
    assert flags(2000, sam) == ["unreserved-use", "idle-reservation"]  # not the holder's
    unknown = replace(EMPTY, processes=(ProcessInfo(9, None, "python", 900),))
    assert flags(2100, unknown) == []  # an owner nobody could tell may be the holder


def test_one_shot_json_counts_the_grace_from_creation() -> None:
    old = new_reservation(
        Target("h", 0), Terms(4 * 3600, user="ann", machine="m"), T0 - timedelta(hours=1))
    new = new_reservation(
        Target("h", 1), Terms(4 * 3600, user="ann", machine="m"), T0 - timedelta(minutes=5))
    snap = host(0, EMPTY, replace(EMPTY, index=1))
    tr = IdleTracker(after_s=1800)  # default grace: 15 minutes
    tr.observe(snap)
    doc = annotate(FleetSnapshot(hosts=(snap,), time=T0), StoreState((old, new)), tr)
    assert [g["flags"] for g in doc["hosts"][0]["gpus"]] == [["idle-reservation"], []]


def test_other_users_says_who_else_uses_a_gpu() -> None:
    g = replace(EMPTY, processes=(ProcessInfo(1, "sam", "a", 1), ProcessInfo(2, "ann", "b", 1),
                                  ProcessInfo(3, None, "c", 1), ProcessInfo(4, "sam", "d", 1)))
    assert other_users(g, "ann") == ["?", "sam"]
    assert other_users(EMPTY, "ann") == []
