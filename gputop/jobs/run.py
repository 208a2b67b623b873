"""``gputop run``: reserve GPUs on one host, run a command there on them, give them back.

The command runs over SSH (a local host: here) as ``sh -c`` of a fixed script: it prints a
marker with its own pid, sets ``CUDA_VISIBLE_DEVICES`` to the reserved GPUs' UUIDs and
``exec``s CMD with every argument passed through ``shlex.quote`` (never interpolated). sshd
starts each session in a new session (setsid), so that pid is the job's session id: every
process the job starts is found by it, by ``run`` and by any gputop checking the job later
(see ``gputop.jobs.reap``). A pty when stdin is a terminal, plain pipes otherwise.

**The job is its session.** When the command exits, ``run`` looks at the session once
more (a few times within a second: children killed by the hang-up take a moment): if
processes it started still run there (``nohup ... &``), or a process of the holder's still
uses the job's GPUs (a ``setsid`` child, a daemon), the reservation is kept for the job
check (``gputop.jobs.reap``) and ``run`` exits with the command's status all the same.

**Connection-drop rule.** If the SSH connection drops while the job runs, ``run`` says so
(host, pid) and keeps the reservation: the job may still be running there. It is released
by the first gputop that finds the job's session gone for ``job_grace`` (or at its expiry).
``run`` killed by SIGKILL is the same case.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import shlex
import signal
import sys
from collections.abc import Awaitable, Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, replace
from datetime import datetime

import asyncssh

from gputop.config.load import Config
from gputop.config.tables import HostConfig
from gputop.jobs.reap import check_jobs, gpus_on, release_ids, uses_gpu
from gputop.jobs.remote import (
    Alive,
    JobHostError,
    alive_local,
    alive_via,
    connect,
    local_start,
    parse_lstart,
)
from gputop.reservations.filelock import StoreError
from gputop.reservations.records import Job, Reservation
from gputop.reservations.state import StoreState
from gputop.reservations.store import ReservationStore
from gputop.text import clean

MARKER = b"gputop-job-pid "
#: Output before the marker (shell startup files) is skipped, up to this much.
MAX_PREAMBLE = 64 * 1024
EXIT_SSH = 255
FORWARDED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
EXIT_REFUSED_SHELL = 2


def remote_command(argv: Sequence[str], devices: str,
                   env: Mapping[str, str] | None = None) -> str:
    """The script sent to the remote shell: nothing but quoted words. ``env``: variables
    to export to the job as well (``share_env``'s fixed names)."""
    if not argv:
        raise ValueError("no command given")
    exports = "".join(f"{k}={shlex.quote(v)}; export {k}; " for k, v in (env or {}).items()
                      if _ENV_NAME.fullmatch(k))
    # The marker: the job's pid and when it started (ps lstart, C locale, UTC), so a later
    # process given the same pid is never taken for the job.
    script = ('echo "gputop-job-pid $$ $(LC_ALL=C TZ=UTC0 ps -o lstart= -p $$ 2>/dev/null)"; '
              f"CUDA_VISIBLE_DEVICES={shlex.quote(devices)}; export CUDA_VISIBLE_DEVICES; "
              + exports + "exec " + " ".join(shlex.quote(a) for a in argv))
    # Whatever the login shell is, it execs a POSIX sh (same pid: the session's leader).
    return "exec /bin/sh -c " + shlex.quote(script)


_ENV_NAME = re.compile(r"[A-Z_][A-Z0-9_]*")


def share_env(rs: Sequence[Reservation], total_mib: int | None) -> dict[str, str]:
    """What a job on a memory share is told (``run --share``): ``GPUTOP_SHARE_MIB``, the
    share as a fraction of the GPU (``GPUTOP_SHARE_FRACTION``, e.g. for PyTorch's
    ``torch.cuda.set_per_process_memory_fraction``), JAX/XLA's own cap
    (``XLA_CLIENT_MEM_FRACTION`` and its older name ``XLA_PYTHON_CLIENT_MEM_FRACTION``:
    the size of its memory pool) and
    TensorFlow's ``TF_FORCE_GPU_ALLOW_GROWTH`` (not a cap: TensorFlow then takes memory as
    it needs it instead of nearly all of the GPU at start). Empty for whole GPUs."""
    share = next((r.share_mib for r in rs if r.share_mib is not None), None)
    if share is None:
        return {}
    env = {"GPUTOP_SHARE_MIB": str(share)}
    if total_mib:
        # Rounded down: a cap a little under the share, never over it.
        frac = f"{max(1, min(1000, share * 1000 // total_mib)) / 1000:g}"
        env |= {"GPUTOP_SHARE_FRACTION": frac, "XLA_CLIENT_MEM_FRACTION": frac,
                "XLA_PYTHON_CLIENT_MEM_FRACTION": frac}
    env["TF_FORCE_GPU_ALLOW_GROWTH"] = "true"
    return env


#: Login shells that read a single-quoted word as POSIX sh does (sshd hands the command to
#: the user's login shell first; that shell then execs /bin/sh on the quoted script).
POSIX_SHELLS = frozenset({"sh", "bash", "dash", "ash", "ksh", "ksh93", "mksh", "pdksh", "zsh",
                          "yash", "posh", "busybox"})
#: What fish and csh read differently inside single quotes: with these in an argument the
#: quoting holds only under a POSIX login shell (fish turned ``\'`` into a way out).
NOT_PORTABLE = ("\\", "\n", "!")
#: Asks which login shell sshd runs: no backslash, no user data.
LOGIN_SHELL_PROBE = "exec /bin/sh -c 'echo \"${SHELL##*/}\"'"


def portable(command: str) -> bool:
    """True when every shell (POSIX, fish, csh) reads ``command``'s quoting alike."""
    return not any(c in command for c in NOT_PORTABLE)


def devices_of(rs: Sequence[Reservation]) -> str:
    """UUIDs, so indices cannot drift; an index where a host gave no UUID."""
    return ",".join(r.uuid or str(r.gpu) for r in sorted(rs, key=lambda r: r.gpu))


def exit_code(status: int | None, sig: str | None) -> int:
    if sig:
        try:
            return 128 + signal.Signals["SIG" + sig.removeprefix("SIG")].value
        except KeyError:
            return EXIT_SSH
    return EXIT_SSH if status is None else status


def record_pid(store: ReservationStore, rs: Sequence[Reservation], pid: int, session: bool,
               start: datetime | None = None) -> None:
    ids = {r.id for r in rs}

    def change(state: StoreState, now: datetime) -> StoreState:
        return replace(state, reservations=tuple(
            replace(r, job=Job(pid, session, start=start)) if r.id in ids else r
            for r in state.reservations))

    store.update(change)


@dataclass
class JobResult:
    code: int
    #: True: the job is known to have ended (release now); False: it may still run.
    ended: bool
    #: False: the command never started (nothing can be left on the GPUs).
    started: bool = True


async def run_on(config: Config, host: HostConfig, store: ReservationStore,
                 rs: Sequence[Reservation],
                 argv: Sequence[str], say: Callable[[str], None],
                 env: Mapping[str, str] | None = None) -> int:
    """Run the job, then release its reservations if it is known to have ended. ``env``:
    more variables for the job (``share_env``)."""
    devices = devices_of(rs)
    if host.local:
        result = await _run_local(store, rs, argv, devices, config.reservations.job_grace_s, env)
    else:
        result = await _run_remote(config, host, store, rs, argv, devices, say, env)
    if result.ended and result.started:
        # A child that left the job's session (setsid, a daemon) is the job while it uses
        # the job's GPUs.
        with contextlib.suppress(Exception):
            seen = (await gpus_on(config, [host.name])).get(host.name)
            busy = [r for r in rs if uses_gpu(r, seen)]
            if busy:
                say(f"the command exited ({result.code}), but processes of yours still use "
                    + ", ".join(f"{clean(r.host)}:{r.gpu}" for r in busy)
                    + ": the reservation stays until none is left for "
                    f"{config.reservations.job_grace_s:g}s, then any gputop command of yours (e.g. "
                    "gputop reservations) releases it")
                return result.code
    if result.ended:
        try:
            gone = await asyncio.to_thread(release_ids, store, {r.id for r in rs})
        except StoreError as exc:  # the job's status is never lost to the file's lock
            say(f"could not release the reservation ({exc}); it stays until a gputop of "
                "yours sees the job gone (or it expires)")
            return result.code
        if gone:
            say("released " + ", ".join(f"{clean(r.host)}:{r.gpu}" for r in gone))
    return result.code


#: After the command exits, its session is looked at this often before what is left
#: counts as left behind (children killed by the hang-up take a moment to go).
LEFTOVER_CHECKS = (0.0, 0.2, 0.5, 1.0)


async def _leftovers(ask: Callable[[], Awaitable[Alive]], sid: int,
                     start: datetime | None) -> list[int]:
    """The job's processes still running once its command exited: the session it led.
    A host that cannot be asked: none (released as before; the job check cannot see them
    either)."""
    left: list[int] = []
    for delay in LEFTOVER_CHECKS:
        await asyncio.sleep(delay)
        try:
            left = (await ask()).in_session(sid, start)
        except (JobHostError, OSError, ValueError):
            return []
        if not left:
            return []
    return left


def _say_left(say: Callable[[str], None], code: int, left: Sequence[int], host: str,
              grace: float) -> None:
    pids = ", ".join(str(p) for p in left[:5]) + (", ..." if len(left) > 5 else "")
    say(f"the command exited ({code}), but {len(left)} process(es) it started still run on "
        f"{clean(host)} (pid {pids}): the reservation stays until none is left for "
        f"{grace:g}s, then any gputop command of yours (e.g. gputop reservations) "
        "releases it")


async def _recorded(recording: list[asyncio.Task[None]]) -> None:
    """The job may outlive us: its pid must be in the file for a later check to release
    it, so wait (a while) for a recording held up by a locked file."""
    if recording and not recording[0].done():
        await asyncio.wait(recording, timeout=60)


async def _record(store: ReservationStore, rs: Sequence[Reservation], pid: int, session: bool,
                  say: Callable[[str], None], start: datetime | None = None) -> None:
    """Record the job's pid, waiting out a locked file (tried again until it is written or
    the job ends): the job and its output never wait for the file."""
    while True:
        try:
            await asyncio.to_thread(record_pid, store, rs, pid, session, start)
            return
        except StoreError as exc:
            say(f"could not record the job's pid yet ({exc}); trying again")
            await asyncio.sleep(1.0)


async def _run_local(store: ReservationStore, rs: Sequence[Reservation], argv: Sequence[str],
                     devices: str, job_grace_s: float,
                     more_env: Mapping[str, str] | None = None) -> JobResult:
    tty = sys.stdin.isatty()
    env = dict(os.environ, CUDA_VISIBLE_DEVICES=devices) | dict(more_env or {})
    try:
        proc = await asyncio.create_subprocess_exec(*argv, env=env,
                                                    start_new_session=not tty)
    except OSError as exc:
        print(f"gputop: cannot run {argv[0]!r}: {exc.strerror}", file=sys.stderr)
        return JobResult(127 if isinstance(exc, FileNotFoundError) else 126, True, False)
    start = local_start(proc.pid)
    recording = asyncio.create_task(_record(store, rs, proc.pid, not tty, _say_err, start))
    loop = asyncio.get_running_loop()

    def forward(sig: int) -> None:
        if sig == signal.SIGINT and tty:
            return  # the terminal sent it to the job's process group already
        with contextlib.suppress(ProcessLookupError):
            if tty:
                os.kill(proc.pid, sig)
            else:
                os.killpg(proc.pid, sig)

    for s in FORWARDED:
        loop.add_signal_handler(s, forward, s)
    try:
        rc = await proc.wait()
        code = 128 - rc if rc < 0 else rc
        if not tty:  # its own session: what it left running is found by the session id
            left = await _leftovers(lambda: asyncio.to_thread(alive_local), proc.pid, start)
            if left:
                await asyncio.wait([recording], timeout=60)
                _say_left(_say_err, code, left, "this host", job_grace_s)
                return JobResult(code, False)
    finally:
        for s in FORWARDED:
            loop.remove_signal_handler(s)
        recording.cancel()
    return JobResult(code, True)


def _say_err(msg: str) -> None:
    print(f"gputop: {msg}", file=sys.stderr, flush=True)


async def _run_remote(config: Config, host: HostConfig, store: ReservationStore,
                      rs: Sequence[Reservation], argv: Sequence[str], devices: str,
                      say: Callable[[str], None],
                      env: Mapping[str, str] | None = None) -> JobResult:
    try:
        conn, jumps = await connect(config, host)
    except (OSError, asyncssh.Error, asyncio.TimeoutError, ValueError) as exc:
        say(f"cannot connect to {host.name}: {clean(str(exc)) or type(exc).__name__}")
        return JobResult(EXIT_SSH, True, False)  # nothing was started
    tty = sys.stdin.isatty()
    pid: list[int] = []
    recording: list[asyncio.Task[None]] = []
    starts: list[datetime | None] = []
    try:
        kw: dict[str, object] = {}
        if tty:
            size = os.get_terminal_size(0)
            kw = {"term_type": os.environ.get("TERM", "xterm"),
                  "term_size": (size.columns, size.lines)}
        command = remote_command(argv, devices, env)
        if not portable(command):
            probe = await asyncio.wait_for(conn.run(LOGIN_SHELL_PROBE, check=False), 30)
            shell = str(probe.stdout or "").strip().splitlines()[-1:] or ["unknown"]
            if shell[0] not in POSIX_SHELLS:
                say(f"{host.name}'s login shell is {clean(shell[0])}: an argument with a "
                    "backslash, a newline or '!' would not reach the job intact through it "
                    "(run a script on the host instead)")
                return JobResult(EXIT_REFUSED_SHELL, True, False)  # nothing was started
        proc = await conn.create_process(command, encoding=None, **kw)
        loop = asyncio.get_running_loop()
        signalling: set[asyncio.Task[None]] = set()

        def forward(sig: int) -> None:
            if sig == signal.SIGINT and tty:
                proc.stdin.write(b"\x03")  # what the key does on a terminal
                return
            if pid:
                t = loop.create_task(_signal_remote(conn, pid[0], sig))
                signalling.add(t)
                t.add_done_callback(signalling.discard)

        for s in FORWARDED:
            loop.add_signal_handler(s, forward, s)

        def resized() -> None:  # the terminal's new size, to the job's pty
            with contextlib.suppress(OSError, asyncssh.Error):
                size = os.get_terminal_size(0)
                proc.change_terminal_size(size.columns, size.lines)

        if tty:
            loop.add_signal_handler(signal.SIGWINCH, resized)
        raw = _raw_terminal() if tty else contextlib.nullcontext()
        try:
            with raw:
                pumps = [asyncio.create_task(_pump_out(proc.stdout, 1, store, rs, pid,
                                                       recording, say, starts)),
                         asyncio.create_task(_pump_plain(proc.stderr, 2))]
                feeder = _feed_stdin(loop, proc)
                try:
                    await proc.wait_closed()
                    said: set[str] = set()
                    for res in await asyncio.gather(*pumps, return_exceptions=True):
                        # Said, never swallowed; a lost connection is said below, once.
                        if isinstance(res, Exception) and not isinstance(
                                res, asyncssh.ConnectionLost):
                            why = str(res) or type(res).__name__
                            if why not in said:
                                said.add(why)
                                say(f"copying the job's output failed: {why}")
                finally:
                    feeder()
        finally:
            for s in (*FORWARDED, signal.SIGWINCH):
                loop.remove_signal_handler(s)
        status, sig = proc.exit_status, proc.exit_signal
        if status is None and sig is None:
            what = f"the job (pid {pid[0]})" if pid else "the job"
            say(f"the SSH connection to {host.name} was lost; {what} may still be running "
                f"there. Its reservation is kept until a gputop sees the job gone for "
                f"{config.reservations.job_grace_s:g}s (or it expires)")
            await _recorded(recording)
            return JobResult(EXIT_SSH, False)
        code = exit_code(status, sig[0] if sig else None)
        if pid:
            left = await _leftovers(lambda: alive_via(conn, host.name, config.defaults.timeout),
                                    pid[0], starts[0] if starts else None)
            if left:
                _say_left(say, code, left, host.name, config.reservations.job_grace_s)
                return JobResult(code, False)
        return JobResult(code, True)
    except (OSError, asyncssh.Error) as exc:
        say(f"the SSH connection to {host.name} failed: {clean(str(exc))}; the job "
            + (f"(pid {pid[0]}) may still be running; its reservation is kept until a "
               "gputop sees it gone" if pid else "was not started"))
        await _recorded(recording)
        return JobResult(EXIT_SSH, not pid, bool(pid))
    finally:
        for t in recording:
            t.cancel()
        conn.close()
        with contextlib.suppress(Exception):
            await jumps.close()


async def _signal_remote(conn: asyncssh.SSHClientConnection, pid: int, sig: int) -> None:
    """Signal every process of the job's session (its pid is the session id)."""
    name = signal.Signals(sig).name.removeprefix("SIG")
    cmd = (f"pkill -{name} -s {pid} 2>/dev/null || kill -{name} -- -{pid} 2>/dev/null || "
           f"kill -{name} {pid}")
    with contextlib.suppress(Exception):
        await asyncio.wait_for(conn.run(cmd), 10)


async def _pump_out(stream: asyncssh.SSHReader[bytes], fd: int, store: ReservationStore,
                    rs: Sequence[Reservation], pid: list[int],
                    recording: list[asyncio.Task[None]], say: Callable[[str], None],
                    starts: list[datetime | None]) -> None:
    """Find the marker line (the job's pid), record it (on its own task: a locked file
    never holds up the output), then copy the rest."""
    buf = b""
    while not pid:
        chunk = await stream.read(65536)
        if not chunk:
            return
        buf += chunk
        at = buf.find(MARKER)
        end = buf.find(b"\n", at) if at >= 0 else -1
        if end >= 0:
            words = buf[at + len(MARKER):end].decode("ascii", "replace").split()
            if words and words[0].isdigit() and len(words[0]) < 11:
                pid.append(int(words[0]))
                try:
                    start: datetime | None = parse_lstart(words[1:])
                except ValueError:  # no ps there: the pid alone, as before
                    start = None
                starts.append(start)
                recording.append(asyncio.create_task(_record(store, rs, pid[0], True, say,
                                                             start)))
            buf = buf[end + 1:]
            break
        if len(buf) > MAX_PREAMBLE:
            buf = buf[-len(MARKER):]
    if buf:
        _write(fd, buf)
    await _pump_plain(stream, fd)


async def _pump_plain(stream: asyncssh.SSHReader[bytes], fd: int) -> None:
    while chunk := await stream.read(65536):
        _write(fd, chunk)


def _write(fd: int, data: bytes) -> None:
    with contextlib.suppress(OSError):  # our terminal may be gone (SIGHUP): keep going
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]


def _feed_stdin(loop: asyncio.AbstractEventLoop,
                proc: asyncssh.SSHClientProcess[bytes]) -> Callable[[], None]:
    """Copy our stdin to the job; returns the function that stops it."""
    fd = 0

    def readable() -> None:
        try:
            data = os.read(fd, 65536)
        except OSError:
            data = b""
        try:
            if data:
                proc.stdin.write(data)
            else:
                loop.remove_reader(fd)
                proc.stdin.write_eof()
        except (OSError, asyncssh.Error, BrokenPipeError):
            loop.remove_reader(fd)

    try:
        loop.add_reader(fd, readable)
    except (OSError, ValueError, PermissionError):
        # A regular file (or /dev/null) cannot be polled: it never blocks, send it whole.
        with contextlib.suppress(OSError, asyncssh.Error):
            while data := os.read(fd, 65536):
                proc.stdin.write(data)
            proc.stdin.write_eof()
        return lambda: None

    def stop() -> None:
        with contextlib.suppress(Exception):
            loop.remove_reader(fd)

    return stop


@contextlib.contextmanager
def _raw_terminal() -> Iterator[None]:
    import termios
    import tty

    saved = termios.tcgetattr(0)
    tty.setraw(0)
    try:
        yield None
    finally:
        termios.tcsetattr(0, termios.TCSADRAIN, saved)


async def reap_quietly(config: Config, store: ReservationStore) -> None:
    with contextlib.suppress(Exception):
        await check_jobs(config, store)
