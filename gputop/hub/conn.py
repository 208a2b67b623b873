"""The hub's connections: how many may be open, and how long one may stop reading.

aiohttp bounds neither. It writes a response after its handler returns with no deadline,
so a client that sends requests (pipelined, or one stream) and never reads held its
socket, its buffered answers and a place among ``--max-connections`` for as long as it
liked: six of them made the hub answer nobody. Here every connection's unsent bytes
are watched: a connection whose write buffer has not shrunk for ``write_timeout_s`` is
aborted (its buffer freed at once, not flushed), whatever was being written.
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


def _peer(transport: asyncio.BaseTransport) -> str:
    peer = transport.get_extra_info("peername")
    if isinstance(peer, tuple) and peer:
        return str(peer[0])
    return "a client"


def limit_connections(counts: Counts, runner: web.AppRunner, limit: int,
                      log: Throttled | None = None) -> None:
    """Close a connection at once when ``limit`` are already open (counted in
    ``gputop_hub_connections_refused``, one line each on stderr, rate-limited). aiohttp
    tells its server of each new connection in ``connection_made``, which this wraps. The
    close waits one turn of the loop: closing inside ``connection_made`` ended the
    connection before aiohttp's own task for it started, which then failed an assertion
    (a seven-line traceback per refusal); that task is told to end instead."""
    server = runner.server
    assert server is not None  # (after runner.setup())
    made = server.connection_made
    log = log or Throttled()

    def connection_made(handler: Any, transport: asyncio.Transport) -> None:
        made(handler, transport)
        if len(server.connections) > limit:
            counts.connections_refused += 1
            log.say(f"refused a connection from {_peer(transport)}: {limit} already open "
                    "(--max-connections)")
            # (aiohttp's own task for it then ends at once, and what it sent is read
            # and dropped: a close with unread bytes would be a reset.)
            handler._force_close = True
            sock = transport.get_extra_info("socket")
            if sock is not None:
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_WR)
            asyncio.get_running_loop().call_soon(transport.close)

    server.connection_made = connection_made  # type: ignore[method-assign]


async def cut_stalled(counts: Counts, runner: web.AppRunner, write_timeout_s: float,
                      log: Throttled | None = None) -> None:
    """Abort each connection whose unsent bytes have not shrunk for ``write_timeout_s``
    (its client stopped reading): run until cancelled. A client that reads, however
    slowly, shrinks its buffer and stays."""
    server = runner.server
    assert server is not None
    log = log or Throttled()
    seen: dict[int, tuple[asyncio.BaseTransport, int, float]] = {}
    every = max(0.05, min(1.0, write_timeout_s / 4))
    while True:
        await asyncio.sleep(every)
        now = time.monotonic()
        live: set[int] = set()
        # (The server's own map, not each handler's ``transport``: aiohttp forgets that
        # when it closes a connection, though a close waits for the buffer to flush.)
        for transport in list(server._connections.values()):
            size = transport.get_write_buffer_size()
            if size == 0:
                continue
            key = id(transport)
            live.add(key)
            was = seen.get(key)
            if was is None or was[0] is not transport or size < was[1]:
                seen[key] = (transport, size, now)
            elif now - was[2] >= write_timeout_s:
                counts.connections_stalled += 1
                log.say(f"closed a connection from {_peer(transport)} that stopped reading "
                        f"({size} bytes unsent for {write_timeout_s:g} s)")
                abort(transport)
                live.discard(key)
            else:
                seen[key] = (transport, size, was[2])
        for key in list(seen):
            if key not in live:
                del seen[key]
