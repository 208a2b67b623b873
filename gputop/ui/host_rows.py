"""One host's rows as the board keeps them between frames, and a frame's rows in order.

A host's share of the summary and its rows' keys are worked out as it answers (they are
cheap, and every frame needs them for every host); its rows themselves are made when they
are first looked at. The table looks only at the rows on screen, so at 200 hosts x 8 GPUs
an answer from a host off screen costs a few microseconds, not a row per GPU
(bench/results/hub.md, "a fifth pass").
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from typing import overload

from gputop.model import HostSnapshot
from gputop.ui.board_rows import GpuRow, HostRow, Row

SEP = "\x00"  # joins a row's words for the filter (a term with it takes the slow path)


@dataclass(slots=True)
class Counts:
    """A host's share of the summary bar."""

    gpus: int = 0
    reserved: int = 0
    free: int = 0
    busy: int = 0
    util_sum: int = 0
    util_n: int = 0
    mem_used_mib: int = 0
    mem_total_mib: int = 0
    instances: int = 0  # MIG instance rows
    shared: int = 0
    down: int = 0
    unknown: int = 0
    #: MIG instances by class (``summary.instance_class``).
    instance_classes: dict[str, int] = field(default_factory=dict)


#: What makes a host's rows when they are first looked at, and what it is given: (its rows,
#: those of its GPU rows without instance or share rows, by key). A function and its
#: arguments, not a closure: a closure was a dozen more objects per answer for the garbage
#: collector to look at.
Builder = tuple[Callable[..., tuple[list[GpuRow], dict[str, GpuRow]]], tuple[object, ...]]


class HostRows:
    """One host's rows as of ``version`` (its answer, the reservations), good until
    ``valid_until`` (a timestamp: the host turns stale, or time-driven flags are due).

    ``counts`` and ``keys`` (its header's and rows' keys, in order) are set as it is
    made; ``rows`` and ``block`` are made by ``build`` when first asked for."""

    __slots__ = ("_block", "_build", "_flat", "_hays", "_rows", "counts", "host_hay", "keys",
                 "memo", "plain", "snapshot", "stale", "valid_until", "version")

    def __init__(self, version: tuple[object, ...], valid_until: float, stale: bool = False,
                 counts: Counts | None = None, keys: list[str] | None = None,
                 build: Builder | None = None, snapshot: HostSnapshot | None = None,
                 rows: list[GpuRow] | None = None) -> None:
        self.version = version
        self.valid_until = valid_until
        self.stale = stale
        self.counts = counts or Counts()
        self.keys: list[str] = keys or []
        self._build = build
        #: The answer (its header row is made from it with the rows).
        self.snapshot = snapshot
        self._rows = rows
        self._block: list[Row] | None = None
        #: Its GPU rows without instance or share rows, by key: the next answer's rows
        #: reuse those whose GPU did not change. Until its own rows are made, the rows
        #: these would have reused (so never a chain of answers, one dict).
        self.plain: dict[str, GpuRow] = {}
        self._flat: list[GpuRow] | None = None
        self._hays: list[str] | None = None
        #: The host's own words (name, tags), lowered and joined.
        self.host_hay: str | None = None
        #: The filter's last answer for these rows: (filter key, terms, rows kept).
        self.memo: tuple[tuple[object, ...], list[str], list[GpuRow]] | None = None

    @property
    def built(self) -> bool:
        return self._rows is not None

    @property
    def rows(self) -> list[GpuRow]:
        rows = self._rows
        if rows is None:
            assert self._build is not None
            make, args = self._build
            rows, self.plain = make(*args)
            self._rows, self._build = rows, None
        return rows

    @property
    def block(self) -> list[Row]:
        """Its header and rows as the grouped view shows them (not collapsed, no filter)."""
        block = self._block
        if block is None:
            rows, snap = self.rows, self.snapshot
            if snap is None:
                block = self._block = [*rows]
            else:
                insts = self.counts.instances
                shares = sum(1 for r in rows if r.share is not None)
                block = self._block = [HostRow(snap.name, snap,
                                               len(self.keys) - 1 - insts - shares,
                                               False, self.stale, snap.time, insts), *rows]
        return block

    def hays(self) -> list[str]:
        """Each row's own words (model, users, holder), lowered and joined, then all of
        them joined as one last item: a term that is in none of the rows' words is not in
        that last one, so a host is ruled out with one look."""
        if self._hays is None:
            hays = []
            for r in self.rows:
                words = [r.gpu.name or "", *r.users]
                if r.reservation:
                    words.append(r.reservation.user)
                words += [s.user for s in r.shares]
                if r.share is not None:
                    words.append(r.share.user)
                hays.append(SEP.join(w.lower() for w in words))
            hays.append(SEP.join(hays))
            self._hays = hays
        return self._hays

    @property
    def rows_flat(self) -> list[GpuRow]:
        """The rows for a sorted view (no host headers: each row names its host)."""
        if self._flat is None:
            self._flat = [replace(r, show_host=True) for r in self.rows]
        return self._flat


NO_ROWS = HostRows((), 0.0, rows=[])


class FrameRows(Sequence[Row]):
    """A frame's rows in order, as parts: rows already made, or a host's ``block``,
    made only when one of its rows is looked at (the table looks at those on screen and
    the cursor's)."""

    __slots__ = ("_len", "_parts", "_starts")

    def __init__(self) -> None:
        self._parts: list[list[Row] | HostRows] = []
        self._starts: list[int] = []
        self._len = 0

    def add_rows(self, rows: Sequence[Row]) -> None:
        if not rows:
            return
        last = self._parts[-1] if self._parts else None
        if isinstance(last, list):
            last.extend(rows)
        else:
            self._parts.append(list(rows))
            self._starts.append(self._len)
        self._len += len(rows)

    def add_block(self, host: HostRows) -> None:
        """``host.block``, whose length is that of its keys."""
        self._parts.append(host)
        self._starts.append(self._len)
        self._len += len(host.keys)

    def __len__(self) -> int:
        return self._len

    @overload
    def __getitem__(self, i: int) -> Row: ...

    @overload
    def __getitem__(self, i: slice) -> list[Row]: ...

    def __getitem__(self, i: int | slice) -> Row | list[Row]:
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(self._len))]
        if i < 0:
            i += self._len
        if not 0 <= i < self._len:
            raise IndexError(i)
        at = bisect_right(self._starts, i) - 1
        part = self._parts[at]
        rows = part.block if isinstance(part, HostRows) else part
        return rows[i - self._starts[at]]

    def __iter__(self) -> Iterator[Row]:
        for part in self._parts:
            yield from (part.block if isinstance(part, HostRows) else part)

    def __repr__(self) -> str:
        return f"FrameRows({list(self)!r})"

    def __eq__(self, other: object) -> bool:
        if isinstance(other, (FrameRows, list)):
            return len(self) == len(other) and all(a == b for a, b in zip(self, other))
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]
