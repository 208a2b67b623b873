"""The board's widgets: the GPU table (updated in place), the summary bar, the detail pane."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from datetime import datetime

from rich.text import Text
from textual import events
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Vertical
from textual.coordinate import Coordinate
from textual.message import Message
from textual.widgets import DataTable, Static

from gputop.model import iso
from gputop.reservations.ops import format_duration
from gputop.text import clean
from gputop.ui.board_model import (
    BoardModel,
    GpuRow,
    HostRow,
    Row,
    Summary,
    host_of,
    short_model,
)
from gputop.ui.cells import (
    COLUMNS,
    FLAG_LABELS,
    Columns,
    Palette,
    RankedText,
    columns_for,
    gib,
    row_cells,
)


class BoardTable(DataTable[Text]):
    """The GPU table. ``show_rows`` diffs against what is on screen: new rows are added,
    gone rows removed, order fixed by one sort, and only changed cells are rewritten.

    The selection is a GPU, not a position: ``chosen`` is the key of the row the user moved
    to, and every redraw puts the cursor back on it. When it is gone (its host went down)
    the cursor goes to its host's row; with no such row the cursor is hidden and nothing is
    selected, so no key acts on a GPU the user did not choose."""

    BINDINGS = [
        Binding("j", "cursor_down", "Down", show=False),
        Binding("k", "cursor_up", "Up", show=False),
        Binding("home", "scroll_top", "First row", show=False),
        Binding("end", "scroll_bottom", "Last row", show=False),
    ]

    class LayoutChanged(Message):
        """The table crossed the wide/narrow width: the board redraws every row."""

    def __init__(self, **kwargs: object) -> None:
        super().__init__(cursor_type="row", zebra_stripes=False, **kwargs)  # type: ignore[arg-type]
        self._shown: dict[str, tuple[Text, ...]] = {}
        self._sigs: dict[str, tuple[object, ...]] = {}
        self._palette: Palette | None = None
        self._order: list[str] = []
        self.columns_shown: Columns = ()
        self.chosen: str | None = None
        self._restoring = False
        self.cell_updates = 0  # for tests: proves unchanged cells are left alone

    def on_mount(self) -> None:
        self._set_columns(columns_for(self.app.size.width))

    def _set_columns(self, columns: Columns) -> None:
        self._restoring = True
        try:
            self.clear(columns=True)
            for key, label, width in columns:
                self.add_column(label, key=key, width=width)
        finally:
            self._restoring = False
        self.columns_shown = columns
        self._shown, self._sigs, self._order = {}, {}, []

    def on_resize(self, event: events.Resize) -> None:
        if columns_for(event.size.width) != self.columns_shown:
            self.post_message(self.LayoutChanged())

    @property
    def narrow(self) -> bool:
        return len(self.columns_shown) != len(COLUMNS)

    def watch_cursor_coordinate(self, old: Coordinate, new: Coordinate) -> None:
        super().watch_cursor_coordinate(old, new)
        if not self._restoring and 0 <= new.row < self.row_count:
            self.chosen = self._key_at(new.row)  # the user moved: this is the choice now
            self.show_cursor = True

    def _key_at(self, row: int) -> str | None:
        return self.coordinate_to_cell_key(Coordinate(row, 0)).row_key.value

    def _wake(self) -> None:
        """A key pressed while nothing was selected: select the row under the cursor."""
        if not self.show_cursor and self.row_count:
            self.show_cursor = True
            self.chosen = self._key_at(min(self.cursor_row, self.row_count - 1))

    async def _on_click(self, event: events.Click) -> None:
        self._wake()
        await super()._on_click(event)

    def action_cursor_up(self) -> None:
        self._wake()
        super().action_cursor_up()

    def action_cursor_down(self) -> None:
        self._wake()
        super().action_cursor_down()

    def action_page_up(self) -> None:
        self._wake()
        super().action_page_up()

    def action_page_down(self) -> None:
        self._wake()
        super().action_page_down()

    def action_scroll_top(self) -> None:
        self._wake()
        super().action_scroll_top()

    def action_scroll_bottom(self) -> None:
        self._wake()
        super().action_scroll_bottom()

    def selected_key(self) -> str | None:
        """The row the user chose and the cursor is on; None when nothing is selected."""
        if not self.show_cursor or not self._order or not 0 <= self.cursor_row < len(
                self._order):
            return None
        return self._key_at(self.cursor_row)

    def show_rows(self, rows: list[Row], now: datetime, palette: Palette,
                  signature: Callable[[Row, datetime], tuple[object, ...]]) -> None:
        self._restoring = True  # rows come and go under the cursor: not the user's choice
        try:
            self._show_rows(rows, now, palette, signature)
        finally:
            self._restoring = False

    def _show_rows(self, rows: list[Row], now: datetime, palette: Palette,
                   signature: Callable[[Row, datetime], tuple[object, ...]]) -> None:
        wanted_columns = columns_for(self.size.width or self.app.size.width)
        if wanted_columns != self.columns_shown:
            self._set_columns(wanted_columns)
            self._restoring = True
        if self.chosen is None and self._order:
            self.chosen = self.selected_key()
        keys = [r.key for r in rows]
        wanted = set(keys)
        narrow = self.narrow
        if palette != self._palette:  # a new theme: every cell's colours change
            self._palette, self._sigs = palette, {}
        for gone in [k for k in self._shown if k not in wanted]:
            self.remove_row(gone)
            del self._shown[gone]
            self._sigs.pop(gone, None)
        for row in rows:
            sig = signature(row, now)
            if self._sigs.get(row.key) == sig:
                continue  # nothing it depends on changed: no cells to build or compare
            self._sigs[row.key] = sig
            cells = row_cells(row, now, palette, narrow)
            old = self._shown.get(row.key)
            if old is None:
                self.add_row(*cells, key=row.key)
            else:
                for (col, _, width), new, was in zip(self.columns_shown, cells, old):
                    if new != was:
                        self.update_cell(row.key, col, new, update_width=width is None)
                        self.cell_updates += 1
            self._shown[row.key] = cells
        if keys != self._order:
            for rank, key in enumerate(keys):
                shown = self.get_cell(key, "gpu")  # the cell the sort below reads
                if isinstance(shown, RankedText):
                    shown.rank = rank
            self.sort("gpu", key=lambda cell: cell.rank)
            self._order = keys
        self._restore(wanted)

    def _restore(self, wanted: set[str]) -> None:
        """Put the cursor back on the chosen GPU, else on its host, else select nothing."""
        if self.chosen is None:
            if keys := self._order:
                self.chosen = keys[min(max(self.cursor_row, 0), len(keys) - 1)]
            return
        for key in (self.chosen, host_of(self.chosen)):
            if key in wanted:
                self.show_cursor = True
                row = self.get_row_index(key)
                if row != self.cursor_row:  # (moving scrolls: leave a mouse scroll alone)
                    self.move_cursor(row=row, animate=False)
                return
        self.show_cursor = False  # the choice is gone and so is its host: nothing selected


class SummaryBar(Static):
    def show(self, s: Summary, palette: Palette, note: str = "",
             problem: str | None = None) -> None:
        # Fits 80 columns: "2 up · 2 down │ 1 free · 6 busy · 0 reserved of 7 GPUs │ ..."
        t = Text(" ")
        if note:  # first: a filtered or re-sorted view must never look like the whole board
            t.append(f"[{note}] ", style=f"bold {palette.reserved}")
        if problem:  # lasts as long as the problem does, unlike a notification
            t.append("reservations unreadable ", style=f"bold reverse {palette.error}")
            t.append(" ")
        t.append(f"{s.hosts_up} up", style="bold")
        if s.hosts_down:
            t.append(f" · {s.hosts_down} down", style=f"bold {palette.error}")
        if s.hosts_waiting:
            t.append(f" · {s.hosts_waiting} waiting", style=palette.muted)
        t.append(" │ ", style=palette.muted)
        t.append(f"{s.free} free", style=f"bold {palette.free}")
        t.append(" · ")
        t.append(f"{s.busy} busy", style=palette.busy)
        t.append(" · ")
        t.append(f"{s.reserved} reserved", style=palette.reserved)
        t.append(f" of {s.gpus} GPUs")
        util = "n/a" if s.util_percent is None else f"{s.util_percent:.0f}%"
        t.append(" │ ", style=palette.muted)
        t.append(f"util {util}")
        t.append(" │ ", style=palette.muted)
        t.append(f"mem {gib(s.mem_used_mib)}/{gib(s.mem_total_mib)}G")
        self.update(t)


SPARK = "▁▂▃▄▅▆▇█"


def spark(values: Iterable[float | None], width: int, style: str) -> Text:
    """The last ``width`` percentages as a sparkline on a fixed 0-100 scale (a flat 100 %
    must not look like a flat 0 %); an unknown value is a gap, not a ``▁`` that reads 0 %."""
    vals = list(values)[-width:]
    chars = "".join(" " if v is None else SPARK[min(7, max(0, round(v / 100 * 7)))]
                    for v in vals)
    return Text(chars, style=style)


class DetailPane(Vertical):
    """The selected GPU: processes, history, reservation, details."""

    def compose(self) -> ComposeResult:
        yield Static(id="detail-head")
        yield Static("utilisation %, this session", classes="spark-label")
        yield Static(id="spark-util", classes="spark")
        yield Static("memory used %", classes="spark-label")
        yield Static(id="spark-mem", classes="spark")
        yield Static(id="detail-procs")

    def show(self, row: Row | None, model: BoardModel, now: datetime, palette: Palette) -> None:
        """Only ``row``'s own data: a host row never shows the previous GPU's history."""
        head = self.query_one("#detail-head", Static)
        procs = self.query_one("#detail-procs", Static)
        for part in self.query(".spark-label, .spark"):  # a host row has no history
            part.display = isinstance(row, GpuRow)
        if not isinstance(row, GpuRow):
            for name in ("#spark-util", "#spark-mem"):
                self.query_one(name, Static).update("")
            procs.update("")
            head.update(self._host_text(row, now))
            return
        g = row.gpu
        t = Text()
        t.append(f"{row.label}  ", style="bold")
        t.append(short_model(g.name))
        t.append(f"\nuuid {clean(g.uuid) or '?'}  bus {clean(g.bus_id) or '?'}  driver "
                 f"{clean(g.driver_version) or '?'}  {clean(g.pstate) or ''}")
        if g.power_limit_w is not None:
            t.append(f"  power limit {g.power_limit_w:.0f} W")
        if g.mig_mode:
            t.append(f"  MIG {clean(g.mig_mode)}")
        r = row.reservation
        if r is not None:
            left = format_duration((r.expires - now).total_seconds())
            t.append(f"\nreserved by {clean(r.user)} (from {clean(r.machine)}) until "
                     f"{iso(r.expires)}, {left} left")
            if r.note:
                t.append(f"\nnote: {clean(r.note)}")
        else:
            t.append("\nnot reserved")
        if row.flags:
            t.append("\n" + "  ".join(FLAG_LABELS.get(f, f) for f in row.flags), style="bold")
        head.update(t)
        util, mem = model.history.get(row.key, ((), ()))
        width = max(10, self.size.width - 2)
        self.query_one("#spark-util", Static).update(spark(util, width, palette.busy))
        self.query_one("#spark-mem", Static).update(spark(mem, width, palette.reserved))
        p = Text()
        if not g.processes:
            p.append("no processes")
        else:
            p.append(f"{'PID':>8}  {'USER':<12} {'GPU MEM':>8}  {'ELAPSED':>8}  COMMAND\n",
                     style="bold")
            for proc in g.processes:
                mem_s = "?" if proc.gpu_memory_mib is None else f"{proc.gpu_memory_mib}M"
                el = "?" if proc.elapsed_s is None else format_duration(proc.elapsed_s)
                p.append(f"{proc.pid:>8}  {clean(proc.user)[:12] or '?':<12} {mem_s:>8}  "
                         f"{el:>8}  {clean(proc.command)}\n")
        procs.update(p)

    @staticmethod
    def _host_text(row: HostRow | None, now: datetime) -> Text:
        if row is None:
            return Text("Nothing selected: move with ↑ ↓ (or j k) to choose a GPU.")
        name = clean(row.host)
        snap = row.snapshot
        if snap is None:
            return Text(f"{name}: waiting for its first answer", style="bold")
        if snap.error is not None and snap.error.kind == "starting":
            return Text(f"{name}: {clean(snap.error.message)} (its first sample; seconds "
                        "per GPU without persistence mode)", style="bold")
        if row.error:
            err = snap.error
            assert err is not None
            t = Text(f"{name} is down: {err.kind}\n", style="bold")
            t.append(clean(err.message))
            t.append(f"\nlast answered: {iso(row.last_seen) or 'never'}"
                     f"\nc reconnects now (skips the retry wait)")
            return t
        t = Text(f"{name}", style="bold")
        t.append(f"  {row.gpu_count} GPU{'s' if row.gpu_count != 1 else ''}")
        if snap.tags:
            t.append("  tags: " + " ".join(clean(x) for x in snap.tags))
        t.append(f"\nlast answered: {iso(snap.time)}")
        t.append("\nSelect one of its GPUs for processes and history; enter folds the host.")
        return t
