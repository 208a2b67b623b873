"""The Textual app: one live board of every GPU, fed by the poller as hosts answer.

This module holds the board's composition, its feed (the poller's thread, the drain, the
frames) and its keys for looking around; reading the shared file and the keys that write
it (reserve, release, the queue) are in :mod:`gputop.ui.store_actions`, a base class.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import os
import queue
import signal
import sys
import threading
import time
from collections.abc import Callable, Sequence
from datetime import datetime
from typing import TYPE_CHECKING

from textual import events, work
from textual.app import ComposeResult
from textual.binding import Binding
from textual.color import Color, ColorParseError
from textual.css.query import NoMatches
from textual.widgets import Footer, Input
from textual.worker import Worker

from gputop.config import Config
from gputop.model import HostSnapshot, utcnow
from gputop.poller import HubPoller, Poller, open_poller
from gputop.reservations.ops import whoami
from gputop.reservations.store import StoreState
from gputop.sources import Source
from gputop.sources.shared_file import open_store
from gputop.text import clean
from gputop.ui.board_model import BoardModel
from gputop.ui.board_rows import GpuRow, HostRow
from gputop.ui.cells import Palette
from gputop.ui.feed import FeedThread
from gputop.ui.screens import (
    HelpScreen,
    UsersScreen,
)
from gputop.ui.store_actions import StoreActions
from gputop.ui.themes import BUILTIN, FALLBACK, load_themes
from gputop.ui.widgets import BoardTable, DetailPane, SummaryBar

if TYPE_CHECKING:
    from gputop.history.live import LiveRecorder

RENDER_PERIOD = 0.5  # seconds: host updates arriving faster are drawn together
#: Signals that end the board like ``q`` does (terminal restored, remote loops ended); the
#: exit code is 128 + the signal's number, as a shell reports a signal.
EXIT_SIGNALS = (signal.SIGTERM, signal.SIGHUP, signal.SIGINT)


#: Seconds a signalled board has to shut down (its feed is given 5 s to end the remote loops)
#: before the process ends anyway: a terminal closed under load can wedge Textual's writer
#: thread, and a board that never exits would squat on its SSH connections forever.
SIGNAL_GRACE_S = 10.0


def arm_exit_watchdog(code: int, after: float | None = None) -> threading.Timer:
    """End the process with ``code`` after ``after`` seconds unless it exited by then."""
    timer = threading.Timer(SIGNAL_GRACE_S if after is None else after, os._exit, (code,))
    timer.daemon = True  # a clean exit does not wait for it
    timer.start()
    return timer


DRAIN_PERIOD = 0.05  # seconds at least between taking answers from the feed thread...
DRAIN_BUDGET_S = 0.008  # ...for at most this long each time (rows worked out included)
#: A frame waits for a burst's last slice at most this much past RENDER_PERIOD (answers
#: that never stop arriving are still drawn at least this often).
BURST_WAIT_S = 0.5
#: The board's own young-generation collections (see _collect_young): their period, and
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


class GputopApp(StoreActions):
    CSS_PATH = "gputop.tcss"
    TITLE = "gputop"
    NOTIFICATION_TIMEOUT = 3  # toasts cover rows: short, and problems that last go in the bar
    BINDINGS = [
        Binding("r", "reserve", "Reserve"),
        Binding("u", "release", "Release"),
        # Priority: handled as it arrives, before the keys typed after it are passed on,
        # so they go to the filter (see check_action, action_filter).
        Binding("slash", "filter", "Filter", key_display="/", priority=True),
        Binding("s", "sort", "Sort"),
        Binding("f", "free_only", "Free", show=False),  # the footer fits 80 columns;
        Binding("w", "users", "Who"),  # `?` lists every key
        Binding("Q", "queue", "Queue", show=False),
        Binding("h", "history", "History", show=False),
        Binding("c", "reconnect", "Reconnect"),
        Binding("enter", "details", "Details", show=False),
        Binding("t", "next_theme", "Theme", show=False),
        Binding("question_mark", "help", "Help", key_display="?"),
        Binding("q", "quit", "Quit"),
        Binding("ctrl+c", "interrupt", "Quit", show=False, priority=True),
        Binding("escape", "escape", "Close / clear", show=False),
    ]

    def __init__(
        self,
        config: Config,
        *,
        sources: Sequence[Source] | None = None,
        feed: bool = True,
        clock: Callable[[], datetime] = utcnow,
        theme: str | None = None,
        user: str | None = None,
        recorder: LiveRecorder | None = None,
        long_running: bool = False,
    ) -> None:
        super().__init__()
        self._long_running = long_running
        self.config = config
        #: ``--record``: every snapshot also goes into the history database.
        self.recorder = recorder
        self._sources = sources
        self._feed = feed
        self.clock = clock
        self.store = open_store(config, warn=self._warn)
        #: For a store over SSH, "me" is the account its host authenticated: learnt with
        #: the first answer (until then, and if it never answers, this machine's account).
        self._me_given = user is not None
        self.me = user or whoami(None if self.store.remote else self.store)[0]
        self.model = BoardModel(host_order=[h.name for h in config.hosts],
                                interval=config.interval, idle_holder_s=config.idle_holder_s,
                                idle_grace_s=config.idle_grace_s,
                                share_grace_s=config.share_grace_s, clock=clock, me=self.me)
        self._store_sig: object = None
        self._state: StoreState | None = None
        self._waiting: Worker[None] | None = None
        self._store_problem: str | None = None
        self._store_reading = False
        #: The hosts whose answers wait for a frame with something on screen (_frame_due).
        self._put_off: set[str] = set()
        self._dirty = True
        #: What is to be drawn is only answers from hosts not on screen (see _frame_due).
        self._offscreen = False
        self._board_table: BoardTable | None = None
        self._wanted_theme = theme or config.theme or FALLBACK
        self._theme_names: list[str] = []
        self.palette = Palette()
        self.poller: Poller | HubPoller | None = None
        self._feed_started = False
        #: Armed by the first signal; cancelled once the board has exited (see run_board).
        self.watchdog: threading.Timer | None = None
        self._feed_closed = asyncio.Event()
        self._feed_thread: FeedThread | None = None
        self._inbox: queue.SimpleQueue[HostSnapshot] = queue.SimpleQueue()
        self._shapes: dict[str, tuple[HostSnapshot, tuple[bool, int, int]]] = {}
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

    def get_theme_variable_defaults(self) -> dict[str, str]:
        """The gpu-* colours exist under every theme (Textual's own ones too)."""
        return {**super().get_theme_variable_defaults(), **BUILTIN.variables}

    # -- layout --------------------------------------------------------------------------

    def compose(self) -> ComposeResult:
        yield SummaryBar(id="summary")
        yield BoardTable(id="board")
        yield DetailPane(id="detail")
        yield Input(placeholder="filter: host, model, user or tag (esc clears)", id="filter")
        yield Footer(compact=True)  # every shown key fits 80 columns, q Quit included

    def on_mount(self) -> None:
        loop = asyncio.get_running_loop()
        for sig in EXIT_SIGNALS:
            with contextlib.suppress(ValueError, RuntimeError, NotImplementedError):
                loop.add_signal_handler(sig, self._on_signal, sig)
        loaded = load_themes()
        for theme in loaded.themes.values():
            self.register_theme(theme)
        self._theme_names = sorted(loaded.themes)
        for problem in loaded.problems:
            self.notify(problem, severity="warning", markup=False, timeout=6)
        if self._wanted_theme not in loaded.themes:
            self.notify(f"unknown theme {self._wanted_theme!r}; using {FALLBACK}",
                        severity="warning", markup=False)
            self._wanted_theme = FALLBACK
        self.theme = self._wanted_theme
        for name in list(self.available_themes):  # the theme picker offers gputop's only
            if name not in loaded.themes:
                self.unregister_theme(name)
        self._update_palette()
        self.query_one(DetailPane).history_path = self.config.history_path
        self.reload_store()
        self.set_focus(self.query_one(BoardTable))  # now, not after a refresh
        if self.config.implicit and self.config.hub_url is None:  # (a hub names the hosts)
            from gputop.config import NO_CONFIG_HINT, default_config_path

            self.notify(NO_CONFIG_HINT.format(path=default_config_path()), markup=False,
                        timeout=8)
        # One timer for the frame and the board's own GC; answers wake the drain (see
        # _deliver), so a board whose hosts are quiet wakes twice a second, not 25 times.
        self._loop = asyncio.get_running_loop()
        self.set_interval(RENDER_PERIOD, self._tick)
        self.set_interval(max(0.5, self.config.interval), self._reload_store_if_changed)
        self.render_board()
        if self._feed:  # after the first frame: a thousand hosts connecting do not delay it
            self.call_after_refresh(self._run_feed)
        if self._long_running:
            self.call_after_refresh(tune_gc)

    async def on_unmount(self) -> None:
        """Textual cancels the feed worker at exit but does not wait for it: wait here (a
        little), so each host's remote loop is ended before the process goes."""
        if self._feed_started:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._feed_closed.wait(), timeout=5.0)
        loop = asyncio.get_running_loop()
        for sig in EXIT_SIGNALS:
            with contextlib.suppress(ValueError, RuntimeError, NotImplementedError):
                loop.remove_signal_handler(sig)

    def _on_signal(self, signum: int) -> None:
        if self.watchdog is None:
            self.watchdog = arm_exit_watchdog(128 + signum)
        self.exit(return_code=128 + signum)

    def action_interrupt(self) -> None:
        """ctrl+c is the terminal's interrupt key: quit as an interrupted command does (the
        terminal is alive here: no watchdog needed)."""
        self.exit(return_code=128 + signal.SIGINT)

    # -- data in -------------------------------------------------------------------------

    @work(exclusive=True, group="feed")
    async def _run_feed(self) -> None:
        """Poll on the feed thread (see feed.py) until the app exits; its snapshots wait in
        ``_inbox`` for the next frame."""
        self._feed_started = True
        poller = self.poller = open_poller(self.config, self._sources)
        feed = self._feed_thread = FeedThread(poller, self._deliver)
        feed.start()
        try:
            await asyncio.Event().wait()
        finally:
            try:
                feed.stop()  # every remote loop ended, every connection closed
            finally:
                if self.recorder is not None:
                    self.recorder.close()
                    self.recorder = None
                self._feed_closed.set()

    def _record(self, snap: HostSnapshot) -> None:
        from gputop.history.db import HistoryError

        assert self.recorder is not None
        try:
            self.recorder.observe(snap)
        except HistoryError as exc:  # the board goes on; recording stops, and says why
            self.notify(f"recording stopped: {exc}", severity="error", markup=False,
                        timeout=10)
            self.recorder.close()
            self.recorder = None

    # -- keys first ------------------------------------------------------------------------

    async def on_event(self, event: events.Event) -> None:
        if isinstance(event, events.Key) and not event.is_forwarded:
            self._key_in()
        await super().on_event(event)

    def _key_in(self) -> None:
        """A key arrived: hold the feed (its thread waits before its next answer), the
        drain and the board's own garbage collection for KEY_HOLD_S, long enough for the
        key's work and frame (15-40 ms at 1,000 x 8), so that they run alone instead of
        beside a burst of answers. The feed waits at most MAX_HOLD_S in a row (feed.py)."""
        self._key_hold_until = time.monotonic() + KEY_HOLD_S
        if self._feed_thread is not None:
            self._feed_thread.hold(self._key_hold_until)

    @property
    def _dirty(self) -> bool:
        """Something is to be drawn. Set by anything but an answer (``ingest``), it is
        drawn with the next tick."""
        return self._dirty_flag

    @_dirty.setter
    def _dirty(self, value: bool) -> None:
        self._dirty_flag = value
        self._offscreen = False
        self._put_off.clear()

    def _frame_due(self, now: float) -> bool:
        """Draw at this tick: something on screen changed, or the summary bar has waited
        OFFSCREEN_WAIT_INTERVALS (see ``ingest`` for which answers count as on screen), or
        a scroll or the cursor brought the rows of a host whose answer waits on screen."""
        if not self._offscreen or now - self._last_render >= (
                OFFSCREEN_WAIT_INTERVALS * self.config.interval):
            return True
        return not self._put_off.isdisjoint(self._table().hosts_on_screen())

    def _collect_young(self) -> None:
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

    def _tick(self) -> None:
        # Nothing answered for a while (a hung hub, every host hung): draw anyway, once a
        # second, for what time alone changes (stale marks, "seen Xs ago", time left).
        now = time.monotonic()
        if now - self._last_ingest > self.config.interval + 1 and now - self._last_render >= 1:
            self._dirty = True
        if self._dirty and not self._frame_due(now):
            pass  # only hosts off screen answered: drawn later (see _frame_due)
        elif (self._dirty and not self._inbox.empty()
                and now - self._last_render < RENDER_PERIOD + BURST_WAIT_S):
            # A burst of answers is being taken in slices: drawn once it is all in (by the
            # drain that finds the inbox empty), not half now and the rest next tick.
            self._frame_waits = True
        else:
            try:
                self._render_if_dirty()
            except NoMatches:  # (a tick while the app shuts down: its widgets are gone)
                return
        if self._long_running:
            self._collect_young()
        if self._drain_timer is None and not self._inbox.empty():
            self._drain_soon(0.0)  # (a wake-up lost at start or shutdown: never stuck)

    def _deliver(self, snap: HostSnapshot) -> None:
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
        self._drain()

    def _drain(self) -> None:
        """Ingest what the feed delivered (each answer is a sample of its GPUs' history)
        and work out those hosts' rows, for at most DRAIN_BUDGET_S: a thousand hosts
        answering at once are taken in slices, DRAIN_PERIOD apart, and a key pressed
        meanwhile waits for one slice, not the whole burst. While a key is handled,
        nothing (see ``_key_in``): it is tried again after the key. The next frame draws
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
            table = self._board_table = self.query_one(BoardTable)
        return table

    def _warn(self, message: str) -> None:
        self.notify(message, severity="warning", markup=False, timeout=8)

    # -- drawing -------------------------------------------------------------------------

    def _render_if_dirty(self) -> None:
        if self._dirty:
            self.render_board()

    def render_board(self) -> None:
        self._dirty = False
        self._last_render = time.monotonic()
        now = self.clock()
        table = self.query_one(BoardTable)
        rows, keys, summary = self.model.frame()
        table.show_rows(rows, now, self.palette, self.model.signature, keys)
        note = f"filter: {clean(self.model.filter_text)}" if self.model.filter_text else ""
        if self.model.free_only:
            note = (note + "  free only").strip()
        if note and not rows:
            note += ": nothing matches"
        if self.model.sort_mode != "host":
            note = (note + f"  sort: {self.model.sort_mode}").strip()
        waiting = len(self._state.waiting(now)) if self._state is not None else 0
        if waiting:
            note = (note + f"  queue: {waiting} waiting (Q)").strip()
        # A hub that is down (or answers garbage) stays in the summary bar until it is back.
        hub_error = getattr(self.poller, "error", None)
        self.query_one(SummaryBar).show(summary, self.palette, note, self._store_problem,
                                        hub_error.kind if hub_error is not None else None)
        detail = self.query_one(DetailPane)
        if detail.display:
            detail.show(self._selected(), self.model, now, self.palette)

    def on_board_table_layout_changed(self, _message: BoardTable.LayoutChanged) -> None:
        self.render_board()

    def _update_palette(self) -> None:
        v = self.theme_variables

        def color(name: str, default: str) -> str:
            try:  # a Rich style needs a plain colour ("auto 60%" is Textual-only)
                return Color.parse(v.get(name, default)).hex
            except ColorParseError:
                return default

        self.palette = Palette(
            free=color("gpu-free", "green"), busy=color("gpu-busy", "yellow"),
            reserved=color("gpu-reserved", "magenta"), error=color("gpu-error", "red"),
            muted=color("gpu-muted", "grey50"))

    def watch_theme(self, _theme: str) -> None:
        self._update_palette()
        self._dirty = True

    def _selected(self) -> GpuRow | HostRow | None:
        table = self.query_one(BoardTable)
        key = table.selected_key()
        return None if key is None else table.row_of(key)  # as last drawn

    def on_board_table_row_highlighted(self, _event: BoardTable.RowHighlighted) -> None:
        try:
            detail = self.query_one(DetailPane)
        except NoMatches:  # (a frame moved the cursor as the app shut down)
            return
        if detail.display:
            detail.show(self._selected(), self.model, self.clock(), self.palette)

    def on_board_table_row_selected(self, _event: BoardTable.RowSelected) -> None:
        self.action_details()

    # -- actions -------------------------------------------------------------------------

    def action_details(self) -> None:
        row = self._selected()
        if isinstance(row, HostRow) and not row.error and row.snapshot is not None:
            self.model.toggle_collapsed(row.host)
            self.render_board()
            return
        detail = self.query_one(DetailPane)
        detail.display = not detail.display
        if detail.display:
            detail.show(row, self.model, self.clock(), self.palette)

    def action_sort(self) -> None:
        mode = self.model.cycle_sort()
        self.notify(f"sorted by {mode}", timeout=2)
        self.render_board()

    def action_free_only(self) -> None:
        self.model.free_only = not self.model.free_only
        self.render_board()

    def action_escape(self) -> None:
        """Esc: clear the filter while typing it, else close the details, else clear."""
        box = self.query_one("#filter", Input)
        detail = self.query_one(DetailPane)
        if detail.display and not box.has_focus:
            detail.display = False
        elif box.display or self.model.filter_text:
            self.action_clear_filter()

    def action_users(self) -> None:
        self.push_screen(UsersScreen(self.model.users()))

    def action_history(self) -> None:
        from gputop.ui.history_screen import FleetHistoryScreen

        self.push_screen(FleetHistoryScreen(self.config.history_path))

    def action_reconnect(self) -> None:
        row = self._selected()
        if row is None:
            self.notify("select a host or one of its GPUs to reconnect", severity="warning")
            return
        if self._feed_thread is None or not self._feed_thread.reconnect(row.host):
            self.notify(f"{clean(row.host)} is not polled here", severity="warning",
                        markup=False)
            return
        self.notify(f"reconnecting {clean(row.host)} now", markup=False)

    def check_action(self, action: str, parameters: tuple[object, ...]) -> bool | None:
        """``/`` (a priority key) opens the filter only from the board itself: in a
        dialog, or typing in any input, it is an ordinary character."""
        return action != "filter" or (self.screen is self.screen_stack[0]
                                      and not isinstance(self.focused, Input))

    def action_filter(self) -> None:
        """Open the filter with the focus in it now, not after the next refresh (as
        ``focus()`` would): keys typed right after ``/`` are the filter's, never the
        board's (``/gpu-012`` typed fast once sent ``u``, release, to the board)."""
        box = self.query_one("#filter", Input)
        box.display = True
        self.screen.set_focus(box)
        # A filtered view shows any host's rows, so it needs every host's: made now, as
        # the box opens (before the first key typed in it, most often), not by that key's
        # frame (at 1,000 x 8, 50 ms more for the first key).
        self.call_after_refresh(self.model.warm, self.model.host_order)

    def action_clear_filter(self) -> None:
        box = self.query_one("#filter", Input)
        box.value = ""
        box.display = False
        self.model.filter_text = ""
        self.query_one(BoardTable).focus()
        self.render_board()

    def on_input_changed(self, event: Input.Changed) -> None:
        if event.input.id == "filter":
            self.model.filter_text = event.value
            self.render_board()

    def on_input_submitted(self, event: Input.Submitted) -> None:
        """Enter applies the filter and closes its bar (the summary says what filters the
        board; ``/`` opens it again, esc clears it)."""
        if event.input.id == "filter":
            event.input.display = False
            self.screen.set_focus(self.query_one(BoardTable))

    def action_next_theme(self) -> None:
        names = self._theme_names or [FALLBACK]
        i = names.index(self.theme) if self.theme in names else -1
        self.theme = names[(i + 1) % len(names)]
        self.notify(f"theme: {self.theme}", timeout=2, markup=False)

    def action_help(self) -> None:
        self.push_screen(HelpScreen())


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


def run_board(config: Config | None, *, demo: bool = False, theme: str | None = None,
              record: bool = False) -> int:
    if demo or config is None:
        from gputop.sources.demo import demo_session

        with demo_session() as (demo_cfg, sources):
            return _run(GputopApp(demo_cfg, sources=list(sources), theme=theme,
                                  long_running=True))
    recorder = None
    if record:
        from gputop.history.live import LiveRecorder

        recorder = LiveRecorder(config)  # a bad database is refused before the board shows
    return _run(GputopApp(config, theme=theme, recorder=recorder, long_running=True))


def _run(app: GputopApp) -> int:
    try:
        app.run()
    finally:
        if app.watchdog is not None:
            app.watchdog.cancel()
    return app.return_code or 0
