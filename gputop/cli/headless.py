"""The outputs without the board: ``--json`` (one document, or one per interval with
``--watch``) and ``--once`` (one table), each host polled alone so none holds the others.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import sys
from collections.abc import Callable, Iterator
from typing import Any

from gputop.config.load import NO_CONFIG_HINT, Config, default_config_path
from gputop.errors import EXIT_NO_HOST, EXIT_OK
from gputop.model import FleetSnapshot, HostSnapshot
from gputop.pacing import set_pace
from gputop.sources import Source

#: ``--watch`` handles the hosts' answers in batches at most this far apart (gputop.pacing),
#: and at most an eighth of the interval: at 2 s, a sample is written at most 0.25 s later
#: (a line every interval either way), for a third less CPU than at 50 ms (measured).
WATCH_PACE_S = 0.25

@contextlib.contextmanager
def fleet(config: Config | None) -> Iterator[tuple[Config, list[Source] | None]]:
    """The config and sources to poll: the demo's (cleaned up after) or the real ones."""
    if config is None:
        from gputop.sources.demo import demo_session

        with demo_session() as (demo_config, sources):
            yield demo_config, list(sources)
    else:
        if config.implicit and config.hub.url is None:
            print("gputop: " + NO_CONFIG_HINT.format(path=default_config_path()),
                  file=sys.stderr)
        yield config, None

def _say(message: str) -> None:
    print(f"gputop: {message}", file=sys.stderr, flush=True)

class ReservationsReader:
    """The shared file, read once per document; a broken file is reported once per change."""

    def __init__(self, config: Config) -> None:
        from gputop.reservations.open import open_store

        self.store = open_store(config)
        self.reported: str | None = None

    def read(self) -> tuple[Any, str | None]:
        from gputop.reservations.filelock import StoreError

        try:
            state, problem = self.store.read(), None
        except StoreError as exc:
            state, problem = None, str(exc)
            if problem != self.reported:
                print(f"gputop: {problem}", file=sys.stderr)
        self.reported = problem
        return state, problem

async def json_output(config: Config, sources: list[Source] | None, *, watch: bool,
                pretty: bool, record: bool = False) -> int:
    """One document, or (``watch``) one per interval, each with reservations and flags."""
    from gputop.hubclient.poller import open_poller
    from gputop.output import write_document
    from gputop.poller import first_answer_s
    from gputop.reservations.flags import IdleTracker, annotate
    from gputop.reservations.summary import fleet_summary

    # One document: one query per host is cheaper for the hosts than starting streams.
    poller = open_poller(config, sources, one_look=not watch, say=_say)
    reservations = ReservationsReader(config)
    tracker = IdleTracker(config.defaults.idle_holder_s, config.reservations.idle_grace_s,
                          config.reservations.share_grace_s)
    reaping = _JobReaper(config, reservations.store) if sources is None else None
    observe = tracker.observe
    live = None
    if record:
        from gputop.history.live import LiveRecorder

        live = LiveRecorder(config)  # a bad database is refused before anything is polled

        def observe(host: HostSnapshot) -> None:
            tracker.observe(host)
            assert live is not None
            live.observe(host)

    def emit(snap: FleetSnapshot) -> None:
        if reaping is not None:
            reaping.kick()
        state, problem = reservations.read()
        doc = annotate(snap, state, tracker)
        doc["summary"] = fleet_summary(snap.hosts, state, snap.time)
        if problem:
            doc["reservations_error"] = problem
        write_document(doc, sys.stdout, pretty=pretty)

    try:
        if not watch:
            snap = await poller.snapshot(first_answer_s(config))
            for host in snap.hosts:
                tracker.observe(host)
            if reaping is not None:
                await reaping.once()
            emit(snap)
            return exit_code(snap)
        await watch_latest(poller, config.defaults.interval, emit, observe)
        return EXIT_OK  # pragma: no cover - watch_latest runs until cancelled
    finally:
        if reaping is not None:
            reaping.cancel()
        await poller.aclose()
        if live is not None:
            live.close()

class _JobReaper:
    """Releases job-tied reservations whose job ended (gputop.jobs.reap), in the background,
    at most every few intervals; only when the file holds such a reservation."""

    def __init__(self, config: Config, store: Any) -> None:
        self.config, self.store = config, store
        self.task: asyncio.Task[Any] | None = None
        self.last = -1e9

    def _due(self) -> bool:
        try:
            return any(r.job is not None for r in self.store.read().reservations)
        except Exception:  # reported by the document itself
            return False

    async def once(self) -> None:
        if self._due():
            from gputop.jobs.reap import check_jobs

            await check_jobs(self.config, self.store)

    def kick(self) -> None:
        loop = asyncio.get_running_loop()
        if (self.task is not None and not self.task.done()) or \
                loop.time() - self.last < max(5.0, 3 * self.config.defaults.interval):
            return
        self.last = loop.time()
        self.task = loop.create_task(self.once())

    def cancel(self) -> None:
        if self.task is not None:
            self.task.cancel()

async def watch_latest(poller: Any, interval: float, emit: Callable[[FleetSnapshot], None],
                       observe: Callable[[HostSnapshot], None]) -> None:
    """Every ``interval``, a snapshot of each host's latest state. Each host is polled by
    its own loop (``Poller.updates``), so a host whose refresh is still in flight keeps its
    last data (its ``time`` says how old) and never holds the others back. The first
    snapshot waits for every host's first answer, which its timeout bounds."""
    latest: dict[str, HostSnapshot] = {}
    everyone = asyncio.Event()

    def names() -> list[str]:  # (a hub's hosts are known once its stream has begun)
        return [s.name for s in poller.sources]

    async def consume() -> None:
        async for snap in poller.updates():
            observe(snap)
            latest[snap.name] = snap
            if not everyone.is_set() and all(n in latest for n in names()):
                everyone.set()

    feed = asyncio.create_task(consume())
    try:
        first = asyncio.create_task(everyone.wait())
        await asyncio.wait({feed, first}, return_when=asyncio.FIRST_COMPLETED)
        first.cancel()
        if feed.done():  # the feed failed: say why
            feed.result()
        loop = asyncio.get_running_loop()
        # Every host answered once: from now on nothing here needs an answer the moment it
        # arrives, so the loop handles them in batches (a no-op on an unpaced loop).
        set_pace(min(WATCH_PACE_S, interval / 8))
        while True:
            started = loop.time()
            emit(FleetSnapshot(hosts=tuple(latest[n] for n in names() if n in latest)))
            await asyncio.sleep(max(0.0, interval - (loop.time() - started)))
    finally:
        feed.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await feed

async def table_output(config: Config, sources: list[Source] | None) -> int:
    """One snapshot as the human-readable table (see gputop/cli/table.py)."""
    import shutil

    from gputop.cli.table import render
    from gputop.hubclient.poller import open_poller
    from gputop.poller import first_answer_s
    from gputop.reservations.flags import IdleTracker

    poller = open_poller(config, sources, one_look=True, say=_say)  # one query
    try:
        snap = await poller.snapshot(first_answer_s(config))
    finally:
        await poller.aclose()
    state, _ = ReservationsReader(config).read()
    # The flags that follow from time (idle reservation, idle holder) as --json says them
    # of the same look: without the tracker the table never showed them.
    tracker = IdleTracker(config.defaults.idle_holder_s, config.reservations.idle_grace_s,
                          config.reservations.share_grace_s)
    for host in snap.hosts:
        tracker.observe(host)
    tty = sys.stdout.isatty()
    width: int | None = None
    if tty or os.environ.get("COLUMNS", "").isdigit():
        width = shutil.get_terminal_size().columns
    color = tty and not os.environ.get("NO_COLOR") and os.environ.get("TERM") != "dumb"
    sys.stdout.write(render(snap, state, tracker=tracker, width=width, color=color))
    sys.stdout.flush()
    return exit_code(snap)


def exit_code(snap: FleetSnapshot) -> int:
    """0, or EXIT_NO_HOST when there were hosts and none of them answered."""
    if snap.hosts and not any(h.ok for h in snap.hosts):
        return EXIT_NO_HOST
    return EXIT_OK
