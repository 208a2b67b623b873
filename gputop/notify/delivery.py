"""The Notifier: notices handed to ``submit`` are queued (bounded) and delivered on a
thread of their own, each route apart, with retries and a give-up limit, so that a slow,
hanging or failing endpoint delays nothing else: not the caller (collection, the store)
and not the other routes. What happened is counted by channel and result (for
``/metrics``) and the last deliveries are kept in a small JSON file (``notify status``).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import tempfile
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gputop.config import Config
from gputop.model import iso, utcnow
from gputop.notify.channels.formats import HTTP_FORMATS, email
from gputop.notify.channels.send import DeliveryError, http_post, read_secret, smtp_send
from gputop.notify.notice import Notice, Route
from gputop.notify_config import NotifyConfig
from gputop.reservations.store import ReservationStore
from gputop.text import excerpt

#: Deliveries kept for ``notify status``.
KEEP_LAST = 50
#: Notices whose routes are being looked up at once, and tries under way at once (each
#: route is tried one notice at a time).
MAX_INFLIGHT = 64
#: Notices one route may have waiting behind its current try; beyond that a new one for it
#: is dropped (counted): a hung endpoint cannot hoard memory or the others' turns.
MAX_ROUTE_BACKLOG = 50
#: The longest wait between two tries.
MAX_BACKOFF_S = 300.0


class Counters:
    """``gputop_notifications_total{channel,result}``: counts by (channel, result), read by
    the hub's metrics from any thread. Results: ``sent``, ``retried`` (a try failed, another
    follows), ``failed`` (given up), ``dropped`` / ``refused`` (the queue was full),
    ``no-route`` (nowhere to send it)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts: dict[tuple[str, str], int] = {}

    def add(self, channel: str, result: str, n: int = 1) -> None:
        with self._lock:
            self._counts[(channel, result)] = self._counts.get((channel, result), 0) + n

    def snapshot(self) -> dict[tuple[str, str], int]:
        with self._lock:
            return dict(self._counts)

    def prometheus(self) -> str:
        """The counter in Prometheus' text format (HELP, TYPE and one line a pair)."""
        out = ["# HELP gputop_notifications_total Notifications by channel and result.",
               "# TYPE gputop_notifications_total counter"]
        out += [f'gputop_notifications_total{{channel="{c}",result="{r}"}} {n}'
                for (c, r), n in sorted(self.snapshot().items())]
        return "\n".join(out) + "\n"


@dataclass(frozen=True)
class Delivery:
    """One notice to one route, as ``notify status`` shows it."""

    time: str
    user: str | None
    kind: str
    channel: str
    target: str
    result: str
    attempts: int
    error: str = ""


def status_path(config: NotifyConfig, history_path: Path) -> Path:
    """Where the sender keeps its last deliveries: ``status_file``, else beside the
    history database."""
    return config.status_file or history_path.with_name("notify-status.json")


def read_status(path: Path) -> list[dict[str, Any]]:
    """The last deliveries a sender recorded (empty when none; a broken file reads empty)."""
    try:
        with open(path, "rb") as f:
            doc = json.loads(f.read(1 << 20))
    except (OSError, ValueError):
        return []
    items = doc.get("deliveries") if isinstance(doc, dict) else None
    return [d for d in items if isinstance(d, dict)] if isinstance(items, list) else []


class Notifier:
    """``submit`` never blocks and never raises; ``close`` stops the thread (what is still
    queued is dropped, counted). ``routes_for(user)``: that person's routes (it may read
    the store: it runs on the Notifier's thread, never the caller's)."""

    def __init__(self, config: NotifyConfig, routes_for: Callable[[str], Sequence[Route]],
                 *, status_file: Path | None = None, counters: Counters | None = None
                 ) -> None:
        self.config = config
        self.routes_for = routes_for
        self.status_file = status_file
        self.counters = counters or Counters()
        self._queue: deque[Notice] = deque()
        self._lock = threading.Lock()
        self._last: deque[Delivery] = deque(maxlen=KEEP_LAST)
        self._last.extend(self._load_last())
        self._loop: asyncio.AbstractEventLoop | None = None
        self._wake: asyncio.Event | None = None
        self._ready = threading.Event()
        self._thread: threading.Thread | None = None
        self._route_locks: dict[tuple[str, str], asyncio.Lock] = {}
        self._backlog: dict[tuple[str, str], int] = {}
        self._tries: asyncio.Semaphore | None = None
        self._idle = threading.Event()
        self._idle.set()
        self._busy = 0

    # -- the caller's side ------------------------------------------------------------------

    def start(self) -> Notifier:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="gputop-notify",
                                            daemon=True)
            self._thread.start()
            self._ready.wait(10)
        return self

    def submit(self, notice: Notice) -> None:
        with self._lock:
            if len(self._queue) >= self.config.queue:
                if self.config.overflow == "refuse":
                    self.counters.add("queue", "refused")
                    return
                self._queue.popleft()
                self.counters.add("queue", "dropped")
            self._queue.append(notice)
            self._idle.clear()
        loop, wake = self._loop, self._wake
        if loop is not None and wake is not None:
            with contextlib.suppress(RuntimeError):  # closed meanwhile
                loop.call_soon_threadsafe(wake.set)

    def wait_idle(self, timeout: float) -> bool:
        """Wait until every submitted notice was delivered or given up (tests, ``notify
        test``); False on timeout."""
        return self._idle.wait(timeout)

    def last(self) -> list[Delivery]:
        with self._lock:
            return list(self._last)

    def close(self, timeout: float = 5.0) -> None:
        loop = self._loop
        if loop is not None and self._thread is not None:
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(self._stop_loop)
            self._thread.join(timeout)
        self._thread = None

    # -- the Notifier's thread --------------------------------------------------------------

    def _stop_loop(self) -> None:
        for task in asyncio.all_tasks():
            task.cancel()

    def _run(self) -> None:
        with contextlib.suppress(asyncio.CancelledError):
            asyncio.run(self._main())

    async def _main(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._wake = asyncio.Event()
        self._ready.set()
        slots = asyncio.Semaphore(MAX_INFLIGHT)
        self._tries = asyncio.Semaphore(MAX_INFLIGHT)
        tasks: set[asyncio.Task[None]] = set()
        while True:
            await self._wake.wait()
            self._wake.clear()
            while True:
                with self._lock:
                    if not self._queue:
                        break
                    notice = self._queue.popleft()
                    self._busy += 1
                await slots.acquire()
                task = asyncio.create_task(self._one(notice, slots))
                tasks.add(task)
                task.add_done_callback(tasks.discard)

    async def _one(self, notice: Notice, slots: asyncio.Semaphore) -> None:
        try:
            try:
                routes = await self._routes(notice)
            finally:
                slots.release()
            if not routes:
                self.counters.add("none", "no-route")
            await asyncio.gather(*(self._deliver(notice, r, team) for r, team in routes))
        finally:
            with self._lock:
                self._busy -= 1
                if self._busy == 0 and not self._queue:
                    self._idle.set()

    async def _routes(self, notice: Notice) -> list[tuple[Route, bool]]:
        if notice.user is None:
            f = self.config.team_webhook_file
            return [] if f is None else [(Route(self._team_kind(), str(f)), True)]
        try:
            routes = await asyncio.to_thread(self.routes_for, notice.user)
        except Exception as exc:  # the store unreadable: recorded
            self._record(notice, "routes", "", "failed", 0, excerpt(str(exc), 160))
            return []
        return [(r, False) for r in routes]

    def _team_kind(self) -> Any:
        return self.config.team_format

    async def _deliver(self, notice: Notice, route: Route, team: bool) -> None:
        channel = route.kind
        key = (channel, route.target)
        lock = self._route_locks.setdefault(key, asyncio.Lock())
        shown = "team" if team else route.target
        wait = self.config.retry_s
        if self._backlog.get(key, 0) >= MAX_ROUTE_BACKLOG:
            self.counters.add(channel, "dropped")
            self._record(notice, channel, shown, "dropped", 0, "too many waiting for this route")
            return
        self._backlog[key] = self._backlog.get(key, 0) + 1
        try:
            await lock.acquire()  # one notice at a time per route: a hung one holds itself
        finally:
            self._backlog[key] -= 1
        try:
            assert self._tries is not None
            async with self._tries:
                await self._tries_of(notice, route, team, channel, shown, wait)
        finally:
            lock.release()

    async def _tries_of(self, notice: Notice, route: Route, team: bool, channel: str,
                        shown: str, wait: float) -> None:
        for attempt in range(1, self.config.attempts + 1):
            try:
                try:
                    await self._send(notice, route, team)
                except (DeliveryError, asyncio.CancelledError):
                    raise
                except Exception as exc:  # a bug or odd input: this route fails alone
                    raise DeliveryError(excerpt(f"{type(exc).__name__}: {exc}", 160),
                                        retry=False) from None
            except DeliveryError as exc:
                if not exc.retry or attempt == self.config.attempts:
                    self.counters.add(channel, "failed")
                    self._record(notice, channel, shown, "failed", attempt, str(exc))
                    return
                self.counters.add(channel, "retried")
                await asyncio.sleep(min(wait, MAX_BACKOFF_S))
                wait *= 2
                continue
            self.counters.add(channel, "sent")
            self._record(notice, channel, shown, "sent", attempt)
            return

    async def _send(self, notice: Notice, route: Route, team: bool) -> None:
        c = self.config
        if route.kind == "email":
            if c.smtp_host is None or c.sender is None:
                raise DeliveryError("no smtp server configured ([notify] smtp, from)",
                                    retry=False)
            await smtp_send(c.smtp_host, c.smtp_port, email(notice, c.sender, route.target),
                            auth_file=c.smtp_auth_file, timeout=c.timeout_s)
            return
        url = route.target
        if team:
            url = read_secret(Path(route.target)).strip()
            if not url.startswith(("https://", "http://")) or any(
                    ch.isspace() for ch in url):
                raise DeliveryError(f"{route.target}: not an http(s) URL", retry=False)
        fmt = HTTP_FORMATS.get(route.kind)
        if fmt is None:
            raise DeliveryError(f"unknown channel {route.kind!r}", retry=False)
        p = fmt(notice)
        await http_post(url, p.body, p.content_type, p.headers, timeout=c.timeout_s)

    # -- the record of the last deliveries --------------------------------------------------

    def _record(self, notice: Notice, channel: str, target: str, result: str, attempts: int,
                error: str = "") -> None:
        d = Delivery(iso(utcnow()) or "", notice.user, notice.kind, channel, target, result,
                     attempts, error)
        with self._lock:
            self._last.append(d)
            items = [vars(x) for x in self._last]
        if self.status_file is not None:
            with contextlib.suppress(OSError):
                _write_json(self.status_file, {"updated": time.time(), "deliveries": items})

    def _load_last(self) -> list[Delivery]:
        if self.status_file is None:
            return []
        out = []
        for d in read_status(self.status_file)[-KEEP_LAST:]:
            with contextlib.suppress(TypeError):
                out.append(Delivery(**{k: d[k] for k in Delivery.__dataclass_fields__
                                       if k in d}))
        return out


def _write_json(path: Path, doc: dict[str, Any]) -> None:
    """Replace ``path`` whole (a reader sees the old file or the new one)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".notify-status.")
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(doc, f, indent=1)
        # Readable by everyone here, as routes are by the team: ``notify status`` of any
        # user on the sender's machine reads it (the team channel's URL is never in it).
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def start_notifier(config: Config, store: ReservationStore) -> Notifier:
    """The sender's Notifier (the hub's, ``gputop notify run``'s): people's routes read
    from ``store``, the last deliveries kept at ``status_path``; started."""
    from gputop.notify.routes import store_routes

    return Notifier(config.notify, store_routes(store, config.notify),
                    status_file=status_path(config.notify, config.history_path)).start()
