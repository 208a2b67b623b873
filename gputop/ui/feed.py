"""The board's data feed on its own thread and event loop, off the UI's loop.

At 1,000 hosts the poller's own work (SSH packets, parsing, a task step per host) comes in
bursts, and on the UI's loop a key pressed during one waited for all of it. Here the poller
runs on a private loop in a daemon thread and only hands finished snapshots over, through
a thread-safe queue the board drains once per frame (see ``GputopApp._drain``). Python's
GIL switches threads every few milliseconds, so a burst no longer holds a keypress.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Callable

from gputop.model import HostSnapshot
from gputop.poller import Poller


class FeedThread:
    def __init__(self, poller: Poller, deliver: Callable[[HostSnapshot], None]) -> None:
        self.poller = poller
        self._deliver = deliver
        self._loop = asyncio.new_event_loop()
        self._main: asyncio.Task[None] | None = None
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="gputop-feed", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        try:
            self._loop.run_until_complete(self._feed())
        finally:
            self._loop.close()

    async def _feed(self) -> None:
        self._main = asyncio.current_task()
        if self._stopping:  # stopped before it started
            await self.poller.aclose()
            return
        try:
            async for snap in self.poller.updates():
                self._deliver(snap)
        except asyncio.CancelledError:
            pass
        finally:
            await self.poller.aclose()

    def reconnect(self, name: str) -> bool:
        """``Poller.reconnect`` on the feed's loop (its events are not thread-safe)."""
        if not any(s.name == name for s in self.poller.sources):
            return False
        with contextlib.suppress(RuntimeError):  # the loop is closed: we are exiting
            self._loop.call_soon_threadsafe(self.poller.reconnect, name)
        return True

    def stop(self, timeout: float = 10.0) -> None:
        """Stop polling and close every connection; wait for it up to ``timeout``."""
        def cancel() -> None:
            if self._main is not None:
                self._main.cancel()

        self._stopping = True
        if self._thread.is_alive():
            with contextlib.suppress(RuntimeError):
                self._loop.call_soon_threadsafe(cancel)
            self._thread.join(timeout)
