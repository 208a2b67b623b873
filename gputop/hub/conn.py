"""The hub's connections: how many may be open (in all, and from one peer address), how
long a new one may take to ask, and how long one may stop reading.

aiohttp bounds neither. It writes a response after its handler returns with no deadline,
so a client that sends requests (pipelined, or one stream) and never reads held its
socket, its buffered answers and a place among ``--max-connections`` for as long as it
liked: six of them made the hub answer nobody. Here every connection's unsent bytes
are watched: a connection whose write buffer has not shrunk for ``write_timeout_s`` is
aborted (its buffer freed at once, not flushed), whatever was being written.

One global pool let one client hold every place with idle sockets (and the liveness
probe with them): each address has its share, a few places answer probes only, and a
connection that sends no whole request within ``first_request_s`` is aborted.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import struct
import sys
import time
from typing import Any, Protocol

from aiohttp import web

from gputop.text import excerpt


class Counts(Protocol):
    """What the guard counts in (the hub, for /metrics)."""

    connections_refused: int
    connections_stalled: int


class Throttled:
    """One line on stderr per event, at most one per ``every_s`` (with a count of those
    left out since): anyone who can connect decides how often it happens."""

    def __init__(self, every_s: float = 10.0) -> None:
        self.every_s, self.last, self.skipped = every_s, -1e9, 0

    def say(self, line: str) -> None:
        now = time.monotonic()
        if now - self.last < self.every_s:
            self.skipped += 1
            return
        self.last = now
        more = f" ({self.skipped} more since)" if self.skipped else ""
        self.skipped = 0
        print(f"gputop: hub: {excerpt(line, 160)}{more}", file=sys.stderr, flush=True)


def abort(transport: asyncio.Transport) -> None:
    """End a connection now with a reset, its unsent bytes dropped here and in the
    kernel. (asyncio's own abort closes the socket with a FIN, which waits behind the
    unsent bytes: a client that never reads would keep that connection, and the
    kernel's copy of them, for minutes.)"""
    sock = transport.get_extra_info("socket")
    if sock is not None:
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    transport.abort()


def peer_of(transport: asyncio.BaseTransport | None) -> str:
    """The peer's address (its port left out: one client, many sockets)."""
    peer = None if transport is None else transport.get_extra_info("peername")
    if isinstance(peer, tuple) and peer:
        return str(peer[0])
    return "a client"


def per_client_connections(limit: int) -> int:
    """``--max-connections-per-client``'s default: a quarter of the pool, at least 16,
    never more than the pool (a setup with a small pool keeps it whole)."""
    return min(limit, max(16, limit // 4))


def probe_reserve(limit: int) -> int:
    """Places of the pool kept for ``/-/healthy`` and ``/-/ready``: one in 16, at most 8
    (none under 16: a small pool stays as it was)."""
    return min(8, limit // 16)


#: The paths a connection in the reserve may ask.
PROBES = ("/-/healthy", "/-/ready")


class Guard:
    """The hub's bounds on connections: the pool (``limit``), each peer address's share
    of it (``per_client``), the reserve only probes may use, and which connections were
    let in only for a probe. A connection past a bound is closed at once, counted in
    ``gputop_hub_connections_refused`` and said in one line on stderr (rate-limited).

    aiohttp tells its server of each connection in ``connection_made`` and of its end in
    ``connection_lost``: both are wrapped (public methods of ``aiohttp.web_server.Server``
    that ``RequestHandler`` calls), so the per-peer counts need no walk of every
    connection."""

    def __init__(self, counts: Counts, runner: web.AppRunner, limit: int, *,
                 per_client: int | None = None, reserve: int | None = None,
                 log: Throttled | None = None) -> None:
        server = runner.server
        assert server is not None  # (after runner.setup())
        self.counts, self.limit = counts, limit
        self.per_client = per_client_connections(limit) if per_client is None else per_client
        self.reserve = probe_reserve(limit) if reserve is None else reserve
        self.log, self.log_client = log or Throttled(), Throttled()
        self.peers: dict[str, int] = {}
        self._peer_of: dict[object, str] = {}
        self.probe_only: set[object] = set()  # handlers let in for a probe only
        made, lost = server.connection_made, server.connection_lost

        def connection_made(handler: Any, transport: asyncio.Transport) -> None:
            made(handler, transport)
            self._made(handler, transport, len(server.connections))

        def connection_lost(handler: Any, exc: BaseException | None = None) -> None:
            lost(handler, exc)
            self._lost(handler)

        server.connection_made = connection_made  # type: ignore[method-assign]
        server.connection_lost = connection_lost  # type: ignore[method-assign]

    def _made(self, handler: Any, transport: asyncio.Transport, open_now: int) -> None:
        peer = peer_of(transport)
        self._peer_of[handler] = peer
        mine = self.peers[peer] = self.peers.get(peer, 0) + 1
        if open_now > self.limit:
            self.log.say(f"refused a connection from {peer}: {self.limit} already open "
                         "(--max-connections)")
        elif mine > self.per_client:
            self.log_client.say(f"refused a connection from {peer}: {self.per_client} "
                                "already open from that address "
                                "(--max-connections-per-client)")
        else:
            if open_now > self.limit - self.reserve:
                self.probe_only.add(handler)
            return
        self.counts.connections_refused += 1
        # (aiohttp's own task for it then ends at once, and what it sent is read and
        # dropped: a close with unread bytes would be a reset. Closing inside
        # ``connection_made`` ended the connection before that task started, which then
        # failed an assertion: a seven-line traceback per refusal.)
        handler._force_close = True
        sock = transport.get_extra_info("socket")
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_WR)
        asyncio.get_running_loop().call_soon(transport.close)

    def _lost(self, handler: object) -> None:
        self.probe_only.discard(handler)
        peer = self._peer_of.pop(handler, None)
        if peer is None:
            return
        left = self.peers.get(peer, 1) - 1
        if left > 0:
            self.peers[peer] = left
        else:
            self.peers.pop(peer, None)

    def allows(self, handler: object, path: str) -> bool:
        """Whether a request for ``path`` may be served on ``handler``'s connection: one
        let into the reserve serves probes only."""
        return handler not in self.probe_only or path in PROBES


def limit_connections(counts: Counts, runner: web.AppRunner, limit: int,
                      log: Throttled | None = None, *, per_client: int | None = None,
                      reserve: int | None = None) -> Guard:
    """Bound the hub's connections (see ``Guard``)."""
    return Guard(counts, runner, limit, per_client=per_client, reserve=reserve, log=log)


async def cut_stalled(counts: Counts, runner: web.AppRunner, write_timeout_s: float,
                      log: Throttled | None = None, *,
                      first_request_s: float | None = None) -> None:
    """Abort each connection whose unsent bytes have not shrunk for ``write_timeout_s``
    (its client stopped reading), and each that has not sent one whole request's line
    and headers within ``first_request_s`` of opening: run until cancelled. A client
    that reads, however slowly, shrinks its buffer and stays; one that asks stays until
    the idle limit between requests (aiohttp's keep-alive timeout)."""
    server = runner.server
    assert server is not None
    log = log or Throttled()
    seen: dict[int, tuple[asyncio.BaseTransport, int, float]] = {}
    born: dict[object, float] = {}
    every = max(0.05, min(1.0, write_timeout_s / 4, (first_request_s or 4.0) / 4))
    while True:
        await asyncio.sleep(every)
        now = time.monotonic()
        if first_request_s is not None:
            _cut_silent(counts, server._connections, born, now, first_request_s, log)
        live: set[int] = set()
        # (The server's own map, not each handler's ``transport``: aiohttp forgets that
        # when it closes a connection, though a close waits for the buffer to flush.)
        for transport in list(server._connections.values()):
            size = transport.get_write_buffer_size()
            if size == 0:  # (an aborted one too: its buffer is dropped)
                continue
            key = id(transport)
            live.add(key)
            was = seen.get(key)
            if was is None or was[0] is not transport or size < was[1]:
                seen[key] = (transport, size, now)
            elif now - was[2] >= write_timeout_s:
                counts.connections_stalled += 1
                log.say(f"closed a connection from {peer_of(transport)} that stopped reading "
                        f"({size} bytes unsent for {write_timeout_s:g} s)")
                abort(transport)
                live.discard(key)
            else:
                seen[key] = (transport, size, was[2])
        for key in list(seen):
            if key not in live:
                del seen[key]


def _cut_silent(counts: Counts, connections: dict[Any, asyncio.Transport],
                born: dict[object, float], now: float, first_request_s: float,
                log: Throttled) -> None:
    """Abort each connection open ``first_request_s`` (as first seen here, so within one
    turn of the loop) without one whole request. ``_request_count`` is aiohttp's count
    of the requests parsed on a connection (``RequestHandler``, aiohttp 3.x): where a
    later aiohttp has none, nothing is cut here and the idle limit still applies."""
    for handler in list(born):
        if handler not in connections:
            del born[handler]
    for handler, transport in list(connections.items()):
        asked = getattr(handler, "_request_count", None)
        if not isinstance(asked, int) or asked > 0 or transport.is_closing():
            born.pop(handler, None)
            continue
        since = born.setdefault(handler, now)
        if now - since >= first_request_s:
            counts.connections_stalled += 1
            log.say(f"closed a connection from {peer_of(transport)} that sent no request "
                    f"within {first_request_s:g} s (--first-request-timeout)")
            abort(transport)
            del born[handler]
