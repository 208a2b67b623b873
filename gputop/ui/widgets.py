"""The board's widgets: the GPU table (updated in place), the summary bar, the detail pane."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from datetime import datetime

from rich.text import Text
from textual.app import ComposeResult
from textual.containers import Vertical
from textual.coordinate import Coordinate
from textual.widgets import DataTable, Static

from gputop.model import iso
from gputop.reservations.ops import format_duration
from gputop.text import clean
from gputop.ui.board_model import BoardModel, GpuRow, HostRow, Row, Summary, short_model
from gputop.ui.cells import COLUMNS, FLAG_LABELS, Palette, RankedText, gib, row_cells


class BoardTable(DataTable[Text]):
    """The GPU table. ``show_rows`` diffs against what is on screen: new rows are added,
    gone rows removed, order fixed by one sort, and only changed cells are rewritten, so
    the cursor and scroll position stay where the user left them."""

    def __init__(self, **kwargs: object) -> None:
        super().__init__(cursor_type="row", zebra_stripes=False, **kwargs)  # type: ignore[arg-type]
        self._shown: dict[str, tuple[Text, ...]] = {}
        self._sigs: dict[str, tuple[object, ...]] = {}
        self._palette: Palette | None = None
        self._order: list[str] = []
        self.cell_updates = 0  # for tests: proves unchanged cells are left alone

    def on_mount(self) -> None:
        for key, label, width in COLUMNS:
            self.add_column(label, key=key, width=width)

    def selected_key(self) -> str | None:
        if not self._order or self.cursor_row < 0 or self.cursor_row >= len(self._order):
            return None
        return self.coordinate_to_cell_key(Coordinate(self.cursor_row, 0)).row_key.value

    def show_rows(self, rows: list[Row], now: datetime, palette: Palette,
                  signature: Callable[[Row, datetime], tuple[object, ...]]) -> None:
        selected = self.selected_key()
        keys = [r.key for r in rows]
        wanted = set(keys)
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
            cells = row_cells(row, now, palette)
            old = self._shown.get(row.key)
            if old is None:
                self.add_row(*cells, key=row.key)
            else:
                for (col, _, width), new, was in zip(COLUMNS, cells, old):
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
            if selected in wanted:
                self.move_cursor(row=self.get_row_index(selected), animate=False)


class SummaryBar(Static):
    def show(self, s: Summary, palette: Palette, note: str = "") -> None:
        # Fits 80 columns: "2 up · 2 down │ 1 free · 6 busy · 0 reserved of 7 GPUs │ ..."
        t = Text(" ")
        if note:  # first: a filtered or re-sorted view must never look like the whole board
            t.append(f"[{note}] ", style=f"bold {palette.reserved}")
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


def spark(values: Iterable[float], width: int, style: str) -> Text:
    """The last ``width`` percentages as a sparkline on a fixed 0-100 scale (a flat 100 %
    must not look like a flat 0 %)."""
    vals = list(values)[-width:]
    chars = "".join(SPARK[min(7, max(0, round(v / 100 * 7)))] for v in vals)
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
        head = self.query_one("#detail-head", Static)
        procs = self.query_one("#detail-procs", Static)
        if isinstance(row, HostRow) and row.error and row.snapshot is not None:
            err = row.snapshot.error
            assert err is not None
            t = Text(f"{clean(row.host)} is down: {err.kind}\n", style="bold")
            t.append(clean(err.message))
            t.append(f"\nlast answered: {iso(row.last_seen) or 'never'}")
            head.update(t)
            procs.update("")
            return
        if not isinstance(row, GpuRow):
            head.update(Text("Select a GPU row to see its details."))
            procs.update("")
            return
        g = row.gpu
        t = Text()
        t.append(f"{clean(row.host)} GPU {g.index}  ", style="bold")
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
        util, mem = model.history.get((row.host, g.index), ([], []))
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
