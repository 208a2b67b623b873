"""One-shot commands answer by the first-answer deadline, whatever one hung host does.

A real sshd fleet: two healthy hosts and one whose nvidia-smi never returns. The timeout
is 20 s and the deadline 1 s, so "answered within 10 s" tells the deadline from the
timeout without timing anything finely.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from gputop.config.load import load_config
from gputop.config.values import ConfigError
from tests.support.fleet import Fleet, Host
from tests.support.shared_fleet import need_sshd, world_readable

TIMEOUT = 20.0


@pytest.fixture(scope="module")
def hung_fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    need_sshd()
    f = Fleet(world_readable(tmp_path_factory.mktemp("hungfleet")), [
        Host("fa-one", "127.0.71.2", gpus=("rtx2080",)),
        Host("fa-two", "127.0.71.3", gpus=("rtx2080",)),
        Host("fa-hung", "127.0.71.4", scenario="hang"),
    ]).start()
    yield f
    f.stop()


def config(fleet: Fleet, extra: str = 'first_answer = "1s"') -> Path:
    return fleet.write_config(timeout=TIMEOUT, extra=extra, wait_all=False)


def gputop(fleet: Fleet, *args: str) -> tuple[float, subprocess.CompletedProcess[str]]:
    started = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "gputop", *args], capture_output=True,
                          text=True, env=fleet.env() | {"COLUMNS": "200"}, timeout=60,
                          stdin=subprocess.DEVNULL)
    return time.monotonic() - started, proc


def test_json_answers_without_the_hung_host_which_is_slow(hung_fleet: Fleet) -> None:
    took, proc = gputop(hung_fleet, "--config", str(config(hung_fleet)), "--json")
    assert proc.returncode == 0, proc.stderr
    assert took < 10, took
    hosts = {h["name"]: h for h in json.loads(proc.stdout)["hosts"]}
    assert hosts["fa-one"]["status"] == hosts["fa-two"]["status"] == "ok"
    assert hosts["fa-hung"]["error"] == {"kind": "slow", "message": "no answer in 1.0 s"}
    assert hosts["fa-hung"]["gpus"] == []
    # Its query was cancelled and killed on the host: nothing left running there.
    assert hung_fleet.remote_processes(hung_fleet.hosts["fa-hung"]) == []
    assert "Traceback" not in proc.stderr and "Task" not in proc.stderr, proc.stderr


def test_once_shows_the_hung_host_as_slow(hung_fleet: Fleet) -> None:
    took, proc = gputop(hung_fleet, "--config", str(config(hung_fleet)), "--once")
    assert proc.returncode == 0, proc.stderr
    assert took < 10, took
    assert "slow: no answer in 1.0 s" in proc.stdout
    assert proc.stdout.count("RTX 2080") == 2, proc.stdout
    assert "Traceback" not in proc.stderr and "Task" not in proc.stderr, proc.stderr


def test_free_offers_the_answering_hosts_and_names_the_slow_one(hung_fleet: Fleet) -> None:
    cfg = str(config(hung_fleet))
    took, proc = gputop(hung_fleet, "free", "--config", cfg, "--json", "--count", "2")
    assert proc.returncode == 0, proc.stderr
    assert took < 10, took
    assert {g["host"] for g in json.loads(proc.stdout)["free"]} == {"fa-one", "fa-two"}
    # Asked for more than the answering hosts have: the slow one is named, not offered.
    took, proc = gputop(hung_fleet, "free", "--config", cfg, "--count", "3")
    assert proc.returncode == 1 and took < 10, (took, proc.stderr)
    assert "fa-hung (slow)" in proc.stderr, proc.stderr


def test_wait_all_waits_for_the_hung_host(hung_fleet: Fleet) -> None:
    """--wait-all (or [defaults] wait_all) keeps waiting up to the timeout."""
    short = hung_fleet.write_config(timeout=3.0, extra='first_answer = "1s"', wait_all=False)
    took, proc = gputop(hung_fleet, "--config", str(short), "--json", "--wait-all")
    assert proc.returncode == 0, proc.stderr
    hosts = {h["name"]: h for h in json.loads(proc.stdout)["hosts"]}
    assert hosts["fa-hung"]["error"]["kind"] == "timeout" and took >= 3.0
    short.write_text(short.read_text().replace('first_answer = "1s"', "wait_all = true"))
    took, proc = gputop(hung_fleet, "free", "--config", str(short), "--count", "3")
    assert "fa-hung (timeout)" in proc.stderr and took >= 3.0, proc.stderr


def test_first_answer_is_checked_against_the_timeout(tmp_path: Path) -> None:
    cfg = tmp_path / "hosts.toml"
    cfg.write_text('[defaults]\ntimeout = 5\nfirst_answer = "10s"\n[[hosts]]\nname = "a"\n')
    with pytest.raises(ConfigError) as err:
        load_config(str(cfg))
    assert str(cfg) in str(err.value) and "defaults.first_answer" in str(err.value)
    cfg.write_text('[defaults]\nfirst_answer = 1.5\nwait_all = true\n[[hosts]]\nname = "a"\n')
    loaded = load_config(str(cfg))
    assert loaded.defaults.first_answer == 1.5 and loaded.defaults.wait_all


async def test_mcp_find_gpus_answers_without_the_hung_host(hung_fleet: Fleet) -> None:
    """The MCP server's find_gpus: the same deadline; the server stays up and answers
    again while the hung host's query goes on in the background."""
    pytest.importorskip("mcp")
    from mcp import ClientSession, StdioServerParameters
    from mcp.client.stdio import stdio_client

    params = StdioServerParameters(command=sys.executable, env=hung_fleet.env(), args=[
        "-m", "gputop", "mcp", "--config", str(config(hung_fleet))])
    async with stdio_client(params) as (read, write), ClientSession(read, write) as s:
        await s.initialize()
        for _ in range(2):
            started = time.monotonic()
            r = await s.call_tool("find_gpus", {"count": 2})
            took = time.monotonic() - started
            doc = json.loads(r.content[0].text)  # type: ignore[union-attr]
            assert took < 10 and doc["enough"], (took, doc)
            assert {g["gpu"] for g in doc["found"]} == {"fa-one:0", "fa-two:0"}
            assert doc["hosts_not_answering"] == [
                {"host": "fa-hung", "kind": "slow", "message": "no answer in 1.0 s"}]


def test_reserve_and_run_do_not_wait_for_the_hung_host(hung_fleet: Fleet, tmp_path: Path
                                                       ) -> None:
    """reserve's check of the GPUs and run's placement take the same deadline: reserve
    says it could not check the slow host's GPU; run places its job on an answering one."""
    cfg = tmp_path / "hosts.toml"
    # (a host that does not answer takes only GPUs gputop knows it has: gpus = 1)
    cfg.write_text(config(hung_fleet).read_text().replace(
        str(hung_fleet.root / "reservations.json"), str(tmp_path / "reservations.json"))
        .replace('name = "fa-hung"\n', 'name = "fa-hung"\ngpus = 1\n'))
    took, proc = gputop(hung_fleet, "reserve", "fa-one:0", "fa-hung:0", "--for", "5m",
                        "--config", str(cfg))
    assert proc.returncode == 0 and took < 10, (took, proc.stderr)
    assert "could not check fa-hung:0 (slow: no answer in 1.0 s" in proc.stderr, proc.stderr
    took, proc = gputop(hung_fleet, "release", "fa-one:0", "fa-hung:0", "--config", str(cfg))
    assert proc.returncode == 0, proc.stderr
    took, proc = gputop(hung_fleet, "run", "--config", str(cfg), "--", "true")
    assert proc.returncode == 0 and took < 10, (took, proc.stderr)
    assert "running on fa-one:0" in proc.stderr or "running on fa-two:0" in proc.stderr
