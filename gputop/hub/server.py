"""``gputop serve``: the hub's HTTP side (aiohttp), read-only.

aiohttp serves the routes, the SSE streams and (in ``gputop.hubclient.client``) the client,
all on the poller's own event loop: the hub is one process, one loop, one collection,
and nothing to hand between threads (starlette + uvicorn would have split the server
from the client library and brought a second loop's worth of machinery).

Every response carries a Content-Security-Policy that allows only the hub itself (no
inline script, no other origin) and ``X-Content-Type-Options: nosniff``. Requests are
bounded: request line and header sizes, header count, no bodies (``client_max_size``),
at most ``MAX_REQUESTS`` handled at once and ``max_subscribers`` event streams (and a
share of those and of the connections per peer address); a client that stops reading, or
sends no request in time, is cut off (gputop.hub.conn). With a token file, every route but
``/-/healthy``, ``/-/ready`` and the web page's own files needs ``Authorization: Bearer
<token>``. No cookie authenticates: a browser sends a host's cookies to every port of it,
so another service there could take one and replay it. The web board holds the token in
memory and, for its event stream (an EventSource sends no header), trades it for a
ticket: single-use, valid ``TICKET_S`` seconds, good for ``/api/v1/events`` only.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import ipaddress
import logging
import re
import secrets
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from aiohttp import web
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from gputop.config.load import HUB_MAX_CONNECTIONS, Config
from gputop.config.values import listen_problem
from gputop.hub.collector import Collector
from gputop.hub.conn import Guard, Throttled, abort, cut_stalled, limit_connections, peer_of
from gputop.hub.events import KEEPALIVE, RETAIN_BYTES, EventLog, frame
from gputop.hub.metrics import HostCounts, HubCounts, families, render
from gputop.hub.notifying import watch
from gputop.hub.waste import WasteCache
from gputop.notify.watcher import Watcher
from gputop.output import dumps
from gputop.text import excerpt

#: ``gputop serve``'s default: loopback, a port of its own (not Prometheus' 9090,
#: node-exporter's 9100 or dcgm-exporter's 9400).
DEFAULT_LISTEN = "127.0.0.1:9847"
MAX_REQUESTS = 128
KEEPALIVE_S = 15.0
#: A connection with no request under way (idle, or a request line or headers dripping
#: in a byte at a time) is closed after this. aiohttp's own default is an hour: anyone on
#: the machine could hold the hub's file descriptors (which its SSH connections and its
#: history need too) with sockets that never finish a request.
IDLE_S = 30.0
#: A connection that has not sent one whole request (line and headers) this long after
#: opening is closed (``--first-request-timeout``): sockets opened and left silent, or
#: dripping their first request, cannot hold the pool for the idle limit.
FIRST_REQUEST_S = 10.0
#: A connection whose socket takes no bytes for this long is closed (``--write-timeout``).
WRITE_TIMEOUT_S = 10.0
#: Events are written in pieces this size, each awaiting the socket: a stream that stops
#: reading holds at most one piece in the hub, never a copy of what it was sent.
CHUNK = 64 * 1024
#: How long an event-stream ticket stays good, and how many may be outstanding.
TICKET_S = 10.0
MAX_TICKETS = 256
WEB_DIR = Path(__file__).resolve().parent / "web"
_STATIC_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,100}$")
_TYPES = {".html": "text/html", ".css": "text/css", ".js": "text/javascript",
          ".mjs": "text/javascript", ".json": "application/json", ".svg": "image/svg+xml",
          ".png": "image/png", ".ico": "image/x-icon", ".woff2": "font/woff2",
          ".txt": "text/plain", ".map": "application/json"}
_TEXT = {".html", ".css", ".js", ".mjs", ".json", ".svg", ".txt", ".map"}
SECURITY_HEADERS = {
    "Content-Security-Policy": "default-src 'self'; script-src 'self'; style-src 'self'; "
    "img-src 'self'; connect-src 'self'; object-src 'none'; base-uri 'none'; "
    "form-action 'none'; frame-ancestors 'none'",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "X-Frame-Options": "DENY",
}
#: Routes anyone may ask without the token: liveness, readiness and the page's own files.
_OPEN = ("/-/healthy", "/-/ready", "/", "/static/")


class ListenError(ValueError):
    """A ``--listen`` that is not HOST:PORT."""


def parse_listen(text: str) -> tuple[str, int]:
    problem = listen_problem(text)
    if problem:
        raise ListenError(f"--listen {problem}")
    host, _, port = text.rpartition(":")
    host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    return host, int(port)


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def listen_warning(host: str, has_token: bool) -> str | None:
    """What ``serve`` says at start when it listens beyond this machine."""
    if is_loopback(host):
        return None
    return (f"listening on {host}, beyond this machine: anyone who can reach it sees every "
            "host's GPUs, processes and reservations"
            + ("" if has_token else " (set [hub] token_file to require a token)"))


def static_files(web_dir: Path = WEB_DIR) -> dict[str, Path]:
    """The files the page may load: plain files directly in ``web_dir`` with plain names
    (no dot files, no folders, no links), found once at start. Nothing else is served."""
    out: dict[str, Path] = {}
    if not web_dir.is_dir():
        return out
    for p in web_dir.iterdir():
        if (_STATIC_NAME.match(p.name) and p.suffix in _TYPES and not p.is_symlink()
                and p.is_file()):
            out[p.name] = p
    return out


class Hub:
    """The collector, its event log and the HTTP routes over them."""

    def __init__(self, config: Config, *, collector: Collector | None = None,
                 token: str | None = None, max_subscribers: int = 64, backlog: int = 64,
                 max_subscribers_per_client: int | None = None,
                 retain: int = 256, retain_bytes: int = RETAIN_BYTES,
                 keepalive_s: float = KEEPALIVE_S, write_timeout_s: float | None = None,
                 web_dir: Path = WEB_DIR) -> None:
        self.config = config
        self.collector = collector or Collector(config)
        self.events = EventLog(retain=retain, retain_bytes=retain_bytes,
                               max_subscribers=max_subscribers, backlog=backlog,
                               max_per_client=max_subscribers_per_client)
        self.collector.on_update = self._published
        self.collector.patches_wanted = self.events.patch_readers
        self.token = token
        self.keepalive_s = keepalive_s
        self.write_timeout_s = WRITE_TIMEOUT_S if write_timeout_s is None else write_timeout_s
        #: ``gputop_notifications_total`` in the text format, when this hub sends notices.
        self.notify_metrics: Callable[[], str] | None = None
        self.connections_refused = 0  # closed at once: too many open (limit_connections)
        self.connections_stalled = 0  # closed: stopped reading, or no request (cut_stalled)
        #: The connection bounds (serve sets it): which connections may ask only probes.
        self.guard: Guard | None = None
        self.streams_log = Throttled()
        self.tickets: dict[str, float] = {}  # event-stream ticket: when it expires
        self.static = static_files(web_dir)
        self._snapshot: tuple[int, bytes, bytes] | None = None  # seq, JSON, SSE frame
        self._inflight = 0
        self.waste = WasteCache(config.history.path)
        #: Listening on loopback only: requests must name a loopback host too, so a web
        #: page elsewhere cannot read the hub through DNS rebinding (serve sets it).
        self.loopback_names_only = False

    def _published(self, update: str, patch: str | None = None) -> None:
        self.events.publish(update, patch)
        self._snapshot = None

    def snapshot(self) -> tuple[bytes, bytes]:
        """The document as JSON and as the stream's first event, encoded once per change."""
        seq = self.events.seq
        if self._snapshot is None or self._snapshot[0] != seq:
            text = dumps(self.collector.document())
            self._snapshot = (seq, text.encode(), frame("snapshot", self.events.event_id(), text))
        return self._snapshot[1], self._snapshot[2]

    # -- the app ----------------------------------------------------------------------------

    def app(self) -> web.Application:
        app = web.Application(client_max_size=1024, middlewares=[self._guard])
        app.on_response_prepare.append(_secure)
        app.router.add_get("/metrics", self.metrics)
        app.router.add_get("/api/v1/snapshot", self.snapshot_route)
        # (No HEAD for the stream: it would hold a subscriber's place and send nothing.)
        app.router.add_get("/api/v1/events", self.events_route, allow_head=False)
        app.router.add_get("/api/v1/waste", self.waste_route)
        app.router.add_post("/api/v1/ticket", self.ticket_route)
        app.router.add_get("/-/ready", self.ready)
        app.router.add_get("/-/healthy", self.healthy)
        app.router.add_get("/", self.index)
        app.router.add_get("/static/{name}", self.static_route)
        return app

    @web.middleware
    async def _guard(self, request: web.Request,
                     handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
                     ) -> web.StreamResponse:
        if self.loopback_names_only and not _loopback_host(request.headers.get("Host", "")):
            raise web.HTTPMisdirectedRequest(text="this hub answers to loopback names only\n")
        if self.token is not None and not _open(request.path):
            got = request.headers.get("Authorization", "")
            want = f"Bearer {self.token}"
            # (aiohttp keeps a header's non-UTF-8 bytes as surrogates: encoded back as
            # they came, so a forged byte is a refusal, never an encoding error's 500.)
            if not (hmac.compare_digest(got.encode("utf-8", "surrogateescape"), want.encode())
                    or (request.path == "/api/v1/events"
                        and self._use_ticket(request.query.get("ticket", "")))):
                raise web.HTTPUnauthorized(text="a bearer token is needed\n",
                                           headers={"WWW-Authenticate": "Bearer"})
        if self.guard is not None and not self.guard.allows(request.protocol, request.path):
            # (a place of the reserve kept for probes: this connection ends after)
            raise web.HTTPServiceUnavailable(text="too many connections open; only "
                                             "/-/healthy and /-/ready answer\n",
                                             headers={"Connection": "close",
                                                      "Retry-After": "10"})
        if request.path == "/api/v1/events":  # bounded by max_subscribers instead
            return await handler(request)
        if self._inflight >= MAX_REQUESTS:
            raise web.HTTPServiceUnavailable(text="too many requests at once\n")
        self._inflight += 1
        try:
            return await handler(request)
        finally:
            self._inflight -= 1

    async def metrics(self, request: web.Request) -> web.StreamResponse:
        c, now = self.collector, time.time()
        hosts = {n: HostCounts(s.answers, dict(s.errors),
                               None if s.last_answer is None else max(0.0, now - s.last_answer))
                 for n, s in c.stats.items()}
        hub = HubCounts(ready=c.ready, start_time=c.started, folds=c.folds,
                        updates=self.events.published, fold_cpu_s=c.fold_seconds,
                        subscribers=len(self.events.subscribers), dropped=self.events.dropped,
                        refused=self.events.refused,
                        retained_bytes=self.events.retained_bytes,
                        connections_refused=self.connections_refused,
                        connections_stalled=self.connections_stalled)
        doc = c.document()
        body = render(lambda: families(doc, hosts, hub))
        if self.notify_metrics is not None:
            body += self.notify_metrics().encode()
        return await self._send(request, body, CONTENT_TYPE_LATEST)

    async def snapshot_route(self, request: web.Request) -> web.StreamResponse:
        body, _ = self.snapshot()
        return await self._send(request, body, "application/json")

    async def waste_route(self, request: web.Request) -> web.StreamResponse:
        """The last day's waste from the history database, for the web board's panel."""
        return await self._send(request, dumps(await self.waste.get()).encode(),
                                "application/json")

    async def ticket_route(self, request: web.Request) -> web.StreamResponse:
        """A ticket for one event stream (the web board's EventSource cannot send the
        token): asked with the token in the header, so only its holder gets one."""
        now = time.monotonic()
        for t, until in list(self.tickets.items()):
            if until <= now:
                del self.tickets[t]
        if len(self.tickets) >= MAX_TICKETS:
            raise web.HTTPServiceUnavailable(text="too many tickets outstanding\n",
                                             headers={"Retry-After": "10"})
        ticket = secrets.token_urlsafe(24)
        self.tickets[ticket] = now + TICKET_S
        return await self._send(request, dumps({"ticket": ticket, "expires_s": TICKET_S})
                                .encode(), "application/json")

    def _use_ticket(self, ticket: str) -> bool:
        """Whether ``ticket`` is one outstanding and unexpired; it is spent either way."""
        until = self.tickets.pop(ticket, None) if 0 < len(ticket) <= 64 else None
        return until is not None and until > time.monotonic()

    async def _send(self, request: web.Request, body: bytes, ctype: str
                    ) -> web.StreamResponse:
        """A body written within the handler, each write bounded by ``write_timeout_s``:
        a client that stops reading is cut off (and counts toward ``MAX_REQUESTS`` while
        it is written). A plain Response is written after the handler returns with no
        bound at all, so a socket that never reads held a copy of the document for as
        long as it stayed open."""
        resp = web.StreamResponse(headers={"Content-Type": ctype, "Cache-Control": "no-store"})
        resp.content_length = len(body)
        try:
            await asyncio.wait_for(resp.prepare(request), self.write_timeout_s)
            if request.method != "HEAD":  # (HEAD: the headers, Content-Length, no body)
                await self._write(resp, body)
            await asyncio.wait_for(resp.write_eof(), self.write_timeout_s)
        except asyncio.TimeoutError:
            self._stalled(request)
        return resp

    async def events_route(self, request: web.Request) -> web.StreamResponse:
        # Nothing awaits between reading the document and subscribing: no update can fall
        # between the snapshot (or the missed updates) and the live stream.
        # A client far behind (its missed events more than the document itself) gets the
        # snapshot instead: the retained events are never copied out per client.
        patches = request.query.get("patches") == "1"  # (hub/patches.py)
        first: list[bytes] | None = self.events.missed(request.headers.get("Last-Event-ID"),
                                                       patches=patches)
        if first is None or sum(map(len, first)) > len(self.snapshot()[1]):
            first = [self.snapshot()[1]]
        task = asyncio.current_task()
        assert task is not None

        def kill() -> None:  # (it fell too far behind: its connection ends, not just it)
            _abort(request)
            task.cancel()

        sub = self.events.subscribe(kill, patches=patches,
                                    client=peer_of(request.transport))
        if sub is None:
            self.streams_log.say(f"refused an event stream from "
                                 f"{peer_of(request.transport)}: {self.events.why_refused}")
            raise web.HTTPServiceUnavailable(text="too many event streams open\n",
                                             headers={"Retry-After": "10"})
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream",
                                           "Cache-Control": "no-store",
                                           "X-Accel-Buffering": "no"})
        try:
            await resp.prepare(request)
            await self._write(resp, b"retry: 2000\n\n", *first)
            del first
            while not sub.dropped:
                try:
                    await asyncio.wait_for(sub.ready.wait(), self.keepalive_s)
                except asyncio.TimeoutError:
                    await self._write(resp, KEEPALIVE)
                    continue
                if sub.dropped:
                    break
                # (each event the one framed copy every stream shares, never joined)
                await self._write(resp, *sub.take())
        except ConnectionError:
            _abort(request)  # the client went: its connection ends
        except asyncio.TimeoutError:
            self._stalled(request)  # it stopped reading: its connection ends
        finally:
            self.events.unsubscribe(sub)
        return resp

    def _stalled(self, request: web.Request) -> None:
        """End the connection of a client that stopped reading, counted once: cut_stalled
        may have ended it in the same turn of a loop that was busy past both deadlines."""
        if request.transport is not None and not request.transport.is_closing():
            self.connections_stalled += 1
        _abort(request)

    async def _write(self, resp: web.StreamResponse, *datas: bytes) -> None:
        """Each of ``datas`` in pieces (each waits for the socket only when it is full),
        all of them within ``write_timeout_s``."""
        async def pieces() -> None:
            for data in datas:
                view = memoryview(data)
                for at in range(0, len(view), CHUNK):
                    await resp.write(view[at:at + CHUNK])

        await asyncio.wait_for(pieces(), self.write_timeout_s)

    async def ready(self, request: web.Request) -> web.Response:
        c = self.collector
        if c.ready:
            return web.Response(text="ready\n")
        waiting = [n for n, s in c.stats.items() if not s.answered]
        return web.Response(status=503, text=f"waiting for {len(waiting)} host(s)\n")

    async def healthy(self, request: web.Request) -> web.Response:
        return web.Response(text="ok\n")

    async def index(self, request: web.Request) -> web.Response:
        return self._file("index.html")

    async def static_route(self, request: web.Request) -> web.Response:
        return self._file(request.match_info["name"])

    def _file(self, name: str) -> web.Response:
        path = self.static.get(name)
        if path is None:
            raise web.HTTPNotFound(text="not found\n")
        try:
            body = path.read_bytes()
        except OSError:
            raise web.HTTPNotFound(text="not found\n") from None
        ctype = _TYPES[path.suffix]
        return web.Response(body=body, content_type=ctype,
                            charset="utf-8" if path.suffix in _TEXT else None)


def _abort(request: web.Request) -> None:
    """End a connection now, its unsent bytes dropped (a close would wait to send them)."""
    if request.transport is not None:
        abort(request.transport)


def _loopback_host(header: str) -> bool:
    """A ``Host`` header naming this machine's loopback (with or without a port)."""
    name = header.strip()
    if name.startswith("["):
        name = name[1:name.find("]")] if "]" in name else ""
    elif name.count(":") == 1:
        name = name.split(":")[0]
    return bool(name) and is_loopback(name)


def _open(path: str) -> bool:
    return path in _OPEN or path.startswith("/static/")


async def _secure(request: web.Request, response: web.StreamResponse) -> None:
    response.headers.update(SECURITY_HEADERS)


def read_token(path: Path) -> str:
    """The bearer token: the file's first line, stripped; empty is an error."""
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"{path}: cannot read the token file: {exc}") from None
    token = text.strip().splitlines()[0].strip() if text.strip() else ""
    if not token or len(token) > 4096 or not token.isprintable():
        raise ValueError(f"{path}: the token file must hold one line of text")
    return token


class _OneLine(logging.Handler):
    """aiohttp's request errors (a malformed request from anyone who can connect) as one
    line each, at most one per ``every_s`` (with a count of those left out): no traceback
    floods the hub's log."""

    def __init__(self, every_s: float = 10.0) -> None:
        super().__init__(logging.ERROR)
        self.every_s, self.last, self.skipped = every_s, -1e9, 0

    def emit(self, record: logging.LogRecord) -> None:
        now = time.monotonic()
        if now - self.last < self.every_s:
            self.skipped += 1
            return
        self.last = now
        why = record.exc_info[1] if record.exc_info else None
        more = f" ({self.skipped} more since)" if self.skipped else ""
        self.skipped = 0
        print(f"gputop: hub: {excerpt(record.getMessage(), 80)}"
              + (f": {excerpt(str(why), 120)}" if why else "") + more,
              file=sys.stderr, flush=True)


def _quiet_request_errors() -> None:
    log = logging.getLogger("aiohttp.server")
    if not any(isinstance(h, _OneLine) for h in log.handlers):
        log.addHandler(_OneLine())
    log.propagate = False


def make_runner(hub: Hub, *, idle_s: float = IDLE_S) -> web.AppRunner:
    """The hub's app as aiohttp serves it: request sizes bounded, idle sockets closed."""
    return web.AppRunner(hub.app(), access_log=None, handle_signals=False,
                         max_line_size=8190, max_field_size=8190, max_headers=64,
                         keepalive_timeout=idle_s)


async def serve(config: Config, listen: str = DEFAULT_LISTEN, *, token: str | None = None,
                ready: Callable[[str], None] | None = None,
                max_connections: int = HUB_MAX_CONNECTIONS, idle_s: float = IDLE_S,
                max_connections_per_client: int | None = None,
                first_request_s: float = FIRST_REQUEST_S,
                watcher: Watcher | None = None,
                notify_metrics: Callable[[], str] | None = None, **hub_options: Any) -> None:
    """Run the hub until cancelled. ``ready(url)`` is called once it listens; ``watcher``
    (when [notify] is configured) is handed the collection once per interval, and
    ``notify_metrics()`` (its delivery's counters) ends /metrics."""
    host, port = parse_listen(listen)
    _quiet_request_errors()
    hub = Hub(config, token=token, **hub_options)
    hub.notify_metrics = notify_metrics
    hub.loopback_names_only = is_loopback(host)
    runner = make_runner(hub, idle_s=idle_s)
    await runner.setup()
    hub.guard = limit_connections(hub, runner, max_connections, Throttled(),
                                  per_client=max_connections_per_client)
    cutting = asyncio.create_task(cut_stalled(hub, runner, hub.write_timeout_s, Throttled(),
                                              first_request_s=first_request_s))
    collecting = asyncio.create_task(hub.collector.run())
    # Notices (with [notify] configured: the caller's Watcher), looked at once per interval.
    watching = None if watcher is None else asyncio.create_task(
        watch(hub.collector, watcher, max(1.0, config.defaults.interval)))
    try:
        site = web.TCPSite(runner, host, port, backlog=128, shutdown_timeout=2.0)
        await site.start()
        url = f"http://{'[' + host + ']' if ':' in host else host}:{port}/"
        print(f"gputop: hub serving {len(hub.collector.names)} host(s) on {url}",
              file=sys.stderr, flush=True)
        warning = listen_warning(host, token is not None)
        if warning:
            print(f"gputop: warning: {warning}", file=sys.stderr, flush=True)
        if ready is not None:
            ready(url)
        await collecting
    finally:
        hub.events.close_all()
        collecting.cancel()
        cutting.cancel()
        if watching is not None:
            watching.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await collecting
        await runner.cleanup()
