"""A host's one kept SSH connection: resolving it as ``ssh NAME`` would, reaching it, and
waiting after failures.

``~/.ssh/config`` is honoured the way ``ssh NAME`` would (HostName, User, Port,
IdentityFile, IdentitiesOnly, ProxyJump, the agent), except that hosts behind the same
ProxyJump share one connection to the jump host (:class:`JumpPool`): a bastion drops
unauthenticated connections beyond ``MaxStartups``.

Host keys are always checked against known_hosts: even a config that says
``UserKnownHostsFile none`` does not switch checking off here.

Nothing here knows how a host is read: the collection modes (:mod:`gputop.sources.query`,
:mod:`gputop.sources.stream_collector`) open their channels on :attr:`HostLink.conn`.
"""

from __future__ import annotations

import asyncio
import errno
import functools
import os
import pwd
import random
import re
import shlex
import socket
import time
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any

import asyncssh

from gputop.config.tables import HostConfig
from gputop.model import HostError
from gputop.pacing import unpaced
from gputop.text import excerpt

#: What runs on a new connection while it still holds its handshake slot.
Setup = Callable[[asyncssh.SSHClientConnection], Awaitable[None]]

#: How long a new connection may hold a handshake slot waiting for TCP to answer. A host
#: whose packets are dropped then waits for its TCP connection (and its SSH banner) without
#: a slot, so it cannot make healthy hosts later in the list wait behind it.
TCP_SLOT_S = 1.0

#: Errors worth a long pause before retrying: sshd penalises repeated auth failures, and
#: a host key will not fix itself.
SLOW_RETRY_KINDS = frozenset({"auth", "host-key"})

#: Unless ~/.ssh/config chooses (see resolve_options).
PREFERRED_CIPHERS = ("aes128-gcm@openssh.com", "aes256-gcm@openssh.com",
                     "chacha20-poly1305@openssh.com", "aes128-ctr", "aes256-ctr")


#: Appended to a failed host's last error while it waits for its next try.
WAITING_TO_RETRY = "(waiting to retry)"


class ParseError(ValueError):
    """Output that is not what was asked for; the message carries a sanitised excerpt."""


class ChannelClosed(Exception):
    """A channel (a query loop, the streaming session, the MIG read) ended before its
    answer was complete."""


class PhaseTimeout(Exception):
    """A connection phase did not finish in time; the message says which."""


class KeyLoadError(Exception):
    """A private key the SSH config names (``IdentityFile``) could not be loaded: the
    host was never asked, so this is the client's set-up, not the network."""

    def __init__(self, path: str, why: str) -> None:
        super().__init__(f"cannot load the key {path} (an IdentityFile of the SSH config): "
                         f"{why}")


def classify_exception(exc: BaseException) -> HostError:
    """Map what asyncssh / the socket layer raised to a classified host error."""
    msg = excerpt(str(exc) or type(exc).__name__)
    if isinstance(exc, PhaseTimeout):
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
        # (the resolver's own words, "Name or service not known", without "[Errno -2]")
        why = excerpt(exc.strerror) if exc.strerror else msg
        return HostError("unreachable", f"name resolution failed: {why}")
    if isinstance(exc, ConnectionRefusedError):
        return HostError("unreachable", "connection refused")
    if isinstance(exc, OSError) and exc.errno in (
        errno.EHOSTUNREACH, errno.ENETUNREACH, errno.EADDRNOTAVAIL, errno.ECONNRESET,
    ):
        return HostError("unreachable", msg)
    if isinstance(exc, asyncssh.DisconnectError):
        return HostError("ssh", msg)
    if isinstance(exc, ChannelClosed):
        return HostError("ssh", f"the remote script ended early: {msg}")
    if isinstance(exc, ParseError):
        return HostError("parse", msg)
    if isinstance(exc, KeyLoadError):
        return HostError("auth", msg)
    if isinstance(exc, OSError) and exc.filename:
        # A local file the SSH set-up reads (a key, the config, known_hosts): never the
        # host's fault ("unreachable: [Errno 13] Permission denied" sent people to the
        # network).
        return HostError("auth", f"cannot read {excerpt(str(exc.filename))}: "
                         f"{exc.strerror or type(exc).__name__}")
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
    opts = _options(**kwargs)
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
    return _options(opts, host=destination, **overrides)


def _options(*args: Any, **kwargs: Any) -> asyncssh.SSHClientConnectionOptions:
    """asyncssh's options, which load the config's keys: one it cannot load is a
    :class:`KeyLoadError` naming the file (asyncssh's own error names none)."""
    try:
        return asyncssh.SSHClientConnectionOptions(*args, **kwargs)
    except asyncssh.KeyImportError as exc:
        raise KeyLoadError(_unloadable_key(args, kwargs), str(exc)) from None


def _unloadable_key(args: tuple[Any, ...], kwargs: dict[str, Any]) -> str:
    """Which IdentityFile asyncssh could not load (best effort: "an IdentityFile")."""
    try:
        opts = asyncssh.SSHClientConnectionOptions(*args, **kwargs, client_keys=[])
        paths: Any = opts.config.get("IdentityFile", None) or ()
        for path in paths:
            try:
                asyncssh.read_private_key(os.path.expanduser(str(path)))
            except asyncssh.KeyImportError:
                return str(path)
            except Exception:  # noqa: S112 - unreadable or encrypted: not the one asked
                continue
    except Exception:  # noqa: S110 - the name is a courtesy; the error stands without it
        pass
    return "an IdentityFile"


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




class HostLink:
    """One host's kept SSH connection (:attr:`conn`), the handshake slot it takes while it
    connects, and the backoff after its failures."""

    def __init__(
        self,
        host: HostConfig,
        *,
        timeout: float,
        interval: float,
        ssh_config: Sequence[Path] | None,
        handshakes: asyncio.Semaphore,
        jumps: JumpPool,
        keepalive_s: float,
    ) -> None:
        self.host = host
        self.name = host.name
        self.timeout = timeout
        self.interval = interval
        #: Seconds between keepalives on new connections; 0 for none.
        self.keepalive_s = keepalive_s
        self._ssh_config = ssh_config
        self._handshakes = handshakes
        self._jumps = jumps
        self.conn: asyncssh.SSHClientConnection | None = None
        self._options: asyncssh.SSHClientConnectionOptions | None = None
        self._waiting_for = ""
        #: SSH connections opened, for tests and the benchmark.
        self.connects = 0
        self._failures = 0
        self.retry_at = 0.0
        self._last_error: HostError | None = None

    # -- backoff ---------------------------------------------------------------------------

    def reset(self) -> None:
        """Forget the backoff: the next query tries (connects) at once."""
        self._failures = 0
        self.retry_at = 0.0
        self._last_error = None

    def waiting(self) -> HostError | None:
        """The last error while the host waits for its next try, else None."""
        if self._last_error is None or time.monotonic() >= self.retry_at:
            return None
        # The same words on every refresh until the next try (a countdown here made
        # every --watch document differ for a host that had not changed).
        return HostError(self._last_error.kind,
                         f"{self._last_error.message} {WAITING_TO_RETRY}")

    def succeeded(self) -> None:
        self._failures = 0
        self._last_error = None

    def backoff(self, err: HostError) -> None:
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
        self.retry_at = time.monotonic() + delay * random.uniform(0.5, 1.0)

    # -- connection ------------------------------------------------------------------------

    def resolved(self) -> asyncssh.SSHClientConnectionOptions:
        if self._options is None:  # resolved once: reconnects skip re-reading ~/.ssh/config
            self._options = resolve_options(
                self.host.address or self.host.name,
                ssh_config=self._ssh_config,
                port=self.host.port,
                user=self.host.user,
            )
        return self._options

    def _tunnel_spec(self) -> str | None:
        spec = self.resolved().tunnel
        return spec if isinstance(spec, str) and spec.lower() != "none" else None

    def _direct(self) -> bool:
        """Whether gputop may open the TCP connection itself: not through a jump host or a
        ProxyCommand, and with no BindAddress or hostname canonicalisation to honour."""
        opts = self.resolved()
        return not (self._tunnel_spec() or opts.proxy_command or opts.local_addr
                    or opts.config.get("CanonicalizeHostname"))

    def keep_alive(self, seconds: float) -> None:
        """Keepalives every ``seconds`` from now on, on this connection and later ones."""
        self.keepalive_s = seconds
        if self.conn is not None:
            self.conn.set_keepalive(seconds)

    async def connect(self, sock: socket.socket | None = None) -> asyncssh.SSHClientConnection:
        """A new connection (over ``sock``, where given), kept as :attr:`conn`."""
        opts = self.resolved()
        spec = self._tunnel_spec()
        tunnel: Any = ()
        if spec:
            tunnel = await self._jumps.get(spec)
        conn = await asyncssh.connect(
            opts.host, opts.port, options=opts, tunnel=tunnel, sock=sock,
            keepalive_interval=self.keepalive_s, known_hosts=known_hosts_for(opts),
        )
        self.connects += 1
        self.conn = conn
        return conn

    async def _tcp(self) -> socket.socket:
        """A TCP connection to the host whose server has spoken (its SSH banner is waiting),
        tried address by address as ``ssh`` does."""
        opts = self.resolved()
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

    async def open(self, setup: Setup | None = None) -> float:
        """Connect (and run ``setup`` on the new connection), holding a handshake slot only for what
        costs the hosts and a shared bastion: key exchange, auth and session setup.

        A direct connection takes a slot, but gives it back if TCP has not answered within
        :data:`TCP_SLOT_S`, and waits for TCP and the server's banner without one (dropped
        packets or a silent listener then cost only this host its timeout). Waiting for a
        slot is not the host's fault: its time runs only while it holds one or waits for
        the network. Returns that time, spent from the host's ``timeout``.
        """
        self.drop()
        if not self._direct():  # e.g. a jump host's channel is the TCP connection
            async with self._handshakes:
                started = time.monotonic()
                await asyncio.wait_for(self._handshake(None, setup), self.timeout)
                return time.monotonic() - started
        tcp = asyncio.ensure_future(self._tcp())
        try:
            async with self._handshakes:
                started = time.monotonic()
                done, _ = await asyncio.wait({tcp}, timeout=min(TCP_SLOT_S, self.timeout))
                if done:
                    await asyncio.wait_for(self._handshake(tcp.result(), setup),
                                           self.timeout - (time.monotonic() - started))
                    return time.monotonic() - started
            done, _ = await asyncio.wait(
                {tcp}, timeout=max(0.0, self.timeout - (time.monotonic() - started)))
            if not done:
                opts = self.resolved()
                raise PhaseTimeout(f"no answer from {opts.host} port {opts.port} in "
                                    f"{self.timeout:g}s: {self._waiting_for}")
            spent = time.monotonic() - started
            sock = tcp.result()
            async with self._handshakes:
                started = time.monotonic()
                await asyncio.wait_for(self._handshake(sock, setup), max(0.1, self.timeout - spent))
                return spent + time.monotonic() - started
        finally:
            if not tcp.done():
                tcp.cancel()
            elif not tcp.cancelled() and tcp.exception() is None and self.conn is None:
                tcp.result().close()  # connected, but the handshake never took it

    async def _handshake(self, sock: socket.socket | None, setup: Setup | None) -> None:
        # Unpaced: a handshake's ten round trips must not each wait for a paced poll (once
        # the server has spoken: a silent host does not turn the pace off while it waits).
        with unpaced():
            conn = await self.connect(sock)
            if setup is not None:  # e.g. the query loop's channel: session setup, in the slot
                await setup(conn)

    def connected(self) -> bool:
        return self.conn is not None and not self.conn.is_closed()

    def drop(self) -> None:
        """Close the connection (its channels go with it) without waiting."""
        if self.conn is not None:
            self.conn.close()
            self.conn = None

    async def close(self) -> None:
        conn, self.conn = self.conn, None
        if conn is not None:
            conn.close()
            await conn.wait_closed()

    def classify(self, exc: BaseException) -> HostError:
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
                                     f"on {where}: `ssh {self.name}` must log in without a "
                                     "prompt (a key in ssh-agent or an IdentityFile in "
                                     "~/.ssh/config)")
        return err
