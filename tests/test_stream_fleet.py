"""Streaming collection end to end: real OpenSSH, the stand-in nvidia-smi's ``-lms`` loop.

The stand-in logs every start (nvidia-smi and ps, ``Fleet.calls``), so "a refresh starts
no process on the host" is counted, not assumed.
"""

from __future__ import annotations

import asyncio
import itertools
import os
import signal
import subprocess
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import jsonschema
import pytest
from conftest import _need_sshd, _world_readable
from fleet import Fleet, GpuProcess, Host

from gputop.config import load_config
from gputop.model import FleetSnapshot, HostSnapshot
from gputop.poller import Poller
from gputop.sources.protocol import PS_ARGS, PS_OWNERS
from gputop.sources.ssh import SshSource

INTERVAL = 0.5
TIMEOUT = 2.0


@pytest.fixture
def sfleet(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Fleet]:
    _need_sshd()
    f = Fleet(_world_readable(tmp_path), [
        Host("alpha", "127.0.6.2", gpus=("h100", "l40s"),
             processes=[GpuProcess("gtalice", "python train.py", gpu=0)]),
        Host("slow", "127.0.6.3", gpus=("l40s",), delay=2.5),
    ]).start()
    monkeypatch.setenv("HOME", str(f.home))
    monkeypatch.delenv("SSH_AUTH_SOCK", raising=False)
    yield f
    f.stop()


def poller_for(fleet: Fleet, names: list[str], **kw: float) -> Poller:
    cfg = fleet.write_config(names, timeout=kw.pop("timeout", TIMEOUT),
                             interval=kw.pop("interval", INTERVAL), **kw)  # type: ignore[arg-type]
    return Poller(load_config(str(cfg)))


async def updates(poller: Poller, seconds: float) -> AsyncIterator[tuple[float, HostSnapshot]]:
    started = time.monotonic()
    async for snap in poller.updates():
        yield time.monotonic() - started, snap
        if time.monotonic() - started > seconds:
            return


def smi_starts(calls: list[str]) -> int:
    return sum(c.startswith("nvidia-smi ") for c in calls)


async def test_steady_state_starts_no_process_and_ps_runs_for_new_pids_only(
    sfleet: Fleet,
) -> None:
    alpha = sfleet.hosts["alpha"]
    poller = poller_for(sfleet, ["alpha"])
    src = poller.sources[0]
    assert isinstance(src, SshSource) and src.streaming
    seen: list[HostSnapshot] = []
    first_calls: list[str] = []
    channels = 0
    newcomer = GpuProcess("gtbob", "python eval.py", gpu=1)
    found_at: int | None = None
    try:
        async for _t, snap in updates(poller, 30):
            assert snap.error is None, snap.error
            seen.append(snap)
            if len(seen) == 1:
                first_calls, channels = sfleet.calls(alpha), src.channels
            if len(seen) == 8:  # steady state: nothing new was started on the host
                assert sfleet.calls(alpha) == first_calls
                assert src.channels == channels and src.connects == 1
                # A new job appears: its owner is asked once, with ps; nothing else starts.
                sfleet.start_process(newcomer)
                alpha.processes.append(newcomer)
                sfleet.set_scenario(alpha, "ok")
            if found_at is None and any(p.pid == newcomer.popen.pid  # type: ignore[union-attr]
                                        for p in snap.gpus[1].processes):
                found_at = len(seen)
            if found_at is not None and len(seen) >= found_at + 4:
                break
    finally:
        await poller.aclose()
    await asyncio.sleep(0.5)
    assert sfleet.remote_processes(alpha) == []  # closing the channels ends the streams
    assert found_at is not None
    # The first refresh: two nvidia-smi streams and one ps pair for alpha's first job.
    assert smi_starts(first_calls) == 2 and len(first_calls) == 4, first_calls
    new_calls = sfleet.calls(alpha)[len(first_calls):]
    assert new_calls == [f"ps {PS_OWNERS.split(' ps ', 1)[1]} {newcomer.pid}",
                         f"ps {PS_ARGS.split(' ps ', 1)[1]} {newcomer.pid}"]
    (p,) = seen[-1].gpus[1].processes
    assert p.command == "python eval.py"
    if sfleet.users:
        assert p.user == "gtbob"
        assert seen[-1].gpus[0].processes[0].user == "gtalice"
    assert all(pr.elapsed_s is not None for g in seen[-1].gpus for pr in g.processes)
    # Fresh data every interval: refreshes follow the stream's samples.
    times = [s.time.timestamp() for s in seen[1:]]
    gaps = [b - a for a, b in itertools.pairwise(times)]
    assert max(gaps) < 1.5 * INTERVAL + 0.5, gaps


async def test_slow_nvidia_smi_is_starting_then_fresh_every_interval(
    sfleet: Fleet, schema: dict[str, object]
) -> None:
    """2.5 s to start (no persistence mode) with a 2 s timeout: the old design timed out
    every refresh; the stream says "starting", then delivers every interval."""
    slow = sfleet.hosts["slow"]
    poller = poller_for(sfleet, ["slow"], first_sample_timeout=20.0, timeout=1.0)
    got: list[tuple[float, HostSnapshot]] = []
    try:
        async for t, snap in updates(poller, 30):
            got.append((t, snap))
            if sum(s.ok for _, s in got) >= 8:
                break
    finally:
        await poller.aclose()
    kinds = [s.error.kind if s.error else "ok" for _, s in got]
    first_ok = kinds.index("ok")
    assert first_ok >= 1 and set(kinds[:first_ok]) == {"starting"}, kinds
    assert got[0][1].error is not None
    assert got[0][1].error.message.startswith("starting nvidia-smi: ")
    assert set(kinds[first_ok:]) == {"ok"}, kinds
    ok_times = [t for t, s in got if s.ok]
    gaps = [b - a for a, b in itertools.pairwise(ok_times)]
    assert max(gaps) < 1.5 * INTERVAL + 0.3, gaps
    last = got[-1][1]
    assert last.first_sample_s is not None and last.first_sample_s >= 2.5
    assert last.gpus[0].persistence_mode == "Disabled"
    assert any("enable nvidia-persistenced" in w for w in last.warnings)
    assert smi_starts(sfleet.calls(slow)) == 2  # started once, never again
    doc = FleetSnapshot(hosts=(got[0][1], last)).to_dict()
    jsonschema.validate(doc, schema)
    assert doc["hosts"][0]["error"]["kind"] == "starting"
    assert doc["hosts"][1]["first_sample_s"] >= 2.5


async def test_stalled_stream_is_a_timeout_killed_on_the_host_and_restarted(
    sfleet: Fleet,
) -> None:
    alpha = sfleet.hosts["alpha"]
    poller = poller_for(sfleet, ["alpha"], first_sample_timeout=10.0)
    stopped: list[int] = []
    kinds: list[str] = []
    try:
        async for _t, snap in updates(poller, 40):
            kinds.append(snap.error.kind if snap.error else "ok")
            if len(kinds) == 3:  # freeze the GPU stream: alive, silent
                procs = sfleet.remote_processes(alpha)
                gpu_lines = [ln for ln in procs if "--query-gpu" in ln]
                assert len(gpu_lines) == 1, (kinds, procs)
                line = gpu_lines[0]
                stopped.append(int(line.split()[0]))
                os.kill(stopped[0], signal.SIGSTOP)
            if "timeout" in kinds and kinds[-1] == "ok" and kinds.count("ok") >= 5:
                break
    finally:
        await poller.aclose()
    assert kinds[:3] == ["ok"] * 3
    i = kinds.index("timeout")
    assert set(kinds[3:i]) <= {"ok"}  # samples already on their way
    assert kinds[-1] == "ok"
    # The frozen process group was killed on the host (SIGKILL works on a stopped process).
    out = subprocess.run(["ps", "-o", "stat=", "-p", str(stopped[0])], capture_output=True,
                         text=True)
    assert out.stdout.strip() in ("", "Z"), out.stdout  # gone, or a zombie for init to reap
    assert smi_starts(sfleet.calls(alpha)) == 4  # one restart of the pair


async def test_lost_gpu_mid_stream_shows_it_and_the_stream_restarts(sfleet: Fleet) -> None:
    alpha = sfleet.hosts["alpha"]
    poller = poller_for(sfleet, ["alpha"])
    snaps: list[HostSnapshot] = []
    lost_at = 0
    try:
        async for _t, snap in updates(poller, 30):
            snaps.append(snap)
            if len(snaps) == 2:
                sfleet.set_scenario(alpha, "lost-middle")  # exits 15 after that sample
            if not lost_at and any(g.lost for g in snap.gpus):
                sfleet.set_scenario(alpha, "ok")
                lost_at = len(snaps)
            if lost_at and len(snaps) >= lost_at + 3:
                break
    finally:
        await poller.aclose()
    assert all(s.error is None for s in snaps), [s.error for s in snaps]
    lost = next(s for s in snaps if any(g.lost for g in s.gpus))
    assert [g.lost for g in lost.gpus] == [False, False, True]
    assert lost.gpus[0].processes  # the GPUs that answer keep their processes
    assert not any(g.lost for g in snaps[-1].gpus) and len(snaps[-1].gpus) == 2
    assert smi_starts(sfleet.calls(alpha)) >= 4  # the stream ended (exit 15) and restarted


async def test_nvidia_smi_that_cannot_stream_falls_back_to_a_query_per_refresh(
    sfleet: Fleet,
) -> None:
    alpha = sfleet.hosts["alpha"]
    (sfleet.root / "alpha" / "smi" / "noloop").write_text("")
    poller = poller_for(sfleet, ["alpha"])
    try:
        snaps = [(await poller.snapshot()).hosts[0] for _ in range(3)]
    finally:
        await poller.aclose()
    assert all(s.error is None for s in snaps), [s.error for s in snaps]
    assert len(snaps[-1].gpus) == 2 and snaps[-1].gpus[0].processes
    src = poller.sources[0]
    assert isinstance(src, SshSource) and not src.streaming
    calls = sfleet.calls(alpha)
    loops = [c for c in calls if c.startswith("nvidia-smi ") and "-lms" in c]
    # One try at streaming (the apps loop may be killed before it even started), then two
    # nvidia-smi per refresh.
    assert 1 <= len(loops) <= 2 and smi_starts(calls) - len(loops) == 2 * 3, calls
