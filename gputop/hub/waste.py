"""The web board's waste panel: the last day of the history database, summed once a minute.

The page asks ``/api/v1/waste``; the hub reads the database (read-only, on a worker thread,
so the event loop never waits on SQLite) at most once per ``CACHE_S`` whatever the number
of pages open, and hands out only the headline and the users who wasted most: a bounded
answer however many users the history holds. No database file: ``available`` false and the
page shows no panel. A broken one: its error, and the file is left untouched (HistoryDB
opens it read-only).
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

from gputop.history.db import HistoryDB, HistoryError
from gputop.history.report import collect, summarise

WINDOW_S = 86400.0
CACHE_S = 60.0
TOP_USERS = 10


def waste_summary(path: Path, now: float) -> dict[str, Any]:
    """The last ``WINDOW_S`` of ``path`` as the panel shows it."""
    if not path.exists():
        return {"available": False, "reason": "no history database (start `gputop record`)"}
    try:
        with HistoryDB(path) as db:
            doc = summarise(collect(db, now - WINDOW_S, now))
    except HistoryError as exc:
        return {"available": False, "reason": str(exc), "error": True}
    users = sorted(doc["users"], key=lambda u: (-(u["reserved_idle_hours"]
                                                  + u["held_idle_hours"]), u["user"]))
    return {"available": True, "from": doc["from"], "to": doc["to"],
            "headline": doc["headline"],
            "users": [{k: u[k] for k in ("user", "used_hours", "reserved_hours",
                                         "reserved_idle_hours", "held_idle_hours")}
                      for u in users[:TOP_USERS]
                      if u["reserved_idle_hours"] + u["held_idle_hours"] > 0]}


class WasteCache:
    """One summary per ``CACHE_S``; readers that come while it is computed wait for it."""

    def __init__(self, path: Path, cache_s: float = CACHE_S) -> None:
        self.path = path
        self.cache_s = cache_s
        self._at = -1e18
        self._doc: dict[str, Any] | None = None
        self._lock = asyncio.Lock()

    async def get(self) -> dict[str, Any]:
        async with self._lock:
            now = time.monotonic()
            if self._doc is None or now - self._at >= self.cache_s:
                self._doc = await asyncio.to_thread(waste_summary, self.path, time.time())
                self._at = time.monotonic()
            return self._doc
