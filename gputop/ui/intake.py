"""How answers reach the board: the feed's thread puts each in an inbox, the drain takes
them in slices between keys, and a tick draws what they changed; and the board's own
garbage collection, timed between keys. :class:`Intake` owns all of that state; the app
owns one, hands it the feed's answers and its keys, and is asked to draw.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import queue
import sys
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from textual.css.query import NoMatches

from gputop.model import HostSnapshot
from gputop.ui.board_model import BoardModel
from gputop.ui.feed import FeedThread
from gputop.ui.table import BoardTable

if TYPE_CHECKING:
    from gputop.history.live import LiveRecorder

RENDER_PERIOD = 0.5  # seconds: host updates arriving faster are drawn together
DRAIN_PERIOD = 0.05  # seconds at least between taking answers from the feed thread...
DRAIN_BUDGET_S = 0.008  # ...for at most this long each time (rows worked out included)
#: A frame waits for a burst's last slice at most this much past RENDER_PERIOD (answers
#: that never stop arriving are still drawn at least this often).
BURST_WAIT_S = 0.5
#: The board's own young-generation collections (see collect_young): their period, and
#: how often (in collections) the next generation is collected too.
GC_PERIOD_S = 20.0
GC_ANSWERS = 400
GC_OLDER_EVERY = 6
#: Answers from hosts that are not on screen (they change the summary bar's counts only)
#: are drawn with the next frame that has something on screen, or this many intervals
#: after the last frame: at 200 hosts about a third of frames drew nothing else.
OFFSCREEN_WAIT_INTERVALS = 1.0
#: A key holds the feed, the drain and the board's GC this long; the drain is never put
#: off longer than KEY_DRAIN_MAX_S (a key held down).
KEY_HOLD_S = 0.12
KEY_DRAIN_MAX_S = 0.3


class Intake:
    """The board's intake: the inbox the feed's thread fills, the drain that takes it in,
    the tick that draws, and the board's own garbage collection. The app calls ``tick``
    on its timer, ``key_in`` for each key, and ``drawn`` once it drew a frame; it draws
    when ``render`` is called (only ever with something to draw)."""

    def __init__(self, model: BoardModel, *, interval: float, long_running: bool,
                 table: Callable[[], BoardTable], render: Callable[[], None],
                 notify_error: Callable[[str], None],
                 recorder: LiveRecorder | None = None) -> None:
        self.model = model
        self.interval = interval
        self.long_running = long_running
        self._find_table = table
        self._render = render
        self._notify_error = notify_error
        #: ``--record``: every answer taken in also goes into the history database.
        self.recorder = recorder
        #: The feed's thread, once started: a key holds it (see ``key_in``).
        self.feed: FeedThread | None = None
        self._inbox: queue.SimpleQueue[HostSnapshot] = queue.SimpleQueue()
        self._shapes: dict[str, tuple[HostSnapshot, tuple[bool, int, int]]] = {}
        #: The hosts whose answers wait for a frame with something on screen (_frame_due).
        self._put_off: set[str] = set()
        self._dirty_flag = True
        #: What is to be drawn is only answers from hosts not on screen (see _frame_due).
        self._offscreen = False
        self._board_table: BoardTable | None = None
        self._key_hold_until = 0.0
        self._last_drain = 0.0
        self._gc_runs = 0
        self._last_gc = 0.0
        self._answers_since_gc = 0
        self._refrozen = False
        #: The feed woke the drain and it has not run since (set on the feed's thread).
        self._drain_woken = False
        self._frame_waits = False  # a tick left its frame for a burst's last slice
        self._drain_timer: asyncio.TimerHandle | None = None
        self._last_ingest = self._last_render = time.monotonic()
        self._loop: asyncio.AbstractEventLoop | None = None

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        """The board's loop, where the feed's thread wakes the drain from now on."""
        self._loop = loop

    def drawn(self) -> None:
        """The app drew a frame: nothing is left to draw."""
        self.dirty = False
        self._last_render = time.monotonic()

    def close_recorder(self) -> None:
        if self.recorder is not None:
            self.recorder.close()
            self.recorder = None

    def _render_if_dirty(self) -> None:
        if self.dirty:
            self._render()

    def _record(self, snap: HostSnapshot) -> None:
        from gputop.history.db import HistoryError

        assert self.recorder is not None
        try:
            self.recorder.observe(snap)
        except HistoryError as exc:  # the board goes on; recording stops, and says why
            self._notify_error(f"recording stopped: {exc}")
            self.recorder.close()
            self.recorder = None

    def key_in(self) -> None:
        """A key arrived: hold the feed (its thread waits before its next answer), the
        drain and the board's own garbage collection for KEY_HOLD_S, long enough for the
        key's work and frame (15-40 ms at 1,000 x 8), so that they run alone instead of
        beside a burst of answers. The feed waits at most MAX_HOLD_S in a row (feed.py)."""
        self._key_hold_until = time.monotonic() + KEY_HOLD_S
        if self.feed is not None:
            self.feed.hold(self._key_hold_until)

    @property
    def dirty(self) -> bool:
        """Something is to be drawn. Set by anything but an answer (``ingest``), it is
        drawn with the next tick."""
        return self._dirty_flag

    @dirty.setter
    def dirty(self, value: bool) -> None:
        self._dirty_flag = value
        self._offscreen = False
        self._put_off.clear()

    def _frame_due(self, now: float) -> bool:
        """Draw at this tick: something on screen changed, or the summary bar has waited
        OFFSCREEN_WAIT_INTERVALS (see ``ingest`` for which answers count as on screen), or
        a scroll or the cursor brought the rows of a host whose answer waits on screen."""
        if not self._offscreen or now - self._last_render >= (
                OFFSCREEN_WAIT_INTERVALS * self.interval):
            return True
        return not self._put_off.isdisjoint(self._table().hosts_on_screen())

    def collect_young(self) -> None:
        """Every frame Textual draws leaves reference cycles behind (a ``Strip`` caches
        itself: its crop of its whole width is itself), and only the garbage collector
        frees them: at 1,000 hosts an automatic collection found 20,000+ such objects
        and took 60-100 ms, in the middle of whatever key came then. Collected here,
        never while a key is being handled, every GC_PERIOD_S: a collection also looks
        at every object made since the last one that is still alive, and most of what an
        answer makes (its GPUs' models and rows) lives until the host's next answer, so
        collecting often looks at each answer's objects again and again (at 200 x 8,
        every 4 s: 7,400 objects, 4 ms per refresh in a slow window; every 20 s: 13,000,
        under 1 ms per refresh), while the garbage is small (about 50 objects in 4 s). A
        large fleet is collected sooner, after GC_ANSWERS answers, so that no collection
        (and no key that waits for one) takes longer than it did (at 1,000 hosts every
        5 s, the longest filter keystroke went from 48 to 93 ms).
        The next generation is collected one time in GC_OLDER_EVERY.
        The automatic thresholds stay as a safety net."""
        now = time.monotonic()
        if not self._refrozen and self.model.snapshots and now >= self._key_hold_until:
            # Once, with the first answers in: what the feed imported as it connected
            # (aiohttp and its kin: 48,000 objects at 200 hosts, made after tune_gc's
            # freeze) is frozen too, never walked again by the older generations.
            self._refrozen = True
            self._last_gc, self._answers_since_gc = now, 0
            gc.collect()
            gc.freeze()
            return
        # What a collection walks is what was made since the last one and still lives:
        # at most every host's last answer, however many answers came. So answers count
        # up to the fleet's size: a fleet of fewer than GC_ANSWERS hosts is collected by
        # time alone.
        young = min(self._answers_since_gc, len(self.model.snapshots))
        if now < self._key_hold_until or (now - self._last_gc < GC_PERIOD_S
                                          and young < GC_ANSWERS):
            return
        self._last_gc, self._answers_since_gc = now, 0
        self._gc_runs += 1
        gc.collect(1 if self._gc_runs % GC_OLDER_EVERY == 0 else 0)

    def tick(self) -> None:
        # Nothing answered for a while (a hung hub, every host hung): draw anyway, once a
        # second, for what time alone changes (stale marks, "seen Xs ago", time left).
        now = time.monotonic()
        if now - self._last_ingest > self.interval + 1 and now - self._last_render >= 1:
            self.dirty = True
        if self.dirty and not self._frame_due(now):
            pass  # only hosts off screen answered: drawn later (see _frame_due)
        elif (self.dirty and not self._inbox.empty()
                and now - self._last_render < RENDER_PERIOD + BURST_WAIT_S):
            # A burst of answers is being taken in slices: drawn once it is all in (by the
            # drain that finds the inbox empty), not half now and the rest next tick.
            self._frame_waits = True
        else:
            try:
                self._render_if_dirty()
            except NoMatches:  # (a tick while the app shuts down: its widgets are gone)
                return
        if self.long_running:
            self.collect_young()
        if self._drain_timer is None and not self._inbox.empty():
            self._drain_soon(0.0)  # (a wake-up lost at start or shutdown: never stuck)

    def deliver(self, snap: HostSnapshot) -> None:
        """On the feed's thread: an answer for the inbox, and the drain woken unless it
        already was (put first, then look: a drain that cleared the flag takes it)."""
        self._inbox.put(snap)
        if not self._drain_woken:
            self._drain_woken = True
            loop = self._loop
            if loop is not None:
                with contextlib.suppress(RuntimeError):  # (the board's loop has closed)
                    loop.call_soon_threadsafe(self._drain_soon, DRAIN_PERIOD)

    def _drain_soon(self, delay: float) -> None:
        """The drain in ``delay`` (at least DRAIN_PERIOD after the last one), unless one
        is due already."""
        if self._drain_timer is not None:
            return
        wait = max(0.0, delay - (time.perf_counter() - self._last_drain))
        loop = self._loop or asyncio.get_running_loop()
        self._drain_timer = loop.call_later(wait, self._drain_due)

    def _drain_due(self) -> None:
        self._drain_timer = None
        self.drain()

    def drain(self) -> None:
        """Ingest what the feed delivered (each answer is a sample of its GPUs' history)
        and work out those hosts' rows, for at most DRAIN_BUDGET_S: a thousand hosts
        answering at once are taken in slices, DRAIN_PERIOD apart, and a key pressed
        meanwhile waits for one slice, not the whole burst. While a key is handled,
        nothing (see ``key_in``): it is tried again after the key. The next frame draws
        them all at once."""
        self._drain_woken = False
        start = time.perf_counter()
        since = start - self._last_drain
        hold = self._key_hold_until - time.monotonic()
        if hold > 0 and since < KEY_DRAIN_MAX_S:
            # After the key, or KEY_DRAIN_MAX_S after the last drain, whichever is first
            # (_drain_soon counts from the last drain: the delay is given that way, or
            # from about KEY_HOLD_S after it on, every try would be due at once: a spin).
            self._drain_soon(since + min(hold, KEY_DRAIN_MAX_S - since))
            return
        self._last_drain = start
        deadline = start + DRAIN_BUDGET_S
        warm = None
        while time.perf_counter() < deadline:
            try:
                snap = self._inbox.get_nowait()
            except queue.Empty:
                if self._frame_waits:  # (the tick left this frame for the burst's end)
                    self._frame_waits = False
                    with contextlib.suppress(NoMatches):
                        self._render_if_dirty()
                return
            if warm is None:
                warm = self.model.warmer()
            self.ingest(snap)
            if self.recorder is not None:
                self._record(snap)
            # (Its rows now if they are on screen; else its counts and keys alone.)
            warm((snap.name,), self._table().hosts_on_screen())
        self._drain_soon(DRAIN_PERIOD)  # the budget ran out: the rest in a moment

    def ingest(self, snap: HostSnapshot) -> None:
        model = self.model
        before = model.snapshots.get(snap.name)
        model.ingest(snap)
        self._answers_since_gc += 1
        if not self._dirty_flag:  # (nothing else to draw: it is this answer's frame)
            self._dirty_flag = self._offscreen = True
        if self._offscreen and (model.sort_mode != "host" or model.free_only
                                or model.filter_text.strip()
                                or snap.name in self._table().hosts_on_screen()
                                or self._shape(before) != self._shape(snap)):
            # (On screen; or any answer can bring rows in or take them out: a sorted or
            # filtered view; or this one moves the rows below it: see _row_shape.)
            self._offscreen = False
        elif self._offscreen:
            self._put_off.add(snap.name)
        self._last_ingest = time.monotonic()

    def _shape(self, snap: HostSnapshot | None) -> tuple[bool, int, int]:
        """``_row_shape``, worked out once per answer (it is asked again of the answer as
        the one before the host's next)."""
        if snap is None:
            return _row_shape(None)
        had = self._shapes.get(snap.name)
        if had is not None and had[0] is snap:
            return had[1]
        shape = _row_shape(snap)
        self._shapes[snap.name] = (snap, shape)
        return shape

    def _table(self) -> BoardTable:
        table = self._board_table
        if table is None:
            table = self._board_table = self._find_table()
        return table


def _row_shape(snap: HostSnapshot | None) -> tuple[bool, int, int]:
    """What a host's count of rows follows from its answer (up or down, its GPUs, their
    MIG instances): an answer that changes it moves the rows below the host, on screen
    or not (and a host's first answer is its first rows: None never equals it)."""
    if snap is None:
        return (False, -1, -1)
    return (snap.error is None, len(snap.gpus), sum([len(g.instances) for g in snap.gpus]))


def tune_gc() -> None:
    """For the board's own process (not tests), once it is on screen. With Python's
    default thresholds a collection ran every 700 allocations and a full one walked every
    object the board holds (at 1,000 hosts: 150 ms and more, the screen frozen, and 7 % of
    a core in all). What exists at startup is frozen (never walked again) and collections
    run less often (reference cycles are still collected, in fewer, larger batches)."""
    gc.freeze()
    gc.set_threshold(50_000, 50, 20)
    # The feed thread works in bursts (a thousand answers at once): hand the GIL back to
    # the UI thread after 1 ms, not Python's default 5 ms, so a key waits less for it.
    sys.setswitchinterval(0.001)
