"""SSH to one configured host for jobs: the same resolution and host-key rules as the poller
(``~/.ssh/config``, known_hosts enforced, ProxyJump), plus which processes are alive there.
"""

from __future__ import annotations

import asyncio
import os
import pwd
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from typing import Any

import asyncssh

from gputop.config.load import Config
from gputop.config.tables import HostConfig
from gputop.model import HostSnapshot
from gputop.ssh.transport import JumpPool, known_hosts_for, resolve_options

#: ``ps`` prints only numbers, a state and a start time here (C locale, UTC): nothing a
#: remote user chooses can forge a row. A zombie (state Z: exited, not yet reaped by its
#: parent) is not a running job. The start time tells a job's pid from a stranger's that
#: got the same pid after the job ended.
#: The first line is the login's own uid: only its processes count as a ``run`` job's
#: session (a teammate who forks until he gets a dead job's pid, then ``setsid``s, leads a
#: session with that id, and kept the holder's reservation alive as long as he liked).
PS_COMMAND = ("exec env LC_ALL=C TZ=UTC0 sh -c "
              "'id -u && exec ps -A -o pid= -o sid= -o uid= -o stat= -o lstart='")
MAX_PS_BYTES = 8 * 1024 * 1024
_MONTHS = {m: i + 1 for i, m in enumerate(("Jan", "Feb", "Mar", "Apr", "May", "Jun", "Jul",
                                           "Aug", "Sep", "Oct", "Nov", "Dec"))}
#: Start times that differ by at most this much are the same process (rounding).
START_SLACK_S = 1.0


def parse_lstart(words: Sequence[str]) -> datetime:
    """``Mon Nov 30 09:01:07 2026`` (ps ``lstart`` in the C locale, TZ=UTC0) as UTC."""
    if len(words) != 5 or words[1] not in _MONTHS:
        raise ValueError(f"not a ps start time: {' '.join(words)[:60]!r}")
    hms = words[3].split(":")
    if not (words[2].isdigit() and words[4].isdigit() and len(hms) == 3
            and all(x.isdigit() for x in hms)):
        raise ValueError(f"not a ps start time: {' '.join(words)[:60]!r}")
    return datetime(int(words[4]), _MONTHS[words[1]], int(words[2]), int(hms[0]),
                    int(hms[1]), int(hms[2]), tzinfo=timezone.utc)


class JobHostError(Exception):
    """The host could not be asked (down, auth, timeout): its jobs' state is unknown."""


async def connect(config: Config, host: HostConfig,
                  jumps: JumpPool | None = None) -> tuple[asyncssh.SSHClientConnection,
                                                         JumpPool]:
    opts = resolve_options(host.address or host.name, ssh_config=config.defaults.ssh_config,
                           port=host.port, user=host.user)
    jumps = jumps or JumpPool(config.defaults.ssh_config)
    spec = opts.tunnel
    tunnel: Any = ()
    if isinstance(spec, str) and spec.lower() != "none":
        tunnel = await jumps.get(spec)
    conn = await asyncio.wait_for(asyncssh.connect(
        opts.host, opts.port, options=opts, tunnel=tunnel, known_hosts=known_hosts_for(opts),
        keepalive_interval=15, keepalive_count_max=3), config.defaults.timeout)
    return conn, jumps


def login_on(config: Config, host: HostConfig) -> str:
    """The account this gputop logs in as on ``host``: resolved exactly as ``connect``
    does (the config's ``user``, else ``~/.ssh/config``'s ``User``, else the real uid's
    name); the local user for a ``local`` host. Recorded with each reservation there, so
    that the holder's processes are known by either name."""
    me = pwd.getpwuid(os.getuid()).pw_name
    if host.local:
        return me
    try:
        opts = resolve_options(host.address or host.name, ssh_config=config.defaults.ssh_config,
                               port=host.port, user=host.user)
    except (OSError, ValueError, asyncssh.Error):
        return me  # connecting would fail the same way: nothing runs there as anyone
    return str(opts.username or me)


def logins(config: Config) -> Callable[[str], str | None]:
    """``login_on`` by host name (each resolved once), for the reservation commands."""
    hosts = {h.name: h for h in config.hosts}
    seen: dict[str, str | None] = {}

    def of(name: str) -> str | None:
        if name not in seen:
            seen[name] = login_on(config, hosts[name]) if name in hosts else None
        return seen[name]

    return of


def answered_logins(config: Config, snaps: Mapping[str, HostSnapshot]
                    ) -> Callable[[str], str | None]:
    """``logins``, for the hosts that answered under that login (``snaps``: as polled);
    None for a host that did not: a login that never logged in (a copied config's
    ``user``, keys that are not yours) must not make someone else's processes yours."""
    of = logins(config)

    def answered(name: str) -> str | None:
        h = snaps.get(name)
        return of(name) if h is not None and h.ok else None

    return answered


@dataclass(frozen=True)
class Alive:
    """The running processes on a host: pid -> (session id, start time if known), and
    which of them are not the login's own (``others``): a ``run`` job's session is the
    login's processes only."""

    procs: Mapping[int, tuple[int, datetime | None]]
    others: frozenset[int] = frozenset()

    def has(self, pid: int, session: bool, start: datetime | None = None) -> bool:
        """Whether the job is alive: process ``pid`` (``session``: any process of the
        session it leads). With ``start`` (when the job's pid started) a process with that
        pid but another start time is a stranger that got the pid after the job ended."""
        if not session:
            return pid in self.procs and _same(self.procs[pid][1], start)
        if pid in self.others:  # a teammate's process that got the pid and setsid'ed
            return bool(self.in_session(pid, start))
        if pid in self.procs and self.procs[pid][0] == pid:  # the session's leader runs
            return _same(self.procs[pid][1], start)
        return bool(self.in_session(pid, start))

    def in_session(self, sid: int, start: datetime | None = None) -> list[int]:
        """The processes of session ``sid`` (started no earlier than its leader did)."""
        return sorted(p for p, (s, t) in self.procs.items()
                      if s == sid and p not in self.others
                      and (start is None or t is None
                           or (t - start).total_seconds() >= -START_SLACK_S))

    def start_of(self, pid: int) -> datetime | None:
        return self.procs[pid][1] if pid in self.procs else None


def _same(seen: datetime | None, recorded: datetime | None) -> bool:
    return (seen is None or recorded is None
            or abs((seen - recorded).total_seconds()) <= START_SLACK_S)


def parse_ps(text: str) -> Alive:
    """:data:`PS_COMMAND`'s output: the login's uid, then ``pid sid uid stat [lstart]``
    rows."""
    procs: dict[int, tuple[int, datetime | None]] = {}
    others: set[int] = set()
    me, *lines = text.splitlines() or [""]
    if not me.strip().isdigit():
        raise ValueError(f"unexpected ps output: {me[:60]!r}")
    for line in lines:
        parts = line.split()
        if len(parts) not in (4, 9) or not all(p.isdigit() and len(p) < 11 for p in parts[:3]) \
                or not parts[3].isascii() or len(parts[3]) > 16:
            raise ValueError(f"unexpected ps output: {line[:60]!r}")
        if parts[3].startswith("Z"):
            continue
        procs[int(parts[0])] = (int(parts[1]), parse_lstart(parts[4:]) if parts[4:] else None)
        if parts[2] != me.strip():
            others.add(int(parts[0]))
    if not lines:
        raise ValueError("ps listed no processes")
    return Alive(procs, frozenset(others))


def local_start(pid: int) -> datetime | None:
    """When local process ``pid`` started (as ps computes ``lstart``), None if gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read(4096).rpartition(b")")[2].split()
        return _boot_time() + timedelta(seconds=int(fields[19]) // os.sysconf("SC_CLK_TCK"))
    except (OSError, IndexError, ValueError):
        return None


def _boot_time() -> datetime:
    with open("/proc/stat", "rb") as f:
        for line in f:
            if line.startswith(b"btime "):
                return datetime.fromtimestamp(int(line.split()[1]), timezone.utc)
    raise ValueError("no btime in /proc/stat")


def alive_local() -> Alive:
    procs: dict[int, tuple[int, datetime | None]] = {}
    others: set[int] = set()
    boot = _boot_time()
    hz = os.sysconf("SC_CLK_TCK")
    for name in os.listdir("/proc"):
        if name.isdigit():
            pid = int(name)
            try:
                with open(f"/proc/{name}/stat", "rb") as f:
                    fields = f.read(4096).rpartition(b")")[2].split()
                sid = os.getsid(pid)
                start = boot + timedelta(seconds=int(fields[19]) // hz)
            except (OSError, IndexError, ValueError):
                continue
            if fields[:1] == [b"Z"]:  # exited, not yet reaped: not running
                continue
            try:
                if os.stat(f"/proc/{name}").st_uid != os.getuid():
                    others.add(pid)
            except OSError:
                continue
            procs[pid] = (sid, start)
    return Alive(procs, frozenset(others))


async def alive_via(conn: asyncssh.SSHClientConnection, name: str, timeout: float) -> Alive:
    """Which processes run on the host of an open connection (one ``ps``)."""
    try:
        res = await asyncio.wait_for(conn.run(PS_COMMAND, encoding=None), timeout)
        out = res.stdout if isinstance(res.stdout, bytes) else b""
        if res.exit_status != 0 or len(out) > MAX_PS_BYTES:
            raise JobHostError(f"{name}: ps failed (exit {res.exit_status})")
        return parse_ps(out.decode("ascii", "replace"))
    except (OSError, asyncssh.Error, asyncio.TimeoutError, ValueError) as exc:
        raise JobHostError(f"{name}: {exc or type(exc).__name__}") from None


async def alive_on(config: Config, host: HostConfig) -> Alive:
    """Which processes run on ``host`` now; JobHostError if it cannot be asked."""
    if host.local:
        return await asyncio.to_thread(alive_local)
    try:
        conn, jumps = await connect(config, host)
    except (OSError, asyncssh.Error, asyncio.TimeoutError, ValueError) as exc:
        raise JobHostError(f"{host.name}: {exc or type(exc).__name__}") from None
    try:
        return await alive_via(conn, host.name, config.defaults.timeout)
    finally:
        conn.close()
        await jumps.close()
