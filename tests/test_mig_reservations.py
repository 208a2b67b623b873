"""Reserving MIG instances through the CLI, as real teammates, against the real fleet:
``gpu-mixed``'s GPU 0 is the real H100's MIG layout (instances 2, 3, 9, 10)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import jsonschema
import pytest

from tests.support.as_user import need_test_users, shared_tmp
from tests.support.fleet import Fleet, mig_uuid
from tests.test_reservation_commands import _runner, only


@pytest.fixture
def gputop(fleet: Fleet) -> Iterator[Any]:
    need_test_users()
    with shared_tmp() as tmp:
        run = _runner(fleet, tmp)
        only(run, "gpu-mixed")
        yield run


def held(gputop: Any) -> list[tuple[int, int | None, str]]:
    doc = json.loads(gputop.path.read_text())
    return sorted((r["gpu"], r.get("instance"), r["user"]) for r in doc["reservations"])


def test_instance_reservations_conflict_both_ways(gputop: Any, schema: Any) -> None:
    r = gputop("reserve", "gpu-mixed:0/3", "--for", "1h")
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("reserved gpu-mixed:0/3 until")
    # An instance reservation blocks the whole GPU...
    clash = gputop("reserve", "gpu-mixed:0", user="gtbob")
    assert clash.returncode == 1
    assert "gpu-mixed:0/3 instance is reserved by gtalice" in clash.stderr
    # ...but not the GPU's other instances.
    assert gputop("reserve", "gpu-mixed:0/9", user="gtbob").returncode == 0
    assert gputop("reserve", "gpu-mixed:0/9").returncode == 1
    assert held(gputop) == [(0, 3, "gtalice"), (0, 9, "gtbob")]
    # Each instance row says who holds it.
    doc = json.loads(gputop("--json", user="gtbob").stdout)
    jsonschema.validate(doc, schema)
    insts = doc["hosts"][0]["gpus"][0]["instances"]
    assert [(i["gpu_instance_id"], (i["reservation"] or {}).get("user")) for i in insts] == [
        (2, None), (3, "gtalice"), (9, "gtbob"), (10, None)]
    assert all(i["flags"] == [] for i in insts)
    assert doc["hosts"][0]["gpus"][0]["reservation"] is None
    # free lists free instances: your own counts as free to you, a teammate's does not.
    free = gputop("free", "--count", "3")
    assert free.returncode == 0, free.stderr
    assert free.stdout.splitlines() == ["gpu-mixed:0/3", "gpu-mixed:0/10", "gpu-mixed:2"]
    r = gputop("release", "gpu-mixed:0/3")
    assert r.returncode == 0 and r.stdout == "released gpu-mixed:0/3\n"
    assert held(gputop) == [(0, 9, "gtbob")]


def test_whole_gpu_reservation_covers_its_instances(gputop: Any) -> None:
    assert gputop("reserve", "gpu-mixed:0").returncode == 0
    clash = gputop("reserve", "gpu-mixed:0/10", user="gtbob")
    assert clash.returncode == 1 and "gpu-mixed:0 is reserved by gtalice" in clash.stderr
    doc = json.loads(gputop("--json", user="gtbob").stdout)
    insts = doc["hosts"][0]["gpus"][0]["instances"]
    assert {i["reservation"]["user"] for i in insts} == {"gtalice"}
    free = gputop("free", "--count", "9", "--json", user="gtbob")
    assert free.returncode == 1  # gpu-mixed:2 alone: fewer than asked
    free = gputop("free", user="gtbob")
    assert free.stdout == "gpu-mixed:2\n"
    # Your own whole GPU already covers the instance you ask for: kept, not doubled.
    r = gputop("reserve", "gpu-mixed:0/10", "--for", "1m")
    assert r.returncode == 0 and "kept your reservation of gpu-mixed:0 " in r.stdout
    assert held(gputop) == [(0, None, "gtalice")]


def test_instance_by_mig_uuid_and_bad_instances(gputop: Any) -> None:
    r = gputop("reserve", f"gpu-mixed:{mig_uuid('gpu-mixed', 0, 0)}")
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("reserved gpu-mixed:0/2 until")  # MIG device 0 is GI 2
    rec = json.loads(gputop.path.read_text())["reservations"][0]
    assert rec["instance"] == 2 and rec["uuid"].startswith("GPU-")  # the parent GPU
    bad = gputop("reserve", "gpu-mixed:0/5")
    assert bad.returncode == 2
    assert "has no MIG instance 5; its instances: 0/2 (3g.40gb), 0/3 (2g.20gb)" in bad.stderr
    bad = gputop("reserve", "gpu-mixed:1/1")
    assert bad.returncode == 2 and "it is not split" in bad.stderr
    bad = gputop("reserve", "gpu-mixed:MIG-nope")
    assert bad.returncode == 2 and "no MIG instance with that uuid" in bad.stderr
    assert gputop("release", f"gpu-mixed:{mig_uuid('gpu-mixed', 0, 0)}").returncode == 0
    assert held(gputop) == []
