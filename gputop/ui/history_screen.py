"""The fleet view (`h`): every host's recorded last hour and day from the history
database, read in a worker thread so the board never waits for it."""

from __future__ import annotations

import time
from pathlib import Path

from rich.text import Text
from textual import work
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import VerticalScroll
from textual.widgets import Static

from gputop.ui.screens import Dialog


class FleetHistoryScreen(Dialog[None]):
    BINDINGS = [Binding("escape,q,h", "close", "Close")]

    def __init__(self, path: Path) -> None:
        super().__init__()
        self.path = path

    def compose(self) -> ComposeResult:
        with VerticalScroll(id="users-dialog"):
            yield Static(Text("Recorded history", style="bold"), id="users-title")
            yield Static(Text(f"reading {self.path} ..."), id="history-text")

    def on_mount(self) -> None:
        self._load()

    @work(thread=True, exclusive=True)
    def _load(self) -> None:
        from gputop.history.db import HistoryDB, HistoryError
        from gputop.history.render import fleet_text
        from gputop.history.report import collect, summarise

        try:
            if not self.path.exists():
                text = (f"no history database at {self.path}: start `gputop record` (or "
                        "`gputop --record`) to keep one; see [history] path")
            else:
                now = time.time()
                with HistoryDB(self.path) as db:
                    hour = summarise(collect(db, now - 3600, now))
                    day = summarise(collect(db, now - 86400, now))
                text = fleet_text(hour, day)
        except HistoryError as exc:
            text = f"history: {exc}"
        self.app.call_from_thread(self._show, text)

    def _show(self, text: str) -> None:
        self.query_one("#history-text", Static).update(Text(text))

    def action_close(self) -> None:
        self.dismiss(None)
