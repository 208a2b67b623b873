"""Server-Sent Events for the hub: event ids, a retained window, bounded subscribers.

Ids are ``<epoch>-<n>``: ``n`` counts the document's changes and the epoch is this hub
run's own, so a restarted hub never takes an old id for one of its own (a client that
comes back with an old run's ``Last-Event-ID`` gets a fresh snapshot). The last
``retain`` updates are kept, framed once, for clients that come back within them.

Each subscriber has a bounded backlog of framed events. A subscriber that falls
``backlog`` events behind (it reads slower than the hub publishes, or not at all) is
dropped: its stream is ended, never buffered without bound. At most ``max_subscribers``
streams run at once, and ``max_per_client`` from one peer address; one more is refused
(503).
"""

from __future__ import annotations

import asyncio
import re
import secrets
import time
from collections import deque
from collections.abc import Callable

#: ``Last-Event-ID`` as this hub writes it; anything else gets a fresh snapshot.
_ID = re.compile(r"^([0-9a-f]{1,32})-([0-9]{1,18})$")
MAX_ID_LEN = 64


def frame(event: str, event_id: str, data: str) -> bytes:
    """One SSE event. ``data`` must be one line (JSON from ``json.dumps`` is): a newline
    would end the data field and let what follows read as fields of its own."""
    if "\n" in data or "\r" in data:
        raise ValueError("SSE data must be one line")
    return f"event: {event}\nid: {event_id}\ndata: {data}\n\n".encode()


KEEPALIVE = b": keepalive\n\n"


class Subscriber:
    """One open stream: the events not yet written to it."""

    def __init__(self, backlog: int, on_drop: Callable[[Subscriber], None],
                 patches: bool = False) -> None:
        self.pending: deque[bytes] = deque()
        self.patches = patches  # it asked for ``patch`` events instead of ``update``
        self.backlog = backlog
        self.ready = asyncio.Event()
        self.dropped = False
        self.client = ""  # the peer's address (its streams are bounded together)
        self._on_drop = on_drop

    def offer(self, data: bytes) -> None:
        if self.dropped:
            return
        if len(self.pending) >= self.backlog:
            self.dropped = True
            self.pending.clear()
            self._on_drop(self)
        else:
            self.pending.append(data)
        self.ready.set()

    def take(self) -> list[bytes]:
        out = list(self.pending)
        self.pending.clear()
        self.ready.clear()
        return out


def per_client_streams(max_subscribers: int) -> int:
    """``--max-subscribers-per-client``'s default: a quarter of the streams, at least 4,
    never more than all of them (a small bound stays whole for one client)."""
    return min(max_subscribers, max(4, max_subscribers // 4))


#: The retained window's bound in bytes (both framings of each event counted).
RETAIN_BYTES = 64 * 1024 * 1024


def _size(update: bytes, patch: bytes) -> int:
    return len(update) + (len(patch) if patch is not update else 0)


class EventLog:
    """The update stream: numbering, the retained window, and who listens."""

    def __init__(self, *, retain: int = 256, retain_bytes: int = RETAIN_BYTES,
                 max_subscribers: int = 64, backlog: int = 64, epoch: str | None = None,
                 max_per_client: int | None = None) -> None:
        # Milliseconds since 1970 in hex, and some randomness: two runs never share one.
        self.epoch = epoch or f"{int(time.time() * 1000):x}{secrets.token_hex(2)}"
        self.seq = 0
        #: (n, the update framed, the same change framed as a patch): the last ``retain``
        #: events, and fewer where they hold more than ``retain_bytes`` (at 1,000 hosts
        #: 256 updates of every host were over a gigabyte).
        self.retained: deque[tuple[int, bytes, bytes]] = deque()
        self.retain, self.retain_bytes = retain, retain_bytes
        self.retained_bytes = 0
        self.max_subscribers = max_subscribers
        self.max_per_client = (per_client_streams(max_subscribers) if max_per_client is None
                               else max_per_client)
        self.clients: dict[str, int] = {}  # streams open per peer address
        self.why_refused = ""
        self.backlog = backlog
        self.subscribers: set[Subscriber] = set()
        self.dropped = 0  # subscribers dropped for falling behind, for /metrics
        self.refused = 0  # streams refused for being one too many
        self.published = 0
        self._kills: dict[Subscriber, Callable[[], None]] = {}

    def event_id(self, n: int | None = None) -> str:
        return f"{self.epoch}-{self.seq if n is None else n}"

    def publish(self, data: str, patch: str | None = None) -> None:
        """One change (one JSON line, and the same as a patch for subscribers that asked
        for them; without one they get the update): numbered, retained, offered to every
        subscriber."""
        self.seq += 1
        self.published += 1
        eid = self.event_id()
        framed = frame("update", eid, data)
        patched = framed if patch is None else frame("patch", eid, patch)
        self.retained.append((self.seq, framed, patched))
        self.retained_bytes += _size(framed, patched)
        while len(self.retained) > self.retain or (
                self.retained_bytes > self.retain_bytes and len(self.retained) > 1):
            _n, u, p = self.retained.popleft()  # (the newest is kept whatever its size)
            self.retained_bytes -= _size(u, p)
        for sub in list(self.subscribers):
            sub.offer(patched if sub.patches else framed)

    def missed(self, last_event_id: str | None, *, patches: bool = False
               ) -> list[bytes] | None:
        """The updates after ``last_event_id``, or None when it is not one of this run's
        ids within the retained window (the client then needs a fresh snapshot)."""
        if not last_event_id or len(last_event_id) > MAX_ID_LEN:
            return None
        m = _ID.match(last_event_id.strip())
        if m is None or m.group(1) != self.epoch:
            return None
        n = int(m.group(2))
        if n > self.seq:
            return None
        if n == self.seq:
            return []
        if not self.retained or self.retained[0][0] > n + 1:
            return None  # fell out of the window
        return [p if patches else u for seq, u, p in self.retained if seq > n]

    def patch_readers(self) -> bool:
        """Whether a subscriber reads patches now (else no patch need be worked out)."""
        return any(s.patches for s in self.subscribers)

    def subscribe(self, kill: Callable[[], None], *, patches: bool = False,
                  client: str = "") -> Subscriber | None:
        """A new subscriber, or None when ``max_subscribers`` streams already run, or
        ``max_per_client`` of them for ``client`` (the peer's address; why is then in
        ``why_refused``). ``kill`` ends its stream (called when it falls too far behind)."""
        if len(self.subscribers) >= self.max_subscribers:
            self.refused += 1
            self.why_refused = f"{self.max_subscribers} already open (--max-subscribers)"
            return None
        if self.clients.get(client, 0) >= self.max_per_client:
            self.refused += 1
            self.why_refused = (f"{self.max_per_client} already open from that address "
                                "(--max-subscribers-per-client)")
            return None
        sub = Subscriber(self.backlog, self._drop, patches)
        sub.client = client
        self.clients[client] = self.clients.get(client, 0) + 1
        self.subscribers.add(sub)
        self._kills[sub] = kill
        return sub

    def unsubscribe(self, sub: Subscriber) -> None:
        if sub in self.subscribers:
            left = self.clients.get(sub.client, 1) - 1
            if left > 0:
                self.clients[sub.client] = left
            else:
                self.clients.pop(sub.client, None)
        self.subscribers.discard(sub)
        self._kills.pop(sub, None)

    def close_all(self) -> None:
        """End every stream (the hub is stopping): each handler sees it at once."""
        for sub in list(self.subscribers):
            sub.dropped = True
            sub.ready.set()
            self.unsubscribe(sub)

    def _drop(self, sub: Subscriber) -> None:
        self.dropped += 1
        kill = self._kills.get(sub)
        self.unsubscribe(sub)
        if kill is not None:
            kill()
