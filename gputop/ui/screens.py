"""Modal screens: reserve a GPU, and the key help."""

from __future__ import annotations

import textwrap
from dataclasses import dataclass
from datetime import datetime
from typing import TypeVar

from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical, VerticalScroll
from textual.screen import ModalScreen
from textual.widgets import Button, Input, Label, Static

from gputop.config.values import parse_duration
from gputop.reservations.ops import Invalid, check_note, format_duration
from gputop.reservations.records import Waiter
from gputop.reservations.shares import parse_size_mib
from gputop.text import clean, excerpt
from gputop.ui.board_rows import UserLoad
from gputop.ui.cells import gib

ResultT = TypeVar("ResultT")


class Dialog(ModalScreen[ResultT]):
    """A modal whose keys act only once it has been drawn: a key typed before the user
    could see it (``r`` then ``y`` in one burst, where ``y`` answers "reserve anyway")
    was meant for what was there before, and is dropped."""

    _shown = False

    def on_mount(self) -> None:
        self.call_after_refresh(self._drawn)

    def _drawn(self) -> None:
        self._shown = True

    def check_action(self, action: str, parameters: tuple[object, ...]) -> bool | None:
        return self._shown


@dataclass(frozen=True)
class ReserveRequest:
    seconds: float
    note: str
    #: A memory share of the GPU (MiB); None: the whole GPU.
    share_mib: int | None = None


class ReserveScreen(Dialog[ReserveRequest | None]):
    """Duration and note for a reservation of one GPU, and (``share``) the size of a
    memory share of it: ``"optional"`` (empty: the whole GPU), ``"required"`` (the GPU is
    shared already; ``share_room`` says what is left), None (a MIG GPU or instance)."""

    BINDINGS = [Binding("escape", "cancel", "Cancel")]

    def __init__(self, target: str, default_s: float, max_s: float, about: str = "",
                 share: str | None = None, share_room: str = "") -> None:
        super().__init__()
        self.target, self.default_s, self.max_s, self.about = target, default_s, max_s, about
        self.share, self.share_room = share, share_room

    def compose(self) -> ComposeResult:
        with Vertical(id="reserve-dialog"):
            title = (f"A share of {self.target} ({self.share_room} left unshared)"
                     if self.share == "required" else f"Reserve {self.target}")
            yield Label(Text(title), id="reserve-title")
            if self.about:  # which GPU exactly: model and uuid, as the board last saw it
                yield Label(Text(self.about), id="reserve-about")
            how_long = (f"For how long? (e.g. 90m, 2h, 1d; at most "
                        f"{format_duration(self.max_s)})")
            duration = Input(value=format_duration(self.default_s).replace("h00m", "h"),
                             id="reserve-duration")
            if self.share is None:
                yield Label(Text(how_long))
                yield duration
            else:  # side by side: the dialog is no taller (it fits 80x24)
                with Horizontal(id="reserve-row"):
                    with Vertical():
                        yield Label(Text(f"How long? (at most {format_duration(self.max_s)})"))
                        yield duration
                    with Vertical():
                        yield Label(Text("Share of its memory"))
                        yield Input(placeholder="e.g. 16G" if self.share == "required"
                                    else "whole GPU; e.g. 16G", id="reserve-share",
                                    max_length=20)
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
            share = None
            if self.share is not None:
                text = self.query_one("#reserve-share", Input).value.strip()
                if text or self.share == "required":
                    share = parse_size_mib(text or "?")
        except (ValueError, Invalid) as exc:
            error.update(Text(str(exc)))
            return
        self.dismiss(ReserveRequest(seconds, note, share))

    def action_cancel(self) -> None:
        self.dismiss(None)


KEYS = (  # (key, what): every binding of the board, two to a line in the help
    ("↑ ↓ j k", "move"), ("Home End", "first / last row"),
    ("PgUp PgDn", "page"), ("enter", "details / fold a host"),
    ("r", "reserve the GPU"), ("u", "release my reservation"),
    ("c", "reconnect host now"), ("w", "who holds what"),
    ("/", "filter"), ("esc", "close details, filter"),
    ("f", "free GPUs only"), ("s", "sort: host, util, memory"),
    ("t", "next theme"), ("h", "recorded history"),
    ("?", "this help"), ("q ctrl+c", "quit"),
    ("Q", "the queue; join it"),
)


def _key_lines() -> str:
    cells = [f"{k:<10}{what:<22}" for k, what in KEYS]
    return "\n".join("  " + "".join(cells[i:i + 2]).rstrip() for i in range(0, len(cells), 2))


HELP = f"""\
gputop: every GPU on your team's servers, live.

{_key_lines()}

Colours: free · busy · reserved · error. Dim rows are stale: the
host has not answered for a few refreshes. Flags: ⚠ unreserved use
(someone else runs on a reserved GPU), ◌ idle reservation (reserved,
nothing running), ◔ idle holder (memory held at ~0% load for long),
▲ over its share (a holder of a memory share of it uses more).
c reconnects the selected host at once, skipping its retry wait;
w: per person, the GPUs they run on or reserved, and what runs.

Reservations are advisory and shared: the whole team's gputop reads
the same file, and `gputop reservations` lists them in a terminal.
"""


class ConfirmScreen(Dialog[bool]):
    """A yes/no question; no (esc) is the default."""

    BINDINGS = [Binding("escape,n", "answer(False)", "No"), Binding("y", "answer(True)", "Yes")]

    def __init__(self, question: Text, yes: str) -> None:
        super().__init__()
        self.question, self.yes = question, yes

    def compose(self) -> ComposeResult:
        with Vertical(id="confirm-dialog"):
            yield Static(self.question, id="confirm-text")
            with Horizontal(id="confirm-buttons"):
                yield Button(f"{self.yes} (y)", variant="warning", id="confirm-yes")
                yield Button("Cancel (n)", id="confirm-no")

    def on_mount(self) -> None:
        self.set_focus(self.query_one("#confirm-no", Button))  # now: see GputopApp.action_filter

    def on_button_pressed(self, event: Button.Pressed) -> None:
        self.dismiss(event.button.id == "confirm-yes")

    def action_answer(self, yes: bool) -> None:
        self.dismiss(yes)


def users_text(loads: list[UserLoad], width: int | None = None) -> Text:
    """The per-user view: who holds how many GPUs, and what they run. ``width``: the
    lines' room, so that a long list wraps under itself, not under the labels."""
    if not loads:
        return Text("Nobody runs anything or holds a reservation right now.")
    t = Text()
    for u in loads:
        t.append(f"{u.user}", style="bold")
        t.append(f"  {u.gpus} GPU{'s' if u.gpus != 1 else ''}")
        if u.processes:
            mem = f", {gib(u.memory_mib)}G" if u.memory_mib else ""
            t.append(f"  ({u.processes} process{'es' if u.processes != 1 else ''}{mem})",
                     style="dim")
        t.append("\n")
        if u.reserved:
            _field(t, "reserved", ", ".join(u.reserved), "", width)
        if u.running:
            _field(t, "runs on", ", ".join(u.running), "", width)
        if u.commands:
            runs = ", ".join(excerpt(cmd, 60) + (f" ({n})" if n > 1 else "")
                             for cmd, n in sorted(u.commands.items(), key=lambda c: -c[1]))
            _field(t, "runs", runs, "dim", width)
    return t


def _field(t: Text, label: str, value: str, style: str, width: int | None) -> None:
    head = f"    {label:<10}"
    room = None if width is None else width - len(head)
    if room is None or room < 20 or len(value) <= room:
        t.append(f"{head}{value}\n", style=style)
        return
    for i, line in enumerate(textwrap.wrap(value, room, break_on_hyphens=False)):
        t.append(f"{head if i == 0 else ' ' * len(head)}{line}\n", style=style)


class UsersScreen(Dialog[None]):
    """Who holds how many GPUs across the fleet (processes and reservations)."""

    BINDINGS = [Binding("escape,q,w", "close", "Close")]

    def __init__(self, loads: list[UserLoad]) -> None:
        super().__init__()
        self.loads = loads

    def compose(self) -> ComposeResult:
        with VerticalScroll(id="users-dialog"):
            yield Static(Text("Who holds what", style="bold"), id="users-title")
            yield Static(users_text(self.loads), id="users-text")

    def on_resize(self) -> None:
        # Laid out: wrapped again to the room there is (a hanging indent under each label).
        box = self.query_one("#users-text", Static)
        if box.content_size.width:  # (less a scrollbar's width: one may yet appear)
            box.update(users_text(self.loads, box.content_size.width - 2))

    def action_close(self) -> None:
        self.dismiss(None)


class HelpScreen(Dialog[None]):
    BINDINGS = [Binding("escape,q,question_mark", "close", "Close")]

    def compose(self) -> ComposeResult:
        with VerticalScroll(id="help-dialog"):
            yield Static(Text(HELP), id="help-text")
            yield Button("Close", id="help-close")

    def on_button_pressed(self) -> None:
        self.dismiss(None)

    def action_close(self) -> None:
        self.dismiss(None)


def queue_text(waiters: list[Waiter], now: datetime, me: str) -> Text:
    """Who waits for what, since when, in order; hostile names are inert (plain Text)."""
    t = Text()
    if not waiters:
        t.append("Nobody is waiting.\n", style="dim")
    for i, w in enumerate(waiters):
        since = format_duration((now - w.created).total_seconds())
        what = f"{w.count} GPU{'s' if w.count != 1 else ''}"
        if w.min_free_mib:
            what += f", {w.min_free_mib / 1024:g}G free"
        if w.want:
            what += f" ({excerpt(w.want, 60)})"
        line = f"{i + 1:>3}. {clean(w.user):<12} {what}  waiting {since}\n"
        t.append(line, style="bold" if w.user == me else "")
    return t


class QueueScreen(Dialog[int | None]):
    """The team's wait queue; enter a number of GPUs to join it (any host)."""

    BINDINGS = [Binding("escape,Q", "close", "Close")]

    def __init__(self, waiters: list[Waiter], now: datetime, me: str) -> None:
        super().__init__()
        self.text = queue_text(waiters, now, me)

    def compose(self) -> ComposeResult:
        with VerticalScroll(id="users-dialog"):
            yield Static(Text("Waiting for GPUs, first come first served", style="bold"),
                         id="queue-title")
            yield Static(self.text, id="queue-text")
            yield Label("Join: how many GPUs (any host)? enter to join, esc to close")
            yield Input(value="1", id="queue-count")

    def on_mount(self) -> None:
        self.set_focus(self.query_one("#queue-count", Input))  # enter joins, as it says

    def on_input_submitted(self, event: Input.Submitted) -> None:
        value = event.value.strip()
        if not value.isdigit() or not 1 <= int(value) <= 64:
            self.notify("a number of GPUs, 1-64", severity="error")
            return
        self.dismiss(int(value))

    def action_close(self) -> None:
        self.dismiss(None)
