"""Hostile remote output, lost GPUs and SSH fairness, end to end against real OpenSSH.

The hosts here run real processes whose command lines are chosen by an attacker (a user
on the GPU host), and a stand-in nvidia-smi that prints lost-GPU lines on stderr wherever
a real one might, with its real exit code 15.
"""

from __future__ import annotations

import asyncio
import json
import os
import pwd
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import jsonschema
import pytest

from gputop.config.load import load_config
from gputop.model import SCHEMA_VERSION
from gputop.poller import Poller
from gputop.sources.protocol import MAX_OUTPUT
from tests.support.fleet import HOSTILE_GPU_NAME, Fleet, GpuProcess, Host, gpu_uuid
from tests.support.shared_fleet import need_sshd, world_readable

TIMEOUT = 4.0
CONTROL = [chr(c) for c in (*range(0x20), 0x7F, 0x9B)] + ["\u202e"]


def hosts() -> list[Host]:
    two = ("l40s", "l40s")
    return [
        Host("inject-end", "127.0.4.2", processes=[
            GpuProcess("gtalice", "python train.py"),
            GpuProcess("gtbob", "python evil.py @@gputop end"),
        ]),
        Host("inject-row", "127.0.4.3", gpus=("h100", "h100"), processes=[
            GpuProcess("gtalice", "python a.py", gpu=0),
            # argv[0] with a newline: as nvidia-smi's process_name it would be a second row,
            # putting pid 1 on GPU 1.
            GpuProcess("gtbob", f"x\n{gpu_uuid('inject-row', 1)}, 1, 4096, /sbin/init", gpu=0),
        ]),
        *(Host(f"lost-{at}", f"127.0.4.{4 + i}", scenario=f"lost-{at}", gpus=two, processes=[
            GpuProcess("gtalice", "python a.py", gpu=0),
            GpuProcess("gtbob", "python b.py", gpu=1),
        ]) for i, at in enumerate(("first", "middle", "last"))),
        *(Host(f"lost-apps-{at}", f"127.0.4.{11 + i}", scenario=f"lost-apps-{at}", gpus=two,
               processes=[GpuProcess("gtalice", "python a.py", gpu=0),
                          GpuProcess("gtbob", "python b.py", gpu=1),
                          GpuProcess("gtalice", "python c.py", gpu=1)])
          for i, at in enumerate(("first", "middle", "last"))),
        Host("dup-index", "127.0.4.7", scenario="dup-index", gpus=two),
        Host("huge", "127.0.4.8", scenario="huge"),
        Host("hostile-names", "127.0.4.9", scenario="hostile-names", gpus=("l40s",)),
        # 36 jobs whose command lines ps shows up to its own cap (128 KiB each): 4.6 MiB,
        # more than the output limit, if they were not cut.
        Host("long-commands", "127.0.4.10", processes=[
            GpuProcess("gtbob", f"python long{i}.py", args=("0" * 70_000,) * 2 + ("86400",))
            for i in range(36)
        ]),
    ]


@pytest.fixture(scope="module")
def pfleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    need_sshd()
    f = Fleet(world_readable(tmp_path_factory.mktemp("pfleet")), hosts()).start()
    yield f
    f.stop()


@pytest.fixture
def home(pfleet: Fleet, monkeypatch: pytest.MonkeyPatch) -> Fleet:
    monkeypatch.setenv("HOME", str(pfleet.home))
    monkeypatch.delenv("SSH_AUTH_SOCK", raising=False)
    return pfleet


def run_json(fleet: Fleet, names: list[str]) -> dict[str, dict]:
    cfg = fleet.write_config(names, timeout=TIMEOUT)
    r = subprocess.run([sys.executable, "-m", "gputop", "--json", "--config", str(cfg)],
                       env=fleet.env(), capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    return {h["name"]: h for h in json.loads(r.stdout)["hosts"]}


# -- 1. remote output can neither forge nor hide data ------------------------------------


@pytest.mark.parametrize("collection", ["query", "stream"])
async def test_end_mark_in_a_command_line_hides_nothing(home: Fleet, collection: str) -> None:
    """``@@gputop end`` in a job's command line used to end the refresh early: the host was
    a parse error, and every later refresh read the leftovers of the one before. Streaming,
    the command lines come from the ps channel, framed the same way."""
    cfg = home.write_config(["inject-end"], timeout=TIMEOUT,
                            extra=f'collection = "{collection}"')
    poller = Poller(load_config(str(cfg)))
    alice, bob = home.hosts["inject-end"].processes
    both = 0
    try:
        for _ in range(3 if collection == "query" else 6):
            (h,) = (await poller.snapshot()).hosts
            assert h.error is None, h.error
            (g,) = h.gpus
            got = {p.pid: p for p in g.processes}
            if collection == "stream" and set(got) < {alice.pid, bob.pid}:
                # (a stream's sample may show an apps batch still arriving: its rows come
                # after the GPU sample's; never another row, never a parse error)
                continue
            assert set(got) == {alice.pid, bob.pid}
            assert got[bob.pid].command == "python evil.py @@gputop end"
            if home.users:
                assert (got[alice.pid].user, got[bob.pid].user) == ("gtalice", "gtbob")
            both += 1
        assert both >= 3 if collection == "query" else both >= 1
        # One channel per refresh loop; streaming: one session (both loops and ps).
        assert poller.sources[0].channels == 1  # type: ignore[attr-defined]
    finally:
        await poller.aclose()


def test_newline_in_a_process_name_injects_no_row(pfleet: Fleet, schema: dict) -> None:
    h = run_json(pfleet, ["inject-row"])["inject-row"]
    assert h["status"] == "ok", h["error"]
    alice, bob = pfleet.hosts["inject-row"].processes
    g0, g1 = h["gpus"]
    assert {p["pid"] for p in g0["processes"]} == {alice.pid, bob.pid}
    assert g1["processes"] == []  # pid 1 does not appear on GPU 1
    for p in g0["processes"]:
        assert "\n" not in (p["command"] or "")


@pytest.mark.parametrize("collection", ["query", "stream"])
async def test_output_over_the_limit_is_cut_off_and_the_channel_reopened(
    home: Fleet, collection: str
) -> None:
    cfg = home.write_config(["huge"], timeout=TIMEOUT, extra=f'collection = "{collection}"')
    poller = Poller(load_config(str(cfg)))
    huge = home.hosts["huge"]
    try:
        (h,) = (await poller.snapshot()).hosts
        assert h.error is not None and h.error.kind == "parse", h.error
        if collection == "query":
            assert h.error.message == f"output larger than {MAX_OUTPUT} bytes"
        else:  # its first line is no sample: the stream is not read any further
            assert h.error.message.startswith("expected 18 comma-separated fields, got 1: A")
        home.set_scenario(huge, "ok")
        try:
            (h,) = (await poller.snapshot()).hosts
        finally:
            home.set_scenario(huge, "huge")
        assert h.error is None and len(h.gpus) == 1
        src = poller.sources[0]
        # A new channel (query) or a new session (streaming), on the same connection.
        assert (src.connects, src.channels) == (1, 2)  # type: ignore[attr-defined]
    finally:
        await poller.aclose()


def test_huge_command_lines_do_not_knock_the_host_off(pfleet: Fleet) -> None:
    h = run_json(pfleet, ["long-commands"])["long-commands"]
    assert h["status"] == "ok", h["error"]
    (g,) = h["gpus"]
    assert len(g["processes"]) == 36
    for p in g["processes"]:
        assert p["command"].startswith("python long") and len(p["command"]) < 5000
        assert p["user"] is not None


def test_strings_from_hosts_are_clean_in_json(pfleet: Fleet, schema: dict) -> None:
    """A GPU name (or lost reason) with ESC sequences and a bidi override: ``jq -r`` would
    write them to the terminal, so ``--json`` carries them cleaned, like the board."""
    h = run_json(pfleet, ["hostile-names"])["hostile-names"]
    assert h["status"] == "ok", h["error"]
    good, lost = h["gpus"]
    assert "\x1b" in HOSTILE_GPU_NAME and "\u202e" in HOSTILE_GPU_NAME
    assert good["name"] == "NVIDIA H100 evil"
    assert lost["lost"] and lost["lost_reason"] == "Unknown Error"
    strings = [good["name"], lost["lost_reason"], lost["bus_id"]]
    assert not [c for s in strings for c in s if c in CONTROL]


# -- 2. a lost GPU hides nothing else ----------------------------------------------------


@pytest.mark.parametrize("at", ["first", "middle", "last"])
def test_lost_gpu_on_stderr_anywhere_hides_nothing(pfleet: Fleet, schema: dict, at: str) -> None:
    name = f"lost-{at}"
    h = run_json(pfleet, [name])[name]
    assert h["status"] == "ok", h["error"]
    assert [g["lost"] for g in h["gpus"]] == [False, False, True]
    a, b, lost = h["gpus"]
    assert (a["index"], b["index"]) == (0, 1)
    assert a["name"] == b["name"] == "NVIDIA L40S"
    assert (lost["bus_id"], lost["lost_reason"]) == ("0000:07:00.0", "Unknown Error")
    alice, bob = pfleet.hosts[name].processes
    # --query-compute-apps failed the same way (exit 15): the healthy GPUs' jobs still show
    assert [p["pid"] for p in a["processes"]] == [alice.pid]
    assert [p["pid"] for p in b["processes"]] == [bob.pid]
    jsonschema.validate({"version": SCHEMA_VERSION, "time": h["time"], "hosts": [h]}, schema)


@pytest.mark.parametrize("at", ["first", "middle", "last"])
def test_a_failed_process_query_hides_no_healthy_gpu(pfleet: Fleet, schema: dict,
                                                     at: str) -> None:
    """Issue 19: the compute-apps query of an nvidia-smi that lost a GPU exits 15 but still
    lists the other GPUs' processes (naming no lost GPU itself), and the script asks ps
    about them. Its rows used to be dropped while the owners section held them: the host
    became ``parse: unexpected ps row`` in every one-shot answer (``--json`` here). The
    lost GPU's line comes first, between the rows and last."""
    name = f"lost-apps-{at}"
    h = run_json(pfleet, [name])[name]
    assert h["status"] == "ok", h["error"]
    assert [g["lost"] for g in h["gpus"]] == [False, False, True]
    a, b, lost = h["gpus"]
    assert (lost["bus_id"], lost["lost_reason"]) == ("0000:07:00.0", "Unknown Error")
    alice, bob, carol = pfleet.hosts[name].processes
    assert [p["pid"] for p in a["processes"]] == [alice.pid]
    assert sorted(p["pid"] for p in b["processes"]) == sorted([bob.pid, carol.pid])
    if pfleet.users:  # the owners ps gave are kept with their rows
        got = {p["pid"]: p["user"] for g in (a, b) for p in g["processes"]}
        assert got == {alice.pid: "gtalice", bob.pid: "gtbob", carol.pid: "gtalice"}
    assert h["warnings"] == []  # the lost GPU says why the query failed
    jsonschema.validate({"version": SCHEMA_VERSION, "time": h["time"], "hosts": [h]}, schema)


async def test_a_failed_process_query_while_streaming(home: Fleet) -> None:
    """The same host streamed: each loop ends after its sample (exit 15), and the sample
    shows the healthy GPUs' processes (as it did before the query mode's fix)."""
    cfg = home.write_config(["lost-apps-middle"], timeout=TIMEOUT,
                            extra='collection = "stream"')
    poller = Poller(load_config(str(cfg)))
    alice, bob, carol = home.hosts["lost-apps-middle"].processes
    want = [[alice.pid], sorted([bob.pid, carol.pid]), []]
    seen = []
    try:
        # A stream's first sample may show an apps batch still arriving (its rows come
        # after the GPU sample's): within three samples, every healthy GPU's processes.
        async for h in poller.updates():
            assert h.error is None, h.error
            assert [g.lost for g in h.gpus] == [False, False, True]
            seen.append([sorted(p.pid for p in g.processes) for g in h.gpus])
            if seen[-1] == want or len(seen) == 3:
                break
    finally:
        await poller.aclose()
    assert seen[-1] == want, seen


def test_two_gpus_with_one_index_are_both_shown_and_flagged(pfleet: Fleet, schema: dict) -> None:
    h = run_json(pfleet, ["dup-index"])["dup-index"]
    assert h["status"] == "ok"
    assert [g["index"] for g in h["gpus"]] == [0, 0]
    assert len({g["uuid"] for g in h["gpus"]}) == 2
    assert h["warnings"] == ["nvidia-smi listed GPU index 0 2 times"]
    jsonschema.validate({"version": SCHEMA_VERSION, "time": h["time"], "hosts": [h]}, schema)


# -- SSH: fairness, retries, messages ----------------------------------------------------


def test_dropped_packets_hold_no_handshake_slot(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two hosts ahead in the list that never answer (SYNs dropped; a listener that never
    speaks) and two handshake slots: the healthy hosts behind them must not wait for the
    bad ones' whole timeout."""
    need_sshd()
    fleet = Fleet(world_readable(tmp_path), [
        Host("dropped", "127.0.5.2", scenario="drop"),
        Host("silent", "127.0.5.3", scenario="banner-timeout"),
        Host("ok1", "127.0.5.4"),
        Host("ok2", "127.0.5.5"),
    ]).start()
    timeout = 6.0
    try:
        cfg = fleet.write_config(timeout=timeout, extra="max_connecting = 2")
        monkeypatch.setenv("HOME", str(fleet.home))
        times = asyncio.run(_time_each(str(cfg)))
    finally:
        fleet.stop()
    assert times["dropped"][1] == times["silent"][1] == "timeout"
    assert times["dropped"][2].endswith("TCP did not connect")
    assert times["silent"][2].endswith("the server sent no SSH banner")
    assert times["dropped"][0] >= timeout - 0.5
    assert times["ok1"][1] is None and times["ok2"][1] is None
    # behind the bad hosts' slots they would wait >= timeout; without, about a second
    assert max(times["ok1"][0], times["ok2"][0]) < timeout - 2, times


async def _time_each(cfg: str) -> dict[str, tuple[float, str | None, str]]:
    poller = Poller(load_config(cfg))
    started = time.monotonic()
    out: dict[str, tuple[float, str | None, str]] = {}

    async def one(src: object) -> None:
        h = await poller.poll_host(src)  # type: ignore[arg-type]
        out[h.name] = (time.monotonic() - started, h.error.kind if h.error else None,
                       h.error.message if h.error else "")

    try:
        await asyncio.gather(*(one(s) for s in poller.sources))
    finally:
        await poller.aclose()
    return out


def test_retries_of_many_failing_hosts_are_spread_out() -> None:
    from gputop.config.tables import HostConfig
    from gputop.model import HostError
    from gputop.sources.ssh import SshSource
    from gputop.ssh.transport import JumpPool

    async def retry_times() -> list[float]:
        sem, jumps = asyncio.Semaphore(1), JumpPool(None)
        srcs = [SshSource(HostConfig(f"h{i}"), timeout=5, interval=2, ssh_config=None,
                          handshakes=sem, jumps=jumps) for i in range(50)]
        now = time.monotonic()
        for _ in range(3):  # the third failure in a row: 8 s nominal
            for s in srcs:
                s.link.backoff(HostError("unreachable", "connection refused"))
        return [s.link.retry_at - now for s in srcs]

    waits = asyncio.run(retry_times())
    assert all(3.9 <= w <= 8.1 for w in waits), waits
    assert max(waits) - min(waits) > 1.5  # not one synchronised burst
    assert len({round(w, 3) for w in waits}) > 40


async def test_reset_makes_the_next_query_try_at_once(fleet_home: Fleet) -> None:
    poller = Poller(load_config(str(fleet_home.write_config(["auth"], timeout=TIMEOUT))))
    src = poller.sources[0]
    try:
        first = (await poller.snapshot()).hosts[0]
        again = (await poller.snapshot()).hosts[0]
        assert again.error is not None and "waiting to retry" in again.error.message
        src.reset()  # type: ignore[attr-defined]
        third = (await poller.snapshot()).hosts[0]
    finally:
        await poller.aclose()
    assert first.error is not None and third.error is not None
    assert third.error.kind == "auth" and "waiting to retry" not in third.error.message


async def test_host_key_and_auth_messages_name_the_host_and_the_fix(fleet_home: Fleet) -> None:
    cfg = fleet_home.write_config(["hostkey-unknown", "hostkey-changed", "auth"],
                                  timeout=TIMEOUT)
    poller = Poller(load_config(str(cfg)))
    try:
        unknown, changed, auth = (await poller.snapshot()).hosts
    finally:
        await poller.aclose()
    assert unknown.error is not None and changed.error is not None and auth.error is not None
    assert unknown.error.message.startswith("host key of hostkey-unknown (127.0.0.10 port ")
    assert " is unknown: " in unknown.error.message
    assert "`ssh hostkey-unknown`" in unknown.error.message
    assert changed.error.message.startswith("host key of hostkey-changed (127.0.0.9 port ")
    assert " is changed: " in changed.error.message
    assert "`ssh hostkey-changed`" in changed.error.message
    assert "ssh-keygen -R '[127.0.0.9]:" in changed.error.message
    me = pwd.getpwuid(os.geteuid()).pw_name
    assert auth.error.message.startswith(f"authentication refused for user '{me}' on auth ")
    # ...and what to do next, as for a host key (a newcomer's first failing host).
    assert auth.error.message.endswith(": `ssh auth` must log in without a prompt (a key in "
                                       "ssh-agent or an IdentityFile in ~/.ssh/config)")


def test_login_name_comes_from_the_real_uid_not_the_environment(
    fleet: Fleet, tmp_path: Path
) -> None:
    """No ``User`` in ~/.ssh/config: ssh logs in as the real uid's name; so must gputop,
    whatever $USER and $LOGNAME say."""
    h = fleet.hosts["gpu-h100"]
    ssh_config = tmp_path / "ssh_config"
    ssh_config.write_text(f"Host no-user\n  HostName {h.address}\n  Port {h.port}\n"
                          f"  IdentityFile {fleet.ssh / 'id_ed25519'}\n  IdentitiesOnly yes\n"
                          f"  UserKnownHostsFile {fleet.ssh / 'known_hosts'}\n")
    cfg = tmp_path / "hosts.toml"
    cfg.write_text(f'[defaults]\ntimeout = {TIMEOUT}\nssh_config = "{ssh_config}"\n'
                   '[[hosts]]\nname = "no-user"\n')
    env = fleet.env() | {"USER": "gtbob", "LOGNAME": "gtbob"}
    r = subprocess.run([sys.executable, "-m", "gputop", "--json", "--config", str(cfg)],
                       env=env, capture_output=True, text=True, timeout=60)
    (host,) = json.loads(r.stdout)["hosts"]
    assert host["status"] == "ok", host["error"]
