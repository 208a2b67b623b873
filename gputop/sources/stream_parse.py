"""Reading the two ``nvidia-smi -lms`` loops' lines into samples, for a streaming session
(:class:`~gputop.sources.stream_session.HostSession` frames the channel and hands each loop's
lines here, tag removed).

The GPU loop: ``timestamp`` starts every row and ``count`` says how many rows (GPUs) one
sample has, so a sample is complete when its last row arrives. The apps loop prints nothing
while no process runs: its rows are grouped by timestamp and matched to the GPU sample by
the host's clock. Nothing here does I/O: it is what the parse tests and the fuzzing feed.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from datetime import datetime, timezone

from gputop.model import GpuInfo
from gputop.sources.nvidia_smi import (
    _LOST,
    APPS_FIELDS,
    GPU_FIELDS,
    AppRow,
    _split_lost,
    gpu_from_cells,
    parse_apps_row,
    parse_gpu_rows,
    to_int,
    to_str,
)
from gputop.ssh.transport import ParseError
from gputop.text import excerpt

#: What every lost GPU's line holds (looked for before the regex that reads one).
_LOST_TEXT = "Unable to determine the device handle for GPU"

#: Most GPUs one host may report (a sample claiming more is not nvidia-smi talking).
MAX_GPUS = 1024


class GpuSampler:
    """Lines of a ``--query-gpu=timestamp,count,...`` stream to complete samples.

    A lost GPU's line (on stderr, anywhere, even inside a row) counts as one of the
    sample's ``count`` rows. More rows than ``count``, a bad count or a malformed row is a
    ParseError: the stream is then not trusted any further.
    """

    def __init__(self) -> None:
        self._lines: list[str] = []
        #: The host-clock time of the last complete sample (its first row's timestamp).
        self.stamp = 0.0
        #: While every line of this sample is a whole row (the usual case): its announced
        #: count and each row's cells, so a row is split once and a sample is built from
        #: its cells instead of being joined and read again.
        self._count: str | None = None
        self._rows = 0
        self._cells: list[list[str]] = []
        self._plain = True

    @property
    def text(self) -> str:
        return "\n".join(self._lines)

    def feed(self, line: str) -> list[GpuInfo] | None:
        self._lines.append(line)
        if self._plain and _LOST_TEXT not in line:
            cells = line.split(", ")
            if len(cells) == len(GPU_FIELDS):
                count = cells[1].strip()
                if self._count is None:
                    if not count.isdigit() or not 1 <= int(count) <= MAX_GPUS:
                        raise ParseError(f"bad GPU count in the stream: {excerpt(line)}")
                    self._count, self._rows = count, int(count)
                elif count != self._count:
                    raise ParseError(f"GPU count changed within a sample: {excerpt(line)}")
                self._cells.append(cells)
                if len(self._cells) < self._rows:
                    return None
                rows = self._cells
                gpus = [gpu_from_cells(c) for c in rows]
                return self._complete(gpus, rows[0][0])
        self._plain = False  # a lost GPU's line, half a row: judge the sample as a whole
        data, lost = _split_lost(self.text)
        if not data:
            return None
        cells = data[0].split(", ")
        if len(cells) > len(GPU_FIELDS) or (len(data) > 1 and len(cells) != len(GPU_FIELDS)):
            raise ParseError(f"expected {len(GPU_FIELDS)} comma-separated fields, got "
                             f"{len(cells)}: {excerpt(data[0])}")
        if len(cells) < len(GPU_FIELDS):
            return None  # half a row (the rest after a lost GPU's line)
        count = cells[1].strip()
        if not count.isdigit() or not 1 <= int(count) <= MAX_GPUS:
            raise ParseError(f"bad GPU count in the stream: {excerpt(data[0])}")
        have = len(data) + len(lost)
        if have > int(count):
            raise ParseError(f"more rows than the {count} GPUs the sample announced")
        if have < int(count) or len(data[-1].split(", ")) < len(GPU_FIELDS):
            return None
        for row in data:
            if row.split(", ")[1].strip() != count:
                raise ParseError(f"GPU count changed within a sample: {excerpt(row)}")
        return self._complete(parse_gpu_rows(self.text), data[0].split(", ", 1)[0])

    def _complete(self, gpus: list[GpuInfo], stamp: str) -> list[GpuInfo]:
        self.stamp = parse_timestamp(stamp)
        self._lines, self._count, self._cells, self._plain = [], None, [], True
        return gpus

    def flush(self) -> list[GpuInfo] | None:
        """At the end of the stream: what is left, if it is (only) lost GPUs' lines."""
        data, lost = _split_lost(self.text)
        if not lost or data:
            return None
        self._lines, self._count, self._cells, self._plain = [], None, [], True
        return parse_gpu_rows("\n".join(f"Unable to determine the device handle for GPU "
                                        f"{bus}: {why}" for bus, why in lost))


_TIMESTAMP = re.compile(
    r"(\d{4})/(\d{2})/(\d{2}) (\d{2}):(\d{2}):(\d{2})(?:\.(\d{1,6}))?")


def parse_timestamp(value: str) -> float:
    """nvidia-smi's ``timestamp`` (``2026/07/14 08:12:53.500``) as seconds (host clock).
    (Read by hand, not ``strptime``, and each day's start worked out once: one per sample
    and process row per host.)"""
    v = value.strip()
    m = _TIMESTAMP.fullmatch(v)
    if not m:
        raise ParseError(f"bad timestamp in the stream: {excerpt(v)}")
    y, mo, d, h, mi, sec, frac = m.groups()
    day = _DAYS.get(v[:10])
    if day is None:
        try:
            day = datetime(int(y), int(mo), int(d), tzinfo=timezone.utc).timestamp()
        except ValueError as exc:
            raise ParseError(f"bad timestamp in the stream: {excerpt(v)}") from exc
        if len(_DAYS) >= 64:
            _DAYS.clear()
        _DAYS[v[:10]] = day
    hours, mins, secs = int(h), int(mi), int(sec)
    if hours > 23 or mins > 59 or secs > 59:
        raise ParseError(f"bad timestamp in the stream: {excerpt(v)}")
    return day + hours * 3600 + mins * 60 + secs + (int(frac) / 10 ** len(frac) if frac else 0.0)


#: Start of a day (UTC seconds) by its ``YYYY/MM/DD`` text.
_DAYS: dict[str, float] = {}


@dataclass
class _Batch:
    stamp: float
    #: By (GPU uuid, pid): a process listed again in one batch (two loop iterations close
    #: together, or a flood) replaces its row instead of adding another.
    rows: dict[tuple[str | None, int], AppRow] = field(default_factory=dict)


@dataclass
class AppsBatches:
    """Rows of a ``--query-compute-apps=timestamp,...`` loop, grouped into samples.

    Rows whose timestamps lie within half an interval of the batch's first belong to one
    loop iteration. A GPU sample taken at ``stamp`` (host clock) shows the newest batch not
    later than half an interval after it; none within 1.5 intervals before it means "no
    processes now" (the loop prints nothing then). Both clocks are the host's.
    """

    interval: float
    batches: list[_Batch] = field(default_factory=list)
    seen: bool = False
    _carry: str = ""

    def feed(self, line: str) -> None:
        m = _LOST.search(line) if _LOST_TEXT in line else None
        if m:  # a lost GPU's line (stderr), maybe inside a row: keep the row's first half
            self._carry += line[: m.start()]
            return
        line, self._carry = self._carry + line, ""
        if not line.strip():
            return
        row = parse_session_apps_row(line)
        stamp = parse_timestamp(line.split(", ", 1)[0])
        if not self.batches or abs(stamp - self.batches[-1].stamp) > self.interval / 2:
            self.batches = [*self.batches[-3:], _Batch(stamp)]
        self.batches[-1].rows[(row.gpu_uuid, row.pid)] = row
        self.seen = True

    def for_sample(self, stamp: float) -> list[AppRow]:
        """The processes a GPU sample taken at ``stamp`` shows.

        The two loops' lines interleave on the host, and the relay writes when a GPU sample
        is complete: the newest apps batch may be cut there, its other rows coming with the
        next sample. So while the batch of this very sample is the newest, a process the
        batch before listed and this one does not (yet) is kept from that one; once a later
        batch began, this one is known whole. A process that ended shows one sample more;
        a busy process never drops off for a sample."""
        for i in range(len(self.batches) - 1, -1, -1):
            b = self.batches[i]
            if b.stamp <= stamp + self.interval / 2:
                if stamp - b.stamp > 1.5 * self.interval:
                    return []
                newest = i == len(self.batches) - 1 and abs(stamp - b.stamp) <= self.interval / 2
                if not (newest and i > 0):
                    return list(b.rows.values())
                before = self.batches[i - 1]
                if b.stamp - before.stamp > 1.5 * self.interval:
                    return list(b.rows.values())
                return [*b.rows.values(), *(r for k, r in before.rows.items() if k not in b.rows)]
        return []


def parse_session_apps_row(line: str) -> AppRow:
    """An apps row as the session sends it: nvidia-smi's four fields and, appended by the
    session's awk, the process's start time (digits, or ``-`` when unknown)."""
    cells = line.split(", ")
    if len(cells) != len(APPS_FIELDS) + 1:
        return parse_apps_row(line)
    start = cells[-1]
    if start != "-" and not start.isdigit():
        raise ParseError(f"unexpected process row: {excerpt(line)}")
    pid = to_int(cells[2])  # as parse_apps_row, without joining the row again
    if pid is None or not cells[2].strip().isdigit():
        raise ParseError(f"unexpected process row: {excerpt(line)}")
    return AppRow(to_str(cells[1]), pid, to_int(cells[3]), None if start == "-" else start)
