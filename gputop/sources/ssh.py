"""Read a remote host's GPUs over one persistent SSH connection (asyncssh).

Per host: one connection and one exec channel running a constant POSIX shell loop
(:data:`~gputop.sources.nvidia_smi.REMOTE_SCRIPT`), both kept open. Per refresh: one line
sent, one block of output read back: one round trip, and no new session on the host.

``~/.ssh/config`` is honoured the way ``ssh NAME`` would (HostName, User, Port,
IdentityFile, IdentitiesOnly, ProxyJump, the agent), except that hosts behind the same
ProxyJump share one connection to the jump host: a bastion drops unauthenticated
connections beyond ``MaxStartups``.

Host keys are always checked against known_hosts: even a config that says
``UserKnownHostsFile none`` does not switch checking off here.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import functools
import os
import re
import shlex
import socket
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal

import asyncssh

from gputop.config import HostConfig
from gputop.model import GpuInfo, HostError
from gputop.sources.nvidia_smi import END, MARK, REMOTE_SCRIPT, parse_remote_output
from gputop.text import excerpt

#: Largest output accepted for one refresh (a host with thousands of processes stays far
#: below this; anything larger is not nvidia-smi talking).
MAX_OUTPUT = 4 * 1024 * 1024

#: Errors worth a long pause before retrying: sshd penalises repeated auth failures, and
#: a host key will not fix itself.
SLOW_RETRY_KINDS = frozenset({"auth", "host-key"})

PREFERRED_CIPHERS = ("aes128-gcm@openssh.com", "aes256-gcm@openssh.com",
                     "chacha20-poly1305@openssh.com", "aes128-ctr", "aes256-ctr")


class _ChannelClosed(Exception):
    """The streaming channel ended before a refresh was complete."""


def classify_exception(exc: BaseException) -> HostError:
    """Map what asyncssh / the socket layer raised to a classified host error."""
    msg = excerpt(str(exc) or type(exc).__name__)
    if isinstance(exc, (asyncio.TimeoutError, TimeoutError)):
        return HostError("timeout", "no answer in time")
    if isinstance(exc, asyncssh.HostKeyNotVerifiable):
        return HostError("host-key", f"host key not verified against known_hosts: {msg}")
    if isinstance(exc, asyncssh.PermissionDenied):
        return HostError("auth", f"authentication refused: {msg}")
    if isinstance(exc, asyncssh.ChannelOpenError):
        # Raised by a jump host that could not reach the target.
        if exc.code == asyncssh.OPEN_CONNECT_FAILED:
            return HostError("unreachable", f"via jump host: {msg}")
        return HostError("ssh", msg)
    if isinstance(exc, socket.gaierror):
        return HostError("unreachable", f"name resolution failed: {msg}")
    if isinstance(exc, ConnectionRefusedError):
        return HostError("unreachable", "connection refused")
    if isinstance(exc, OSError) and exc.errno in (
        errno.EHOSTUNREACH, errno.ENETUNREACH, errno.EADDRNOTAVAIL, errno.ECONNRESET,
    ):
        return HostError("unreachable", msg)
    if isinstance(exc, asyncssh.DisconnectError):
        return HostError("ssh", msg)
    if isinstance(exc, _ChannelClosed):
        return HostError("ssh", f"the remote script ended: {msg}")
    if isinstance(exc, FileNotFoundError):
        return HostError("auth", f"cannot read {exc.filename}: {exc.strerror}")
    if isinstance(exc, OSError):
        return HostError("unreachable", msg)
    return HostError("error", msg)


def known_hosts_for(opts: asyncssh.SSHClientConnectionOptions) -> Any:
    """The trusted keys for a connection, from the (cached) known_hosts files."""
    files = opts.known_hosts or ["~/.ssh/known_hosts"]
    if isinstance(files, (list, tuple)) and all(isinstance(f, str) for f in files):
        return KNOWN_HOSTS.get(files)
    return files


def resolve_options(
    destination: str,
    *,
    ssh_config: Sequence[Path] | None,
    port: int | None = None,
    user: str | None = None,
) -> asyncssh.SSHClientConnectionOptions:
    """Options as ``ssh destination`` would resolve them, with host-key checking forced on."""
    # config=() means "the default ~/.ssh/config", as connect() does; omitting it reads none.
    kwargs: dict[str, Any] = {
        "host": destination,
        "config": () if ssh_config is None else [str(p) for p in ssh_config],
    }
    if port:
        kwargs["port"] = port
    if user:
        kwargs["username"] = user
    opts = asyncssh.SSHClientConnectionOptions(**kwargs)
    overrides: dict[str, Any] = {}
    if opts.known_hosts is None:  # "UserKnownHostsFile none": never silently accept
        overrides["known_hosts"] = ["~/.ssh/known_hosts"]
    if opts.config.get("Ciphers") is None:
        # Unless ~/.ssh/config chooses: AES-GCM first. asyncssh's chacha20-poly1305 builds
        # cipher contexts in Python for every packet; AES-GCM costs a fraction of that CPU
        # per refresh, and is just as standard (OpenSSH offers both).
        overrides["encryption_algs"] = PREFERRED_CIPHERS
    if not overrides:
        return opts
    # Derived from opts: the config file already read is reused, not parsed again.
    return asyncssh.SSHClientConnectionOptions(opts, host=destination, **overrides)


class _MemoShlex:
    """shlex for asyncssh's config reader, memoised: it re-reads ~/.ssh/config for every
    host it resolves and splits every line again, so a config listing 200 hosts cost
    200 x 1,200 slow ``shlex.split`` calls at start-up. Same results, each line split once."""

    @staticmethod
    @functools.lru_cache(maxsize=65536)
    def _split(line: str) -> tuple[str, ...]:
        return tuple(shlex.split(line))

    @classmethod
    def split(cls, line: str) -> list[str]:
        return list(cls._split(line))  # a fresh list: callers may modify it


def _memoise_config_tokenizer() -> None:
    import asyncssh.config as ssh_config_module

    if getattr(ssh_config_module, "shlex", None) is shlex:  # only the layout we know
        ssh_config_module.shlex = _MemoShlex  # type: ignore[assignment,attr-defined]


_memoise_config_tokenizer()


class _KnownHostsCache:
    """known_hosts files read once and shared by every connection (asyncssh would parse
    them again per connection: 200 hosts x 200 entries); re-read when a file changes, so
    a key accepted with ``ssh NAME`` while gputop runs is seen at the next connect."""

    def __init__(self) -> None:
        self._cache: dict[tuple[str, ...], tuple[tuple[tuple[int, int], ...], Any]] = {}

    def get(self, paths: Sequence[str]) -> Any:
        files = tuple(str(Path(p).expanduser()) for p in paths)
        stamps = tuple(_mtime(f) for f in files)
        hit = self._cache.get(files)
        if hit is not None and hit[0] == stamps:
            return hit[1]
        readable = [f for f, m in zip(files, stamps) if m[0] >= 0]
        value = asyncssh.import_known_hosts("") if not readable else \
            asyncssh.read_known_hosts(readable)
        self._cache[files] = (stamps, value)
        return value


def _mtime(path: str) -> tuple[int, int]:
    try:
        st = os.stat(path)
    except OSError:
        return (-1, -1)
    return (st.st_mtime_ns, st.st_size)


KNOWN_HOSTS = _KnownHostsCache()


_HOP = re.compile(r"^(?:(?P<user>[^@]+)@)?(?P<host>\[[^\]]+\]|[^:]+)(?::(?P<port>\d+))?$")


class JumpPool:
    """One shared connection per distinct ProxyJump spec, opened on first use (by a host
    that already holds a handshake slot, so it takes none of its own)."""

    def __init__(self, ssh_config: Sequence[Path] | None) -> None:
        self._ssh_config = ssh_config
        self._conns: dict[str, asyncssh.SSHClientConnection] = {}
        self._locks: dict[str, asyncio.Lock] = {}
        self.opened = 0

    async def get(self, spec: str) -> asyncssh.SSHClientConnection:
        lock = self._locks.setdefault(spec, asyncio.Lock())
        async with lock:
            conn = self._conns.get(spec)
            if conn is not None and not conn.is_closed():
                return conn
            conn = await self._open(spec)
            self._conns[spec] = conn
            return conn

    async def _open(self, spec: str) -> asyncssh.SSHClientConnection:
        prev: asyncssh.SSHClientConnection | None = None
        for hop in spec.split(","):
            m = _HOP.match(hop.strip())
            if not m:
                raise ValueError(f"cannot parse ProxyJump {spec!r}")
            opts = resolve_options(
                m.group("host").strip("[]"),
                ssh_config=self._ssh_config,
                port=int(m.group("port")) if m.group("port") else None,
                user=m.group("user"),
            )
            prev = await asyncssh.connect(
                opts.host, opts.port, options=opts, tunnel=prev or (), keepalive_interval=30,
                known_hosts=known_hosts_for(opts),
            )
            self.opened += 1
        assert prev is not None
        return prev

    async def close(self) -> None:
        for conn in self._conns.values():
            conn.close()
        for conn in self._conns.values():
            await conn.wait_closed()
        self._conns.clear()


class SshSource:
    """One remote host: a persistent connection and channel, one refresh in flight at most."""

    kind: Literal["ssh"] = "ssh"

    def __init__(
        self,
        host: HostConfig,
        *,
        timeout: float,
        interval: float,
        ssh_config: Sequence[Path] | None,
        handshakes: asyncio.Semaphore,
        jumps: JumpPool,
    ) -> None:
        self.host = host
        self.name = host.name
        self.timeout = timeout
        self.interval = interval
        self._ssh_config = ssh_config
        self._handshakes = handshakes
        self._jumps = jumps
        self._conn: asyncssh.SSHClientConnection | None = None
        self._proc: asyncssh.SSHClientProcess[str] | None = None
        self._remote_pid: int | None = None
        #: A refresh is waiting for its answer / the kill of an abandoned one (for close()).
        self._in_flight = False
        self._killing: asyncio.Future[None] | None = None
        self._options: asyncssh.SSHClientConnectionOptions | None = None
        self._failures = 0
        self._retry_at = 0.0
        self._last_error: HostError | None = None
        #: SSH connections and exec channels opened, for tests and the benchmark.
        self.connects = 0
        self.channels = 0

    # -- connection ------------------------------------------------------------------------

    async def _connect(self) -> asyncssh.SSHClientConnection:
        if self._options is None:  # resolved once: reconnects skip re-reading ~/.ssh/config
            self._options = resolve_options(
                self.host.address or self.host.name,
                ssh_config=self._ssh_config,
                port=self.host.port,
                user=self.host.user,
            )
        opts = self._options
        spec = opts.tunnel if isinstance(opts.tunnel, str) else None
        tunnel: Any = ()
        if spec and spec.lower() != "none":
            tunnel = await self._jumps.get(spec)
        conn = await asyncssh.connect(
            opts.host, opts.port, options=opts, tunnel=tunnel,
            keepalive_interval=max(30.0, self.interval * 5), known_hosts=known_hosts_for(opts),
        )
        self.connects += 1
        return conn

    def _connected(self) -> bool:
        return self._conn is not None and not self._conn.is_closed()

    def _close_channel(self) -> None:
        if self._proc is not None:
            self._proc.close()  # stdin EOF: the remote loop ends
        self._proc, self._remote_pid = None, None

    def _drop(self) -> None:
        self._close_channel()
        if self._conn is not None:
            self._conn.close()
            self._conn = None

    # -- one refresh -----------------------------------------------------------------------

    async def query(self) -> tuple[list[GpuInfo], HostError | None]:
        """This host's GPUs, or its classified error. Never raises (but CancelledError)."""
        now = time.monotonic()
        if now < self._retry_at and self._last_error is not None:
            wait = self._retry_at - now
            return [], HostError(self._last_error.kind,
                                 f"{self._last_error.message} (retrying in {wait:.0f}s)")
        try:
            if self._connected():
                gpus, err = await asyncio.wait_for(self._query(fresh=False), self.timeout)
            else:
                # A new connection holds a slot for its handshake and first refresh (session
                # setup is the costly part for sshd and a shared bastion). Waiting for a slot
                # is not this host's fault: its timeout starts once it has one.
                async with self._handshakes:
                    gpus, err = await asyncio.wait_for(self._first_query(), self.timeout)
        except Exception as exc:  # every failure is this host's alone
            err = classify_exception(exc)
            if err.kind != "timeout" or not self._connected():
                self._drop()
            self._backoff(err)
            return [], err
        self._failures = 0
        self._last_error = None
        return gpus, err

    def _backoff(self, err: HostError) -> None:
        self._failures += 1
        self._last_error = err
        if err.kind in SLOW_RETRY_KINDS:
            delay = min(300.0, 60.0 * 2 ** (self._failures - 1))
        elif self._failures > 1:
            delay = min(60.0, self.interval * 2 ** (self._failures - 1))
        else:
            delay = 0.0
        self._retry_at = time.monotonic() + delay

    async def _first_query(self) -> tuple[list[GpuInfo], HostError | None]:
        self._drop()
        self._conn = await self._connect()
        return await self._query(fresh=True)

    async def _query(self, fresh: bool) -> tuple[list[GpuInfo], HostError | None]:
        assert self._conn is not None
        try:
            text = await self._refresh(self._conn)
        except (asyncssh.Error, BrokenPipeError, _ChannelClosed):
            if fresh:
                raise
            # The kept connection or channel died since the last refresh: reopen once, now.
            self._drop()
            self._conn = await self._connect()
            text = await self._refresh(self._conn)
        return parse_remote_output(text)

    async def _refresh(self, conn: asyncssh.SSHClientConnection) -> str:
        """One refresh on the streaming channel: send a line, read up to the end mark."""
        try:
            if self._proc is None:
                # The script sends its own stderr to stdout, in order. What arrives on the
                # channel's stderr comes from the user's shell startup files: not ours.
                proc = await conn.create_process(
                    REMOTE_SCRIPT, stderr=asyncssh.DEVNULL, encoding="utf-8", errors="replace")
                self._proc = proc
                self.channels += 1
                self._remote_pid = await self._read_start(proc)
                if self._remote_pid is None:  # not a POSIX shell running our script
                    self._close_channel()
                    return "the remote shell did not run the gputop script"
            assert self._proc is not None
            self._in_flight = True
            self._proc.stdin.write("\n")
            text = str(await self._proc.stdout.readuntil(f"{END}\n"))
        except asyncio.IncompleteReadError as exc:
            self._close_channel()
            raise _ChannelClosed(str(exc.partial)) from None
        except asyncio.CancelledError:
            # Timed out or shutting down: the refresh must not pile up on the remote host.
            # close() waits for this kill, should this task be cancelled again meanwhile.
            self._killing = asyncio.ensure_future(self._kill_remote(conn))
            await asyncio.shield(self._killing)
            raise
        finally:
            self._in_flight = False
        if len(text) > MAX_OUTPUT:
            return f"output larger than {MAX_OUTPUT} bytes"
        return text

    @staticmethod
    async def _read_start(proc: asyncssh.SSHClientProcess[str]) -> int | None:
        """The script's pid from its first line; lines a shell startup file printed before
        it (a banner in ~/.bashrc, say) are skipped."""
        for _ in range(200):
            line = await proc.stdout.readline()
            if not line:
                return None
            m = re.match(rf"{MARK} start (\d+)$", line.strip())
            if m:
                return int(m.group(1))
        return None

    async def _kill_remote(self, conn: asyncssh.SSHClientConnection) -> None:
        """Kill the remote loop's whole process group (sshd made it a session leader)."""
        pid = self._remote_pid
        self._close_channel()
        if not pid or pid <= 1:
            return
        try:
            await asyncio.wait_for(
                conn.run(f"kill -s KILL -- -{int(pid)}", check=False), timeout=1.5
            )
        except Exception:  # noqa: S110 - best effort; the connection may be gone too
            pass

    async def close(self) -> None:
        """End the remote loop and the connection. A refresh still in flight is killed on
        the host first (closing stdin would only end the loop after it), and a kill already
        under way is waited for: at shutdown nothing is left running there."""
        killing = self._killing
        if (killing is None or killing.done()) and self._in_flight and self._connected():
            assert self._conn is not None
            killing = asyncio.ensure_future(self._kill_remote(self._conn))
        if killing is not None and not killing.done():
            with contextlib.suppress(Exception, asyncio.CancelledError):
                await asyncio.wait_for(asyncio.shield(killing), timeout=2.0)
        self._close_channel()
        conn, self._conn = self._conn, None
        if conn is not None:
            conn.close()
            await conn.wait_closed()
