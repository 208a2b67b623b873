"""The Textual app: one live board of every GPU, fed by the poller as hosts answer.

This module holds the board's composition, its feed's start and end, its drawing and its
keys. The app owns two plain objects and delegates to them: how answers reach the model
(the inbox, the drain, the tick, the board's own garbage collection) is an
:class:`~gputop.ui.intake.Intake`, and reading the shared file and writing it (reserve,
release, the queue) a :class:`~gputop.ui.store_actions.StoreActions`. Textual dispatches
keys and messages to the app, so their handlers stay here, thin.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import threading
from collections.abc import Callable, Sequence
from datetime import datetime
from typing import TYPE_CHECKING

from textual import events, work
from textual.app import App, ComposeResult
from textual.binding import Binding
from textual.color import Color, ColorParseError
from textual.css.query import NoMatches
from textual.widgets import Footer, Input

from gputop.config.load import Config
from gputop.hubclient.poller import HubPoller, open_poller
from gputop.model import HostSnapshot, utcnow
from gputop.poller import Poller
from gputop.reservations.open import open_store
from gputop.reservations.ops import whoami
from gputop.sources import Source
from gputop.text import clean
from gputop.ui.board_model import BoardModel
from gputop.ui.board_rows import GpuRow, HostRow
from gputop.ui.cells import Palette
from gputop.ui.feed import FeedThread
from gputop.ui.intake import RENDER_PERIOD, Intake, tune_gc
from gputop.ui.screens import HelpScreen, UsersScreen
from gputop.ui.store_actions import StoreActions
from gputop.ui.table import BoardTable
from gputop.ui.themes import BUILTIN, FALLBACK, load_themes
from gputop.ui.widgets import DetailPane, SummaryBar

if TYPE_CHECKING:
    from gputop.history.live import LiveRecorder

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
        self.config = config
        self.clock = clock
        self._sources = sources
        self._feed = feed
        store = open_store(config, warn=self._warn)
        # For a store over SSH, "me" is the account its host authenticated: learnt with the
        # first answer (until then, and if it never answers, this machine's account).
        me = user or whoami(None if store.remote else store)[0]
        self.model = BoardModel(host_order=[h.name for h in config.hosts],
                                interval=config.defaults.interval,
                                idle_holder_s=config.defaults.idle_holder_s,
                                idle_grace_s=config.reservations.idle_grace_s,
                                share_grace_s=config.reservations.share_grace_s, clock=clock, me=me)
        self.intake = Intake(self.model, interval=config.defaults.interval,
                             long_running=long_running,
                             table=lambda: self.query_one(BoardTable),
                             render=lambda: self.render_board(), notify_error=self._error,
                             recorder=recorder)
        self.reservations = StoreActions(
            self, store, self.model, config=config, clock=clock, me=me,
            me_given=user is not None, selected=self._selected, redraw=lambda: self.render_board(),
            changed=self._changed,
            given_hosts=None if sources is None else [s.name for s in sources])
        self._wanted_theme = theme or config.defaults.theme or FALLBACK
        self._theme_names: list[str] = []
        self.palette = Palette()
        self.poller: Poller | HubPoller | None = None
        self._feed_started = False
        #: Armed by the first signal; cancelled once the board has exited (see run_board).
        self.watchdog: threading.Timer | None = None
        self._feed_closed = asyncio.Event()

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
        self.query_one(DetailPane).history_path = self.config.history.path
        self.query_one(DetailPane).via_hub = self.config.hub.url is not None
        self.reservations.reload()
        self.set_focus(self.query_one(BoardTable))  # now, not after a refresh
        if self.config.implicit and self.config.hub.url is None:  # (a hub names the hosts)
            from gputop.config.load import NO_CONFIG_HINT, default_config_path

            self.notify(NO_CONFIG_HINT.format(path=default_config_path()), markup=False,
                        timeout=8)
        # One timer for the frame and the board's own GC; answers wake the drain (see
        # Intake.deliver), so a board whose hosts are quiet wakes twice a second, not 25.
        self.intake.start(asyncio.get_running_loop())
        self.set_interval(RENDER_PERIOD, self.intake.tick)
        self.set_interval(max(0.5, self.config.defaults.interval),
                          self.reservations.reload_if_changed)
        self.render_board()
        if self._feed:  # after the first frame: a thousand hosts connecting do not delay it
            self.call_after_refresh(self._run_feed)
        if self.intake.long_running:
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

    async def on_event(self, event: events.Event) -> None:
        if isinstance(event, events.Key) and not event.is_forwarded:
            self.intake.key_in()
        await super().on_event(event)

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
        the intake's inbox for the next frame."""
        self._feed_started = True
        poller = self.poller = open_poller(self.config, self._sources)
        feed = self.intake.feed = FeedThread(poller, self.intake.deliver)
        feed.start()
        try:
            await asyncio.Event().wait()
        finally:
            try:
                feed.stop()  # every remote loop ended, every connection closed
            finally:
                self.intake.close_recorder()
                self._feed_closed.set()

    def _warn(self, message: str) -> None:
        self.notify(message, severity="warning", markup=False, timeout=8)

    def _error(self, message: str) -> None:
        self.notify(message, severity="error", markup=False, timeout=10)

    def ingest(self, snap: HostSnapshot) -> None:
        """One host's answer into the board, as the drain takes it in (drawn next tick)."""
        self.intake.ingest(snap)

    def _changed(self) -> None:
        self.intake.dirty = True

    # -- drawing -------------------------------------------------------------------------

    def render_board(self) -> None:
        self.intake.drawn()
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
        state = self.reservations.state
        waiting = len(state.waiting(now)) if state is not None else 0
        if waiting:
            note = (note + f"  queue: {waiting} waiting (Q)").strip()
        # A hub that is down (or answers garbage) stays in the summary bar until it is back.
        hub_error = self.poller.error if isinstance(self.poller, HubPoller) else None
        self.query_one(SummaryBar).show(summary, self.palette, note, self.reservations.problem,
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
        self.intake.dirty = True

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

    def action_reserve(self) -> None:
        self.reservations.reserve()

    def action_release(self) -> None:
        self.reservations.release()

    def action_queue(self) -> None:
        self.reservations.queue()

    def action_users(self) -> None:
        self.push_screen(UsersScreen(self.model.users()))

    def action_history(self) -> None:
        from gputop.ui.history_screen import FleetHistoryScreen

        self.push_screen(FleetHistoryScreen(self.config.history.path))

    def action_reconnect(self) -> None:
        row = self._selected()
        if row is None:
            self.notify("select a host or one of its GPUs to reconnect", severity="warning")
            return
        feed = self.intake.feed
        if feed is None or not feed.reconnect(row.host):
            self.notify(f"{clean(row.host)} is not polled here", severity="warning",
                        markup=False)
            return
        if isinstance(self.poller, HubPoller) and not self.poller.direct:
            # (The hub polls its hosts: what can be done from here is ask the hub again.)
            self.notify(f"the hub polls {clean(row.host)}: asking the hub again now",
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
