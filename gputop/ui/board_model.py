"""What the board shows, computed without Textual: rows, order, filter, summary, history.

The rows themselves and their keys are in :mod:`gputop.ui.board_rows`, the per-user view's
records in :mod:`gputop.ui.board_users`. The row cache, the filter's memo and the summary's
counts stay together here: they share one pass over the fleet per frame
(bench/results/board-scale.md).

The app feeds host snapshots and reservation state in, and asks for rows out. Keeping this
free of widgets makes it cheap to test and lets the table update only the rows that changed.
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Callable, Container, Iterable, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Literal

from gputop.model import GpuInfo, HostSnapshot, utcnow
from gputop.reservations.flags import (
    IDLE_GRACE_S,
    SHARE_GRACE_S,
    IdleTracker,
    gpu_flags,
    instance_index,
    instance_reservation,
    instance_view,
    is_free,
    reservation_index,
    share_flags,
)
from gputop.reservations.ops import format_duration
from gputop.reservations.records import Reservation
from gputop.reservations.shares import share_index
from gputop.reservations.state import StoreState
from gputop.reservations.summary import CLASSES
from gputop.reservations.summary import classes as gpu_classes
from gputop.ui.board_history import BoardHistory
from gputop.ui.board_rows import (
    GpuRow,
    HostRow,
    Row,
    Summary,
    UserLoad,
    gpu_keys,
    instance_keys,
    share_keys,
)
from gputop.ui.board_users import user_loads
from gputop.ui.host_rows import NO_ROWS, SEP, Counts, FrameRows, HostRows

SortMode = Literal["host", "utilization", "free-memory"]
SORT_MODES: tuple[SortMode, ...] = ("host", "utilization", "free-memory")
STALE_AFTER_INTERVALS = 3



#: Seconds a host's rows are reused when it did not answer again: the time-driven flags
#: (idle holder, idle reservation, thresholds of minutes) may show up 1.5 times this late.
ROW_CACHE_S = 5


def _flags(flags: list[str]) -> tuple[str, ...]:
    return tuple(flags) if flags else ()


@dataclass
class BoardModel:
    host_order: list[str]
    interval: float = 2.0
    idle_holder_s: float = 1800.0
    idle_grace_s: float = IDLE_GRACE_S
    share_grace_s: float = SHARE_GRACE_S
    clock: Callable[[], datetime] = utcnow
    me: str = ""
    snapshots: dict[str, HostSnapshot] = field(default_factory=dict)
    #: The last snapshot that had GPUs, per host: shown dimmed when the host fails.
    last_good: dict[str, HostSnapshot] = field(default_factory=dict)
    #: Each GPU's utilisation and memory-used percentages, one per refresh (the detail
    #: pane's sparklines: ``history.series``).
    history: BoardHistory = field(default_factory=BoardHistory)
    state: StoreState = field(default_factory=StoreState)
    filter_text: str = ""
    sort_mode: SortMode = "host"
    free_only: bool = False
    collapsed: set[str] = field(default_factory=set)

    def __post_init__(self) -> None:
        self.tracker = IdleTracker(self.idle_holder_s, self.idle_grace_s, self.share_grace_s)
        self._shared: tuple[object, dict[tuple[str, int], tuple[Reservation, ...]]] = (
            None, {})
        #: Bumped on every change a row's look depends on, so the table can skip rows whose
        #: inputs did not change (most of them: hosts answer one at a time).
        self.host_version: dict[str, int] = {}
        self.state_version = 0
        self._row_cache: dict[str, HostRows] = {}
        self._phase: dict[str, float] = {}
        self._keys: dict[str, tuple[HostSnapshot, list[str]]] = {}  # gpu_keys, per answer
        #: Per host: its GPUs' uuids, their keys, and whether the uuids alone made them
        #: (all set and distinct: then the same uuids make the same keys).
        self._uuid_keys: dict[str, tuple[list[str | None], list[str], bool]] = {}

    # -- input ---------------------------------------------------------------------------

    def ingest(self, snap: HostSnapshot) -> None:
        name = snap.name
        if name not in self.snapshots and name not in self.host_order:
            self.host_order.append(name)
        self.snapshots[name] = snap
        self.host_version[name] = self.host_version.get(name, 0) + 1
        if snap.ok:
            self.last_good[name] = snap
            self.tracker.observe(snap)
            keys = self._keys[name] = (snap, self._gpu_keys(name, snap.gpus))
            self.history.add(snap, keys[1])
        elif (last := self._keys.get(name)) is not None:
            self.history.gap(name, last[1])  # no answer: a gap in each of its GPUs' series

    def _gpu_keys(self, host: str, gpus: tuple[GpuInfo, ...]) -> list[str]:
        """``gpu_keys``, reused while the host lists the same uuids (every answer but
        the first, nearly always): when they are all set and distinct, the keys depend on
        them alone (a uuid listed twice falls back to its index, which may change)."""
        uuids = [g.uuid for g in gpus]
        last = self._uuid_keys.get(host)
        if last is not None and last[2] and last[0] == uuids:
            return last[1]
        keys = gpu_keys(host, gpus)
        self._uuid_keys[host] = (uuids, keys, all(uuids) and len(set(uuids)) == len(uuids))
        return keys

    def set_state(self, state: StoreState) -> None:
        self.state = state
        self.state_version += 1

    def signature(self, row: Row, now: datetime) -> tuple[object, ...]:
        """Everything a row's cells depend on; equal signatures mean equal cells."""
        if isinstance(row, GpuRow):
            # The row itself: the same object (its GPU did not change: see _host_rows)
            # compares at once, an equal one field by field, so a host's answer redraws
            # only the GPUs that moved. And the time left it shows (a reservation's or a
            # share's), as shown: a row kept or equal still counts down.
            held = row.share if row.share is not None else row.reservation
            left = ("" if held is None else
                    format_duration(max(0.0, (held.expires - now).total_seconds())))
            return ("g", row, self.state_version, left)
        seconds = int(now.timestamp()) if row.error or row.stale else 0
        return ("h", self.host_version.get(row.host), row.collapsed, row.stale,
                row.gpu_count, row.instance_count, seconds)

    # -- queries -------------------------------------------------------------------------

    def _stale_after(self) -> float:
        return max(STALE_AFTER_INTERVALS * self.interval, self.interval + 5)

    def is_stale(self, snap: HostSnapshot | None, now: datetime) -> bool:
        if snap is None:
            return False
        return (now - snap.time).total_seconds() > self._stale_after()

    def gpu_rows(self, host: str, now: datetime,
                 held: dict[tuple[str, int], Reservation],
                 inst_held: dict[tuple[str, int, int], Reservation] | None = None
                 ) -> list[GpuRow]:
        return self._host_rows(host, now, held, inst_held).rows

    def _host_rows(self, host: str, now: datetime,
                   held: dict[tuple[str, int], Reservation],
                   inst_held: dict[tuple[str, int, int], Reservation] | None = None
                   ) -> HostRows:
        """A host's GPU rows and its share of the summary, worked out again only when
        something they depend on changed: a new answer, the reservations (a write, or one
        expiring: the count of active ones), staleness, or ``ROW_CACHE_S`` passing (the
        idle flags are time-driven). A frame costs nothing for hosts that did not answer."""
        snap = self.snapshots.get(host)
        if snap is None or snap.error is not None:
            return NO_ROWS
        ts = now.timestamp()
        version = (self.host_version.get(host), self.state_version, len(held),
                   len(inst_held or {}))
        cached = self._row_cache.get(host)
        if cached is not None and cached.version == version and ts < cached.valid_until:
            return cached  # the common case, for every host on every frame: kept cheap
        stale = self.is_stale(snap, now)
        phase = self._phase.get(host)
        if phase is None:  # hosts' rows expire at different times, not all in one frame
            phase = self._phase[host] = zlib.crc32(host.encode(errors="replace")) % 997 / 997
        # The next boundary of its phase at least half a period away: rows just worked
        # out for an answer are not worked out again before the next (every 2 s).
        valid_until = (math.floor((ts + ROW_CACHE_S / 2) / ROW_CACHE_S + phase) + 1
                       - phase) * ROW_CACHE_S
        if not stale:  # (a new answer, a new version, is what makes it fresh again)
            valid_until = min(valid_until, snap.time.timestamp() + self._stale_after())
        keys = self._keys.get(host)
        if keys is None or keys[0] is not snap:
            keys = self._keys[host] = (snap, self._gpu_keys(host, snap.gpus))
        gkeys = keys[1]
        shared = self._share_index(now)
        counts, row_keys, has_shares = self._tally(host, snap, gkeys, shared, held,
                                                   inst_held or {})
        # A GPU whose object is the one before (a hub's patch left it as it was) with the
        # same inputs keeps its row object: the table then skips it at once.
        before = cached.plain if cached is not None else {}
        out = self._row_cache[host] = HostRows(
            version, valid_until, stale, counts, row_keys,
            (self._build_rows, (host, snap, gkeys, now, shared, held, inst_held, stale, before)),
            snap)
        out.plain = before
        if has_shares:
            out.rows  # noqa: B018  (made now: a share's over-use is timed as rows are made)
        if self.filter_text.strip():  # while filtering, the words are worked out here (as
            out.hays()  # the host answers: see warm), not in the next keystroke
        return out

    def _tally(self, host: str, snap: HostSnapshot, gkeys: list[str],
               shared: dict[tuple[str, int], tuple[Reservation, ...]],
               held: dict[tuple[str, int], Reservation],
               inst_held: dict[tuple[str, int, int], Reservation],
               ) -> tuple[Counts, list[str], bool]:
        """The host's share of the summary and its rows' keys, from its answer alone (no
        rows: those are made when looked at, see ``_build_rows``), with locals (as
        attributes it was a fifth of drawing a frame at 200 x 8), each GPU in its class by
        the rule of the document's ``summary``. Last: whether any of its GPUs is shared."""
        gpus = util_sum = util_n = used = total = insts = 0
        classes = dict.fromkeys(CLASSES, 0)
        inst_classes: dict[str, int] = {}
        has_shares = has_instances = False
        idx = (held, inst_held, shared)
        for g in snap.gpus:
            gpus += 1
            has_shares = has_shares or (bool(shared) and (host, g.index) in shared)
            has_instances = has_instances or bool(g.instances)
            c, ics = gpu_classes(host, g, idx)
            classes[c] += 1
            for ic in ics:
                inst_classes[ic] = inst_classes.get(ic, 0) + 1
            if g.utilization_percent is not None:
                util_sum += g.utilization_percent
                util_n += 1
            used += g.memory_used_mib or 0
            total += g.memory_total_mib or 0
        counts = Counts(gpus, classes["reserved"], classes["free"], classes["busy"], util_sum,
                        util_n, used, total, 0, classes["shared"], classes["down"],
                        classes["unknown"], inst_classes)
        if not has_shares and not has_instances:  # (nearly always: the keys are the GPUs')
            return counts, [host, *gkeys], False
        keys = [host]
        for g, gkey in zip(snap.gpus, gkeys):
            sh = shared.get((host, g.index)) if shared and g.index is not None else None
            keys.append(gkey)
            if sh:
                keys += share_keys(gkey, sh)
                continue
            if g.instances:
                ikeys = instance_keys(gkey, g.instances)
                insts += len(ikeys)
                keys += [k for _, k in ikeys]
        counts.instances = insts
        return counts, keys, has_shares

    def _build_rows(self, host: str, snap: HostSnapshot, gkeys: list[str], now: datetime,
                    shared: dict[tuple[str, int], tuple[Reservation, ...]],
                    held: dict[tuple[str, int], Reservation],
                    inst_held: dict[tuple[str, int, int], Reservation] | None, stale: bool,
                    before: dict[str, GpuRow]) -> tuple[list[GpuRow], dict[str, GpuRow]]:
        """A host's rows (see ``_tally`` for their keys), and those of its GPUs without
        instance or share rows by key: ``before`` is the last such, whose rows a GPU
        whose object did not change keeps."""
        rows: list[GpuRow] = []
        tracker = self.tracker
        idle_since = tracker.idle_since  # (most GPUs are not in it: no call for them)
        plain: dict[str, GpuRow] = {}
        for g, gkey in zip(snap.gpus, gkeys):
            sh = shared.get((host, g.index)) if shared and g.index is not None else None
            if sh:
                rows.extend(self._shared_rows(host, g, gkey, sh, stale, now))
                continue
            r = held.get((host, g.index)) if held and g.index is not None else None
            idle = ((host, g.index) in idle_since
                    and tracker.is_idle_holder(host, g.index, now))
            row = before.get(gkey)
            if (r is None and row is not None and row.gpu is g and row.reservation is None
                    and row.stale == stale and idle == ("idle-holder" in row.flags)
                    and not g.instances):
                # The same GPU object, unreserved: its free and flags are what they were
                # (they depend on the GPU and, unreserved, on idle alone).
                rows.append(row)
                plain[gkey] = row
                continue
            unused = r is not None and tracker.reservation_idle(host, g, r, now)
            free = is_free(g) and (r is None or r.user == self.me)
            flags = _flags(gpu_flags(g, r, idle, unused))
            if (row is None or row.gpu is not g or row.reservation is not r
                    or row.stale != stale or row.free != free or row.flags != flags):
                row = GpuRow(host, gkey, g, r, flags, stale, free)
            rows.append(row)
            if not g.instances:
                plain[gkey] = row
            for inst, ikey in instance_keys(gkey, g.instances) if g.instances else ():
                # (MIG: a row per instance, under its GPU)
                view = instance_view(g, inst)
                ir = instance_reservation(held, inst_held or {}, host, g, inst)
                iunused = ir is not None and self.tracker.reservation_idle(host, view, ir, now)
                ifree = is_free(view) and (ir is None or ir.user == self.me)
                rows.append(GpuRow(host, ikey, view, ir,
                                   _flags(gpu_flags(view, ir, False, iunused)), stale, ifree,
                                   instance=inst))
        return rows, plain

    def _share_index(self, now: datetime) -> dict[tuple[str, int], tuple[Reservation, ...]]:
        """The shares by GPU, worked out once per state and second (not per host)."""
        key = (self.state_version, id(self.state), int(now.timestamp()))
        if self._shared[0] != key:
            self._shared = (key, share_index(self.state, now))
        return self._shared[1]

    def _shared_rows(self, host: str, g: GpuInfo, gkey: str,
                     shares: tuple[Reservation, ...], stale: bool, now: datetime
                     ) -> list[GpuRow]:
        """A shared GPU's row (its flags; never free: it is not whole), then one row per
        share: its holder, size, what the holder's processes use, time left, flags."""
        flags, per = share_flags(host, g, shares, self.tracker, now)
        if (host, g.index) in self.tracker.idle_since and self.tracker.is_idle_holder(
                host, g.index, now):
            flags.append("idle-holder")
        rows = [GpuRow(host, gkey, g, None, _flags(flags), stale, False, shares=shares)]
        rows += [GpuRow(host, key, g, None, _flags(f), stale, False, share=r)
                 for key, r, f in zip(share_keys(gkey, shares), shares, per)]
        return rows

    def _words(self, host: str, row: GpuRow | None) -> list[str]:
        snap = self.snapshots.get(host)
        words = [host, *(snap.tags if snap else ())]
        if row is not None:
            words += [row.gpu.name or "", *row.users]
            if row.reservation:
                words.append(row.reservation.user)
        return words

    def _matches(self, host: str, row: GpuRow | None) -> bool:
        """Every term of the filter is in one of the row's words (host, tags, model,
        users, holder)."""
        terms = self.filter_text.strip().lower().split()
        words = self._words(host, row)
        return all(any(term in w.lower() for w in words) for term in terms)

    def _filtered(self, host: str, rows: list[GpuRow]) -> list[GpuRow]:
        """``rows`` that pass free-only and the filter, as ``_matches`` says, without
        looking at each row where the host decides: a keystroke in the filter looks at the
        whole fleet. Terms the host's own words (name, tags) hold match all its rows; a
        row keeps its other words joined and lowered for the rest."""
        if self.free_only:
            rows = [r for r in rows if r.free]
        terms = self.filter_text.strip().lower().split()
        if not terms or not rows:
            return rows
        if any(SEP in t for t in terms):  # the joined words could fake a match: each row
            return [r for r in rows if self._matches(host, r)]
        host_hay = SEP.join(w.lower() for w in self._words(host, None))
        rest = [t for t in terms if t not in host_hay]
        if not rest:
            return rows
        out = []
        for r in rows:
            hay = r.__dict__.get("_hay")
            if hay is None:
                words = [r.gpu.name or "", *r.users]
                if r.reservation:
                    words.append(r.reservation.user)
                hay = r.__dict__["_hay"] = SEP.join(w.lower() for w in words)
            if all(t in hay for t in rest):
                out.append(r)
        return out

    def _filter_host(self, host: str, cached: HostRows, grouped: bool,
                     terms: list[str]) -> list[GpuRow]:
        """``_filtered`` for one host's cached rows, as a keystroke needs it: the answer
        is kept with the rows; typing on (each old term inside a new one: fewer rows can
        match) looks only at the rows the last answer kept; a host none of whose words
        holds a term is ruled out with one look (``HostRows.hays``)."""
        rows = cached.rows if grouped else cached.rows_flat
        if not rows or any(SEP in t for t in terms):
            return self._filtered(host, rows)
        key = (self.filter_text, self.free_only, grouped)
        memo = cached.memo
        if memo is not None and memo[0] == key:
            return memo[2]
        index: range | list[int] = range(len(rows))
        if memo is not None and memo[0][1:] == key[1:] and all(
                any(old in new for new in terms) for old in memo[1]):
            kept = memo[2]
            if not kept:
                cached.memo = (key, terms, kept)
                return kept
            if len(kept) != len(rows):
                ids = {id(r) for r in kept}
                index = [i for i, r in enumerate(rows) if id(r) in ids]
        if cached.host_hay is None:
            cached.host_hay = SEP.join(w.lower() for w in self._words(host, None))
        rest = [t for t in terms if t not in cached.host_hay]
        out: list[GpuRow]
        if not rest:
            out = rows if isinstance(index, range) else [rows[i] for i in index]
            if self.free_only:
                out = [r for r in out if r.free]
        else:
            hays = cached.hays()
            if any(t not in hays[-1] for t in rest):
                out = []
            else:
                out = [rows[i] for i in index if (not self.free_only or rows[i].free)
                       and all(t in hays[i] for t in rest)]
        cached.memo = (key, terms, out)
        return out

    def warm(self, hosts: Iterable[str], on_screen: Container[str] | None = None) -> None:
        """Work out these hosts' rows now (as they answer, a few at a time) so that the
        next frame finds them ready instead of doing a whole fleet's burst at once: with
        ``on_screen``, only those of its hosts, and their share of the summary for all
        (the rest are made when looked at), unless this view shows every host's rows."""
        self.warmer()(hosts, on_screen)

    def shows_every_row(self) -> bool:
        """A sorted or filtered view: which rows it shows depends on every host's."""
        return self.sort_mode != "host" or self.free_only or bool(self.filter_text.strip())

    def warmer(self) -> Callable[[Iterable[str], Container[str] | None], None]:
        """``warm`` with the clock and the reservations looked up once, for a drain that
        warms its hosts one by one (as it takes them, within its time budget)."""
        now = self.clock()
        held = reservation_index(self.state, now)
        inst_held = instance_index(self.state, now)
        every = self.shows_every_row()

        def warm(hosts: Iterable[str], on_screen: Container[str] | None = None) -> None:
            for host in hosts:
                rows = self._host_rows(host, now, held, inst_held)
                if every or on_screen is None or host in on_screen:
                    rows.block  # noqa: B018  (made now, while its answer is in the caches)
        return warm

    def view(self) -> tuple[Sequence[Row], Summary]:
        """The rows to show and the summary (see ``frame``)."""
        rows, _keys, summary = self.frame()
        return rows, summary

    def frame(self) -> tuple[FrameRows, list[str], Summary]:
        """The rows to show, their keys and the summary, from one pass over the hosts
        (this runs on every redraw: a host's counts and keys are worked out again only when
        it changed, and its rows only when they are looked at)."""
        now = self.clock()
        held = reservation_index(self.state, now)
        inst_held = instance_index(self.state, now)
        per_host = {host: self._host_rows(host, now, held, inst_held)
                    for host in self.host_order}
        rows, keys = self._rows(per_host)
        return rows, keys, self._summary(per_host)

    def rows(self) -> Sequence[Row]:
        return self.view()[0]

    def summary(self) -> Summary:
        return self.view()[1]

    def _rows(self, per_host: dict[str, HostRows]) -> tuple[FrameRows, list[str]]:
        """In order, with their keys: grouped by host when sorting by host (a host in error
        keeps its place), else flat, with the hosts in error after the GPUs. The grouped
        view without a filter takes each host's block as it is (see ``HostRows.block``):
        its rows are made only if the table looks at them."""
        grouped = self.sort_mode == "host"
        out = FrameRows()
        keys: list[str] = []
        flat: list[GpuRow] = []
        errors: list[Row] = []
        terms = self.filter_text.strip().lower().split()
        filtering = self.free_only or bool(terms)

        def add(rows: Sequence[Row]) -> None:
            out.add_rows(rows)
            keys.extend(r.key for r in rows)

        for host in self.host_order:
            snap = self.snapshots.get(host)
            cached = per_host[host]
            if snap is not None and not snap.ok:
                if not self.free_only and self._matches(host, None):
                    last = self.last_good.get(host)
                    row = HostRow(host, snap, len(last.gpus) if last else 0, False, False,
                                  snap.last_ok)
                    if grouped:
                        add((row,))
                    else:
                        errors.append(row)
                continue
            if snap is None:
                if not self.free_only and self._matches(host, None) and grouped:
                    add((HostRow(host, None, 0, False, False, None),))
                continue
            collapsed = host in self.collapsed
            if grouped and not filtering and not collapsed:
                if len(cached.keys) > 1:  # (its header and at least one row)
                    out.add_block(cached)
                    keys.extend(cached.keys)
                continue
            if filtering:
                gpus = self._filter_host(host, cached, grouped, terms)
            else:
                gpus = cached.rows if grouped else cached.rows_flat
            if not gpus:
                continue
            if grouped:
                insts = sum(1 for r in gpus if r.instance is not None)
                shares = sum(1 for r in gpus if r.share is not None)  # (rows under a GPU)
                add((HostRow(host, snap, len(gpus) - insts - shares, collapsed, cached.stale,
                             snap.time, insts),))
                if not collapsed:
                    add(gpus)
            else:
                flat.extend(gpus)  # (rows that name their host: see HostRows.rows_flat)
        if not grouped:
            if self.sort_mode == "utilization":
                # Unknown utilisation (n/a, e.g. a MIG GPU) is not 0 %: it goes last.
                flat.sort(key=lambda r: (r.gpu.utilization_percent is None,
                                         -(r.gpu.utilization_percent or 0), r.host,
                                         r.gpu.index or 0))
            else:
                flat.sort(key=lambda r: (-r.free_mib, r.host, r.gpu.index or 0))
            add(flat)
        add(errors)
        return out, keys

    def _summary(self, per_host: dict[str, HostRows]) -> Summary:
        s = Summary()
        util_sum = util_n = 0
        for host in self.host_order:
            snap = self.snapshots.get(host)
            if snap is None or (snap.error is not None and snap.error.kind == "starting"):
                s.hosts_waiting += 1
                continue
            if not snap.ok:
                s.hosts_down += 1
                continue
            s.hosts_up += 1
            c = per_host[host].counts
            s.gpus += c.gpus
            s.reserved += c.reserved
            s.free += c.free
            s.busy += c.busy
            s.shared += c.shared
            s.down += c.down
            s.unknown += c.unknown
            for k, v in c.instance_classes.items():
                s.instances[k] = s.instances.get(k, 0) + v
            util_sum += c.util_sum
            util_n += c.util_n
            s.mem_used_mib += c.mem_used_mib
            s.mem_total_mib += c.mem_total_mib
        s.util_percent = util_sum / util_n if util_n else None
        return s

    def users(self) -> list[UserLoad]:
        """The per-user view's records: see ``board_users.user_loads``."""
        return user_loads(self.host_order, self.snapshots, self.state, self.clock())

    def find(self, key: str) -> Row | None:
        rows, keys, _summary = self.frame()
        return rows[keys.index(key)] if key in keys else None

    def cycle_sort(self) -> SortMode:
        self.sort_mode = SORT_MODES[(SORT_MODES.index(self.sort_mode) + 1) % len(SORT_MODES)]
        return self.sort_mode

    def toggle_collapsed(self, host: str) -> None:
        self.collapsed.symmetric_difference_update({host})

    def known_hosts(self) -> Iterable[str]:
        return list(self.host_order)
