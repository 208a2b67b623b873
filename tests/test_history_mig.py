"""History on MIG GPUs: each instance counts for its fraction of the GPU (accounting's
rule), the GPU once; rollups give the raw totals; a version-1 database migrates.

Snapshots are synthetic (an injected clock), shaped by the real H100 MIG captures: the
``-L`` layout (3g.40gb, 2g.20gb, 2x 1g.10gb) and the GPU instance ids of its MIG table.
"""

from __future__ import annotations

import sqlite3
from dataclasses import replace
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import pytest

from gputop.history.accounting import mig_fraction
from gputop.history.db import SCHEMA_VERSION, HistoryDB
from gputop.history.recorder import Recorder
from gputop.history.report import collect, summarise
from gputop.model import GpuInfo, HostSnapshot, ProcessInfo
from gputop.reservations.state import StoreState
from gputop.reservations.terms import Target, Terms, new_reservation
from gputop.sources import mig
from tests.test_history import drop_share_sums

DATA = Path(__file__).parent / "data" / "nvidia-smi"
MIXED_L = (DATA / "table/list-L-h100-80gb-hbm3-mig-mixed-profiles-driver-590.48.01.txt").read_text()
X8_L = (DATA / "table/list-L-h100-80gb-hbm3-x8-mig-1g.10gb.txt").read_text()
T0 = datetime(2026, 11, 2, 8, 0, tzinfo=timezone.utc)
#: GPU instance ids of the capture's MIG table, in device order (3g, 2g, 1g, 1g).
GI = (2, 3, 9, 10)
A = pytest.approx


def hours(seconds: float) -> float:
    return seconds / 3600


def mig_gpu(*placed: tuple[str | None, int], unplaced: str | None = None,
            index: int = 0) -> GpuInfo:
    """The captured H100 with MIG on, ``placed`` processes (owner, GI id) on its instances."""
    (uuid, devs), = mig.parse_list(MIXED_L).items()
    uuid = uuid[:-1] + str(index)  # one capture, a GPU uuid per index
    devs = [replace(d, gpu_instance_id=gi, compute_instance_id=0)
            for d, gi in zip(devs, GI)]
    inv = mig.Inventory({uuid: tuple(devs)}, {uuid: {}})
    procs = [ProcessInfo(pid=100 + i, user=u, gpu_instance_id=gi, compute_instance_id=0)
             for i, (u, gi) in enumerate(placed)]
    if unplaced is not None:
        procs.append(ProcessInfo(pid=999, user=unplaced))
    g = GpuInfo(index=index, uuid=uuid, name="NVIDIA H100 80GB HBM3", mig_mode="Enabled",
                utilization_percent=None, memory_used_mib=11125, memory_total_mib=81559,
                processes=tuple(procs))
    (out,) = mig.attach([g], inv)
    return out


def plain_gpu(index: int, util: int, *users: str) -> GpuInfo:
    return GpuInfo(index=index, uuid=f"GPU-plain-{index}", name="NVIDIA H100 80GB HBM3",
                   utilization_percent=util, memory_used_mib=100, memory_total_mib=81559,
                   processes=tuple(ProcessInfo(pid=500 + i, user=u)
                                   for i, u in enumerate(users)))


def held(*what: tuple[str, int, str, int | None]) -> StoreState:
    return StoreState(reservations=tuple(
        new_reservation(
            Target(h, g, None, inst), Terms(86400 * 3, user=u, machine="m"),
            T0 - timedelta(hours=1))
        for h, g, u, inst in what))


def open_recorder(path: Path, interval: float = 10.0, **kw: Any) -> Recorder:
    return Recorder(HistoryDB(path, writer=True), interval=interval, timeout=5.0,
                    clock=lambda: 0.0, **kw)


def report(path: Path, start: datetime, end: datetime) -> dict[str, Any]:
    with HistoryDB(path) as db:
        return summarise(collect(db, start.timestamp(), end.timestamp()))


def by(rows: list[dict[str, Any]], key: str) -> dict[str, dict[str, Any]]:
    return {r[key]: r for r in rows}


def test_the_fraction_is_the_instance_s_compute_slices() -> None:
    h100 = "NVIDIA H100 80GB HBM3"
    (devs,) = mig.parse_list(MIXED_L).values()
    assert [mig_fraction(d.profile, h100, None, None) for d in devs] == A([3 / 7, 2 / 7,
                                                                          1 / 7, 1 / 7])
    for devs in mig.parse_list(X8_L).values():  # 8 GPUs, each 7 x 1g.10gb: all of it
        assert sum(mig_fraction(d.profile, h100, None, None) or 0 for d in devs) == A(1.0)
    assert mig_fraction("1c.3g.40gb", h100, None, None) == A(1 / 7)  # a compute instance
    assert mig_fraction("1g.10gb+me", h100, None, None) == A(1 / 7)
    assert mig_fraction("2g.12gb", "NVIDIA A30", None, None) == A(2 / 4)  # A30: 4 slices
    # a profile nobody can read: the memory share; nothing known: no fraction at all
    assert mig_fraction("\x1b[31m9g", h100, 20096, 81559) == A(20096 / 81559)
    assert mig_fraction("8g.80gb", h100, None, None) is None
    assert mig_fraction(None, h100, 90000, 81559) is None


def _two_users_on_two_instances(db: Path, samples: int = 60) -> None:
    """Host m: GPU 0 is the captured MIG H100, alice on its 3g.40gb (GI 2), bob on its
    2g.20gb (GI 3), which bob reserved as m:0/3; the two 1g.10gb and nothing else idle.
    GPU 1: carol reserved it whole (MIG, nobody on it). GPU 2: a plain GPU of dave's."""
    rec = open_recorder(db)
    rec.set_reservations(held(("m", 0, "bob", 3), ("m", 1, "carol", None)))
    for i in range(samples):
        t = T0 + timedelta(seconds=10 * (i + 1))
        rec.record(HostSnapshot(name="m", time=t, gpus=(
            mig_gpu(("alice", 2), ("alice", 2), ("bob", 3)), mig_gpu(index=1),
            plain_gpu(2, 80, "dave"))))
    rec.flush()
    rec.db.close()


def test_two_users_on_two_instances_of_one_gpu_get_their_fractions(tmp_path: Path) -> None:
    db = tmp_path / "h.sqlite3"
    _two_users_on_two_instances(db)
    doc = report(db, T0, T0 + timedelta(seconds=605))
    users = by(doc["users"], "user")
    t = 600.0
    assert users["alice"]["used_hours"] == A(hours(t * 3 / 7))  # two processes, one share
    assert users["alice"]["unreserved_hours"] == A(hours(t * 3 / 7))
    assert users["alice"]["reserved_hours"] == 0
    assert users["bob"]["used_hours"] == A(hours(t * 2 / 7))
    assert users["bob"]["reserved_hours"] == A(hours(t * 2 / 7))  # his instance, not the GPU
    assert users["bob"]["unreserved_hours"] == 0
    assert users["bob"]["reserved_idle_hours"] == 0
    # carol's whole reservation covers all of GPU 1's instances: whole, and all idle
    assert users["carol"]["reserved_hours"] == A(hours(t))
    assert users["carol"]["reserved_idle_hours"] == A(hours(t))
    assert users["dave"]["used_hours"] == A(hours(t))
    gpus = {g["index"]: g for g in doc["gpus"]}
    # GPU 0 counts once: its instances' parts add up to it, never more
    assert gpus[0]["gpu_hours"] == A(hours(t))
    assert gpus[0]["used_hours"] == A(hours(t * 5 / 7))
    assert gpus[0]["busy_hours"] == A(hours(t * 5 / 7))  # MIG reports no load: processes
    assert gpus[0]["idle_hours"] == A(hours(t * 2 / 7))  # the two 1g.10gb
    assert gpus[0]["reserved_hours"] == A(hours(t * 2 / 7))
    assert gpus[1]["held_idle_hours"] == A(hours(t))  # reserved, nobody on it
    host = doc["hosts"][0]
    assert host["gpus"] == 3 and host["gpu_hours"] == A(hours(3 * t))
    assert host["busy_hours"] == A(hours(t * 5 / 7 + t))
    hl = doc["headline"]
    assert hl["gpu_hours"] == A(hours(3 * t))  # three GPUs, whatever their instances
    assert hl["busy_percent"] == A(100 * (5 / 7 + 1) / 3)
    assert sum(u["used_hours"] for u in doc["users"]) == A(hours(t * 5 / 7 + t))


def test_rollups_of_instances_give_the_raw_totals(tmp_path: Path) -> None:
    raw, rolled = tmp_path / "raw.sqlite3", tmp_path / "rolled.sqlite3"
    _two_users_on_two_instances(raw, samples=720)  # two hours
    _two_users_on_two_instances(rolled, samples=720)
    start, end = T0, T0 + timedelta(hours=3)
    expected = report(raw, start, end)
    rec = open_recorder(rolled, raw_keep_s=600, minute_keep_s=3600)
    rec.maintain(T0.timestamp() + 4 * 3600)
    rec.maintain(T0.timestamp() + 4 * 3600 + 86400)  # minutes dropped too: hours only
    c = rec.db.conn
    assert c.execute("SELECT COUNT(*) FROM samples").fetchone()[0] == 0
    assert c.execute("SELECT COUNT(*) FROM gpu_minute").fetchone()[0] == 0
    rec.db.close()
    got = report(rolled, start, end)
    for section, key in (("users", "user"), ("hosts", "host"), ("gpus", "index")):
        want, have = by(expected[section], key), by(got[section], key)
        assert want.keys() == have.keys()
        for k, row in want.items():
            assert have[k] == A(row), (section, k)
    assert got["headline"] == A(expected["headline"])
    assert by(got["users"], "user")["alice"]["used_hours"] == A(2 * 3 / 7)


def test_a_process_no_instance_holds_makes_the_gpu_count_whole(tmp_path: Path) -> None:
    """The inventory could not place eve's process: who runs where is not known, so the
    GPU counts whole, split between its users, as on a GPU without MIG."""
    db = tmp_path / "h.sqlite3"
    rec = open_recorder(db)
    for i in range(6):
        rec.record(HostSnapshot(name="m", time=T0 + timedelta(seconds=10 * (i + 1)),
                                gpus=(mig_gpu(("alice", 2), unplaced="eve"),)))
    rec.flush()
    rec.db.close()
    users = by(report(db, T0, T0 + timedelta(seconds=65))["users"], "user")
    assert users["alice"]["used_hours"] == A(hours(30))
    assert users["eve"]["used_hours"] == A(hours(30))


def test_a_version_1_database_migrates_and_keeps_its_numbers(tmp_path: Path) -> None:
    db = tmp_path / "h.sqlite3"
    rec = open_recorder(db)
    for i in range(6):
        rec.record(HostSnapshot(name="m", time=T0 + timedelta(seconds=10 * (i + 1)),
                                gpus=(plain_gpu(0, 50, "alice"),)))
    rec.flush()
    rec.db.close()
    c = sqlite3.connect(db)  # what gputop 1 wrote: no mark, version 1
    c.execute("DELETE FROM meta WHERE key = 'mig_parts_from'")
    drop_share_sums(c)  # nor the shares' sums (version 4)
    c.execute("PRAGMA user_version = 1")
    c.commit()
    c.close()
    before = report(db, T0, T0 + timedelta(seconds=65))  # read as it is
    assert by(before["users"], "user")["alice"]["used_hours"] == A(hours(60))
    rec = open_recorder(db)  # the writer migrates it
    rec.record(HostSnapshot(name="m", time=T0 + timedelta(seconds=70),
                            gpus=(mig_gpu(("alice", 9)),)))
    rec.flush()
    assert rec.db.conn.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION
    assert rec.db.meta("mig_parts_from") > 0
    rec.db.close()
    users = by(report(db, T0, T0 + timedelta(seconds=75))["users"], "user")
    assert users["alice"]["used_hours"] == A(hours(60 + 10 / 7))
