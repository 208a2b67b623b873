"""The board's widgets: the GPU table (see table.py), the summary bar, the detail pane."""

from __future__ import annotations

import time
from collections.abc import Iterable
from datetime import datetime
from pathlib import Path

from rich.text import Text
from textual import work
from textual.app import ComposeResult
from textual.containers import Vertical
from textual.widgets import Static

from gputop.model import GpuInfo
from gputop.reservations.ops import ends_with, format_duration, local_time, size_text
from gputop.reservations.shares import holder_use_mib, room_mib
from gputop.text import clean
from gputop.ui.board_model import BoardModel
from gputop.ui.board_rows import GpuRow, HostRow, Row, Summary, short_model
from gputop.ui.cells import FLAG_LABELS, Palette, gib, gpu_count_text, power_text

__all__ = ["DetailPane", "SummaryBar", "spark"]


class SummaryBar(Static):
    """One line: hosts up/down, GPUs by class (the document's summary rule), load,
    memory. When the terminal is narrower than the whole line, its words shorten ("resv",
    no "GPUs"); what still does not fit ends in ``…``, never cut silently."""

    _last: tuple[Summary, Palette, str, str | None, str | None] | None = None
    _shown: Text | None = None

    def show(self, s: Summary, palette: Palette, note: str = "",
             problem: str | None = None, hub_problem: str | None = None) -> None:
        self._last = (s, palette, note, problem, hub_problem)
        width = self.size.width or self.app.size.width
        t = self._line(s, palette, note, problem, hub_problem, short=False)
        if t.cell_len > width:
            t = self._line(s, palette, note, problem, hub_problem, short=True)
            if t.cell_len > width:
                t.truncate(width, overflow="ellipsis")
        if t == self._shown:
            return
        self._shown = t
        # No layout: the bar is one line (gputop.tcss) as wide as the screen whatever it
        # says; a layout of the whole screen per refresh was a third of the board's drawing.
        self.update(t, layout=False)

    def on_resize(self) -> None:
        if self._last is not None:
            self.show(*self._last)

    @staticmethod
    def _line(s: Summary, palette: Palette, note: str, problem: str | None,
              hub_problem: str | None, short: bool) -> Text:
        t = Text(" ")
        if note:  # first: a filtered or re-sorted view must never look like the whole board
            t.append(f"[{note}] ", style=f"bold {palette.reserved}")
        if hub_problem:  # the hub the board reads ([hub] url) is down: every row says why
            t.append(f"hub {hub_problem} ", style=f"bold reverse {palette.error}")
            t.append(" ")
        if problem:  # lasts as long as the problem does, unlike a notification
            t.append("reservations unreadable ", style=f"bold reverse {palette.error}")
            t.append(" ")
        dot, bar = ("·", " │ ") if not short else ("·", "│")
        t.append(f"{s.hosts_up} up", style="bold")
        if s.hosts_down:
            t.append(f" {dot} {s.hosts_down} down", style=f"bold {palette.error}")
        if s.hosts_waiting:
            t.append(f" {dot} {s.hosts_waiting} waiting", style=palette.muted)
        t.append(bar, style=palette.muted)
        t.append(f"{s.free} free", style=f"bold {palette.free}")
        t.append(f" {dot} ")
        t.append(f"{s.busy} busy", style=palette.busy)
        t.append(f" {dot} ")
        t.append(f"{s.reserved} {'resv' if short else 'reserved'}", style=palette.reserved)
        # The other classes of the document's summary, when there are any: every GPU is
        # in exactly one, so the counts add up to the total.
        for n, word, style in ((s.shared, "shared", palette.reserved),
                               (s.down, "down", palette.error),
                               (s.unknown, "unknown", palette.muted)):
            if n:
                t.append(f" {dot} ")
                t.append(f"{n} {word}", style=style)
        t.append(f" of {s.gpus}" if short else f" of {s.gpus} GPUs")
        if s.instances:
            mig = sum(s.instances.values())
            t.append(f" {dot} MIG {s.instances.get('free', 0)} free of {mig}", style=palette.muted)
        util = "n/a" if s.util_percent is None else f"{s.util_percent:.0f}%"
        t.append(bar, style=palette.muted)
        t.append(f"util {util}")
        t.append(bar, style=palette.muted)
        t.append(f"mem {gib(s.mem_used_mib)}/{gib(s.mem_total_mib)}G")
        return t


SPARK = "▁▂▃▄▅▆▇█"


def gpu_vitals(g: GpuInfo) -> str:
    """Temperature, power, load and memory in words, for the details (the table's 80
    columns have no room for temperature and power)."""
    parts = [f"{g.temperature_c}°C" if g.temperature_c is not None else "temp ?"]
    parts.append(f"power {power_text(g)}" if g.power_draw_w is not None else "power ?")
    if g.utilization_percent is not None:
        parts.append(f"util {g.utilization_percent}%")
    if g.memory_total_mib:
        parts.append(f"mem {gib(g.memory_used_mib)}/{gib(g.memory_total_mib)}G")
    if g.pstate:
        parts.append(clean(g.pstate))
    return "  ".join(parts)


def spark(values: Iterable[float | None], width: int, style: str) -> Text:
    """The last ``width`` percentages as a sparkline on a fixed 0-100 scale (a flat 100 %
    must not look like a flat 0 %); an unknown value is a gap, not a ``▁`` that reads 0 %."""
    vals = list(values)[-width:]
    chars = "".join(" " if v is None else SPARK[min(7, max(0, round(v / 100 * 7)))]
                    for v in vals)
    return Text(chars, style=style)


class DetailPane(Vertical):
    """The selected GPU: processes, history, reservation, details."""

    #: The history database (``[history] path``): its last hour and day of the GPU show
    #: under the sparklines when it exists.
    history_path: Path | None = None
    #: The board reads a hub: ``c`` asks the hub again, it cannot reconnect a host.
    via_hub = False
    _recent_key: tuple[str, int] | None = None
    #: The last GPU shown (to lay it out again when the pane is resized).
    _last: tuple[GpuRow, BoardModel, datetime, Palette] | None = None

    def _show_recent(self, row: GpuRow | HostRow) -> None:
        """The row's recorded last hour and day (a host: all its GPUs), once a minute."""
        box = self.query_one("#detail-recent", Static)
        if self.history_path is None or not self.history_path.exists():
            box.display = False
            return
        key = row.key if isinstance(row, GpuRow) else f"host\x00{row.host}"
        stamp = (key, int(time.time() // 60))
        if stamp == self._recent_key:
            return
        if self._recent_key is None or self._recent_key[0] != key:
            box.display = False
        self._recent_key = stamp
        gpu = row.gpu if isinstance(row, GpuRow) else None
        self._lookup(self.history_path, row.host, gpu, key)

    @work(thread=True, exclusive=True, group="recent")
    def _lookup(self, path: Path, host: str, gpu: GpuInfo | None, key: str) -> None:
        from gputop.history.db import HistoryError
        from gputop.history.recent import recent_gpu, recent_host

        try:
            now = time.time()
            got = (recent_host(path, host, now) if gpu is None
                   else recent_gpu(path, host, gpu.uuid, gpu.index, now))
            what = "this host" if gpu is None else "this GPU"
            text = (f"recorded: nothing for {what} yet" if got is None else
                    "recorded " + got[0].line("last hour") + "\n         "
                    + got[1].line("last day"))
        except HistoryError as exc:
            text = f"history: {exc}"
        self.app.call_from_thread(self._set_recent, key, text)

    def _set_recent(self, key: str, text: str) -> None:
        if self._recent_key is None or self._recent_key[0] != key:
            return  # the selection moved on meanwhile
        box = self.query_one("#detail-recent", Static)
        box.update(Text(clean(text, one_line=False)))
        box.display = True

    def compose(self) -> ComposeResult:
        yield Static(id="detail-head")
        yield Static(id="detail-procs")  # right under the head: never pushed out of view
        yield Static("utilisation %, this session", classes="spark-label")
        yield Static(id="spark-util", classes="spark")
        yield Static("memory used %", classes="spark-label")
        yield Static(id="spark-mem", classes="spark")
        recent = Static(id="detail-recent")
        recent.display = False  # shown once the history database answered
        yield recent

    def show(self, row: Row | None, model: BoardModel, now: datetime, palette: Palette) -> None:
        """Only ``row``'s own data: a host row never shows the previous GPU's history."""
        head = self.query_one("#detail-head", Static)
        procs = self.query_one("#detail-procs", Static)
        for part in self.query(".spark-label, .spark"):  # a host row has no history
            part.display = isinstance(row, GpuRow)
        if not isinstance(row, GpuRow):
            self._last = None
            for name in ("#spark-util", "#spark-mem"):
                self.query_one(name, Static).update("")
            procs.update("")
            head.update(self._host_text(row, now))
            if row is None:
                self.query_one("#detail-recent", Static).display = False
                self._recent_key = None
            else:
                self._show_recent(row)
            return
        g = row.gpu
        t = Text()
        t.append(f"{row.label}  ", style="bold")
        if g.lost:  # the driver has no handle for it: what it said, not a row of "?"
            t.append(f"lost: {clean(g.lost_reason) or 'no reason given'}", style="bold")
        else:
            t.append(short_model(g.name))
            if row.instance is None:  # (an instance has no temperature or power of its own)
                t.append(f"  {gpu_vitals(g)}")
        t.append(f"\nuuid {clean(g.uuid) or '?'}  bus {clean(g.bus_id) or '?'}  driver "
                 f"{clean(g.driver_version) or '?'}")
        if g.mig_mode:
            t.append(f"  MIG {clean(g.mig_mode)}")
        r = row.reservation
        if r is not None:
            left = format_duration((r.expires - now).total_seconds())
            t.append(f"\nreserved by {clean(r.user)} (from {clean(r.machine)}) until "
                     f"{local_time(r.expires)}, {left} left")
            job = ends_with(r)
            if job:
                t.append(f"; it {job}, if that comes first")
            if r.note:
                t.append(f"\nnote: {clean(r.note)}")
        elif row.shares or row.share is not None:
            t.append(share_text(row, now))
        else:
            t.append("\nnot reserved")
        if row.flags:
            t.append("\n" + "  ".join(FLAG_LABELS.get(f, f) for f in row.flags), style="bold")
        head.update(t)
        self._last = (row, model, now, palette)
        util, mem = model.history.series(row.key, row.host)
        width = max(10, self.size.width - 2)
        self.query_one("#spark-util", Static).update(spark(util, width, palette.busy))
        self.query_one("#spark-mem", Static).update(spark(mem, width, palette.reserved))
        self._show_recent(row)
        procs.update(self._procs_text(g, self._room_for_procs(t)))

    def _room_for_procs(self, head: Text) -> int:
        """Lines the processes have under the head (wrapped as drawn), in the pane's
        height: the sparklines below them may go out of view, they may not."""
        app = self.app
        height = self.size.height or min(14, app.size.height // 2)
        width = max(10, (self.size.width or app.size.width) - 2)
        used = len(head.wrap(app.console, width)) + 1  # (+ the pane's top border)
        return max(2, height - used)

    @staticmethod
    def _procs_text(g: GpuInfo, room: int) -> Text:
        """The GPU's processes in ``room`` lines (the column titles one of them); those
        that do not fit are counted on the last line, never dropped without a sign."""
        p = Text()
        if not g.processes:
            p.append("no processes")
            return p
        p.append(f"{'PID':>8}  {'USER':<12} {'GPU MEM':>8}  {'ELAPSED':>8}  COMMAND",
                 style="bold")
        shown = g.processes
        if len(shown) > room - 1:
            shown = shown[:max(0, room - 2)]
        for proc in shown:
            mem_s = "?" if proc.gpu_memory_mib is None else f"{proc.gpu_memory_mib}M"
            el = "?" if proc.elapsed_s is None else format_duration(proc.elapsed_s)
            user = clean(proc.user) or "?"
            user = user if len(user) <= 12 else user[:11] + "…"
            p.append(f"\n{proc.pid:>8}  {user:<12} {mem_s:>8}  {el:>8}  {clean(proc.command)}")
        hidden = len(g.processes) - len(shown)
        if hidden:
            p.append(f"\n… and {hidden} more process{'es' if hidden != 1 else ''} "
                     f"({len(g.processes)} in all; a taller terminal shows them)",
                     style="bold")
        p.no_wrap, p.overflow = True, "ellipsis"  # a line per process, a long one cut with …
        return p

    def on_resize(self) -> None:
        if self.display and self._last is not None:
            self.show(*self._last)

    def _host_text(self, row: HostRow | None, now: datetime) -> Text:
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
            seen = local_time(row.last_seen) if row.last_seen else "never"
            again = ("c asks the hub again now (the hub itself reconnects its hosts)"
                     if self.via_hub else "c reconnects now (skips the retry wait)")
            t.append(f"\nlast answered: {seen}\n{again}")
            return t
        t = Text(f"{name}", style="bold")
        t.append(f"  {gpu_count_text(row.gpu_count, row.instance_count)}")
        if snap.tags:
            t.append("  tags: " + " ".join(clean(x) for x in snap.tags))
        t.append(f"\nlast answered: {local_time(snap.time)}")
        for w in snap.warnings:
            t.append(f"\n⚠ {clean(w)}", style="bold")
        t.append("\nSelect one of its GPUs for processes and history; enter folds the host.")
        return t


def share_text(row: GpuRow, now: datetime) -> Text:
    """A shared GPU's shares in the details: holder, size, what the holder's processes use
    now, time left, note; then the unshared rest."""
    g = row.gpu
    shares = row.shares or ((row.share,) if row.share is not None else ())
    t = Text()
    for r in shares:
        left = format_duration((r.expires - now).total_seconds())
        used = holder_use_mib(g, r)
        t.append(f"\nshare {size_text(r.share_mib or 0)}: {clean(r.user)} (from "
                 f"{clean(r.machine)}) uses {size_text(used) if used else 'nothing'}, until "
                 f"{local_time(r.expires)}, {left} left"
                 + (f"; note: {clean(r.note)}" if r.note else ""))
    if row.shares and g.memory_total_mib is not None:
        t.append(f"\nunshared: {size_text(room_mib(g.memory_total_mib, row.shares))} of "
                 f"{size_text(g.memory_total_mib)} (r takes a share of it)")
    return t
