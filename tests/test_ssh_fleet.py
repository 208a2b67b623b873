"""End to end against real OpenSSH: every fault fails alone, healthy hosts are complete."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time
from pathlib import Path

import jsonschema
import pytest

from gputop.config.load import load_config
from gputop.poller import Poller
from tests.support.fleet import Fleet, GpuProcess, Host
from tests.support.shared_fleet import FAULTS

TIMEOUT = 3.0


def run_json(fleet: Fleet, *args: str, timeout: float = TIMEOUT) -> tuple[dict, float, str]:
    cfg = fleet.write_config(timeout=timeout)
    started = time.monotonic()
    r = subprocess.run(
        [sys.executable, "-m", "gputop", "--json", "--config", str(cfg), *args],
        env=fleet.env(), capture_output=True, text=True, timeout=60,
    )
    elapsed = time.monotonic() - started
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout), elapsed, r.stderr


@pytest.fixture(scope="module")
def document(fleet: Fleet) -> dict:
    doc, elapsed, _ = run_json(fleet)
    doc["_elapsed"] = elapsed
    return doc


def hosts(doc: dict) -> dict[str, dict]:
    return {h["name"]: h for h in doc["hosts"]}


def test_document_validates_against_schema(document: dict, schema: dict) -> None:
    doc = {k: v for k, v in document.items() if not k.startswith("_")}
    jsonschema.validate(doc, schema)
    assert [h["name"] for h in doc["hosts"]][:3] == ["gpu-h100", "gpu-mixed", "gpu-lost"]


def test_returns_within_timeout_plus_two_seconds(document: dict, fleet: Fleet) -> None:
    """Not a speed benchmark: the contract that a hung host cannot hold the snapshot (two
    hang here: held one after the other they would take two timeouts). Measured against
    the same command on the healthy hosts alone, so the start-up of Python on a loaded
    machine is not counted as the hung hosts'."""
    cfg = fleet.write_config(["gpu-h100"], timeout=TIMEOUT)
    started = time.monotonic()
    subprocess.run([sys.executable, "-m", "gputop", "--json", "--config", str(cfg)],
                   env=fleet.env(), capture_output=True, timeout=60, check=True)
    control = time.monotonic() - started
    assert document["_elapsed"] - control < TIMEOUT + 2


@pytest.mark.parametrize(("name", "kind"), sorted(FAULTS.items()))
def test_every_fault_is_its_own_classified_error(document: dict, name: str, kind: str) -> None:
    h = hosts(document)[name]
    assert h["status"] == "error"
    assert h["error"]["kind"] == kind, h["error"]
    assert h["gpus"] == []
    assert h["error"]["message"]


def test_healthy_host_has_gpus_and_real_process_owners(document: dict, fleet: Fleet) -> None:
    h = hosts(document)["gpu-h100"]
    assert h["status"] == "ok" and h["error"] is None
    g0, g1 = h["gpus"]
    assert (g0["index"], g1["index"]) == (0, 1)
    assert g0["name"] == "NVIDIA H100 80GB HBM3"
    assert g0["memory_total_mib"] == 81559 and g0["memory_used_mib"] == 19818
    assert g0["utilization_percent"] == 100 and g0["power_draw_w"] == 631.95
    assert g0["fan_percent"] is None  # [N/A] in the capture: null, never 0
    procs = fleet.hosts["gpu-h100"].processes
    (p0,) = g0["processes"]
    assert p0["pid"] == procs[0].pid
    assert p0["gpu_memory_mib"] == 19000
    assert p0["command"].startswith("python train.py --epochs 90")
    assert p0["elapsed_s"] is not None and p0["elapsed_s"] >= 0
    (p1,) = g1["processes"]
    assert p1["pid"] == procs[1].pid
    if fleet.users:  # real test users exist (CI runs as root)
        assert p0["user"] == "gtalice" and p1["user"] == "gtbob"


def test_hostile_process_name_stays_data(document: dict) -> None:
    (p,) = hosts(document)["gpu-h100"]["gpus"][1]["processes"]
    assert "[bold red]x[/]" in p["command"]
    assert "\x1b" not in p["command"]  # ps itself shows control bytes as '?' or '.'


def test_raw_json_has_no_control_bytes(fleet: Fleet) -> None:
    cfg = fleet.write_config(["gpu-h100"], timeout=TIMEOUT)
    out = subprocess.run([sys.executable, "-m", "gputop", "--json", "--config", str(cfg)],
                         env=fleet.env(), capture_output=True, timeout=60).stdout
    assert out and all(b >= 0x20 or b == 0x0A for b in out)


def test_mixed_models_and_mig(document: dict) -> None:
    gpus = hosts(document)["gpu-mixed"]["gpus"]
    assert [g["name"] for g in gpus] == [
        "NVIDIA H100 80GB HBM3", "NVIDIA L40S",
        "NVIDIA GeForce RTX 2080 SUPER", "NVIDIA GeForce RTX 2080 SUPER",
    ]
    assert gpus[0]["mig_mode"] == "Enabled"
    assert gpus[0]["utilization_percent"] is None  # [N/A] under MIG
    assert gpus[1]["mig_mode"] is None
    assert gpus[2]["pstate"] == "P8" and gpus[2]["fan_percent"] == 38
    assert [g["driver_version"] for g in gpus] == ["590.48.01", "595.80", "610.57.04", "591.86"]


def test_lost_gpu_marks_only_that_gpu(document: dict) -> None:
    h = hosts(document)["gpu-lost"]
    assert h["status"] == "ok"
    good, lost = h["gpus"]
    assert good["name"] == "NVIDIA L40S" and not good["lost"]
    assert lost["lost"] and lost["bus_id"] == "0000:07:00.0"
    assert lost["lost_reason"] == "Unknown Error"


def test_parse_error_carries_sanitised_excerpt(document: dict) -> None:
    msg = hosts(document)["parse"]["error"]["message"]
    assert "NVIDIA-SMI" in msg or "Jan" in msg
    assert len(msg) < 300 and "\n" not in msg


def test_no_remote_query_left_running(document: dict, fleet: Fleet) -> None:
    # The module fixture already ran the snapshot with the hanging host in it.
    assert fleet.remote_processes(fleet.hosts["hang"]) == []


async def test_connections_are_reused_across_refreshes(fleet_home: Fleet) -> None:
    cfg = fleet_home.write_config(["gpu-h100", "gpu-mixed", "driver"], timeout=TIMEOUT)
    poller = Poller(load_config(str(cfg)))
    try:
        channels = []
        for _ in range(3):
            snap = await poller.snapshot()
            assert [h.ok for h in snap.hosts] == [True, True, False]
            channels.append([s.channels for s in poller.sources])  # type: ignore[attr-defined]
        assert poller.connects == 3  # one per host, none per refresh
        # ...and the healthy hosts' channel (one session: both nvidia-smi loops and ps) is
        # kept: a refresh opens no new session remotely. The failing host's session ends
        # with the failure: it is started again per refresh.
        assert [c[:2] for c in channels] == [[1, 1]] * 3
    finally:
        await poller.aclose()


async def test_updates_arrive_per_host_without_waiting_for_the_slowest(
    fleet_home: Fleet,
) -> None:
    cfg = fleet_home.write_config(["hang", "gpu-h100", "gpu-lost"], timeout=TIMEOUT)
    poller = Poller(load_config(str(cfg)))
    seen: list[str] = []
    try:
        async for snap in poller.updates():
            seen.append(snap.name)
            if snap.name == "hang":
                assert snap.error is not None and snap.error.kind == "timeout"
                break
    finally:
        await poller.aclose()
    # The healthy hosts answered (and were re-polled every interval) while "hang" hung.
    assert seen[-1] == "hang" and set(seen[:-1]) == {"gpu-h100", "gpu-lost"}
    # (gpu-lost's nvidia-smi loop ends after each sample, exit 15: it is restarted, so it
    # may answer less often than every interval.)
    assert seen.count("gpu-h100") >= 2 and seen.count("gpu-lost") >= 1


async def test_host_that_recovers_is_picked_up_again(
    small_fleet: Fleet, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HOME", str(small_fleet.home))
    cfg = small_fleet.write_config(timeout=TIMEOUT)
    poller = Poller(load_config(str(cfg)))
    alpha = small_fleet.hosts["alpha"]
    try:
        assert all(h.ok for h in (await poller.snapshot()).hosts)
        small_fleet.stop_sshd(alpha)  # also drops the kept connection
        # A sample streamed before the host went down is still data: let the client see
        # the connection close (as it does within a moment) before asking again.
        await asyncio.sleep(0.5)
        snap = await poller.snapshot()
        assert snap.hosts[0].error is not None and snap.hosts[1].ok
        small_fleet.restart_sshd(alpha)
        for src in poller.sources:  # skip the backoff wait instead of sleeping through it
            src.reset()  # type: ignore[attr-defined]
        snap = await poller.snapshot()
        assert snap.hosts[0].ok, snap.hosts[0].error
        assert snap.hosts[0].last_ok == snap.hosts[0].time
    finally:
        await poller.aclose()


async def test_stand_in_scenario_change_is_seen_on_the_same_connection(
    small_fleet: Fleet, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HOME", str(small_fleet.home))
    poller = Poller(load_config(str(small_fleet.write_config(timeout=TIMEOUT))))
    beta = small_fleet.hosts["beta"]
    try:
        assert (await poller.snapshot()).hosts[1].ok
        small_fleet.set_scenario(beta, "driver")
        # The stream's next sample shows the change (a sample already on its way may come
        # first).
        kinds = [(await poller.snapshot()).hosts[1].error for _ in range(3)]
        assert "driver" in [e.kind for e in kinds if e is not None], kinds
        small_fleet.set_scenario(beta, "ok")
        snaps = [(await poller.snapshot()).hosts[1] for _ in range(2)]
        assert snaps[-1].ok, snaps
        assert poller.connects == 2
    finally:
        await poller.aclose()


async def test_auth_failure_is_not_retried_in_a_tight_loop(fleet_home: Fleet) -> None:
    poller = Poller(load_config(str(fleet_home.write_config(["auth"], timeout=TIMEOUT))))
    try:
        first = (await poller.snapshot()).hosts[0]
        again = (await poller.snapshot()).hosts[0]
        await asyncio.sleep(1.1)
        third = (await poller.snapshot()).hosts[0]
    finally:
        await poller.aclose()
    assert first.error is not None and first.error.kind == "auth"
    assert third.error == again.error  # no countdown: unchanged until the next try
    assert again.error is not None and again.error.kind == "auth"
    assert "waiting to retry" in again.error.message  # answered from backoff, no new attempt
    assert poller.sources[0].connects == 0


async def test_known_hosts_none_in_ssh_config_does_not_disable_checking(
    fleet_home: Fleet, tmp_path: Path
) -> None:
    """``UserKnownHostsFile none`` would make asyncssh accept any key; gputop refuses."""
    ssh_config = tmp_path / "ssh_config"
    ssh_config.write_text(
        (fleet_home.ssh / "config").read_text() + "\nHost *\n  UserKnownHostsFile none\n"
        "  StrictHostKeyChecking no\n"
    )
    cfg = fleet_home.write_config(["hostkey-unknown"], timeout=TIMEOUT,
                                  extra=f'ssh_config = "{ssh_config}"')
    poller = Poller(load_config(str(cfg)))
    try:
        (h,) = (await poller.snapshot()).hosts
    finally:
        await poller.aclose()
    assert h.error is not None and h.error.kind == "host-key"


def test_watch_prints_one_document_per_refresh(fleet: Fleet) -> None:
    cfg = fleet.write_config(["gpu-h100", "driver"], timeout=TIMEOUT, interval=0.2)
    proc = subprocess.Popen(
        [sys.executable, "-m", "gputop", "--json", "--watch", "--config", str(cfg)],
        env=fleet.env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    assert proc.stdout is not None
    docs = [json.loads(proc.stdout.readline()) for _ in range(3)]
    proc.send_signal(2)  # Ctrl-C
    _, err = proc.communicate(timeout=20)
    assert proc.returncode in (0, 130)
    assert "Traceback" not in err
    assert [len(d["hosts"]) for d in docs] == [2, 2, 2]
    assert docs[0]["time"] <= docs[2]["time"]


def test_unknown_dns_name_is_unreachable(tmp_path: Path) -> None:
    cfg = tmp_path / "hosts.toml"
    cfg.write_text('[defaults]\ntimeout = 3\n[[hosts]]\nname = "x"\n'
                   'address = "no-such-host.invalid"\n')
    r = subprocess.run([sys.executable, "-m", "gputop", "--json", "--config", str(cfg)],
                       capture_output=True, text=True, timeout=30,
                       env={"HOME": str(tmp_path), "PATH": "/usr/bin:/bin"})
    (h,) = json.loads(r.stdout)["hosts"]
    assert h["error"]["kind"] == "unreachable", h


@pytest.mark.parametrize("n_behind", [40])
def test_forty_hosts_behind_one_bastion(tmp_path: Path, n_behind: int) -> None:
    """40 hosts through one ProxyJump bastion running sshd's default MaxStartups (10:30:100).

    Without a shared jump connection 40 simultaneous handshakes to the bastion would be
    dropped in part; gputop opens one connection to the bastion and tunnels all 40 through it.
    """
    from tests.support.shared_fleet import need_sshd, world_readable

    need_sshd()
    hosts = [Host("bastion", "127.0.2.1")] + [
        Host(f"node{i:02d}", f"127.0.3.{i + 1}", behind="bastion",
             processes=[GpuProcess("gtalice", f"python job{i}.py")] if i % 10 == 0 else [])
        for i in range(n_behind)
    ]
    fleet = Fleet(world_readable(tmp_path), hosts).start()
    try:
        names = [h.name for h in hosts[1:]]
        cfg = fleet.write_config(names, timeout=10.0)
        started = time.monotonic()
        r = subprocess.run([sys.executable, "-m", "gputop", "--json", "--config", str(cfg)],
                           env=fleet.env(), capture_output=True, text=True, timeout=120)
        elapsed = time.monotonic() - started
        doc = json.loads(r.stdout)
        bad = {h["name"]: h["error"] for h in doc["hosts"] if h["status"] != "ok"}
        assert bad == {}
        assert len(doc["hosts"]) == n_behind
        owners = [p["user"] for h in doc["hosts"] for g in h["gpus"] for p in g["processes"]]
        assert len(owners) == n_behind // 10
        assert elapsed < 10.0 + 2
        log = (tmp_path / "bastion" / "sshd.log").read_text()
        assert log.count("Accepted publickey") == 1, log  # ONE connection to the bastion
        assert "MaxStartups" not in log
    finally:
        fleet.stop()


def test_ssh_agent_is_used(fleet: Fleet, tmp_path: Path) -> None:
    """No IdentityFile in the config: the key comes from a real ssh-agent."""
    import shutil

    if not shutil.which("ssh-agent"):
        pytest.skip("ssh-agent not installed")
    sock = tmp_path / "agent.sock"
    agent = subprocess.Popen(["ssh-agent", "-D", "-a", str(sock)], stdout=subprocess.PIPE,
                             text=True)
    try:
        empty_home = tmp_path / "home"  # no ~/.ssh/id_*: the agent is the only key source
        empty_home.mkdir()
        env = fleet.env() | {"SSH_AUTH_SOCK": str(sock), "HOME": str(empty_home)}
        assert agent.stdout is not None
        assert "SSH_AUTH_SOCK" in agent.stdout.readline()  # printed once it listens
        subprocess.run(["ssh-add", str(fleet.ssh / "id_ed25519")], env=env, check=True,
                       capture_output=True)
        h = fleet.hosts["gpu-h100"]
        ssh_config = tmp_path / "ssh_config"
        import getpass

        ssh_config.write_text(f"Host via-agent\n  HostName {h.address}\n  Port {h.port}\n"
                              f"  User {getpass.getuser()}\n"
                              f"  UserKnownHostsFile {fleet.ssh / 'known_hosts'}\n")
        cfg = tmp_path / "hosts.toml"
        cfg.write_text(f'[defaults]\ntimeout = 5\nssh_config = "{ssh_config}"\n'
                       '[[hosts]]\nname = "via-agent"\n')
        r = subprocess.run([sys.executable, "-m", "gputop", "--json", "--config", str(cfg)],
                           env=env, capture_output=True, text=True, timeout=60)
        (host,) = json.loads(r.stdout)["hosts"]
        assert host["status"] == "ok", host["error"]
        r = subprocess.run([sys.executable, "-m", "gputop", "--json", "--config", str(cfg)],
                           env=env | {"SSH_AUTH_SOCK": str(tmp_path / "none")},
                           capture_output=True, text=True, timeout=60)
        assert json.loads(r.stdout)["hosts"][0]["error"]["kind"] == "auth"
    finally:
        agent.terminate()
        agent.wait(5)


async def test_a_source_that_raises_becomes_that_hosts_error() -> None:
    from gputop.config.load import Config
    from gputop.config.tables import HostConfig
    from gputop.model import GpuInfo, HostError

    class Broken:
        name, connects, kind = "broken", 0, "ssh"
        warnings, first_sample_s, paced = (), None, False

        def reset(self) -> None:
            return None

        async def query(self) -> tuple[list[GpuInfo], HostError | None]:
            raise RuntimeError("boom")

        async def close(self) -> None:
            return None

    cfg = Config(path=None, hosts=(HostConfig("broken"),))
    poller = Poller(cfg, [Broken()])
    (h,) = (await poller.snapshot()).hosts
    assert h.error is not None and h.error.kind == "error" and "boom" in h.error.message


async def test_a_host_key_accepted_meanwhile_is_seen_at_the_next_connect(
    small_fleet: Fleet, monkeypatch: pytest.MonkeyPatch
) -> None:
    """known_hosts is cached across connections, but a change to it is read again."""
    monkeypatch.setenv("HOME", str(small_fleet.home))
    known = small_fleet.ssh / "known_hosts"
    full = known.read_text()
    beta = small_fleet.hosts["beta"]
    known.write_text("".join(ln + "\n" for ln in full.splitlines() if beta.address not in ln))
    poller = Poller(load_config(str(small_fleet.write_config(timeout=TIMEOUT))))
    try:
        snap = await poller.snapshot()
        assert snap.hosts[0].ok
        assert snap.hosts[1].error is not None and snap.hosts[1].error.kind == "host-key"
        known.write_text(full)  # the user ran `ssh beta` and accepted the key
        for src in poller.sources:
            src.reset()  # type: ignore[attr-defined]
        snap = await poller.snapshot()
        assert snap.hosts[1].ok, snap.hosts[1].error
    finally:
        await poller.aclose()
