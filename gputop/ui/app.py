"""The Textual app: one live board of every GPU, fed by the poller as hosts answer.

About 700 lines, over the ~600 rule: every key's action shares the app's state (the
selection, the store, the feed). The reservation and queue keys are the part that could
move to a module of their own; that waits for the queue work on the board's ``r`` (issue
19's order rule) to land, so the two changes do not collide.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
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

from rich.text import Text
from textual import events, work
from textual.app import App, ComposeResult
from textual.binding import Binding
from textual.color import Color, ColorParseError
from textual.widgets import Footer, Input
from textual.worker import Worker

from gputop.config import Config
from gputop.model import HostSnapshot, utcnow
from gputop.poller import HubPoller, Poller, open_poller
from gputop.reservations import Invalid, Refused, StoreError, Target, release
from gputop.reservations.ops import whoami
from gputop.reservations.shares import mig_mode, reserve_share, room_mib, size_text
from gputop.reservations.store import StoreState
from gputop.sources import Source
from gputop.sources.shared_file import open_store
from gputop.text import clean, excerpt
from gputop.ui.board_model import BoardModel
from gputop.ui.board_rows import (
    GpuRow,
    HostRow,
    gpu_keys,
    host_of,
    short_model,
    split_instance,
    split_share,
)
from gputop.ui.cells import Palette, time_left
from gputop.ui.feed import BoardSource, FeedThread
from gputop.ui.screens import (
    ConfirmScreen,
    HelpScreen,
    ReserveRequest,
    ReserveScreen,
    UsersScreen,
)
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


DRAIN_PERIOD = 0.05  # seconds between taking answers from the feed thread...
DRAIN_BUDGET_S = 0.008  # ...for at most this long each time (rows worked out included)
#: A key holds the feed, the drain and the board's GC this long; the drain is never put
#: off longer than KEY_DRAIN_MAX_S (a key held down).
KEY_HOLD_S = 0.12
KEY_DRAIN_MAX_S = 0.3
#: The board collects young garbage itself this often, between keys (see _collect_young).
GC_PERIOD = 0.5


class GputopApp(App[int]):
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
        self._dirty = True
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
        self._key_hold_until = 0.0
        self._last_drain = 0.0
        self._gc_runs = 0

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
        if self.config.implicit:
            from gputop.config import NO_CONFIG_HINT, default_config_path

            self.notify(NO_CONFIG_HINT.format(path=default_config_path()), markup=False,
                        timeout=8)
        self.set_interval(RENDER_PERIOD, self._render_if_dirty)
        self.set_interval(DRAIN_PERIOD, self._drain)
        self.set_interval(max(0.5, self.config.interval), self._reload_store_if_changed)
        self.render_board()
        if self._feed:  # after the first frame: a thousand hosts connecting do not delay it
            self.call_after_refresh(self._run_feed)
        if self._long_running:
            self.call_after_refresh(tune_gc)
            self.set_interval(GC_PERIOD, self._collect_young)

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
        feed = self._feed_thread = FeedThread(poller, self._inbox.put)
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

    def _collect_young(self) -> None:
        """Every frame Textual draws leaves reference cycles behind (a ``Strip`` caches
        itself: its crop of its whole width is itself), and only the garbage collector
        frees them: at 1,000 hosts an automatic collection found 20,000+ such objects
        and took 60-100 ms, in the middle of whatever key came then. Collected here, every
        GC_PERIOD and never while a key is being handled, each takes a few ms (at 1,000 x 8
        about 5 ms: each young object is looked at once however often this runs, so a
        longer period costs no more CPU); the next generation is collected one time in
        fifty, every 25 s: about 50 ms then, against 30 ms every 5 s (three times the CPU).
        The automatic thresholds stay as a safety net."""
        if time.monotonic() < self._key_hold_until:
            return
        self._gc_runs += 1
        gc.collect(1 if self._gc_runs % 50 == 0 else 0)

    def _drain(self) -> None:
        """Ingest what the feed delivered (each answer is a sample of its GPUs' history)
        and work out those hosts' rows, for at most DRAIN_BUDGET_S: a thousand hosts
        answering at once are taken in slices, and a key pressed meanwhile waits for one
        slice, not the whole burst. While a key is handled, nothing (see ``_key_in``).
        The next frame draws them all at once."""
        start = time.perf_counter()
        if (time.monotonic() < self._key_hold_until
                and start - self._last_drain < KEY_DRAIN_MAX_S):
            return
        self._last_drain = start
        deadline = start + DRAIN_BUDGET_S
        warm = self.model.warmer()
        while time.perf_counter() < deadline:
            try:
                snap = self._inbox.get_nowait()
            except queue.Empty:
                break
            self.ingest(snap)
            if self.recorder is not None:
                self._record(snap)
            warm((snap.name,))

    def ingest(self, snap: HostSnapshot) -> None:
        self.model.ingest(snap)
        self._dirty = True

    def _store_stat(self) -> object:
        return self.store.signature()

    def reload_store(self) -> None:
        """Re-read the shared file now (after our own write, or when asked)."""
        if self.store.remote:
            self._read_remote_store()
            return
        sig = self._store_stat()
        try:
            result: StoreState | StoreError = self.store.read()
        except StoreError as exc:
            result = exc
        self._apply_store(sig, result)

    def _reload_store_if_changed(self) -> None:
        """Every interval: when the file changed (a teammate reserved something), read it
        on a worker thread. A large or hostile file (up to 4 MiB, 10,000 records) costs
        that thread a tenth of a second, never the screen; an unchanged file, broken or not,
        is not read again."""
        if self.store.remote:
            self._read_remote_store()
            return
        sig = self._store_stat()
        if sig == self._store_sig or self._store_reading:
            return
        self._store_reading = True

        def read() -> None:
            try:
                result: StoreState | StoreError = self.store.read()
            except StoreError as exc:
                result = exc
            self.call_from_thread(self._apply_store, sig, result)

        self.run_worker(read, thread=True, group="store", exit_on_error=False)

    def _read_remote_store(self) -> None:
        """A store over SSH, always on a worker thread: one short round trip when the file
        did not change (its checksum), the file only when it did; a host that is down
        costs that thread its timeout, never the screen."""
        if self._store_reading:
            return
        self._store_reading = True

        def read() -> None:
            me = None
            try:
                result: StoreState | StoreError = self.store.read()
                me = self.store.whoami()[0]
            except StoreError as exc:
                result = exc
            self.call_from_thread(self._apply_remote_store, result, me)

        self.run_worker(read, thread=True, group="store", exit_on_error=False)

    def _apply_remote_store(self, result: StoreState | StoreError, me: str | None) -> None:
        if me is not None and not self._me_given and me != self.me:
            self.me = self.model.me = me
            self.model.state_version += 1  # every row's "is it mine" may change
            self._dirty = True
        if result is self._state and self._store_problem is None:
            self._store_reading = False  # unchanged: nothing to redo
            return
        self._apply_store(None, result)

    def _apply_store(self, sig: object,
                     result: StoreState | StoreError) -> None:
        self._store_reading = False
        self._store_sig = sig
        if isinstance(result, StoreError):
            if str(result) != self._store_problem:  # stays in the summary bar until fixed
                self._store_problem = str(result)
                self.notify(str(result), title="reservations", severity="error",
                            markup=False, timeout=6)
                self._dirty = True
            return
        if self._store_problem is not None:
            self._store_problem = None
        self._state = result
        self.model.set_state(result)
        self._dirty = True

    def _warn(self, message: str) -> None:
        self.notify(message, severity="warning", markup=False, timeout=8)

    # -- drawing -------------------------------------------------------------------------

    def _render_if_dirty(self) -> None:
        if self._dirty:
            self.render_board()

    def render_board(self) -> None:
        self._dirty = False
        now = self.clock()
        table = self.query_one(BoardTable)
        rows, summary = self.model.view()
        table.show_rows(rows, now, self.palette, self.model.signature)
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

    @property
    def _rows(self) -> dict[str, GpuRow | HostRow]:
        """The rows as last drawn, by key."""
        return self.query_one(BoardTable).rows_by_key

    def _selected(self) -> GpuRow | HostRow | None:
        key = self.query_one(BoardTable).selected_key()
        return None if key is None else self._rows.get(key)  # as last drawn

    def on_board_table_row_highlighted(self, _event: BoardTable.RowHighlighted) -> None:
        detail = self.query_one(DetailPane)
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

    def action_queue(self) -> None:
        from gputop.ui.screens import QueueScreen

        waiting = self._state.waiting(self.clock()) if self._state is not None else []
        self.push_screen(QueueScreen(waiting, self.clock(), self.me), self._join_queue)

    def _join_queue(self, count: int | None) -> None:
        if count is None:
            return
        if self._waiting is not None and not self._waiting.is_finished:
            self.notify("you are already waiting in the queue", severity="warning")
            return
        self._waiting = self._wait(count)

    @work(group="queue", exclusive=True)
    async def _wait(self, count: int) -> None:
        """Wait in the queue like ``free --wait``; quitting the board leaves the queue."""
        from gputop.jobs.wait import WaitedTooLong, wait_for_gpus
        from gputop.reservations.queue import DEFAULT_LEASE_S, Request

        def say(msg: str) -> None:
            self.notify(msg, title="queue", markup=False, timeout=6)
            self._store_sig = None

        poller = None
        if self._sources is not None:  # the demo (or given sources): what the board shows,
            poller = Poller(dataclasses.replace(self.config, collection="query"), [
                BoardSource(s.name, self.model.snapshots.get) for s in self._sources])
        try:  # (else the waiter's own queries: a GPU is free the moment its job ends)
            got = await wait_for_gpus(self.config, self.store, Request(count), note="",
                                      seconds=self.config.reservation_default_s,
                                      lease_s=DEFAULT_LEASE_S, max_wait=None, say=say,
                                      poller=poller)
        except (Invalid, Refused, StoreError, WaitedTooLong) as exc:
            self.notify(str(exc), severity="error", markup=False, timeout=6)
            return
        finally:
            if poller is not None:
                await poller.aclose()
        self.bell()
        self._store_changed("granted: " + ", ".join(f"{clean(r.host)}:{r.gpu}" for r in got))
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

    def action_reserve(self) -> None:
        """Reserve the selected GPU: refuse at once if someone else holds it, ask first if
        someone else runs on it, and check again on submit that it is still that GPU."""
        row = self._selected()
        if not isinstance(row, GpuRow) or row.gpu.index is None:
            self.notify("select a GPU row to reserve", severity="warning")
            return
        if row.shares or row.share is not None:  # a shared GPU: `r` offers a share of it
            self._ask_share(row)
            return
        holder = row.reservation
        if holder is not None and holder.user != self.me:
            note = f" ({clean(holder.note)})" if holder.note else ""
            self.notify(f"{row.label} is reserved by {clean(holder.user)} for "
                        f"{time_left(holder.expires, self.clock())} more{note}",
                        severity="warning", markup=False, timeout=6)
            return
        key, label = row.key, row.label
        about = f"{short_model(row.gpu.name)}  {clean(row.gpu.uuid) or 'no uuid'}"

        def done(req: ReserveRequest | None) -> None:
            if req is not None:
                self._reserve_checked(key, label, req)

        shareable = row.instance is None and not mig_mode(row.gpu) and holder is None

        def ask() -> None:
            self.push_screen(ReserveScreen(label, self.config.reservation_default_s,
                                           self.config.reservation_max_s, about,
                                           "optional" if shareable else None), done)

        from gputop.jobs.remote import login_on

        host = next((h for h in self.config.hosts if h.name == row.host), None)
        mine = {self.me} | ({login_on(self.config, host)} if host is not None else set())
        others = [p for p in row.gpu.processes if clean(p.user) not in mine]
        if not others:
            ask()
            return
        who = ", ".join(sorted({clean(p.user) or "?" for p in others}))
        q = Text()
        q.append(f"{label} is in use by {who}:\n", style="bold")
        for p in others[:5]:
            q.append(f"  {p.pid} {clean(p.user) or '?'}  {excerpt(p.command or '', 50)}\n")
        if len(others) > 5:
            q.append(f"  … and {len(others) - 5} more\n")
        q.append("\nReserve it anyway? Your reservation will not stop their jobs.")
        self.push_screen(ConfirmScreen(q, "Reserve anyway"),
                         lambda yes: ask() if yes else None)

    def _ask_share(self, row: GpuRow) -> None:
        """`r` on a shared GPU (or one of its shares): a share of it, or yours resized."""
        g = row.gpu
        shares = row.shares or next((r.shares for r in self.model.rows()
                                     if isinstance(r, GpuRow)
                                     and r.key == split_share(row.key)[0]), ())
        rest = "?" if g.memory_total_mib is None else size_text(
            room_mib(g.memory_total_mib, shares, but=self.me))
        key, label = split_share(row.key)[0], f"{clean(row.host)}:{g.index}"
        about = f"{short_model(g.name)}  {clean(g.uuid) or 'no uuid'}"

        def done(req: ReserveRequest | None) -> None:
            if req is not None:
                self._reserve_checked(key, label, req)

        self.push_screen(ReserveScreen(label, self.config.reservation_default_s,
                                       self.config.reservation_max_s, about, "required",
                                       rest), done)

    def _reserve_checked(self, key: str, label: str, req: ReserveRequest) -> None:
        """The dialog was open a while: reserve only if the latest data still shows the GPU
        the user chose, at the same index, on a host that answers."""
        host = host_of(key)
        gpu_key, gi = split_instance(key)  # gi: a MIG instance row's GPU instance id
        snap = self.model.snapshots.get(host)
        gpu = None if snap is None or not snap.ok else next(
            (g for g, k in zip(snap.gpus, gpu_keys(host, snap.gpus)) if k == gpu_key), None)
        now_label = None if gpu is None else (
            f"{clean(host)}:{gpu.index}" + ("" if gi is None else f"/{gi}"))
        if snap is None or not snap.ok:
            problem = f"{clean(host)} is down now"
        elif gpu is None or gpu.index is None or (
                gi is not None and gi not in {i.gpu_instance_id for i in gpu.instances}):
            problem = f"{label} is gone from {clean(host)}"
        elif now_label != label:
            problem = f"{label} is now {now_label} (renumbered)"
        elif req.share_mib is not None and gpu.memory_total_mib is None:
            problem = f"{label} does not report its memory"
        else:
            self._reserve(Target(host, gpu.index, gpu.uuid, gi), req, gpu.memory_total_mib)
            return
        self.notify(f"not reserved: {problem}", severity="error", markup=False, timeout=6)

    @work(group="store")
    async def _reserve(self, target: Target, req: ReserveRequest,
                       total_mib: int | None = None) -> None:
        from gputop.jobs.remote import logins
        from gputop.reservations.ops import reserve_outcomes
        from gputop.reservations.queue import queue_claim

        try:
            if req.share_mib is not None:
                # The queue's order rule for shares, as for `gputop reserve --share`.
                from gputop.reservations.queue import share_claim

                claim = share_claim([h.name for h in self.config.hosts],
                                    [h for _, h in self.model.snapshots.items()],
                                    req.share_mib, self.me, target)
                await asyncio.to_thread(
                    reserve_share, self.store, target, req.share_mib, total_mib or 0,
                    seconds=req.seconds, max_seconds=self.config.reservation_max_s,
                    note=req.note, user=self.me, check=claim)
            else:
                # The queue's order rule, as for `gputop reserve`: a GPU a waiter could use
                # is theirs to wait for (refused, naming them).
                check = queue_claim([target], dict(self.model.snapshots),
                                    [h.name for h in self.config.hosts], self.me)
                await asyncio.to_thread(
                    reserve_outcomes, self.store, [target], seconds=req.seconds,
                    max_seconds=self.config.reservation_max_s, note=req.note, user=self.me,
                    check=check, login=logins(self.config))
        except Refused as exc:
            self.notify(f"refused: {exc}", severity="error", markup=False, timeout=6)
            return
        except (Invalid, StoreError) as exc:
            self.notify(str(exc), severity="error", markup=False, timeout=6)
            return
        self._store_changed(f"reserved {clean(target.label)}" + (
            "" if req.share_mib is None else f" (a {size_text(req.share_mib)} share)"))

    def action_release(self) -> None:
        row = self._selected()
        if isinstance(row, GpuRow) and row.gpu.index is not None and (
                row.shares or row.share is not None):  # a shared GPU: your share of it
            shares = row.shares or ((row.share,) if row.share else ())
            if not any(r.user == self.me for r in shares) and (
                    row.share is None or row.share.user != self.me):
                self.notify("you hold no share of the selected GPU", severity="warning")
                return
            self._release(Target(row.host, row.gpu.index))
            return
        if not isinstance(row, GpuRow) or row.reservation is None:
            self.notify("no reservation on the selected GPU", severity="warning")
            return
        if row.reservation.user != self.me:
            self.notify(f"reserved by {clean(row.reservation.user)}, not you; use "
                        "`gputop release --force` to take it back", severity="warning",
                        markup=False)
            return
        self._release(Target(row.host, row.reservation.gpu, instance=row.reservation.instance))

    @work(group="store")
    async def _release(self, target: Target) -> None:
        try:
            await asyncio.to_thread(release, self.store, [target], user=self.me)
        except (Refused, StoreError) as exc:
            self.notify(str(exc), severity="error", markup=False, timeout=6)
            return
        self._store_changed(f"released {clean(target.label)}")

    def _store_changed(self, message: str) -> None:
        """We wrote the shared file: show it now rather than at the next re-read."""
        self.notify(message, markup=False)
        self._store_sig = None
        self.reload_store()
        self.render_board()


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
