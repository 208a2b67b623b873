"""An event loop that can be told to wake at most every so often.

A fleet's hosts answer spread over the interval: 200 hosts at 2 s are 100 packets a
second, and asyncio wakes for each one (an ``epoll_wait``, a loop turn, a task step).
Headless ``--watch`` only needs each host's latest answer once per interval, so once it
runs steadily the loop may sleep ``pace`` seconds between two polls: what arrived meanwhile
waits in the kernel's socket buffers and is handled in one turn. At 200 hosts that is about
a third of the client's CPU for the same packets (``bench/results/board-scale.md``), for at
most ``pace`` seconds more latency (``--watch`` uses an eighth of its interval).

Nothing is delayed while the loop has work ready (a zero timeout); a timer fires at most
``pace`` late; a loop whose pace is 0 (the default) behaves exactly like asyncio's own.
"""

from __future__ import annotations

import asyncio
import contextlib
import selectors
import time
import weakref
from collections.abc import Coroutine, Iterator
from typing import Any, TypeVar

T = TypeVar("T")


class PacedSelector(selectors.DefaultSelector):
    """The platform's default selector, sleeping before a poll that comes sooner than
    ``pace`` seconds after the last one returned."""

    def __init__(self) -> None:
        super().__init__()
        self.pace = 0.0
        #: Exchanges under way whose every round trip counts (a handshake): no pace then.
        self.holds = 0
        self._last = 0.0

    def select(self, timeout: float | None = None) -> list[tuple[selectors.SelectorKey, int]]:
        if self.pace > 0 and not self.holds and (timeout is None or timeout > 0):
            wait = self._last + self.pace - time.monotonic()
            if wait > 0:
                # A timer due sooner waits too: 200 hosts' stall alarms and timeouts, each
                # due at its own moment, would otherwise wake the loop a few dozen times a
                # second between the paced polls. A timer fires at most ``pace`` late.
                time.sleep(wait)
                if timeout is not None:
                    timeout = max(0.0, timeout - wait)
        ready: list[tuple[selectors.SelectorKey, int]] = super().select(timeout)
        self._last = time.monotonic()
        return ready


_SELECTORS: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, PacedSelector] = (
    weakref.WeakKeyDictionary())


def new_paced_loop() -> asyncio.AbstractEventLoop:
    selector = PacedSelector()
    loop = asyncio.SelectorEventLoop(selector)
    _SELECTORS[loop] = selector
    return loop


def set_pace(seconds: float) -> bool:
    """Pace the running loop (False where it is not a paced loop: nothing changes)."""
    selector = _SELECTORS.get(asyncio.get_running_loop())
    if selector is None:
        return False
    selector.pace = max(0.0, seconds)
    return True


@contextlib.contextmanager
def unpaced() -> Iterator[None]:
    """No pace while this runs (nested and concurrent uses add up): for a handshake, whose
    ten round trips would each wait for a paced poll, and which has a timeout to keep."""
    try:
        selector = _SELECTORS.get(asyncio.get_running_loop())
    except RuntimeError:
        selector = None
    if selector is None:
        yield
        return
    selector.holds += 1
    try:
        yield
    finally:
        selector.holds -= 1


def run_paced(main: Coroutine[Any, Any, T]) -> T:
    """``asyncio.run(main)`` on a loop that :func:`set_pace` can pace. (``asyncio.run``
    takes no loop factory before Python 3.12.)"""
    loop = new_paced_loop()
    try:
        asyncio.set_event_loop(loop)
        return loop.run_until_complete(main)
    finally:
        try:
            _cancel_all(loop)
            loop.run_until_complete(loop.shutdown_asyncgens())
            loop.run_until_complete(loop.shutdown_default_executor())
        finally:
            asyncio.set_event_loop(None)
            loop.close()


def _cancel_all(loop: asyncio.AbstractEventLoop) -> None:
    """What ``asyncio.run`` does with tasks still pending when ``main`` returns."""
    pending = asyncio.all_tasks(loop)
    if not pending:
        return
    for task in pending:
        task.cancel()
    loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
    for task in pending:
        if not task.cancelled() and task.exception() is not None:
            loop.call_exception_handler({"message": "unhandled exception during shutdown",
                                         "exception": task.exception(), "task": task})
