"""Which reservations store a config means: a path here, or ``HOST:/path`` over SSH.

Every user of the shared file (the CLI, the queue, ``run``, the board, history's recorder)
gets it from :func:`open_store`, so where the file lives is decided in one place. A remote
store connects with the poller's transport (:mod:`gputop.ssh.transport`):
``~/.ssh/config`` resolution, known_hosts always enforced, ProxyJump through a jump
connection, classified errors.
"""

from __future__ import annotations

import asyncio
import os
import threading
from collections.abc import Callable
from pathlib import PurePosixPath
from typing import Any

import asyncssh

from gputop.config.load import Config
from gputop.config.tables import HostConfig
from gputop.reservations.remote import ConnectFailed, RemoteStore
from gputop.reservations.store import ReservationStore, Store
from gputop.ssh.transport import HostLink, JumpPool

#: One RemoteStore (one kept connection) per file per process: commands that open the
#: store several times share it.
_REMOTES: dict[tuple[object, ...], RemoteStore] = {}
_GUARD = threading.Lock()


def open_store(config: Config, *, warn: Callable[[str], None] | None = None
               ) -> ReservationStore:
    """The config's reservations store: :class:`Store` or :class:`RemoteStore`, read with
    its ``max_duration`` (an expiry further ahead counts as created + max_duration)."""
    if config.reservations.host is None:
        return Store(config.reservations.path, warn=warn, max_s=config.reservations.max_s)
    name = config.reservations.host
    # A configured host's address, port and user apply; otherwise an SSH destination.
    known = config.host(name)
    host = known if known is not None and not known.local else HostConfig(name=name)
    key = (os.getpid(), name, str(config.reservations.path), host.address, host.port, host.user,
           str(config.defaults.ssh_config), config.defaults.timeout, config.reservations.max_s)
    with _GUARD:
        store = _REMOTES.get(key)
        if store is None:
            store = RemoteStore(name, PurePosixPath(str(config.reservations.path)),
                                _connector(config, host), timeout=config.defaults.timeout,
                                warn=warn, max_s=config.reservations.max_s)
            _REMOTES[key] = store
        return store


def _connector(config: Config, host: HostConfig) -> Callable[[], Any]:
    """The store host's kept connection, opened as the poller opens a host's
    (:class:`~gputop.ssh.transport.HostLink`: TCP first, a handshake slot, ProxyJump
    through a shared jump connection), with keepalives: the connection idles between
    reads, and a dead one must be noticed (the script's watchdog covers the writes)."""
    def new_link() -> HostLink:
        return HostLink(host, timeout=config.defaults.timeout, interval=config.defaults.interval,
                        ssh_config=config.defaults.ssh_config, handshakes=asyncio.Semaphore(1),
                        jumps=JumpPool(config.defaults.ssh_config), keepalive_s=15.0)

    links: dict[int, HostLink] = {}

    async def connect() -> asyncssh.SSHClientConnection:
        # Per process: a forked child must never touch (or close) its parent's connection.
        link = links.get(os.getpid())
        if link is None:
            links.clear()
            link = links[os.getpid()] = new_link()
        try:
            await link.open()
        except Exception as exc:  # every failure: one classified reason
            link.drop()
            err = link.classify(exc)
            raise ConnectFailed(f"{err.kind}: {err.message}") from None
        assert link.conn is not None
        return link.conn

    return connect
