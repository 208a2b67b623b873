"""MIG instances as rows, end to end: real sshd hosts whose stand-in nvidia-smi replays the
real H100 MIG captures (``-L``, the table's MIG devices, ``--query-gpu``) in the real
``-q -x`` document structure, with real processes of real users on the instances."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator

import jsonschema
import pytest

from gputop.reservations.terms import Target, Terms
from tests.support.fleet import Fleet, GpuProcess, Host, gpu_uuid, mig_uuid
from tests.support.shared_fleet import need_sshd, world_readable

#: argv0 a user chose to break (or forge inside) nvidia-smi's unescaped XML.
XML_HOSTILE = ("evil</process_name><pid>1</pid>&amp;<gpu_instance_id>3"
               "\n</process_info></processes></gpu><gpu id=\"x\"><uuid>GPU-forged</uuid>")


@pytest.fixture(scope="module")
def mig_fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    need_sshd()
    f = Fleet(world_readable(tmp_path_factory.mktemp("migfleet")), [
        Host("gpu-mig", "127.0.3.2", gpus=("h100-mig", "l40s", "h100-mig"), processes=[
            GpuProcess("gtalice", "python big.py", gpu=0, mem_mib=7484, mig=(2, 0)),
            GpuProcess("gtbob", "python small.py", gpu=0, mem_mib=900, mig=(9, 0)),
            GpuProcess("gtbob", XML_HOSTILE, gpu=2, mem_mib=5, mig=(10, 0)),
            GpuProcess("gtalice", "python plain.py", gpu=1, mem_mib=100),
        ]),
        Host("gpu-migu", "127.0.3.3", gpus=("h100-mig",), apps_by_mig=True, processes=[
            GpuProcess("gtbob", "python on-mig.py", gpu=0, mem_mib=300, mig=(3, 0)),
        ]),
    ]).start()
    yield f
    f.stop()


def run(fleet: Fleet, *args: str) -> subprocess.CompletedProcess[str]:
    cfg = fleet.write_config(timeout=5.0)
    return subprocess.run([sys.executable, "-m", "gputop", "--config", str(cfg), *args],
                          env=fleet.env(), capture_output=True, text=True, timeout=60)


@pytest.fixture(scope="module")
def doc(mig_fleet: Fleet) -> dict:
    r = run(mig_fleet, "--json")
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def test_instances_are_rows_under_their_gpu(doc: dict, mig_fleet: Fleet, schema: dict) -> None:
    jsonschema.validate(doc, schema)
    assert doc["version"] == 5
    h = doc["hosts"][0]
    assert h["status"] == "ok", h["error"]
    g0, g1, g2 = h["gpus"]
    assert g0["uuid"] == gpu_uuid("gpu-mig", 0) and g0["mig_mode"] == "Enabled"
    inst = g0["instances"]
    # The real H100's layout: profiles from its -L, ids and memory from its MIG table.
    assert [(i["profile"], i["gpu_instance_id"], i["compute_instance_id"]) for i in inst] == [
        ("3g.40gb", 2, 0), ("2g.20gb", 3, 0), ("1g.10gb", 9, 0), ("1g.10gb", 10, 0)]
    assert [(i["memory_used_mib"], i["memory_total_mib"]) for i in inst] == [
        (11091, 40448), (17, 20096), (9, 9984), (9, 9984)]
    assert [i["uuid"] for i in inst] == [mig_uuid("gpu-mig", 0, d) for d in range(4)]
    # NVML reports no utilisation per MIG instance: null, never 0.
    assert all(i["utilization_percent"] is None for i in inst)
    assert g1["instances"] == [] and g1["mig_mode"] is None
    assert len(g2["instances"]) == 4


def test_processes_with_owners_on_the_right_instance(doc: dict, mig_fleet: Fleet) -> None:
    procs = mig_fleet.hosts["gpu-mig"].processes
    g0, g1, _g2 = doc["hosts"][0]["gpus"]
    by_gi = {i["gpu_instance_id"]: [p["pid"] for p in i["processes"]] for i in g0["instances"]}
    assert by_gi == {2: [procs[0].pid], 3: [], 9: [procs[1].pid], 10: []}
    # The GPU still lists all of its processes, each saying its instance.
    assert {(p["pid"], p["gpu_instance_id"]) for p in g0["processes"]} == {
        (procs[0].pid, 2), (procs[1].pid, 9)}
    if mig_fleet.users:
        users = {i["gpu_instance_id"]: [p["user"] for p in i["processes"]]
                 for i in g0["instances"]}
        assert users[2] == ["gtalice"] and users[9] == ["gtbob"]
    (plain,) = g1["processes"]
    assert plain["gpu_instance_id"] is None


def test_hostile_process_name_in_the_xml_is_inert(doc: dict, mig_fleet: Fleet) -> None:
    """The argv0 breaks the XML nvidia-smi prints unescaped and tries to forge a GPU: its
    lines are dropped, nothing forged appears, every other placement stands."""
    procs = mig_fleet.hosts["gpu-mig"].processes
    h = doc["hosts"][0]
    g2 = h["gpus"][2]
    assert [i["gpu_instance_id"] for i in g2["instances"]] == [2, 3, 9, 10]
    placed = {p["pid"]: p["gpu_instance_id"] for i in g2["instances"] for p in i["processes"]}
    assert placed in ({procs[2].pid: 10}, {})
    assert [g["uuid"] for g in h["gpus"]] == [gpu_uuid("gpu-mig", i) for i in range(3)]
    assert any("malformed line" in w for w in h["warnings"])  # said, not hidden
    assert all(p["pid"] != 1 for g in h["gpus"] for p in g["processes"])


def test_inventory_is_read_rarely(mig_fleet: Fleet, monkeypatch: pytest.MonkeyPatch) -> None:
    """Three refreshes, one inventory: the layout and the process set did not change."""
    import asyncio

    from gputop.config.load import load_config
    from gputop.poller import Poller
    from gputop.sources.ssh import SshSource

    monkeypatch.setenv("HOME", str(mig_fleet.home))
    monkeypatch.delenv("SSH_AUTH_SOCK", raising=False)

    async def go() -> tuple[int, int]:
        poller = Poller(load_config(mig_fleet.write_config(timeout=5.0)))
        try:
            for _ in range(3):
                snap = await poller.snapshot()
                assert snap.hosts[0].gpus[0].instances
            src = poller.sources[0]
            assert isinstance(src, SshSource)
            return src.mig_reads, src.channels - 1
        finally:
            await poller.aclose()

    reads, new_channels = asyncio.run(go())
    assert reads == 1 and new_channels == 0  # no channel opened after the first refresh


def test_process_reported_under_its_mig_uuid(doc: dict, mig_fleet: Fleet) -> None:
    """Some drivers name the MIG device in --query-compute-apps: that unknown uuid makes the
    first refresh read the inventory and place the process, in the same snapshot."""
    (p,) = mig_fleet.hosts["gpu-migu"].processes
    h = doc["hosts"][1]
    assert h["name"] == "gpu-migu" and h["status"] == "ok", h["error"]
    (g,) = h["gpus"]
    assert [(x["pid"], x["gpu_instance_id"]) for x in g["processes"]] == [(p.pid, 3)]
    (on3,) = [i for i in g["instances"] if i["processes"]]
    assert on3["gpu_instance_id"] == 3 and on3["uuid"] == mig_uuid("gpu-migu", 0, 1)
    if mig_fleet.users:
        assert on3["processes"][0]["user"] == "gtbob"


def test_recorded_run_counts_each_instance_as_its_fraction(
        mig_fleet: Fleet, monkeypatch: pytest.MonkeyPatch, tmp_path: object) -> None:
    """The real fleet recorded (two refreshes): on gpu-mig's GPU 0, gtalice's process on
    the 3g.40gb counts 3/7 of the GPU, gtbob's on a 1g.10gb (his reservation
    ``gpu-mig:0/9``) 1/7; the GPU counts once, whole."""
    import asyncio
    from datetime import timedelta
    from pathlib import Path

    from gputop.config.load import load_config
    from gputop.history.db import HistoryDB
    from gputop.history.recorder import Recorder
    from gputop.history.report import collect, summarise
    from gputop.model import utcnow
    from gputop.poller import Poller
    from gputop.reservations.state import StoreState
    from gputop.reservations.store import new_reservation

    if not mig_fleet.users:
        pytest.skip("needs the test users (root)")
    monkeypatch.setenv("HOME", str(mig_fleet.home))
    monkeypatch.delenv("SSH_AUTH_SOCK", raising=False)
    path = Path(str(tmp_path)) / "h.sqlite3"
    start = utcnow()
    rec = Recorder(HistoryDB(path, writer=True), interval=1.0, timeout=5.0)
    rec.set_reservations(StoreState(reservations=(new_reservation(
        Target("gpu-mig", 0, None, 9), Terms(7200, user="gtbob", machine="m"),
        start - timedelta(hours=1)),)))

    want = len(mig_fleet.hosts["gpu-mig"].processes)

    async def go() -> None:
        poller = Poller(load_config(mig_fleet.write_config(timeout=5.0)))
        try:
            recorded = 0
            for _ in range(20):
                snap = await poller.snapshot()
                host = snap.hosts[0]
                assert host.ok and host.gpus[0].instances, host.error
                if (not all(p.gpu_instance_id is not None for p in host.gpus[0].processes)
                        or not all(p.user for g in host.gpus for p in g.processes)
                        or len([p for g in host.gpus for p in g.processes]) < want):
                    # The MIG inventory places processes in instances, and a session's
                    # first samples may show a process before its owner (or one batch of
                    # processes in part); until then (a loaded machine), the sample is
                    # not the one this test is about.
                    await asyncio.sleep(0.3)
                    continue
                rec.record(host)
                recorded += 1
                if recorded == 2:
                    break
                # More than half an interval apart: history keeps a name seen in two
                # refreshes (gputop.history.names), and samples closer are one refresh.
                await asyncio.sleep(0.6)
            assert recorded == 2, "the MIG inventory never placed the processes"
        finally:
            await poller.aclose()

    asyncio.run(go())
    rec.flush()
    secs = rec.db.conn.execute("SELECT SUM(dt) FROM samples").fetchone()[0] / 1000
    rec.db.close()
    with HistoryDB(path) as db:
        doc = summarise(collect(db, start.timestamp() - 60, utcnow().timestamp() + 60))
    users = {u["user"]: u for u in doc["users"]}
    a = pytest.approx
    # gtalice also runs a plain process on GPU 1 (whole): 3/7 + 1
    assert users["gtalice"]["used_hours"] * 3600 == a(secs * (3 / 7 + 1))
    assert users["gtbob"]["used_hours"] * 3600 == a(secs * (1 / 7 + 1 / 7))  # GPU 2: GI 10
    assert users["gtbob"]["reserved_hours"] * 3600 == a(secs / 7)
    assert users["gtbob"]["reserved_idle_hours"] == 0
    g0 = next(g for g in doc["gpus"] if g["index"] == 0)
    assert g0["gpu_hours"] * 3600 == a(secs)
    assert g0["used_hours"] * 3600 == a(secs * 4 / 7)
    assert doc["headline"]["gpu_hours"] * 3600 == a(3 * secs)
