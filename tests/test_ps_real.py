"""The exact ``ps`` commands of the remote scripts, run for real (procps here, as on the
GPU servers): what a teammate's user name and command line can do to them."""

from __future__ import annotations

import os
import pwd
import subprocess
import time
from collections.abc import Iterator

import pytest

from gputop.sources.nvidia_smi import parse_args_rows, parse_owner_rows
from gputop.sources.protocol import PS_ARGS, PS_OWNERS

LONG_USER = "gt.teammate-longname"  # 20 characters: procps' default column shows 8


def _as(user: str, argv: list[str], env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
    pw = pwd.getpwnam(user)

    def drop() -> None:
        os.setgid(pw.pw_gid)
        os.setuid(pw.pw_uid)

    return subprocess.Popen(argv, preexec_fn=drop, env=env)


@pytest.fixture
def long_user() -> Iterator[str]:
    if os.geteuid() != 0:
        pytest.skip("needs root to create a user with a long name")
    try:
        pwd.getpwnam(LONG_USER)
    except KeyError:
        subprocess.run(["useradd", "-M", "-s", "/usr/sbin/nologin", LONG_USER], check=True,
                       capture_output=True)
    yield LONG_USER


def _sh(cmd: str, env: dict[str, str] | None = None) -> str:
    return subprocess.run(["sh", "-c", cmd], capture_output=True, text=True, check=True,
                          env=env, timeout=30).stdout


def test_a_long_user_name_is_read_whole(long_user: str) -> None:
    """``first.lastname`` must not read ``first.l+``: the holder of a reservation would be
    flagged for unreserved use on her own GPU."""
    p = _as(long_user, ["sleep", "30"])
    try:
        time.sleep(0.2)
        out = _sh(f'{PS_OWNERS} "{p.pid},{os.getpid()}"')
        owners = parse_owner_rows(out, [p.pid, os.getpid()])
    finally:
        p.kill()
        p.wait()
    assert owners[p.pid].user == long_user
    assert owners[os.getpid()].user == pwd.getpwuid(os.geteuid()).pw_name


def test_a_command_line_costs_at_most_512_bytes_even_under_utf8(long_user: str) -> None:
    """Zero-width characters take no columns: under a UTF-8 locale ``COLUMNS=4096`` let one
    process print 128 KiB, and 32 of them hid the host. The line is cut by bytes now."""
    zw = "\u200b" * 33_000
    p = _as(long_user, ["/bin/sh", "-c", "sleep 30; :", "job", zw, zw, zw])
    try:
        time.sleep(0.3)
        env = {**os.environ, "LANG": "C.UTF-8", "LC_ALL": "C.UTF-8"}
        out = subprocess.run(["sh", "-c", f'{PS_ARGS} "{p.pid}"'], capture_output=True,
                             env=env, check=True, timeout=30).stdout
    finally:
        p.kill()
        p.wait()
    assert len(out) <= 600, len(out)
    args = parse_args_rows(out.decode(errors="replace"), [p.pid])
    assert args[p.pid].startswith("/bin/sh -c sleep 30; : job")
