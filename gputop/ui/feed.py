"""The board's data feed on its own thread and event loop, off the UI's loop.

At 1,000 hosts the poller's own work (SSH packets, parsing, a task step per host) comes in
bursts, and on the UI's loop a key pressed during one waited for all of it. Here the poller
runs on a private loop in a daemon thread and only hands finished snapshots over, through
a thread-safe queue the board drains once per frame (see ``Intake.drain`` in
``gputop.ui.intake``). Python's GIL switches threads every few milliseconds, so a burst no
longer holds a keypress.

While a key is being handled the board asks the feed to wait (``hold``): a key's work then
has the GIL, and on a loaded machine the CPU, to itself, instead of sharing them with a
burst of a thousand answers. A hold is short (the board asks for ~0.1 s a key; at most
``MAX_HOLD_S`` in a row), and the feed always gets ``MIN_RUN_S`` between holds, so a key
held down never stops the data.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import Callable
from typing import Literal

from gputop.hubclient.poller import HubPoller
from gputop.model import GpuInfo, HostError, HostSnapshot
from gputop.poller import Poller

#: The longest the feed waits for the board in one go, and how long it then runs at least.
MAX_HOLD_S = 0.25
MIN_RUN_S = 0.1


class FeedThread:
    def __init__(self, poller: Poller | HubPoller, deliver: Callable[[HostSnapshot], None],
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.poller = poller
        self._deliver = deliver
        self._clock = clock
        #: Set by the board's thread: the feed waits until then (clock time) before it
        #: hands over the next answer (and so before it polls on).
        self.hold_until = 0.0
        self._run_until = 0.0
        self.held_s = 0.0  # time spent waiting for the board, for the benchmarks
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
                self._wait_if_held()
                self._deliver(snap)
        except asyncio.CancelledError:
            pass
        finally:
            await self.poller.aclose()

    def hold(self, until: float) -> None:
        """Ask the feed to wait until ``until`` (0: go on now). Thread-safe."""
        self.hold_until = until

    def _wait_if_held(self) -> None:
        """Block this thread (its whole loop: it is the feed's) while the board holds
        it, at most MAX_HOLD_S at a time, then run at least MIN_RUN_S."""
        now = start = self._clock()
        if now < self._run_until or now >= self.hold_until:
            return
        while now < self.hold_until and not self._stopping:
            if now - start >= MAX_HOLD_S:
                self._run_until = now + MIN_RUN_S
                break
            time.sleep(min(self.hold_until - now, 0.005))
            now = self._clock()
        self.held_s += now - start

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


class BoardSource:
    """A host as the board last saw it, for a poller that must not poll anything itself:
    the demo's queue (``Q``) waits on the simulated fleet the board shows, never on hosts
    of the same names over SSH. Read on the board's own loop (its model is not shared
    with the feed thread)."""

    kind: Literal["demo"] = "demo"
    connects = 0
    #: Not a stream, nothing odd to report, no backoff to forget (see ``Source``).
    warnings: tuple[str, ...] = ()
    first_sample_s: float | None = None
    paced = False

    def __init__(self, name: str, latest: Callable[[str], HostSnapshot | None]) -> None:
        self.name = name
        self._latest = latest

    def reset(self) -> None:
        """Nothing to forget: every query tries the host anew."""

    async def query(self) -> tuple[list[GpuInfo], HostError | None]:
        snap = self._latest(self.name)
        if snap is None:
            return [], HostError("starting", "the board has no answer from it yet")
        return list(snap.gpus), snap.error

    async def close(self) -> None:
        return None
