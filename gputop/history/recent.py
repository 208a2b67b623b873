"""One GPU's recorded last hour and last day, for the board's detail pane.

Read from the rollups only (minutes for the hour, hours plus minutes for the day), so a
lookup scans at most an hour of minute rows and a day of hour rows, whatever the fleet.
The minute now being recorded is not in yet.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from gputop.history.accounting import BUSY, DATA, HELD_IDLE, IDLE, NODATA, UTIL_SECS, UTIL_SUM
from gputop.history.db import GPU_METRICS, HistoryDB


@dataclass(frozen=True)
class Recent:
    hours: float  # GPU-hours with data
    no_data_hours: float
    busy: float  # fractions of the hours with data
    idle: float
    held_idle: float
    mean_utilization: float | None

    def line(self, label: str) -> str:
        if self.hours <= 0:
            return f"{label}: no data" if self.no_data_hours else f"{label}: nothing recorded"
        util = "?" if self.mean_utilization is None else f"{self.mean_utilization:.0f} %"
        gap = f", {self.no_data_hours * 60:.0f} min no data" if self.no_data_hours else ""
        return (f"{label}: mean {util}, busy {100 * self.busy:.0f} %, idle "
                f"{100 * self.idle:.0f} %, held idle {100 * self.held_idle:.0f} %{gap}")


def _recent(sums: list[float]) -> Recent:
    data = sums[DATA]
    frac = (lambda x: x / data) if data > 0 else (lambda x: 0.0)
    return Recent(data / 3600, sums[NODATA] / 3600, frac(sums[BUSY]), frac(sums[IDLE]),
                  frac(sums[HELD_IDLE]),
                  sums[UTIL_SUM] / sums[UTIL_SECS] if sums[UTIL_SECS] > 0 else None)


def recent_gpu(path: Path, host: str, uuid: str | None, index: int | None, now: float
               ) -> tuple[Recent, Recent] | None:
    """(last hour, last day) of one GPU, or None when nothing was recorded for it.
    Raises HistoryError for a database it cannot read."""
    key = uuid or (f"index:{index}" if index is not None else None)
    if key is None:
        return None
    return _recent_of(path, host, key, now)


def recent_host(path: Path, host: str, now: float) -> tuple[Recent, Recent] | None:
    """(last hour, last day) of all of a host's GPUs together (GPU-hours add up)."""
    return _recent_of(path, host, None, now)


def _recent_of(path: Path, host: str, key: str | None, now: float
               ) -> tuple[Recent, Recent] | None:
    if not path.exists():
        return None
    with HistoryDB(path) as db, db.errors():
        c = db.conn
        sql = "SELECT g.id FROM gpus g JOIN hosts h ON g.host = h.id WHERE h.name = ?"
        ids = [r[0] for r in c.execute(sql + ("" if key is None else " AND g.key = ?"),
                                       (host,) if key is None else (host, key))]
        if not ids:
            return None
        cols = ", ".join(f"TOTAL({m})" for m in GPU_METRICS)
        marks = ", ".join("?" * len(ids))
        hour_done = db.meta("hour_done")

        def sums(table: str, a: float, z: float) -> list[float]:
            got = c.execute(f"SELECT {cols} FROM {table} WHERE b >= ? AND b < ? "
                            f"AND gpu IN ({marks})", (a, z, *ids)).fetchone()
            return [float(x) for x in got]

        hour = sums("gpu_minute", now - 3600, now)
        day_start = now - 86400
        first_hour = -(-day_start // 3600) * 3600
        split = max(first_hour, min(hour_done, now))
        day = [a + b + d for a, b, d in zip(sums("gpu_minute", day_start, first_hour),
                                            sums("gpu_hour", first_hour, split),
                                            sums("gpu_minute", split, now))]
    return _recent(hour), _recent(day)
