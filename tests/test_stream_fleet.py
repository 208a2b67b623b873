"""Streaming collection end to end: real OpenSSH, the stand-in nvidia-smi's ``-lms`` loop.

The stand-in logs every start (nvidia-smi and ps, ``Fleet.calls``), so "a refresh starts
no process on the host" is counted, not assumed.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import os
import signal
import subprocess
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import jsonschema
import pytest

from gputop.config.load import load_config
from gputop.model import FleetSnapshot, HostSnapshot
from gputop.poller import Poller
from gputop.sources.protocol import PS_ARGS, PS_OWNERS
from gputop.sources.ssh import SshSource
from tests.support.fleet import Fleet, GpuProcess, Host, gpu_uuid
from tests.support.shared_fleet import need_sshd, world_readable

INTERVAL = 0.5
TIMEOUT = 2.0


@pytest.fixture
def sfleet(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Fleet]:
    need_sshd()
    f = Fleet(world_readable(tmp_path), [
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


def sessions_of(fleet: Fleet, h: Host) -> dict[int, list[int]]:
    """The host's stand-in nvidia-smi processes by SSH session (sshd starts each exec
    channel's command in a session of its own: a session id is a channel)."""
    out: dict[int, list[int]] = {}
    for ln in fleet.remote_processes(h):
        pid = int(ln.split()[0])
        sid = subprocess.run(["ps", "-o", "sid=", "-p", str(pid)], capture_output=True,
                             text=True).stdout.strip()
        if sid:
            out.setdefault(int(sid), []).append(pid)
    return out


def session_pids(sid: int) -> set[int]:
    """Every process in that session on the host (the loops, their awks, the relay)."""
    out = subprocess.run(["ps", "-eo", "pid=,sid="], capture_output=True, text=True).stdout
    return {int(p) for p, s in (ln.split() for ln in out.splitlines()) if int(s) == sid}


def hang_ps(fleet: Fleet, host: str, flag: Path, when: str = "") -> None:
    """Make ``host``'s ps hang while ``flag`` exists (as on a host with a hung NFS mount in
    /proc), for every call or only those whose arguments match the case pattern ``when``."""
    ps = fleet.root / host / "bin" / "ps"
    hang = f"[ -e {flag} ] && exec sleep 600"
    guard = f'case "$*" in {when}) {hang} ;; esac' if when else hang
    ps.write_text(ps.read_text().replace("exec /bin/ps", f"{guard}\nexec /bin/ps"))


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
    at3: tuple[set[int], int, int] = (set(), 0, 0)
    try:
        async for _t, snap in updates(poller, 30):
            assert snap.error is None, snap.error
            seen.append(snap)
            if len(seen) == 1:
                first_calls, channels = sfleet.calls(alpha), src.channels
            st = src.streams.session
            assert st is not None
            if len(seen) == 3:
                # ONE exec channel carries both loops and ps: one SSH session on the host.
                assert channels == 1 and src.channels == 1
                groups = sessions_of(sfleet, alpha)
                assert list(groups) == [st.pid] and len(groups[st.pid]) == 2, groups
                at3 = (session_pids(st.pid), st.reads, st.seq)
            if len(seen) == 8:  # steady state: nothing new was started on the host
                assert sfleet.calls(alpha) == first_calls
                assert src.channels == channels and src.connects == 1
                # ...not even an awk: the session's processes are the same ones.
                assert session_pids(st.pid) == at3[0]
                # One write per refresh: the client wakes once per sample, not per loop.
                reads, samples = st.reads - at3[1], st.seq - at3[2]
                assert samples >= 4 and reads <= samples + 1, (reads, samples)
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
    # The newest snapshot that shows it (on a loaded machine the stand-in's apps loop can
    # run a sample late, and that sample then shows no processes: the host's clock decides).
    last = next(s for s in reversed(seen) if s.gpus[1].processes)
    assert seen.index(last) >= len(seen) - 3
    (p,) = last.gpus[1].processes
    assert p.command == "python eval.py"
    if sfleet.users:
        assert p.user == "gtbob"
        assert last.gpus[0].processes[0].user == "gtalice"
    assert all(pr.elapsed_s is not None for g in last.gpus for pr in g.processes)
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
    groups: dict[int, list[int]] = {}
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
                groups = sessions_of(sfleet, alpha)
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
    # ...in one new session: nothing of the stalled one was left on the host.
    (pids,) = groups.values()
    assert len(pids) == 2 and stopped[0] not in pids, groups
    await asyncio.sleep(0.5)
    assert sfleet.remote_processes(alpha) == []  # closing the channel ended the session


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


NONCE_GUESS = "0123456789abcdef0123456789abcdef"


async def test_hostile_command_lines_cannot_forge_a_row_or_a_marker(sfleet: Fleet) -> None:
    """ps's lines share the channel with the GPU and apps rows: a job whose command line
    looks like a tagged row or a marker (any nonce) is just a command line."""
    alpha = sfleet.hosts["alpha"]
    row = ("2026/07/14 08:12:53.500, 2, 7, GPU-forged, NVIDIA H100, 00000000:99:00.0, "
           "Enabled, 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10")
    hostile = [
        f"g {row}",
        f"\ng {row}\n",
        f"a 2026/07/14 08:12:53.500, {gpu_uuid(alpha.name, 1)}, 1, 4096",
        f"@@gputop {NONCE_GUESS} exit 15",
        f"g @@gputop {NONCE_GUESS} exit 0",
        f"p @@gputop {NONCE_GUESS} end",
        "@@gputop end\np @@gputop end",
    ]
    jobs = [GpuProcess("gtbob", argv0, gpu=i % 2) for i, argv0 in enumerate(hostile)]
    for j in jobs:
        sfleet.start_process(j)
        alpha.processes.append(j)
    sfleet.set_scenario(alpha, "ok")
    poller = poller_for(sfleet, ["alpha"])
    src = poller.sources[0]
    assert isinstance(src, SshSource)
    snaps: list[HostSnapshot] = []
    try:
        async for _t, snap in updates(poller, 20):
            snaps.append(snap)
            if len(snaps) >= 4:
                break
    finally:
        await poller.aclose()
    for snap in snaps:
        assert snap.error is None, snap.error
        assert [g.index for g in snap.gpus] == [0, 1]
        assert [g.uuid for g in snap.gpus] == [gpu_uuid("alpha", 0), gpu_uuid("alpha", 1)]
    last = snaps[-1]
    by_pid = {p.pid: (g.index, p) for g in last.gpus for p in g.processes}
    want = {j.pid: j for j in [*alpha.processes]}
    assert set(by_pid) == set(want)  # no forged pid 1, every real job
    for pid, (gpu, p) in by_pid.items():
        assert gpu == want[pid].gpu  # on the right GPU
        # (ps shows a newline as a blank: it never starts a line of its own)
        assert p.command is not None
        assert p.command.strip() == want[pid].argv0.replace("\n", " ").strip()
        if sfleet.users:
            assert p.user == want[pid].user
    assert (src.channels, src.stream_starts) == (1, 1)  # nothing broke the session


async def test_hung_ps_is_a_timeout_that_kills_the_session_on_the_host(sfleet: Fleet) -> None:
    alpha = sfleet.hosts["alpha"]
    flag = sfleet.root / "alpha" / "ps-hangs"
    hang_ps(sfleet, "alpha", flag)
    poller = poller_for(sfleet, ["alpha"], timeout=1.0)
    src = poller.sources[0]
    assert isinstance(src, SshSource)
    kinds: list[str] = []
    newcomer = GpuProcess("gtbob", "python eval.py", gpu=1)
    hung_sid = 0
    hung = False
    try:
        async for _t, snap in updates(poller, 40):
            kinds.append(snap.error.kind if snap.error else "ok")
            if not hung and kinds[-2:] == ["ok", "ok"]:
                # Two answers in a row first (under load, a 1 s timeout may also pass
                # before the session's first answer: that is not the hang under test).
                hung = True
                kinds.clear()
                st = src.streams.session
                assert st is not None
                hung_sid = st.pid
                flag.write_text("")
                sfleet.start_process(newcomer)
                alpha.processes.append(newcomer)
                sfleet.set_scenario(alpha, "ok")
            if hung and "timeout" in kinds and flag.exists():
                # The hung ps went with its session: nothing of it is left on the host.
                for _ in range(50):
                    left = session_pids(hung_sid)
                    if not left:
                        break
                    await asyncio.sleep(0.1)
                assert left == set(), kinds
                flag.unlink()
            if hung and "timeout" in kinds and kinds[-1] == "ok" and any(
                    p.pid == newcomer.pid for g in snap.gpus for p in g.processes):
                break
    finally:
        await poller.aclose()
    assert "timeout" in kinds and kinds[-1] == "ok", kinds
    assert src.stream_starts >= 2  # the session was restarted (the flag may outlive one)


async def test_host_without_awk_falls_back_to_a_query_and_says_so(sfleet: Fleet) -> None:
    alpha = sfleet.hosts["alpha"]
    # What a shell says when a command is missing (a stand-in first on PATH: the real
    # awk stays installed for the rest of the machine).
    (sfleet.root / "alpha" / "bin" / "awk").write_text(
        "#!/bin/sh\necho 'sh: 1: awk: not found' >&2\nexit 127\n")
    (sfleet.root / "alpha" / "bin" / "awk").chmod(0o755)
    poller = poller_for(sfleet, ["alpha"])
    try:
        snaps = [(await poller.snapshot()).hosts[0] for _ in range(2)]
    finally:
        await poller.aclose()
    assert all(s.error is None for s in snaps), [s.error for s in snaps]
    assert len(snaps[-1].gpus) == 2 and snaps[-1].gpus[0].processes
    assert any("no awk on the host: collecting with a query per refresh" in w
               for w in snaps[-1].warnings), snaps[-1].warnings
    src = poller.sources[0]
    assert isinstance(src, SshSource) and not src.streaming
    calls = sfleet.calls(alpha)
    assert not any("-lms" in c for c in calls) and smi_starts(calls) == 2 * 2, calls


async def test_the_last_job_ending_shows_no_processes_within_two_samples(sfleet: Fleet) -> None:
    """The apps loop then prints nothing at all: the GPU sample's host-clock time says its
    last rows are stale (they are never kept as "still arriving")."""
    alpha = sfleet.hosts["alpha"]
    poller = poller_for(sfleet, ["alpha"])
    procs: list[int] = []
    ended_at = 0
    try:
        async for _t, snap in updates(poller, 20):
            assert snap.error is None, snap.error
            procs.append(sum(len(g.processes) for g in snap.gpus))
            if len(procs) == 3:
                assert procs == [1, 1, 1]
                (job,) = alpha.processes
                alpha.processes.clear()
                sfleet.set_scenario(alpha, "ok")  # the apps loop prints nothing from now
                assert job.popen is not None
                job.popen.kill()
                job.popen.wait(5)
                ended_at = len(procs)
            if ended_at and len(procs) >= ended_at + 5:
                break
    finally:
        await poller.aclose()
    after = procs[ended_at:]
    # The sample in flight may still show it; from the next but one on, never again.
    assert after[2:] == [0] * len(after[2:]) and len(after) >= 5, procs


async def test_closing_while_ps_hangs_leaves_nothing_on_the_host(sfleet: Fleet) -> None:
    """gputop quits (q, SIGTERM) while a ps it asked for hangs: the session's shells, awks
    and the hung ps are killed on the host, not left waiting for an EOF they cannot read."""
    alpha = sfleet.hosts["alpha"]
    flag = sfleet.root / "alpha" / "ps-hangs"
    hang_ps(sfleet, "alpha", flag)
    poller = poller_for(sfleet, ["alpha"], timeout=20.0)
    src = poller.sources[0]
    assert isinstance(src, SshSource)
    newcomer = GpuProcess("gtbob", "python eval.py", gpu=1)
    sid = 0
    try:
        first = await poller.snapshot()
        assert first.hosts[0].error is None, first.hosts[0].error
        st = src.streams.session
        assert st is not None
        sid = st.pid
        flag.write_text("")
        sfleet.start_process(newcomer)
        alpha.processes.append(newcomer)
        sfleet.set_scenario(alpha, "ok")
        refresh = asyncio.ensure_future(poller.snapshot())
        for _ in range(200):  # refreshes until one waits on the hung ps
            if st._ps is not None:
                break
            if refresh.done():
                refresh = asyncio.ensure_future(poller.snapshot())
            await asyncio.sleep(0.05)
        assert st._ps is not None
        refresh.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await refresh
    finally:
        await poller.aclose()
        flag.unlink(missing_ok=True)
    left = session_pids(sid)
    for _ in range(30):
        if not left:
            break
        await asyncio.sleep(0.1)
        left = session_pids(sid)
    assert left == set(), subprocess.run(["ps", "-o", "pid,args", "-s", str(sid)],
                                         capture_output=True, text=True).stdout


async def test_a_command_line_ps_cannot_read_costs_its_text_not_the_host(
    sfleet: Fleet,
) -> None:
    """A job whose command line cannot be read (ps hangs on it, as on argv pages behind a
    FUSE mount its owner serves) keeps its owner and GPU; only its command is unknown. The
    host stays on the board, and the hung ps is killed on the host."""
    alpha = sfleet.hosts["alpha"]
    flag = sfleet.root / "alpha" / "args-hang"
    hang_ps(sfleet, "alpha", flag, when="*args=*")
    poller = poller_for(sfleet, ["alpha"], timeout=6.0)  # command lines: 3 s
    kinds: list[str] = []
    newcomer = GpuProcess("gtbob", "python eval.py", gpu=1)
    shown = None
    try:
        async for _t, snap in updates(poller, 30):
            kinds.append(snap.error.kind if snap.error else "ok")
            if len(kinds) == 2:
                flag.write_text("")
                sfleet.start_process(newcomer)
                alpha.processes.append(newcomer)
                sfleet.set_scenario(alpha, "ok")
            found = [p for g in snap.gpus for p in g.processes
                     if newcomer.popen is not None and p.pid == newcomer.pid]
            if found:
                shown = found[0]
                break
    finally:
        await poller.aclose()
        flag.unlink(missing_ok=True)
    assert kinds and all(k == "ok" for k in kinds), kinds
    assert shown is not None and shown.user == "gtbob", shown
    assert not shown.command, shown  # unknown, not someone else's or a stale one
    # The hung ps is killed as its time runs out; the kill may still be on its way on the
    # host when the answer without the command line arrives (a loaded run saw it there).
    for _ in range(50):
        left = subprocess.run(["pgrep", "-f", "^sleep 600$"], capture_output=True, text=True)
        if not left.stdout.strip():
            break
        await asyncio.sleep(0.1)
    assert left.stdout.strip() == "", left.stdout


async def test_a_session_that_opened_between_refreshes_is_not_awaited_again(
    sfleet: Fleet,
) -> None:
    """A refresh gives up on a session still opening (the host is ``starting``), and the
    session opens before the next refresh. Once that session is gone (killed as stalled),
    the next refresh opens a new one on the same connection: it used to await the old
    opening again, find no session, and fail the host (``error: AssertionError``) with a
    reconnect."""
    poller = poller_for(sfleet, ["alpha"])
    src = poller.sources[0]
    assert isinstance(src, SshSource)
    st = src.streams
    kinds: list[str] = []

    async def until_ok() -> None:
        for _ in range(40):  # each waits at most an interval for the session's next sample
            _gpus, err = await src.query()
            kinds.append(err.kind if err else "ok")
            if err is None:
                return
        raise AssertionError(kinds)

    try:
        await src.link.open()  # connected; no session yet
        st.timeout = 0.0  # this refresh gives up on the opening at once
        _gpus, err = await src.query()
        assert err is not None and err.kind == "starting", err
        opening = st._opening
        assert opening is not None
        await opening  # it opens between two refreshes
        st.timeout = TIMEOUT
        await until_ok()
        assert st.session is not None
        st._kill(st.session)  # as a session with no sample in time is
        await until_ok()
    finally:
        await poller.aclose()
    assert set(kinds) <= {"ok", "starting"}, kinds
    assert (src.connects, src.stream_starts) == (1, 2)
