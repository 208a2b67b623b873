"""The sender of a team's notices: the hub's collection, looked at by the notice watcher
(``gputop.notify.watcher``) once per interval, off the event loop (in a thread), so that
deciding and handing over never delay a fold or a reader.

The hub (``gputop serve`` with ``[notify]`` configured) runs ``watch`` beside its
collector; ``gputop notify run`` runs ``serve_notices``: the same collection without HTTP,
for teams without a hub. Exactly one of them per team sends (docs/notification-events.md).
"""

from __future__ import annotations

import asyncio
import contextlib
import sys

from gputop.config.load import Config
from gputop.hub.collector import Collector
from gputop.model import utcnow
from gputop.notify.watcher import Watcher


async def watch(collector: Collector, watcher: Watcher, every_s: float) -> None:
    """Hand each look at the collection to ``watcher`` every ``every_s`` (hosts that
    have not answered yet are left out: "starting" is neither up nor down)."""
    while True:
        await asyncio.sleep(every_s)
        state, _problem = collector._read_reservations()
        doc = collector.document()
        try:
            await asyncio.to_thread(watcher.observe, state, doc["hosts"], utcnow())
        except Exception as exc:  # a bug here must not stop the hub's collection
            print(f"gputop: notices: {type(exc).__name__}: {exc}", file=sys.stderr,
                  flush=True)


async def serve_notices(config: Config, watcher: Watcher,
                        collector: Collector | None = None) -> None:
    """Collect the fleet and the store and send notices until cancelled."""
    collector = collector or Collector(config)
    collecting = asyncio.create_task(collector.run())
    watching = asyncio.create_task(watch(collector, watcher, max(1.0, config.defaults.interval)))
    try:
        done, _ = await asyncio.wait({collecting, watching},
                                     return_when=asyncio.FIRST_COMPLETED)
        for t in done:
            t.result()
    finally:
        for t in (collecting, watching):
            t.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await t
