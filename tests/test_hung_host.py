"""A hung host costs nobody its wait: waiters answer by the first-answer deadline, the hub
counts it down (not "starting" again with every restart) as ``--once`` does, and ``free``
says its list leaves it out.

A real sshd fleet: hh-one with two GPUs, hh-two with one, and hh-hung whose nvidia-smi never
returns (``gpus = 1`` in its config: GPUs gputop knows it has)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.fleet import Fleet, Host
from tests.support.hubs import Hub, get
from tests.support.shared_fleet import need_sshd, world_readable

ADDR = "127.0.219.1"


@pytest.fixture(scope="module")
def hfleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    need_sshd()
    f = Fleet(world_readable(tmp_path_factory.mktemp("hhfleet")), [
        Host("hh-one", "127.0.219.2", gpus=("rtx2080", "rtx2080")),
        Host("hh-two", "127.0.219.3", gpus=("rtx2080",)),
        Host("hh-hung", "127.0.219.4", scenario="hang"),
    ]).start()
    yield f
    f.stop()


def config(fleet: Fleet, tmp: Path, *, timeout: float = 20.0, first_sample: float | None = None,
           extra: str = 'first_answer = "1s"') -> Path:
    """Its own reservations file in ``tmp``; the hung host has ``gpus = 1``."""
    text = fleet.write_config(timeout=timeout, extra=extra, wait_all=False,
                              first_sample_timeout=first_sample).read_text()
    cfg = tmp / "hosts.toml"
    cfg.write_text(text.replace(str(fleet.root / "reservations.json"),
                                str(tmp / "reservations.json"))
                   .replace('name = "hh-hung"\n', 'name = "hh-hung"\ngpus = 1\n'))
    return cfg


def gputop(fleet: Fleet, *args: str) -> tuple[float, subprocess.CompletedProcess[str]]:
    started = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "gputop", *args], capture_output=True,
                          text=True, env=fleet.env() | {"COLUMNS": "200"}, timeout=60,
                          stdin=subprocess.DEVNULL)
    return time.monotonic() - started, proc


def first_line(fleet: Fleet, *args: str) -> tuple[float, str, float, str, int]:
    """(when stderr's first line came, that line, when it ended, the rest, exit code)."""
    started = time.monotonic()
    proc = subprocess.Popen([sys.executable, "-m", "gputop", *args], stderr=subprocess.PIPE,
                            stdout=subprocess.DEVNULL, stdin=subprocess.DEVNULL, text=True,
                            env=fleet.env())
    assert proc.stderr is not None
    line = proc.stderr.readline()
    at = time.monotonic() - started
    rest = proc.stderr.read()
    rc = proc.wait(60)
    return at, line, time.monotonic() - started, rest, rc


@pytest.mark.parametrize("cmd", [("free", "--count", "4", "--wait"),
                                 ("run", "--count", "2", "--wait")])
def test_a_waiters_first_line_comes_by_the_first_answer_deadline(
        hfleet: Fleet, tmp_path: Path, cmd: tuple[str, ...]) -> None:
    """The timeout is 20 s and the deadline 1 s: the first line names the hung host well
    before its timeout, and --max-wait counts from the start."""
    cfg = str(config(hfleet, tmp_path))
    argv = [*cmd, "--max-wait", "3s", "--config", cfg]
    if cmd[0] == "run":  # (hh-one:0 held: no host has two free GPUs)
        argv += ["--", "true"]
        assert gputop(hfleet, "reserve", "hh-one:0", "--for", "5m", "--config", cfg
                      )[1].returncode == 0
    at, line, took, rest, rc = first_line(hfleet, *argv)
    assert at < 8, (at, line, rest)
    assert "position 1 in the queue" in line and "1 host(s) not answering: hh-hung" in line
    assert line.startswith(f"gputop: waiting for {cmd[2]} whole GPUs"), line
    assert rc == 1 and "waited 3s" in rest and took < 10, (took, rest)


def _hosts_metric(hub: Hub) -> dict[str, str]:
    body = get(hub.url + "metrics")[2].decode()
    return dict(re.findall(r'^gputop_fleet_hosts{state="(\w+)"} (\S+)$', body, re.M))


def test_a_hung_host_stays_down_at_the_hub_and_agrees_with_once(hfleet: Fleet,
                                                                tmp_path: Path) -> None:
    """Its first sample times out after 4 s; each restart after that is still down (it has
    never answered), not "starting" with a timer from zero: /metrics, the hub's document
    and --once --hub count what plain --once counts."""
    cfg = config(hfleet, tmp_path, timeout=2.0, first_sample=4.0)
    hub = Hub(cfg, hfleet.env(), ADDR).start(wait_ready=30)
    try:
        deadline = time.monotonic() + 20
        while _hosts_metric(hub).get("down") != "1.0":
            assert time.monotonic() < deadline, _hosts_metric(hub)
            time.sleep(0.2)
        seen: set[str] = set()
        until = time.monotonic() + 7  # past several restarts of its stream
        while time.monotonic() < until:
            assert _hosts_metric(hub) == {"up": "2.0", "down": "1.0", "waiting": "0.0"}
            hung = next(h for h in hub.json("api/v1/snapshot")["hosts"]
                        if h["name"] == "hh-hung")
            assert hung["error"]["kind"] == "timeout", hung["error"]
            seen.add(hung["error"]["message"])
            time.sleep(0.25)
        assert any(m.startswith("never answered: trying since ") for m in seen), seen
        _, via_hub = gputop(hfleet, "--once", "--hub", hub.url, "--config", str(cfg))
    finally:
        hub.stop()
    _, direct = gputop(hfleet, "--once", "--config", str(cfg))
    for proc in (via_hub, direct):
        assert proc.returncode == 0, proc.stderr
        assert "\n2 up · 1 down | 3 free" in proc.stdout, proc.stdout


def test_free_says_its_list_leaves_out_the_hosts_not_answering(hfleet: Fleet,
                                                               tmp_path: Path) -> None:
    """Enough found, exit 0, but the list is incomplete: one stderr line names the hung
    host (-v: its error too), and --json lists it in hosts_not_answering."""
    cfg = str(config(hfleet, tmp_path))
    _, proc = gputop(hfleet, "free", "--config", cfg)
    assert proc.returncode == 0, proc.stderr
    assert set(proc.stdout.split()) == {"hh-one:0", "hh-one:1", "hh-two:0"}, proc.stdout
    assert proc.stderr == "gputop: 1 host not answering: hh-hung (-v says why)\n"
    _, proc = gputop(hfleet, "free", "--count", "2", "-v", "--config", cfg)
    assert proc.returncode == 0 and len(proc.stdout.split()) == 2, proc.stderr
    assert proc.stderr == ("gputop: 1 host not answering: hh-hung\n"
                           "gputop: hh-hung: slow: no answer in 1.0 s\n"), proc.stderr
    _, proc = gputop(hfleet, "free", "--json", "--config", cfg)
    doc = json.loads(proc.stdout)
    assert len(doc["free"]) == 3 and doc["hosts_not_answering"] == [
        {"host": "hh-hung", "kind": "slow", "message": "no answer in 1.0 s"}], doc


def test_run_mine_runs_on_the_gpus_you_hold_and_keeps_them(hfleet: Fleet,
                                                           tmp_path: Path) -> None:
    """You hold hh-one:0,1 (as after `free --count 2 --wait`): a plain run of 2 is refused
    and points at --mine; `run --mine` runs on them, with CUDA_VISIBLE_DEVICES set to
    their uuids, and they are still yours (not tied to the job) after it."""
    cfg = str(config(hfleet, tmp_path))
    _, proc = gputop(hfleet, "reserve", "hh-one:0,1", "--for", "30m", "--config", cfg)
    assert proc.returncode == 0, proc.stderr
    before = json.loads(gputop(hfleet, "reservations", "--json", "--config", cfg)[1].stdout)
    _, proc = gputop(hfleet, "run", "--count", "2", "--config", cfg, "--", "true")
    assert proc.returncode == 1, proc.stderr
    assert ("you hold idle GPUs (hh-one:0, hh-one:1): gputop run --mine [--count N] -- CMD "
            "runs on them") in proc.stderr, proc.stderr
    _, proc = gputop(hfleet, "run", "--mine", "--config", cfg, "--",
                     "sh", "-c", "echo devices=$CUDA_VISIBLE_DEVICES")
    assert proc.returncode == 0, proc.stderr
    uuids = [r["uuid"] for r in before["reservations"]]
    assert f"devices={','.join(uuids)}" in proc.stdout, (proc.stdout, uuids)
    assert "running on your hh-one:0, hh-one:1" in proc.stderr, proc.stderr
    assert "released" not in proc.stderr, proc.stderr
    after = json.loads(gputop(hfleet, "reservations", "--json", "--config", cfg)[1].stdout)
    assert after["reservations"] == before["reservations"], after
    _, proc = gputop(hfleet, "run", "--mine", "--count", "1", "--config", cfg, "--", "true")
    assert proc.returncode == 0 and "running on your hh-one:0 " in proc.stderr, proc.stderr
    _, proc = gputop(hfleet, "run", "--mine", "--count", "3", "--config", cfg, "--", "true")
    assert proc.returncode == 1 and "you hold 3 idle GPU(s) on no one host" in proc.stderr
