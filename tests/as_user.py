"""Run ``gputop`` as a real other user: a forked child that drops to the user's uid/gid.

The test users cannot exec this venv's interpreter (it may live under root's home), so the
child is forked from the test process and calls ``gputop.cli.main`` after ``setuid``: the
kernel then sees a different real user, which is what gputop's identity rule is about.
Everything the commands import lazily is imported before the fork (the user may not be able
to read the standard library): a new lazy import shows up as ModuleNotFoundError here.
"""

from __future__ import annotations

import contextlib
import os
import pwd
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path

from fleet import Fleet, ensure_test_users


@contextlib.contextmanager
def shared_tmp() -> Iterator[Path]:
    """A directory the test users can reach. Not under pytest's base temp: pytest makes
    that root-only again whenever a session starts (other test runs on the machine)."""
    d = Path(tempfile.mkdtemp(prefix="gputop-as-user-", dir="/tmp"))
    d.chmod(0o755)
    try:
        yield d
    finally:
        shutil.rmtree(d, ignore_errors=True)


def team_dir(root: Path) -> Path:
    """A directory both test users may write, like a team's shared one (the lock files are
    made writable for both: a real team shares a group instead)."""
    team = root / "team"
    team.mkdir()
    team.chmod(0o777)
    for name in ("reservations.json.lock", "reservations.json.flock"):
        lock = team / name
        lock.touch()
        lock.chmod(0o666)
    return team


def user_home(fleet: Fleet, root: Path, user: str) -> Path:
    """A copy of the fleet's client side (~/.ssh) that ``user`` owns and can read."""
    home = root / f"home-{user}"
    ssh = home / ".ssh"
    ssh.mkdir(parents=True)
    for name in ("id_ed25519", "known_hosts"):
        shutil.copy(fleet.ssh / name, ssh / name)
    (ssh / "config").write_text((fleet.ssh / "config").read_text()
                                .replace(str(fleet.ssh), str(ssh)))
    pw = pwd.getpwnam(user)
    for p in (home, ssh, *ssh.iterdir()):
        os.chown(p, pw.pw_uid, pw.pw_gid)
    ssh.chmod(0o700)
    (ssh / "id_ed25519").chmod(0o600)
    return home


_PRELOAD = ["gputop.cli", "gputop.cli.subcommands", "gputop.cli.targets", "gputop.cli.shares",
            "gputop.poller",
            "gputop.output",
            "gputop.reservations.flags", "gputop.sources.ssh", "gputop.sources.nvml",
            "gputop.sources.nvidia_smi", "asyncssh", "concurrent.futures.thread",
            "encodings.idna", "queue", "gputop.jobs.run", "gputop.jobs.reap",
            "gputop.jobs.wait", "gputop.jobs.remote", "gputop.reservations.queue", "termios",
            "tty", "shlex", "subprocess", "gputop.history.known", "sqlite3",
            "gputop.notify.delivery", "gputop.notify.routes"]


def preload() -> None:
    import importlib
    import pkgutil

    for name in _PRELOAD:
        importlib.import_module(name)
    import asyncssh

    for m in pkgutil.walk_packages(asyncssh.__path__, "asyncssh."):
        try:
            importlib.import_module(m.name)
        except Exception:  # optional backends (e.g. no libnettle)
            continue


def need_test_users() -> None:
    import pytest

    if os.geteuid() != 0 or set(ensure_test_users()) != {"gtalice", "gtbob"}:
        pytest.skip("needs root and the test users gtalice/gtbob")


def start_as(user: str, argv: Sequence[str], env: Mapping[str, str], out_dir: Path,
             tag: str | None = None) -> tuple[int, Path, Path]:
    """Fork ``gputop ARGV`` as ``user`` in the background: (pid, stdout file, stderr file)."""
    preload()
    pw = pwd.getpwnam(user)
    tag = tag or user
    out, err = out_dir / f".out.{tag}", out_dir / f".err.{tag}"
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:  # the child: never returns into pytest
        code = 70
        try:
            os.setpgid(0, 0)  # its own group: a test can signal it alone
            for fd, path in ((1, out), (2, err)):
                f = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
                os.dup2(f, fd)
                os.close(f)
            null = os.open(os.devnull, os.O_RDONLY)
            os.dup2(null, 0)
            sys.stdout = open(1, "w", closefd=False)  # noqa: SIM115
            sys.stderr = open(2, "w", closefd=False)  # noqa: SIM115
            import faulthandler  # (wait_as asks for the stacks of one that hangs)

            faulthandler.register(signal.SIGUSR1, file=sys.stderr, all_threads=True)
            os.setgroups([])
            os.setgid(pw.pw_gid)
            os.setuid(pw.pw_uid)
            os.environ.clear()
            os.environ.update(env)
            time.tzset()
            from gputop.cli import main

            code = main(list(argv))
        except BaseException as exc:  # reported through stderr and exit 70
            import traceback

            traceback.print_exception(exc)
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
    _ERR[pid] = err
    return pid, out, err


#: Each started process's stderr file, by pid (what a timeout reports).
_ERR: dict[int, Path] = {}


def wait_as(pid: int, timeout: float = 60.0) -> int:
    """The exit code of a process from ``start_as``. After ``timeout`` it is asked for
    every thread's stack (SIGUSR1: faulthandler, registered in the child), then
    SIGKILLed, and the TimeoutError carries the end of its stderr: where it was stuck."""
    deadline = time.monotonic() + timeout
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status)
        if time.monotonic() > deadline:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGUSR1)
            time.sleep(1.0)
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            err = _ERR.get(pid)
            tail = err.read_text(errors="replace")[-6000:] if err and err.exists() else ""
            raise TimeoutError(f"process {pid} still running after {timeout:g}s; its "
                               f"stderr ends:\n{tail}")
        time.sleep(0.02)


def run_as(user: str, argv: Sequence[str], env: Mapping[str, str], out_dir: Path,
           timeout: float = 60.0) -> subprocess.CompletedProcess[str]:
    """``gputop ARGV`` as ``user`` with exactly ``env``; stdout/stderr captured."""
    preload()
    pw = pwd.getpwnam(user)
    out, err = out_dir / f".out.{user}", out_dir / f".err.{user}"
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:  # the child: never returns into pytest
        code = 70
        try:
            for fd, path in ((1, out), (2, err)):
                f = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
                os.dup2(f, fd)
                os.close(f)
            sys.stdout = open(1, "w", closefd=False)  # noqa: SIM115
            sys.stderr = open(2, "w", closefd=False)  # noqa: SIM115
            os.setgroups([])
            os.setgid(pw.pw_gid)
            os.setuid(pw.pw_uid)
            os.environ.clear()
            os.environ.update(env)
            time.tzset()
            from gputop.cli import main

            code = main(list(argv))
        except BaseException as exc:  # reported through stderr and exit 70
            import traceback

            traceback.print_exception(exc)
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
    deadline = time.monotonic() + timeout
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            raise TimeoutError(f"gputop {' '.join(argv)} as {user}")
        time.sleep(0.02)
    return subprocess.CompletedProcess(list(argv), os.waitstatus_to_exitcode(status),
                                       out.read_text(), err.read_text())
