"""Recording from a running poller: ``gputop record``, and ``--record`` on other modes.

Reservations are re-read at most twice per refresh interval (so that no read stands for
two refreshes of a host: a holder is seen in each refresh as the file then was) and
rollups run every 20 s, so a 200-host fleet costs a file read or two and one commit per
second or so, not one per host.
"""

from __future__ import annotations

import asyncio
import sys
import time
from pathlib import Path

from gputop.config.load import Config
from gputop.history.db import HistoryDB
from gputop.history.recorder import Recorder
from gputop.model import HostSnapshot
from gputop.reservations.filelock import StoreError
from gputop.reservations.open import open_store
from gputop.reservations.state import StoreState

#: Minutes are rolled up this often, so a report reads few raw samples.
MAINTAIN_EVERY_S = 20.0


class LiveRecorder:
    def __init__(self, config: Config, path: Path | None = None) -> None:
        self.path = path or config.history.path
        self.db = HistoryDB(self.path, writer=True)
        self.recorder = Recorder(self.db, interval=config.defaults.interval,
                                 timeout=config.defaults.timeout,
                                 raw_keep_s=config.history.keep_raw_s,
                                 minute_keep_s=config.history.keep_minutes_s,
                                 hour_keep_s=config.history.keep_hours_s)
        self.store = open_store(config)
        self.interval = config.defaults.interval
        self._read_at = -1e18
        self._maintained_at = time.monotonic()
        self._problem: str | None = None

    def observe(self, host: HostSnapshot, state: StoreState | None = None) -> None:
        """Record one host snapshot; ``state``: reservations the caller just read, if any."""
        now = time.monotonic()
        if state is not None:
            self.recorder.set_reservations(state)
            self._read_at = now
        elif now - self._read_at >= self.interval / 2:
            self._read_at = now
            try:
                self.recorder.set_reservations(self.store.read())
                self._problem = None
            except StoreError as exc:  # keep the last good reservations; say so once
                if str(exc) != self._problem:
                    print(f"gputop: record: {exc} (keeping the last reservations read)",
                          file=sys.stderr)
                self._problem = str(exc)
        self.recorder.record(host)
        if now - self._maintained_at >= MAINTAIN_EVERY_S:
            self._maintained_at = now
            self.recorder.maintain(time.time())

    def close(self) -> None:
        try:
            self.recorder.flush()
        finally:
            self.db.close()


async def record_forever(config: Config, path: Path | None = None) -> None:
    """``gputop record``: every host's snapshots into the database until cancelled."""
    from gputop.poller import Poller

    live = LiveRecorder(config, path)
    print(f"gputop: recording {len(config.hosts)} host(s) every {config.defaults.interval:g} s to "
          f"{live.path}", file=sys.stderr)
    poller = Poller(config)
    task = asyncio.current_task()
    loop = asyncio.get_running_loop()
    import signal

    if task is not None:
        loop.add_signal_handler(signal.SIGTERM, task.cancel)
    try:
        live.recorder.maintain(time.time())
        async for host in poller.updates():
            live.observe(host)
    finally:
        loop.remove_signal_handler(signal.SIGTERM)
        await poller.aclose()
        live.close()
