"""Read a remote host's GPUs over one persistent SSH connection (asyncssh).

Per host: one connection, kept open. Streaming (the default): one exec channel whose
session runs both ``nvidia-smi -lms`` loops and answers ``ps`` for new pids on its stdin,
multiplexed into one framed stdout (:mod:`gputop.sources.stream`); a refresh reads the
next sample and starts nothing on the host. Per-refresh query (``collection = "query"``, one-shot
``--json``, or a host that cannot stream): one exec channel running a constant POSIX shell
loop (:data:`~gputop.sources.nvidia_smi.REMOTE_SCRIPT`); per refresh one line sent (a fresh
nonce), one framed block read back (:mod:`gputop.sources.protocol`).

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
import pwd
import random
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
from gputop.pacing import unpaced
from gputop.sources import mig
from gputop.sources.nvidia_smi import (
    REMOTE_SCRIPT,
    AppRow,
    Owner,
    RemoteResult,
    attach_processes,
    index_warnings,
    parse_args_rows,
    parse_owner_rows,
    parse_sections,
)
from gputop.sources.protocol import (
    MARK,
    FramingError,
    LineReader,
    ParseError,
    Section,
    end_line,
    new_nonce,
    split_frame,
    start_pid,
)
from gputop.sources.stream import HostSession, NoAwk, SessionClosed, kill_group
from gputop.text import excerpt

#: Largest output accepted for one refresh (a host with thousands of processes stays far
#: below this; anything larger is not nvidia-smi talking). Enforced while reading.
MAX_OUTPUT = 4 * 1024 * 1024

#: How long a new connection may hold a handshake slot waiting for TCP to answer. A host
#: whose packets are dropped then waits for its TCP connection (and its SSH banner) without
#: a slot, so it cannot make healthy hosts later in the list wait behind it.
TCP_SLOT_S = 1.0

#: Errors worth a long pause before retrying: sshd penalises repeated auth failures, and
#: a host key will not fix itself.
SLOW_RETRY_KINDS = frozenset({"auth", "host-key"})

#: The MIG inventory (``nvidia-smi -L`` and ``-q -x``, see :mod:`gputop.sources.mig`) is
#: read again after this long, and sooner (at most every MIG_RETRY_S) when a refresh shows
#: what it does not know: a new MIG GPU, a new or gone process on one, an unknown MIG uuid.
MIG_REFRESH_S = 300.0
MIG_RETRY_S = 15.0
#: Largest inventory accepted: ``-q -x`` is about 30-120 KiB per GPU.
MIG_MAX_OUTPUT = 8 * 1024 * 1024
#: Run on its own channel, rarely: a nonce line in (never in the command line), the script's
#: pid (to kill its process group on a timeout), then the two outputs, each closed by a
#: marker with that nonce and its exit code. Nothing from the config is interpolated.
MIG_SCRIPT = (
    "IFS= read -r n || exit 0; case $n in *[!0-9a-f]*|'') exit 0 ;; esac; "
    f'printf "{MARK} %s start %s\\n" "$n" "$$"; '
    "nvidia-smi -L </dev/null 2>/dev/null; "
    f'printf "\\n{MARK} %s list %s\\n" "$n" "$?"; '
    "nvidia-smi -q -x </dev/null 2>/dev/null; "
    f'printf "\\n{MARK} %s xml %s\\n" "$n" "$?"'
)

#: A streaming host's first sample waits this long (at most one interval) for the apps
#: loop's first rows: it prints nothing while no process runs.
FIRST_APPS_WAIT_S = 1.0
#: ...and then this long for the rest of that first batch.
SETTLE_S = 0.05

PREFERRED_CIPHERS = ("aes128-gcm@openssh.com", "aes256-gcm@openssh.com",
                     "chacha20-poly1305@openssh.com", "aes128-ctr", "aes256-ctr")


#: Appended to a failed host's last error while it waits for its next try.
WAITING_TO_RETRY = "(waiting to retry)"


#: Intervals a pid may be missing from the samples and keep the owner ps gave for it.
OWNER_MEMORY = 3


class _ChannelClosed(Exception):
    """The streaming channel ended before a refresh was complete."""


class _PhaseTimeout(Exception):
    """A connection phase did not finish in time; the message says which."""


def classify_exception(exc: BaseException) -> HostError:
    """Map what asyncssh / the socket layer raised to a classified host error."""
    msg = excerpt(str(exc) or type(exc).__name__)
    if isinstance(exc, _PhaseTimeout):
        return HostError("timeout", str(exc))
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
        return HostError("ssh", f"the remote script ended early: {msg}")
    if isinstance(exc, ParseError):
        return HostError("parse", msg)
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
    if not user and opts.config.get("User") is None:
        # asyncssh's default login name comes from $USER/$LOGNAME; ssh's, like every
        # identity in gputop, from the real uid.
        real = pwd.getpwuid(os.getuid()).pw_name
        if opts.username != real:
            overrides["username"] = real
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


@functools.lru_cache(maxsize=64)
def _persistence_warning(off: tuple[int | None, ...]) -> str:
    """(The same words every sample: worked out once per set of GPUs.)"""
    return (f"persistence mode is off on GPU {', '.join(str(i) for i in off)}: every "
            "nvidia-smi start initialises the GPU again; enable nvidia-persistenced")


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
        first_sample_timeout: float = 60.0,
        collection: str = "stream",
    ) -> None:
        self.host = host
        self.first_sample_timeout = first_sample_timeout
        #: Streaming (one session per host: two nvidia-smi loops and ps) or one framed
        #: query per refresh; a host that cannot stream falls back to the query for good.
        self.streaming = collection == "stream"
        #: Why this host fell back to a query per refresh (shown among its warnings).
        self._fallback_note: str | None = None
        self._streams: HostSession | None = None
        self._first_deadline = 0.0
        self._opening: asyncio.Task[None] | None = None
        self._short_streams = 0
        self._stream_kills: set[asyncio.Task[None]] = set()
        self._seen_seq = 0
        self._starting = False
        #: The last answer was a new stream sample: the poller queries again at once (the
        #: query waits for the next sample) instead of sleeping first.
        self.paced = False
        #: Owners and command lines of the pids in the last sample, and when ps was asked.
        #: pid -> (owner, command line, when ps answered, when last in a sample, start)
        self._owners: dict[int, tuple[Owner, str | None, float, float, str | None]] = {}
        #: Probe cost: seconds the last stream took to its first sample.
        self.first_sample_s: float | None = None
        self.name = host.name
        self.timeout = timeout
        self.interval = interval
        self.max_output = MAX_OUTPUT
        self._ssh_config = ssh_config
        self._handshakes = handshakes
        self._jumps = jumps
        self._conn: asyncssh.SSHClientConnection | None = None
        self._proc: asyncssh.SSHClientProcess[bytes] | None = None
        self._remote_pid: int | None = None
        #: A refresh is waiting for its answer / the kill of an abandoned one (for close()).
        self._in_flight = False
        self._killing: asyncio.Future[None] | None = None
        self._options: asyncssh.SSHClientConnectionOptions | None = None
        self._failures = 0
        self._retry_at = 0.0
        self._last_error: HostError | None = None
        self._waiting_for = ""
        #: What the last refresh found odd in data it still shows (e.g. a GPU index twice).
        self.warnings: tuple[str, ...] = ()
        #: SSH connections and exec channels opened, for tests and the benchmark.
        self.connects = 0
        self.channels = 0
        self._mig: mig.Inventory | None = None
        self._sections: dict[str, Section] | None = None
        self._mig_at = -1e18  # monotonic time of the last inventory read
        self._mig_pids: frozenset[tuple[str | None, int]] = frozenset()
        #: MIG inventories read (each on a short-lived channel of its own), for tests.
        self.mig_reads = 0
        #: Streaming sessions started (one channel each), for tests and the benchmark.
        self.stream_starts = 0

    def reset(self) -> None:
        """Forget the backoff: the next query tries (connects) at once."""
        self._failures = 0
        self._retry_at = 0.0
        self._last_error = None

    # -- connection ------------------------------------------------------------------------

    def _resolved(self) -> asyncssh.SSHClientConnectionOptions:
        if self._options is None:  # resolved once: reconnects skip re-reading ~/.ssh/config
            self._options = resolve_options(
                self.host.address or self.host.name,
                ssh_config=self._ssh_config,
                port=self.host.port,
                user=self.host.user,
            )
        return self._options

    def _tunnel_spec(self) -> str | None:
        spec = self._resolved().tunnel
        return spec if isinstance(spec, str) and spec.lower() != "none" else None

    def _direct(self) -> bool:
        """Whether gputop may open the TCP connection itself: not through a jump host or a
        ProxyCommand, and with no BindAddress or hostname canonicalisation to honour."""
        opts = self._resolved()
        return not (self._tunnel_spec() or opts.proxy_command or opts.local_addr
                    or opts.config.get("CanonicalizeHostname"))

    async def _connect(self, sock: socket.socket | None = None) -> asyncssh.SSHClientConnection:
        opts = self._resolved()
        spec = self._tunnel_spec()
        tunnel: Any = ()
        if spec:
            tunnel = await self._jumps.get(spec)
        # Keepalives only for the query per refresh: a stream's samples flow every interval
        # and a silent one is a stall, killed and restarted at its limit. (asyncssh moves
        # its keepalive timer on every packet received: a timer armed and cancelled per
        # host per refresh, for nothing.)
        keepalive = 0.0 if self.streaming else max(30.0, self.interval * 5)
        conn = await asyncssh.connect(
            opts.host, opts.port, options=opts, tunnel=tunnel, sock=sock,
            keepalive_interval=keepalive, known_hosts=known_hosts_for(opts),
        )
        self.connects += 1
        return conn

    async def _tcp(self) -> socket.socket:
        """A TCP connection to the host whose server has spoken (its SSH banner is waiting),
        tried address by address as ``ssh`` does."""
        opts = self._resolved()
        loop = asyncio.get_running_loop()
        infos = await loop.getaddrinfo(opts.host, opts.port, family=opts.family or 0,
                                       type=socket.SOCK_STREAM)
        last: OSError | None = None
        self._waiting_for = "TCP did not connect"
        for family, type_, proto, _, addr in infos:
            sock = socket.socket(family, type_, proto)
            sock.setblocking(False)
            try:
                await loop.sock_connect(sock, addr)
            except OSError as exc:
                sock.close()
                last = exc
                continue
            except BaseException:
                sock.close()
                raise
            self._waiting_for = "TCP connected, but the server sent no SSH banner"
            try:
                await self._readable(sock)
            except BaseException:
                sock.close()
                raise
            return sock
        raise last or OSError(errno.EADDRNOTAVAIL, f"no address for {opts.host}")

    @staticmethod
    async def _readable(sock: socket.socket) -> None:
        loop = asyncio.get_running_loop()
        ready: asyncio.Future[None] = loop.create_future()

        def wake() -> None:
            if not ready.done():
                ready.set_result(None)

        loop.add_reader(sock.fileno(), wake)
        try:
            await ready
        finally:
            loop.remove_reader(sock.fileno())

    async def _open(self) -> float:
        """Connect and open the streaming channel, holding a handshake slot only for what
        costs the hosts and a shared bastion: key exchange, auth and session setup.

        A direct connection takes a slot, but gives it back if TCP has not answered within
        :data:`TCP_SLOT_S`, and waits for TCP and the server's banner without one (dropped
        packets or a silent listener then cost only this host its timeout). Waiting for a
        slot is not the host's fault: its time runs only while it holds one or waits for
        the network. Returns that time, spent from the host's ``timeout``.
        """
        self._drop()
        if not self._direct():  # e.g. a jump host's channel is the TCP connection
            async with self._handshakes:
                started = time.monotonic()
                await asyncio.wait_for(self._handshake(None), self.timeout)
                return time.monotonic() - started
        tcp = asyncio.ensure_future(self._tcp())
        try:
            async with self._handshakes:
                started = time.monotonic()
                done, _ = await asyncio.wait({tcp}, timeout=min(TCP_SLOT_S, self.timeout))
                if done:
                    await asyncio.wait_for(self._handshake(tcp.result()),
                                           self.timeout - (time.monotonic() - started))
                    return time.monotonic() - started
            done, _ = await asyncio.wait(
                {tcp}, timeout=max(0.0, self.timeout - (time.monotonic() - started)))
            if not done:
                opts = self._resolved()
                raise _PhaseTimeout(f"no answer from {opts.host} port {opts.port} in "
                                    f"{self.timeout:g}s: {self._waiting_for}")
            spent = time.monotonic() - started
            sock = tcp.result()
            async with self._handshakes:
                started = time.monotonic()
                await asyncio.wait_for(self._handshake(sock), max(0.1, self.timeout - spent))
                return spent + time.monotonic() - started
        finally:
            if not tcp.done():
                tcp.cancel()
            elif not tcp.cancelled() and tcp.exception() is None and self._conn is None:
                tcp.result().close()  # connected, but the handshake never took it

    async def _handshake(self, sock: socket.socket | None) -> None:
        # Unpaced: a handshake's ten round trips must not each wait for a paced poll (once
        # the server has spoken: a silent host does not turn the pace off while it waits).
        with unpaced():
            self._conn = await self._connect(sock)
            if not self.streaming:  # streams are opened after the handshake (_stream_query)
                await self._open_channel(self._conn)

    def _connected(self) -> bool:
        return self._conn is not None and not self._conn.is_closed()

    def _close_channel(self) -> None:
        if self._proc is not None:
            self._proc.close()  # stdin EOF: the remote loop ends
        self._proc, self._remote_pid = None, None

    def _drop(self) -> None:
        self._close_channel()
        self._cancel_opening()
        self._stop_streams()
        if self._conn is not None:
            self._conn.close()
            self._conn = None

    # -- one refresh -----------------------------------------------------------------------

    async def query(self) -> tuple[list[GpuInfo], HostError | None]:
        """This host's GPUs, or its classified error. Never raises (but CancelledError)."""
        self.paced = False
        now = time.monotonic()
        if now < self._retry_at and self._last_error is not None:
            # The same words on every refresh until the next try (a countdown here made
            # every --watch document differ for a host that had not changed).
            return [], HostError(self._last_error.kind,
                                 f"{self._last_error.message} {WAITING_TO_RETRY}")
        try:
            if self.streaming:
                result = await self._stream_query()
            else:
                opened = not self._connected()
                spent = await self._open() if opened else 0.0
                result = await asyncio.wait_for(self._query(reopen=not opened),
                                                max(0.1, self.timeout - spent))
        except Exception as exc:  # every failure is this host's alone
            err = self._classify(exc)
            if err.kind != "timeout" or not self._connected():
                self._drop()
            self._backoff(err)
            self.warnings = ()
            return [], err
        self._failures = 0
        self._last_error = None
        gpus, mig_warnings = await self._with_mig(result)
        note = (self._fallback_note,) if self._fallback_note else ()
        self.warnings = result.warnings + mig_warnings + note
        return gpus, result.error

    def _classify(self, exc: BaseException) -> HostError:
        """classify_exception, with what only this host knows: its name, user and keys."""
        err = classify_exception(exc)
        opts = self._options
        if opts is None:
            return err
        where = f"{self.name} ({opts.host} port {opts.port})"
        if err.kind == "host-key":
            known = known_hosts_for(opts)
            try:
                match = known.match(opts.host, "", opts.port)
                state = "changed" if match[0] or match[1] else "unknown"
            except Exception:  # a guess at the state must not hide the error
                state = "unknown or changed"
            entry = opts.host if opts.port == 22 else f"[{opts.host}]:{opts.port}"
            fix = (f"if the change is expected, run `ssh-keygen -R '{entry}'`, then "
                   f"`ssh {self.name}` to review the new key" if state == "changed"
                   else f"run `ssh {self.name}` to review and accept it")
            return HostError("host-key", f"host key of {where} is {state}: {fix}")
        if err.kind == "auth" and isinstance(exc, asyncssh.PermissionDenied):
            return HostError("auth", f"authentication refused for user {opts.username!r} "
                                     f"on {where}")
        return err

    def _backoff(self, err: HostError) -> None:
        """Wait longer after each failure, with jitter: many hosts failing at once (a network
        blip, a bastion restart) then retry spread out, not in synchronised bursts."""
        self._failures += 1
        self._last_error = err
        if err.kind in SLOW_RETRY_KINDS:
            delay = min(300.0, 60.0 * 2 ** (self._failures - 1))
        elif self._failures > 1:
            # Capped low: a host back from a reboot shows within seconds, not a minute.
            delay = min(max(15.0, 5 * self.interval), self.interval * 2 ** (self._failures - 1))
        else:
            delay = 0.0
        self._retry_at = time.monotonic() + delay * random.uniform(0.5, 1.0)

    async def _query(self, reopen: bool) -> RemoteResult:
        assert self._conn is not None
        try:
            if self._proc is None:
                await self._open_channel(self._conn)
            return await self._refresh()
        except (asyncssh.Error, BrokenPipeError, _ChannelClosed):
            if not reopen:
                raise
            # The kept connection or channel died since the last refresh: reopen once, now.
            self._drop()
            self._conn = await self._connect()
            await self._open_channel(self._conn)
            return await self._refresh()

    async def _open_channel(self, conn: asyncssh.SSHClientConnection) -> None:
        """Start the remote loop and read its start line (with a nonce of its own)."""
        # The script sends its own stderr to stdout, in order. What arrives on the channel's
        # stderr comes from the user's shell startup files: not ours.
        proc = await conn.create_process(REMOTE_SCRIPT, stderr=asyncssh.DEVNULL, encoding=None)
        self._proc = proc
        self.channels += 1
        nonce = new_nonce()
        proc.stdin.write(f"{nonce}\n".encode())
        # A shell startup file's banner may come first; 64 KiB of it is more than enough.
        reader = LineReader(64 * 1024)
        while True:
            data = await proc.stdout.read(65536)
            if not data:
                self._close_channel()
                raise _ChannelClosed("the remote shell did not run the gputop script")
            for line in reader.feed(data):
                pid = start_pid(line, nonce)
                if pid is not None:
                    self._remote_pid = pid
                    return

    async def _refresh(self) -> RemoteResult:
        """One refresh: send a fresh nonce, read lines up to exactly its end line."""
        proc = self._proc
        assert proc is not None and self._conn is not None
        nonce = new_nonce()
        end = end_line(nonce)
        reader = LineReader(self.max_output)
        lines: list[str] = []
        try:
            self._in_flight = True
            proc.stdin.write(f"{nonce}\n".encode())
            done = False
            while not done:
                data = await proc.stdout.read(65536)
                if not data:
                    self._close_channel()
                    tail = " ".join(lines[-3:]) or reader.tail()
                    raise _ChannelClosed(excerpt(tail) or "no output")
                for line in reader.feed(data):
                    if done:
                        raise FramingError("output after the end of the refresh")
                    if line == end:
                        done = True
                    else:
                        lines.append(line)
            if reader.pending:
                raise FramingError("output after the end of the refresh")
        except FramingError as exc:
            # Never read this channel again: whatever is still in flight is not trusted.
            await self._kill_remote(self._conn)
            return RemoteResult([], HostError("parse", str(exc)))
        except asyncio.CancelledError:
            # Timed out or shutting down: the refresh must not pile up on the remote host.
            # close() waits for this kill, should this task be cancelled again meanwhile.
            self._killing = asyncio.ensure_future(self._kill_remote(self._conn))
            await asyncio.shield(self._killing)
            raise
        finally:
            self._in_flight = False
        try:
            sections = split_frame(lines, nonce)
        except FramingError as exc:
            self._close_channel()  # the next refresh opens a new channel
            return RemoteResult([], HostError("parse", str(exc)))
        self._sections = sections  # parsed again if it names MIG uuids not yet known
        return parse_sections(sections, self._mig.parents if self._mig else None)

    # -- MIG inventory (rare: its own channel, on the kept connection) ------------------------

    async def _with_mig(self, result: RemoteResult) -> tuple[list[GpuInfo], tuple[str, ...]]:
        """The refresh's GPUs with their MIG instances, reading the inventory again when it
        is old or the refresh shows what it does not know. Never raises: an inventory that
        cannot be read is a warning, and the GPUs are shown without instances."""
        gpus = result.gpus
        migs = [g for g in gpus if mig.is_mig(g)]
        if not migs:
            self._mig = None
            return gpus, ()
        pids = frozenset((g.uuid, p.pid) for g in migs for p in g.processes)
        now = time.monotonic()
        due = (now - self._mig_at >= MIG_REFRESH_S
               or (now - self._mig_at >= MIG_RETRY_S
                   and (pids != self._mig_pids
                        or mig.unknown(gpus, self._mig, result.unknown_mig))))
        warnings: list[str] = []
        if due and self._conn is not None:
            self._mig_at = now
            try:
                inventory = await asyncio.wait_for(self._read_mig(self._conn), self.timeout)
            except Exception as exc:  # the GPUs are still shown, without instances
                warnings.append(f"MIG inventory not read: {classify_exception(exc).message}")
            else:
                self._mig, self._mig_pids = inventory, pids
                if result.unknown_mig and self._sections is not None:
                    # Processes reported under MIG uuids just learnt: place them now.
                    again = parse_sections(self._sections, inventory.parents)
                    gpus = again.gpus if again.error is None else gpus
        if self._mig is None:
            return gpus, tuple(warnings)
        return mig.attach(gpus, self._mig), tuple(warnings) + self._mig.warnings

    async def _read_mig(self, conn: asyncssh.SSHClientConnection) -> mig.Inventory:
        """Run :data:`MIG_SCRIPT` once; its output is bounded while it is read."""
        proc = await conn.create_process(MIG_SCRIPT, stderr=asyncssh.DEVNULL, encoding=None)
        self.mig_reads += 1  # its own count: ``channels`` counts the refresh channel
        nonce = new_nonce()
        reader = LineReader(MIG_MAX_OUTPUT)
        pid: int | None = None
        parts: dict[str, tuple[str, int]] = {}
        buf: list[str] = []
        prefix = f"{MARK} {nonce} "
        try:
            proc.stdin.write(f"{nonce}\n".encode())
            while len(parts) < 2:
                data = await proc.stdout.read(65536)
                if not data:
                    raise _ChannelClosed("the MIG inventory script ended early")
                for line in reader.feed(data):
                    if pid is None:
                        pid = start_pid(line, nonce)
                        continue
                    if not line.startswith(prefix):
                        buf.append(line)
                        continue
                    name, _, rc = line[len(prefix):].partition(" ")
                    expected = ("list", "xml")[len(parts)] if len(parts) < 2 else None
                    if name != expected or not rc.isdigit():
                        raise FramingError(f"unexpected marker in the MIG inventory: "
                                           f"{excerpt(line)}")
                    parts[name] = ("\n".join(buf), int(rc))
                    buf = []
        except BaseException:
            if pid and pid > 1:
                await asyncio.shield(kill_group(conn, pid))
            raise
        finally:
            proc.close()
        listed, xml = parts["list"], parts["xml"]
        return mig.build_inventory(listed[0] if listed[1] == 0 else None,
                                   xml[0] if xml[1] == 0 else None)

    async def _kill_remote(self, conn: asyncssh.SSHClientConnection) -> None:
        """Kill the remote loop's whole process group and forget its channel."""
        pid = self._remote_pid
        self._close_channel()
        await kill_group(conn, pid)

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
        st = self._streams
        if st is not None and st.ps_pending and self._connected():
            # Its shell waits on that ps and would not see stdin close: kill the group.
            self._streams = None
            with contextlib.suppress(Exception, asyncio.CancelledError):
                await asyncio.wait_for(st.kill(), timeout=2.0)
        if self._stream_kills:  # kills of stalled sessions still under way
            with contextlib.suppress(Exception, asyncio.CancelledError):
                await asyncio.wait(set(self._stream_kills), timeout=2.0)
        self._close_channel()
        self._cancel_opening()
        self._stop_streams()
        conn, self._conn = self._conn, None
        if conn is not None:
            conn.close()
            await conn.wait_closed()

    # -- streaming -------------------------------------------------------------------------

    async def _start_streams(self, conn: asyncssh.SSHClientConnection) -> None:
        self._stop_streams()
        # Command lines get half the timeout: a ps that cannot read one is cut short in
        # time for the refresh to show the owners (a loaded host's ps may need a second).
        streams = HostSession(conn, self.interval, self.max_output,
                              args_wait_s=max(1, int(self.timeout / 2)))
        self._seen_seq = 0
        self.stream_starts += 1
        try:
            with unpaced():
                await streams.start()
        except BaseException:
            streams.close()
            raise
        finally:
            self.channels += streams.channels
        self._streams = streams

    def _kill_streams(self, st: HostSession) -> None:
        """Kill a stalled session on the host in the background: the answer does not wait."""
        if self._streams is st:
            self._streams = None
        task = asyncio.create_task(st.kill())
        self._stream_kills.add(task)
        task.add_done_callback(self._stream_kills.discard)

    def _stop_streams(self) -> None:
        if self._streams is not None:
            self._streams.close()
            self._streams = None

    async def _fall_back(self, why: str) -> RemoteResult:
        """Collect with a query per refresh from now on (a host that cannot stream)."""
        self.streaming = False
        self._fallback_note = f"{why}: collecting with a query per refresh"
        if self._conn is not None:  # connected to stream, without keepalive: as a query's
            self._conn.set_keepalive(max(30.0, self.interval * 5))
        self._stop_streams()
        self._close_channel()
        self.warnings = ()
        return await asyncio.wait_for(self._query(reopen=False), self.timeout)

    async def _stream_query(self) -> RemoteResult:
        """The next GPU sample of this host's streams (waiting for it), with processes.

        Starts the streams when there are none; restarts them (once per refresh) when they
        ended; a stream with no sample for ``max(timeout, 3 x interval)`` is a timeout and
        is killed on the host (the caller's backoff then delays the restart). Before the
        first sample the host is ``starting`` until ``first_sample_timeout``.
        """
        asked = time.monotonic()
        if not self._connected():
            self._first_deadline = asked + self.first_sample_timeout  # connecting included
            await self._open()
        if self._streams is None:
            try:
                starting = await self._await_streams(asked)
            except NoAwk:
                return await self._fall_back("no awk on the host")
            if starting is not None:
                return starting
        restarted = False
        while True:
            st = self._streams
            assert st is not None and self._conn is not None
            if st.error is not None:
                err = st.error
                cannot_stream = st.first_at is None and err.kind == "error"
                await st.kill()
                self._streams = None
                if cannot_stream:  # e.g. an nvidia-smi without -lms: query per refresh
                    return await self._fall_back(f"nvidia-smi cannot stream ({err.message})")
                return RemoteResult([], err)
            if st.seq > self._seen_seq:
                return await self._sample(st)
            if st.ended is not None:
                self._stop_streams()
                # A loop that ends after every sample (e.g. a lost GPU, where nvidia-smi
                # exits 15) costs the host more than a query per refresh: fall back.
                self._short_streams = self._short_streams + 1 if st.seq <= 1 else 0
                if self._short_streams >= 3:
                    return await self._fall_back("nvidia-smi's stream ends after every sample")
                if restarted:
                    raise _ChannelClosed(f"nvidia-smi's stream ended (exit {st.ended})")
                self._first_deadline = time.monotonic() + self.first_sample_timeout
                try:
                    await asyncio.wait_for(self._start_streams(self._conn), self.timeout)
                except NoAwk:
                    return await self._fall_back("no awk on the host")
                restarted = True
                continue
            now = time.monotonic()
            if st.first_at is None:
                first_deadline = self._first_deadline
                wait = self.interval if self._starting else self.timeout
                until = min(first_deadline, asked + wait)
                if now >= until:
                    if now < first_deadline:
                        return self._starting_result()
                    self._kill_streams(st)
                    raise _PhaseTimeout(f"nvidia-smi sent no sample in "
                                        f"{self.first_sample_timeout:g}s (first_sample_timeout)")
            else:
                limit = max(self.timeout, 3 * self.interval)
                until = st.last_at + limit
                if now >= until:
                    self._kill_streams(st)
                    raise _PhaseTimeout(f"nvidia-smi's stream sent no sample in {limit:g}s; "
                                        "restarting it")
            await st.changed(until - now)

    async def _await_streams(self, asked: float) -> RemoteResult | None:
        """Open the session (an SSH session set-up: on a busy host that alone takes a while).

        Opening runs on in the background and counts against ``first_sample_timeout``, not
        ``timeout``: until then the host is ``starting``, and a refresh that comes back
        finds the opening where it was instead of starting it again."""
        assert self._conn is not None
        if self._opening is None:
            if self._first_deadline < asked:
                self._first_deadline = asked + self.first_sample_timeout
            self._opening = asyncio.create_task(self._start_streams(self._conn))
        opening = self._opening
        wait = self.interval if self._starting else self.timeout
        until = min(self._first_deadline, asked + wait)
        done, _ = await asyncio.wait({opening}, timeout=max(0.0, until - time.monotonic()))
        if not done:
            if time.monotonic() < self._first_deadline:
                return self._starting_result()
            self._cancel_opening()
            if self._conn is not None:  # a channel open unanswered: the connection is dead
                self._conn.abort()
            raise _PhaseTimeout(f"the nvidia-smi streams did not open in "
                                f"{self.first_sample_timeout:g}s (first_sample_timeout)")
        self._opening = None
        opening.result()  # raises what opening raised
        return None

    def _starting_result(self) -> RemoteResult:
        self._starting = True
        since = self._first_deadline - self.first_sample_timeout
        return RemoteResult([], HostError(
            "starting", f"starting nvidia-smi: {time.monotonic() - since:.0f} s"))

    def _cancel_opening(self) -> None:
        if self._opening is not None:
            self._opening.cancel()
            self._opening = None

    async def _sample(self, st: HostSession) -> RemoteResult:
        """The newest GPU sample with the apps stream's processes and their owners."""
        first = self._seen_seq == 0
        self._seen_seq = st.seq
        self.paced = True  # a new sample: the next query waits for the next one
        self._starting = False
        self.first_sample_s = st.first_sample_s
        if first and not st.apps.seen:
            # Both loops started together; the apps one prints nothing without processes.
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._apps_seen(st),
                                       min(FIRST_APPS_WAIT_S, self.interval))
        gpus = st.gpus
        now = time.monotonic()
        apps = st.apps.for_sample(st.stamp)
        if apps or self._owners:
            owners, args = await self._owners_of(st, apps, now)
            gpus = attach_processes(gpus, apps, owners, args)
        warnings = index_warnings(gpus)
        off = tuple(g.index for g in gpus if g.persistence_mode == "Disabled")
        if off:
            warnings.append(_persistence_warning(off))
        return RemoteResult(gpus, None, tuple(warnings))

    @staticmethod
    async def _apps_seen(st: HostSession) -> None:
        while not st.apps.seen:
            await st.changed(FIRST_APPS_WAIT_S)
        await asyncio.sleep(SETTLE_S)  # the rest of its first batch

    async def _owners_of(self, st: HostSession, apps: list[AppRow],
                         now: float) -> tuple[dict[int, Owner], dict[int, str]]:
        """Owners and command lines: ``ps`` only for processes not seen lately. A process
        is its pid and its start time (the session appends it to each apps row): a pid
        reused by another process, even from one sample to the next, is asked again. A
        known process missing from a sample or two (a late apps batch on a loaded host)
        keeps its owner for ``OWNER_MEMORY`` intervals; where the start time is unknown
        (no /proc), only while it stays in every sample."""
        pids = list(dict.fromkeys(a.pid for a in apps))
        starts = {a.pid: a.start for a in apps}
        keep = OWNER_MEMORY * self.interval
        self._owners = {
            p: v for p, v in self._owners.items()
            if (p in starts and starts[p] == v[4])
            or (p not in starts and v[4] is not None and now - v[3] <= keep)}
        for p in pids:
            if p in self._owners:
                self._owners[p] = (*self._owners[p][:3], now, self._owners[p][4])
        new = [p for p in pids if p not in self._owners]
        if new:
            found, cmds = await self._ask_ps(st, new)
            for p in new:
                o = found.get(p)
                if o is not None:
                    self._owners[p] = (o, cmds.get(p), now, now, starts[p])
        owners: dict[int, Owner] = {}
        args: dict[int, str] = {}
        for p in pids:
            if p not in self._owners:
                continue
            o, cmd, at, _seen, _start = self._owners[p]
            age = None if o.elapsed_s is None else o.elapsed_s + int(now - at)
            owners[p] = Owner(o.pid, o.user, age)
            if cmd:
                args[p] = cmd
        return owners, args

    async def _ask_ps(self, st: HostSession,
                      pids: list[int]) -> tuple[dict[int, Owner], dict[int, str]]:
        """One round trip on the session's stdin: ``NONCE PIDS`` -> owners, args. A ps
        that hangs, or an answer whose frame does not check out, ends the session (killed
        on the host, restarted by a later refresh): that refresh is the host's error."""
        try:
            sections = await asyncio.wait_for(st.ask_ps(pids), self.timeout)
        except SessionClosed:
            # The loops ended meanwhile (e.g. a lost GPU): this sample is shown without
            # owners; the next refresh restarts the session and asks again.
            return {}, {}
        except BaseException:
            self._kill_streams(st)
            raise
        return (parse_owner_rows(sections["owners"].text, pids),
                parse_args_rows(sections["args"].text, pids))
