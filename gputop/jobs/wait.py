"""Waiting in the queue until the order rule grants this waiter its GPUs.

One loop per waiter: poll the hosts (one refresh per interval over the kept connections),
read the file without the lock, and take the lock only to write: to grant (re-checked under
the lock), to renew the lease (once per half lease) or to leave. So 50 waiters at the
default interval cost a few short writes a second, not 25 locked read-modify-writes.
Between refreshes a waiter stats the file every 0.2 s: a reservation released there is
taken up at once, not at the next refresh.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, replace

from gputop.config import Config
from gputop.model import utcnow
from gputop.poller import Poller
from gputop.reservations.queue import LeftQueue, Queue, Request, grantable
from gputop.reservations.store import Job, Reservation, Store, StoreState
from gputop.text import clean

#: How often a waiter looks at the file between refreshes (a stat, no lock).
WATCH_S = 0.2


def _signature(store: Store) -> tuple[int, int, int] | None:
    try:
        st = os.stat(store.path)
    except OSError:
        return None
    return (st.st_ino, st.st_mtime_ns, st.st_size)


class WaitedTooLong(Exception):
    """``--max-wait`` passed before the GPUs were granted (exit code 1)."""


@dataclass
class Progress:
    """What a waiter tells its user: its place and how many are ahead of it."""

    position: int
    waiting: int


def describe_request(req: Request) -> str:
    what = f"{req.count} GPU{'s' if req.count != 1 else ''}"
    if req.min_free_mib:
        what += f" with {req.min_free_mib / 1024:g}G free"
    if req.want:
        what += f" ({clean(req.want)})"
    elif req.one_host:
        what += " on one host"
    return what


async def wait_for_gpus(config: Config, store: Store, req: Request, *, seconds: float,
                        note: str = "", lease_s: float, max_wait: float | None,
                        say: Callable[[str], None],
                        job: Callable[[str], Job | None] | None = None,
                        poller: Poller | None = None,
                        reaper: Callable[[], object] | None = None) -> list[Reservation]:
    """Join the queue and return the reservations once granted. Cancellation (Ctrl-C,
    SIGTERM) and every error leave the queue at once; nothing is half-reserved."""
    own = poller is None
    if poller is None:
        if req.hosts:  # poll only the hosts it can be granted on
            config = replace(config, hosts=tuple(h for h in config.hosts
                                                 if h.name in req.hosts))
        poller = Poller(config)
    q = Queue(store, req, lease_s=lease_s)
    started = time.monotonic()
    try:
        pos = q.join()
        say(f"waiting for {describe_request(req)}: position {pos} in the queue")
        last = pos
        while True:
            loop_start = time.monotonic()
            snap = await poller.snapshot()
            if reaper is not None:
                reaper()
            state = store.read()
            now = snap.time
            hosts = list(snap.hosts)
            pos_now = q.position(state, now)
            if pos_now is None:
                say("your place in the queue lapsed (lease not renewed in time); joining "
                    "again at the end")
                last = q.join()
                continue
            if grantable(state, q.id, hosts, now) is not None:
                with contextlib.suppress(LeftQueue):  # then it joins again, above
                    got = q.try_grant(hosts, seconds=seconds, note=note, job=job)
                    if got is not None:
                        return got
            elif pos_now != last:
                say(f"position {pos_now} of {len(state.waiting(now))}: "
                    f"{_ahead(state, q, now)}")
                last = pos_now
            if max_wait is not None and time.monotonic() - started >= max_wait:
                raise WaitedTooLong(f"waited {max_wait:g}s for {describe_request(req)}; still "
                                    f"position {pos_now} in the queue (left it)")
            if q.renew_due(now):
                try:
                    q.renew()
                except LeftQueue:
                    continue
            # Until the next refresh, watch the file: a release there is acted on within
            # WATCH_S, against the hosts as the last refresh saw them.
            sig = _signature(store)
            while (left := config.interval - (time.monotonic() - loop_start)) > 0:
                await asyncio.sleep(min(WATCH_S, left))
                if _signature(store) == sig:
                    continue
                sig = _signature(store)
                state = store.read()
                if grantable(state, q.id, hosts, utcnow()) is not None:
                    with contextlib.suppress(LeftQueue):
                        got = q.try_grant(hosts, seconds=seconds, note=note, job=job)
                        if got is not None:
                            return got
                    break
    finally:
        try:
            await asyncio.shield(asyncio.to_thread(q.leave))
        finally:
            if own:
                await poller.aclose()


def _ahead(state: StoreState, q: Queue, now: object) -> str:
    from datetime import datetime

    assert isinstance(now, datetime)
    queue = state.waiting(now)
    at = next(i for i, w in enumerate(queue) if w.id == q.id)
    if at == 0:
        return "you are next; waiting for enough GPUs to be free"
    head = queue[0]
    return f"{at} ahead of you (first: {clean(head.user)}, {head.count} GPU(s))"
