"""The reservation commands as a script (or a teammate) runs them, against the real fleet."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import jsonschema
import pytest
from fleet import Fleet


@pytest.fixture
def gputop(fleet: Fleet, tmp_path: Path) -> Iterator:  # type: ignore[type-arg]
    """Run ``gputop`` as a given teammate against the fleet with a fresh shared file."""
    res = tmp_path / "team" / "reservations.json"
    cfg = fleet.write_config(timeout=3.0)
    text = cfg.read_text().replace(str(fleet.root / "reservations.json"), str(res))
    cfg = tmp_path / "hosts.toml"
    cfg.write_text(text)

    def run(*args: str, user: str = "ann") -> subprocess.CompletedProcess[str]:
        env = fleet.env() | {"LOGNAME": user, "USER": user}
        return subprocess.run([sys.executable, "-m", "gputop", "--config", str(cfg), *args],
                              env=env, capture_output=True, text=True, timeout=60)

    run.path = res  # type: ignore[attr-defined]
    yield run


def test_reserve_list_and_conflict(gputop) -> None:  # type: ignore[no-untyped-def]
    r = gputop("reserve", "gpu-h100:0,1", "--for", "2h", "--note", "sweep [bold]7[/]")
    assert r.returncode == 0, r.stderr
    assert r.stdout.count("reserved gpu-h100:") == 2
    listed = json.loads(gputop("reservations", "--json", user="bob").stdout)["reservations"]
    assert [(x["host"], x["gpu"], x["user"]) for x in listed] == [
        ("gpu-h100", 0, "ann"), ("gpu-h100", 1, "ann")]
    assert listed[0]["uuid"].startswith("GPU-")  # recorded from the live host
    assert listed[0]["note"] == "sweep [bold]7[/]"
    clash = gputop("reserve", "gpu-h100:1", user="bob")
    assert clash.returncode == 1
    assert "ann" in clash.stderr and "sweep [bold]7[/]" in clash.stderr and "until" in clash.stderr
    plain = gputop("reservations", user="bob").stdout
    assert "gpu-h100:0" in plain and "ann" in plain


def test_unknown_host_and_gpu_list_the_valid_ones(gputop) -> None:  # type: ignore[no-untyped-def]
    r = gputop("reserve", "nope:0")
    assert r.returncode == 2 and "gpu-h100" in r.stderr and "gpu-mixed" in r.stderr
    r = gputop("reserve", "gpu-h100:7")
    assert r.returncode == 2 and "its GPUs: 0, 1" in r.stderr
    r = gputop("reserve", "gpu-h100")
    assert r.returncode == 2 and "HOST:GPU" in r.stderr
    r = gputop("reserve", "gpu-h100:0", "--for", "30d")
    assert r.returncode == 2 and "duration" in r.stderr
    assert not gputop.path.exists()  # type: ignore[attr-defined]


def test_release_and_force(gputop) -> None:  # type: ignore[no-untyped-def]
    assert gputop("reserve", "gpu-mixed:0").returncode == 0
    r = gputop("release", "gpu-mixed:0", user="bob")
    assert r.returncode == 1 and "--force" in r.stderr
    r = gputop("release", "gpu-mixed:0", "--force", user="bob")
    assert r.returncode == 0 and "held by ann" in r.stdout
    events = json.loads(gputop.path.read_text())["events"]  # type: ignore[attr-defined]
    assert events[-1]["by"] == "bob" and events[-1]["reservation"]["user"] == "ann"
    assert gputop("reserve", "gpu-mixed:0", "gpu-mixed:1").returncode == 0
    r = gputop("release", "--mine")
    assert r.returncode == 0 and r.stdout.count("released") == 2
    assert json.loads(gputop("reservations", "--json").stdout)["reservations"] == []


def test_free_lists_and_reserves_idle_unreserved(gputop) -> None:  # type: ignore[no-untyped-def]
    # Of the fleet's GPUs only gpu-mixed:2 (RTX 2080 SUPER, idle, 211 MiB) is free: the rest
    # run processes, hold memory, show load, or are lost.
    r = gputop("free")
    assert r.returncode == 0 and r.stdout == "gpu-mixed:2\n"
    r = gputop("free", "--count", "2")
    assert r.returncode == 1 and "1 free" in r.stderr
    r = gputop("free", "--min-free-memory", "20G")
    assert r.returncode == 1
    r = gputop("free", "--reserve", "--for", "1h", "--json")
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    assert doc["reserved"] and [(f["host"], f["gpu"]) for f in doc["free"]] == [("gpu-mixed", 2)]
    assert gputop("free", user="bob").returncode == 1  # now reserved by ann
    assert gputop("free").stdout == "gpu-mixed:2\n"  # still free to its holder


def test_snapshot_carries_reservations_and_flags(gputop, schema) -> None:  # type: ignore[no-untyped-def]
    assert gputop("reserve", "gpu-h100:0", "gpu-mixed:2").returncode == 0
    r = gputop("--json", user="bob")  # a teammate sees it at the next refresh
    doc = json.loads(r.stdout)
    jsonschema.validate(doc, schema)
    by = {h["name"]: h for h in doc["hosts"]}
    g0 = by["gpu-h100"]["gpus"][0]
    assert g0["reservation"]["user"] == "ann"
    assert "unreserved-use" in g0["flags"]  # gtalice's job runs on ann's GPU
    idle = by["gpu-mixed"]["gpus"][2]
    assert idle["reservation"]["user"] == "ann" and idle["flags"] == ["idle-reservation"]
    assert by["gpu-h100"]["gpus"][1]["reservation"] is None
    assert by["gpu-lost"]["gpus"][1]["flags"] == ["lost"]


def test_broken_store_does_not_stop_the_snapshot(gputop, schema) -> None:  # type: ignore[no-untyped-def]
    gputop.path.parent.mkdir(parents=True)  # type: ignore[attr-defined]
    gputop.path.write_text("{oops")  # type: ignore[attr-defined]
    r = gputop("--json")
    assert r.returncode == 0
    doc = json.loads(r.stdout)
    jsonschema.validate(doc, schema)
    assert "not valid JSON" in doc["reservations_error"] and "not valid JSON" in r.stderr
    assert gputop.path.read_text() == "{oops"  # type: ignore[attr-defined]
