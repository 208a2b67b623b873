"""Modal screens: reserve a GPU, and the key help."""

from __future__ import annotations

from dataclasses import dataclass

from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical
from textual.screen import ModalScreen
from textual.widgets import Button, Input, Label, Static

from gputop.config import parse_duration
from gputop.reservations.ops import Invalid, check_note, format_duration


@dataclass(frozen=True)
class ReserveRequest:
    seconds: float
    note: str


class ReserveScreen(ModalScreen[ReserveRequest | None]):
    """Duration and note for a reservation of one GPU."""

    BINDINGS = [Binding("escape", "cancel", "Cancel")]

    def __init__(self, target: str, default_s: float, max_s: float) -> None:
        super().__init__()
        self.target, self.default_s, self.max_s = target, default_s, max_s

    def compose(self) -> ComposeResult:
        with Vertical(id="reserve-dialog"):
            yield Label(Text(f"Reserve {self.target}"), id="reserve-title")
            yield Label(Text(f"For how long? (e.g. 90m, 2h, 1d; at most "
                             f"{format_duration(self.max_s)})"))
            yield Input(value=format_duration(self.default_s).replace("h00m", "h"),
                        id="reserve-duration")
            yield Label("Note for your team (optional)")
            yield Input(placeholder="what it is for", id="reserve-note", max_length=500)
            yield Static("", id="reserve-error")
            with Horizontal(id="reserve-buttons"):
                yield Button("Reserve", variant="primary", id="reserve-ok")
                yield Button("Cancel", id="reserve-cancel")

    def on_button_pressed(self, event: Button.Pressed) -> None:
        if event.button.id == "reserve-ok":
            self._submit()
        else:
            self.dismiss(None)

    def on_input_submitted(self, event: Input.Submitted) -> None:
        self._submit()

    def _submit(self) -> None:
        error = self.query_one("#reserve-error", Static)
        try:
            seconds = parse_duration(self.query_one("#reserve-duration", Input).value)
            if seconds > self.max_s:
                raise Invalid(f"at most {format_duration(self.max_s)}")
            note = check_note(self.query_one("#reserve-note", Input).value.strip())
        except ValueError as exc:
            error.update(Text(str(exc)))
            return
        self.dismiss(ReserveRequest(seconds, note))

    def action_cancel(self) -> None:
        self.dismiss(None)


HELP = """\
gputop: every GPU on your team's servers, live.

  ↑ ↓ PgUp PgDn  move            enter  details / fold a host
  r  reserve the selected GPU    u      release my reservation
  /  filter (host, model, user, tag)    esc   clear the filter
  s  sort: host → utilisation → free memory
  f  free GPUs only              t      next theme
  ?  this help                   q      quit

Colours: free · busy · reserved · error. Dim rows are stale: the host
has not answered for a few refreshes. Flags: ⚠ unreserved use (someone
else runs on a reserved GPU), ◌ idle reservation (reserved, nothing
running), ◔ idle holder (memory held at ~0% load for a long time).

Reservations are advisory and shared: the whole team's gputop reads
the same file, and `gputop reservations` lists them in a terminal.
"""


class HelpScreen(ModalScreen[None]):
    BINDINGS = [Binding("escape,q,question_mark", "close", "Close")]

    def compose(self) -> ComposeResult:
        with Vertical(id="help-dialog"):
            yield Static(Text(HELP), id="help-text")
            yield Button("Close", id="help-close")

    def on_button_pressed(self) -> None:
        self.dismiss(None)

    def action_close(self) -> None:
        self.dismiss(None)
