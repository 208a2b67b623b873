"""One count of the fleet, shown the same everywhere: ``--json``'s summary, ``--once``, the
board's top line (Textual's pilot), the hub's document, ``/metrics``, the web page
(headless Chromium) and MCP, for real-sshd hosts with a MIG GPU, a lost GPU, a share and
a down host that holds a reservation. And ``--once`` shows every reservation: a MIG
instance's on its row, the down host's under its error."""

from __future__ import annotations

import json
import os
import pwd
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from gputop.reservations.ops import Target, reserve
from gputop.reservations.store import Store
from tests.support.fleet import Fleet, GpuProcess, Host
from tests.support.hubs import Hub, get
from tests.support.shared_fleet import need_sshd, world_readable
from tests.support.web_hub import browser, chromium_missing

ADDR = "127.0.47.1"
ME = pwd.getpwuid(os.getuid()).pw_name
#: mixed: a MIG GPU (instance 2 holds 11 GiB, 9 is reserved, 3 and 10 idle: busy), an L40S
#: shared, an RTX busy with a process, an idle RTX; lost: an L40S at 100 % (its capture's
#: load: busy) and a lost GPU; down: unreachable, with a reservation.
WANT = {"hosts": {"up": 2, "down": 1, "waiting": 0},
        "gpus": {"total": 6, "free": 1, "busy": 3, "reserved": 0, "shared": 1, "down": 1,
                 "unknown": 0},
        "instances": {"total": 4, "free": 2, "busy": 1, "reserved": 1, "down": 0,
                      "unknown": 0}}


@pytest.fixture(scope="module")
def sum_fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    need_sshd()
    f = Fleet(world_readable(tmp_path_factory.mktemp("sumfleet")), [
        Host("mixed", "127.0.47.2", gpus=("h100-mig", "l40s", "rtx2080", "rtx2080"),
             processes=[GpuProcess("gtbob", "python train.py", gpu=2, mem_mib=3000)]),
        Host("lost", "127.0.47.3", scenario="lost", gpus=("l40s",)),
        Host("down", "127.0.47.4", scenario="unreachable"),
    ]).start()
    yield f
    f.stop()


def gputop(fleet: Fleet, cfg: Path, *args: str,
           env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "gputop", *args, "--config", str(cfg)],
                          capture_output=True, text=True, timeout=60,
                          env=fleet.env() | (env or {}), stdin=subprocess.DEVNULL)


@pytest.fixture(scope="module")
def cfg(sum_fleet: Fleet) -> Path:
    path = sum_fleet.write_config(timeout=3.0, interval=1.0)
    r = gputop(sum_fleet, path, "reserve", "mixed:0/9", "--for", "2h")
    assert r.returncode == 0, r.stderr
    r = gputop(sum_fleet, path, "reserve", "mixed:1", "--share", "4G", "--for", "2h")
    assert r.returncode == 0, r.stderr
    # The down host's, through the store (reserve asks the host, which does not answer).
    reserve(Store(sum_fleet.root / "reservations.json"), [Target("down", 0)], seconds=3600,
            max_seconds=7 * 86400, user="gtalice")
    return path


@pytest.fixture(scope="module")
def doc(sum_fleet: Fleet, cfg: Path) -> dict[str, Any]:
    r = gputop(sum_fleet, cfg, "--json")
    assert r.returncode == 0, r.stderr
    return dict(json.loads(r.stdout))


def test_json_carries_the_summary_by_the_rule(doc: dict[str, Any], schema: dict) -> None:
    import jsonschema

    jsonschema.validate(doc, schema)
    assert doc["version"] == 5
    assert doc["summary"] == WANT, doc["summary"]


def test_once_shows_the_summary_and_every_reservation(sum_fleet: Fleet, cfg: Path) -> None:
    r = gputop(sum_fleet, cfg, "--once", env={"COLUMNS": "200"})
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert lines[-1] == ("2 up · 1 down | 1 free · 3 busy · 0 reserved · 1 shared · 1 down "
                         "of 6 GPUs | MIG: 2 free · 1 busy · 1 reserved of 4"), r.stdout
    # The MIG instance's holder on its own row, under its GPU.
    (inst,) = [ln for ln in lines if ln.split()[:2] == ["/9", "1g.10gb"]]
    assert re.search(rf"\b{ME} 1h59m|\b{ME} 2h00m", inst), inst
    assert [ln.split()[0] for ln in lines if ln.split()[:1] and ln.split()[0].startswith("/")
            ] == ["/2", "/3", "/9", "/10"]
    # The down host's reservation, under its error line.
    at = next(i for i, ln in enumerate(lines) if ln.startswith("down "))
    assert "unreachable" in lines[at]
    assert lines[at + 1].split()[:1] == ["0"] and "gtalice" in lines[at + 1], lines[at + 1]


async def test_the_board_top_line_is_the_summary(sum_fleet: Fleet, cfg: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    from gputop.config.load import load_config
    from gputop.ui.app import GputopApp
    from gputop.ui.widgets import SummaryBar

    monkeypatch.setenv("HOME", str(sum_fleet.home))
    monkeypatch.delenv("SSH_AUTH_SOCK", raising=False)
    app = GputopApp(load_config(str(cfg)), user=ME)
    async with app.run_test(size=(200, 40)) as pilot:
        want = ("2 up · 1 down │ 1 free · 3 busy · 0 reserved · 1 shared · 1 down of 6 GPUs"
                " · MIG 2 free of 4")
        text = ""
        for _ in range(600):
            app.render_board()
            await pilot.pause(0.05)
            text = str(app.query_one(SummaryBar).render())
            if want in text:
                break
        assert want in text, text
        s = app.model.summary()
        assert (s.free, s.busy, s.reserved, s.shared, s.down, s.unknown) == (1, 3, 0, 1, 1, 0)
        assert s.instances == {"free": 2, "busy": 1, "reserved": 1}


@pytest.fixture(scope="module")
def hub(sum_fleet: Fleet, cfg: Path) -> Iterator[Hub]:
    h = Hub(cfg, sum_fleet.env(), ADDR).start(wait_ready=30)
    yield h
    h.stop()


def _hub_summary(hub: Hub) -> dict[str, Any]:
    deadline = time.monotonic() + 20
    while True:
        got = hub.json("api/v1/snapshot")["summary"]
        if got == WANT or time.monotonic() > deadline:
            return dict(got)
        time.sleep(0.1)


def test_the_hub_document_and_metrics_carry_the_summary(hub: Hub) -> None:
    assert _hub_summary(hub) == WANT
    status, _, body = get(hub.url + "metrics")
    assert status == 200
    text = body.decode()
    for fam, part in (("gputop_fleet_gpus", "gpus"), ("gputop_fleet_mig_instances",
                                                      "instances")):
        got = {m[0]: float(m[1]) for m in re.findall(rf'^{fam}{{class="(\w+)"}} (\S+)$', text,
                                                       re.M)}
        assert got == {k: float(v) for k, v in WANT[part].items() if k != "total"}, got
    hosts = dict(re.findall(r'^gputop_fleet_hosts{state="(\w+)"} (\S+)$', text, re.M))
    assert hosts == {"up": "2.0", "down": "1.0", "waiting": "0.0"}


def test_the_web_page_shows_the_summary(hub: Hub) -> None:
    reason = chromium_missing()
    if reason:
        pytest.skip(reason)
    assert _hub_summary(hub) == WANT
    b = browser(1600, 1000)
    try:
        b.get(hub.url)
        deadline = time.monotonic() + 20
        text = ""
        while time.monotonic() < deadline:
            text = b.execute_script("return document.getElementById('summary').textContent")
            if "6 GPUs" in text:
                break
            time.sleep(0.05)
        assert text.startswith("3 hosts (1 down) · 6 GPUs · 1 free · 3 busy · 0 reserved"
                               " · 1 shared · 1 down · MIG 2 free of 4"), text
    finally:
        b.quit()


async def test_mcp_fleet_status_carries_the_summary(sum_fleet: Fleet, cfg: Path) -> None:
    pytest.importorskip("mcp")
    from tests.test_mcp import call, session  # (the real `gputop mcp`, over stdio)

    async with session(sum_fleet, cfg) as s:
        status = await call(s, "fleet_status")
    assert status["fleet"] == WANT, status["fleet"]
    assert "; 6 GPU(s): 1 free, 3 busy, 0 reserved, 1 shared, 1 down; MIG instances: 2 free " \
           "of 4;" in status["summary"], status["summary"]
