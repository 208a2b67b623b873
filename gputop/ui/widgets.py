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
from gputop.reservations.ops import format_duration, local_time
from gputop.text import clean
from gputop.ui.board_model import BoardModel, GpuRow, HostRow, Row, Summary, short_model
from gputop.ui.cells import FLAG_LABELS, Palette, gib
from gputop.ui.table import BoardTable

__all__ = ["BoardTable", "DetailPane", "SummaryBar", "spark"]


class SummaryBar(Static):
    def show(self, s: Summary, palette: Palette, note: str = "",
             problem: str | None = None, hub_problem: str | None = None) -> None:
        # Fits 80 columns: "2 up · 2 down │ 1 free · 6 busy · 0 reserved of 7 GPUs │ ..."
        t = Text(" ")
        if note:  # first: a filtered or re-sorted view must never look like the whole board
            t.append(f"[{note}] ", style=f"bold {palette.reserved}")
        if hub_problem:  # the hub the board reads ([hub] url) is down: every row says why
            t.append(f"hub {hub_problem} ", style=f"bold reverse {palette.error}")
            t.append(" ")
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

    #: The history database (``[history] path``): its last hour and day of the GPU show
    #: under the sparklines when it exists.
    history_path: Path | None = None
    _recent_key: tuple[str, int] | None = None

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
        yield Static("utilisation %, this session", classes="spark-label")
        yield Static(id="spark-util", classes="spark")
        yield Static("memory used %", classes="spark-label")
        yield Static(id="spark-mem", classes="spark")
        recent = Static(id="detail-recent")
        recent.display = False  # shown once the history database answered
        yield recent
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
            if row is None:
                self.query_one("#detail-recent", Static).display = False
                self._recent_key = None
            else:
                self._show_recent(row)
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
                     f"{local_time(r.expires)}, {left} left")
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
        self._show_recent(row)
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
            seen = local_time(row.last_seen) if row.last_seen else "never"
            t.append(f"\nlast answered: {seen}"
                     f"\nc reconnects now (skips the retry wait)")
            return t
        t = Text(f"{name}", style="bold")
        t.append(f"  {row.gpu_count} GPU{'s' if row.gpu_count != 1 else ''}")
        if snap.tags:
            t.append("  tags: " + " ".join(clean(x) for x in snap.tags))
        t.append(f"\nlast answered: {local_time(snap.time)}")
        for w in snap.warnings:
            t.append(f"\n⚠ {clean(w)}", style="bold")
        t.append("\nSelect one of its GPUs for processes and history; enter folds the host.")
        return t
