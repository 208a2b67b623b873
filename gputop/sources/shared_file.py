"""Which reservations store a config means: a path here, or ``HOST:/path`` over SSH.

Every user of the shared file (the CLI, the queue, ``run``, the board, history's recorder)
gets it from :func:`open_store`, so where the file lives is decided in one place. A remote
store connects with the poller's transport: ``~/.ssh/config`` resolution, known_hosts
always enforced, ProxyJump through a shared jump connection.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from pathlib import PurePosixPath
from typing import Any

import asyncssh

from gputop.config import Config
from gputop.reservations.remote import ConnectFailed, RemoteStore
from gputop.reservations.store import ReservationStore, Store
from gputop.sources.ssh import JumpPool, classify_exception, known_hosts_for, resolve_options

#: One RemoteStore (one kept connection) per file per process: commands that open the
#: store several times share it.
_REMOTES: dict[tuple[str, str, int, str | None, int | None, str | None], RemoteStore] = {}
_GUARD = threading.Lock()


def open_store(config: Config, *, warn: Callable[[str], None] | None = None
               ) -> ReservationStore:
    """The config's reservations store: :class:`Store` or :class:`RemoteStore`."""
    if config.reservations_host is None:
        return Store(config.reservations_path, warn=warn)
    name = config.reservations_host
    host = config.host(name)
    address = (host.address or host.name) if host is not None and not host.local else name
    port = host.port if host is not None else None
    user = host.user if host is not None else None
    key = (address, str(config.reservations_path), id(config.ssh_config), user, port,
           str(config.ssh_config))
    with _GUARD:
        store = _REMOTES.get(key)
        if store is None:
            store = RemoteStore(name, PurePosixPath(str(config.reservations_path)),
                                _connector(config, address, port, user),
                                timeout=config.timeout, warn=warn)
            _REMOTES[key] = store
        return store


def _connector(config: Config, address: str, port: int | None,
               user: str | None) -> Callable[[], Any]:
    jumps: list[JumpPool] = []

    async def connect() -> asyncssh.SSHClientConnection:
        opts: asyncssh.SSHClientConnectionOptions | None = None
        try:
            opts = resolve_options(address, ssh_config=config.ssh_config, port=port, user=user)
            spec = opts.tunnel
            tunnel: Any = ()
            if isinstance(spec, str) and spec.lower() != "none":
                if not jumps:
                    jumps.append(JumpPool(config.ssh_config))
                tunnel = await jumps[0].get(spec)
            return await asyncio.wait_for(asyncssh.connect(
                opts.host, opts.port, options=opts, tunnel=tunnel,
                known_hosts=known_hosts_for(opts), keepalive_interval=15,
                keepalive_count_max=3), config.timeout)
        except Exception as exc:  # every failure: one classified reason
            err = classify_exception(exc)
            if opts is not None and isinstance(exc, asyncssh.PermissionDenied):
                raise ConnectFailed(f"auth: authentication refused for user "
                                    f"{opts.username!r}") from None
            raise ConnectFailed(f"{err.kind}: {err.message}") from None

    return connect
