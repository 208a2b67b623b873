"""Shared fixtures: the real-sshd test fleet and the schema."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.fleet import Fleet, GpuProcess, Host
from tests.support.shared_fleet import fleet_hosts, need_sshd, world_readable

ROOT = Path(__file__).resolve().parents[1]
SCHEMA = ROOT / "gputop" / "schema" / "snapshot.schema.json"


@pytest.fixture(scope="session")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    """The dozen-host fleet, shared by the tests that only read it."""
    need_sshd()
    f = Fleet(world_readable(tmp_path_factory.mktemp("fleet")), fleet_hosts()).start()
    yield f
    f.stop()


@pytest.fixture
def small_fleet(tmp_path: Path) -> Iterator[Fleet]:
    """Two healthy hosts a test may break and mend."""
    need_sshd()
    f = Fleet(world_readable(tmp_path), [
        Host("alpha", "127.0.1.2", processes=[GpuProcess("gtalice", "python a.py")]),
        Host("beta", "127.0.1.3", gpus=("l40s",)),
    ]).start()
    yield f
    f.stop()


@pytest.fixture
def fleet_home(fleet: Fleet, monkeypatch: pytest.MonkeyPatch) -> Fleet:
    """In-process tests: point HOME (and so ~/.ssh) at the fleet's client side."""
    monkeypatch.setenv("HOME", str(fleet.home))
    monkeypatch.delenv("SSH_AUTH_SOCK", raising=False)
    return fleet


@pytest.fixture(scope="session")
def schema() -> dict[str, object]:
    return json.loads(SCHEMA.read_text())
