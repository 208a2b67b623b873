"""Table cells as ``rich.text.Text``: untrusted strings are cleaned and never parsed as markup.

``Text(...)`` takes its string literally, so a process called ``[bold red]x[/]`` shows as
exactly that; ``clean`` strips escape/control/bidi characters first.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime

from rich.text import Text

from gputop.model import GpuInfo, iso
from gputop.reservations.ops import format_duration
from gputop.text import clean
from gputop.ui.board_model import GpuRow, HostRow, Row, short_model

COLUMNS: tuple[tuple[str, str, int | None], ...] = (
    # key, label, fixed width (None: as wide as its content)
    ("gpu", "GPU", 20),
    ("util", "Util", 9),
    ("mem", "Memory", 16),
    ("users", "Users", 12),
    ("resv", "Reserved", 13),
    ("temp", "Temp", 4),
    ("power", "Power", 9),
    ("flags", "Flags", None),
)
BLOCKS = " ▏▎▍▌▋▊▉█"
FLAG_LABELS = {
    "unreserved-use": "⚠ unreserved use",
    "idle-reservation": "◌ idle reservation",
    "idle-holder": "◔ idle holder",
    "lost": "✖ lost",
    "renumbered": "⚠ renumbered",
}


@dataclass(frozen=True)
class Palette:
    free: str = "green"
    busy: str = "yellow"
    reserved: str = "magenta"
    error: str = "red"
    muted: str = "grey50"


class RankedText(Text):
    """A Text that also carries its row's sort rank (the table sorts rows by it)."""

    rank: int = 0


def bar(fraction: float | None, width: int, style: str) -> Text:
    if fraction is None:
        return Text(" " * width)
    eighths = round(max(0.0, min(1.0, fraction)) * width * 8)
    full, part = divmod(eighths, 8)
    s = "█" * full + (BLOCKS[part] if part and full < width else "")
    return Text(s.ljust(width), style=style)


def gib(mib: int | None) -> str:
    if mib is None:
        return "?"
    g = mib / 1024
    return f"{g:.1f}" if g < 10 else f"{g:.0f}"


def util_cell(g: GpuInfo, p: Palette) -> Text:
    u = g.utilization_percent
    if u is None:
        return Text("  n/a", style=p.muted)
    t = bar(u / 100, 4, p.busy if u > 10 else p.free)
    t.append(f"{u:>4}%")
    return t


def mem_cell(g: GpuInfo, p: Palette) -> Text:
    used, total = g.memory_used_mib, g.memory_total_mib
    frac = used / total if used is not None and total else None
    t = bar(frac, 5, p.busy if frac and frac > 0.05 else p.free)
    t.append(f" {gib(used)}/{gib(total)}G")
    return t


def time_left(r_expires: datetime, now: datetime) -> str:
    return format_duration(max(0.0, (r_expires - now).total_seconds()))


def gpu_cells(row: GpuRow, now: datetime, p: Palette) -> tuple[Text, ...]:
    g = row.gpu
    if row.reservation is not None:
        label_style = p.reserved
    elif row.free:
        label_style = p.free
    else:
        label_style = ""
    idx = "?" if g.index is None else str(g.index)
    label = RankedText(f"  {idx:>2} ", style="bold")
    label.append(short_model(g.name) if not g.lost else f"lost {clean(g.bus_id)}",
                 style=label_style or (p.error if g.lost else ""))
    if g.mig_mode == "Enabled":
        label.append(" MIG", style=p.muted)
    users = ",".join(row.users) or "—"
    resv = Text("—", style=p.muted)
    if row.reservation is not None:
        resv = Text(f"{clean(row.reservation.user)} {time_left(row.reservation.expires, now)}",
                    style=p.reserved)
    temp = Text("" if g.temperature_c is None else f"{g.temperature_c}°")
    power = Text("" if g.power_draw_w is None else f"{g.power_draw_w:.0f}W"
                 + ("" if g.power_limit_w is None else f"/{g.power_limit_w:.0f}"))
    flags = Text(" ".join(FLAG_LABELS.get(f, f) for f in row.flags),
                 style=p.error if row.flags else "")
    cells = (label, util_cell(g, p) if not g.lost else Text(""),
             mem_cell(g, p) if not g.lost else Text(""), Text(users), resv, temp, power, flags)
    if row.stale:
        for c in cells:
            c.stylize("dim")
    return cells


def host_cells(row: HostRow, now: datetime, p: Palette) -> tuple[Text, ...]:
    name = clean(row.host)
    blank = Text("")
    if row.snapshot is None:
        return (RankedText(f"… {name}", style=p.muted), Text("waiting", style=p.muted), blank,
                blank, blank, blank, blank, blank)
    if row.error:
        err = row.snapshot.error
        assert err is not None
        seen = "never" if row.last_seen is None else _ago(row.last_seen, now)
        return (RankedText(f"✖ {name}", style=f"bold {p.error}"),
                Text("down", style=p.error), Text(err.kind, style=f"bold {p.error}"),
                Text(f"seen {seen}", style=p.muted), blank, blank, blank,
                Text(clean(err.message)[:120], style=p.error))
    arrow = "▸" if row.collapsed else "▾"
    label = RankedText(f"{arrow} {name}", style="bold")
    tags = Text(" ".join(clean(t) for t in row.snapshot.tags), style=p.muted)
    state = Text("stale: seen " + _ago(row.last_seen, now), style=p.error) if row.stale else blank
    count = Text(f"{row.gpu_count} GPU" + ("s" if row.gpu_count != 1 else ""), style=p.muted)
    return (label, count, tags, blank, blank, blank, blank, state)


def row_cells(row: Row, now: datetime, p: Palette) -> tuple[Text, ...]:
    return gpu_cells(row, now, p) if isinstance(row, GpuRow) else host_cells(row, now, p)


def _ago(t: datetime | None, now: datetime) -> str:
    if t is None:
        return "never"
    s = max(0, int((now - t).total_seconds()))
    if s < 60:
        return f"{s}s ago"
    if s < 3600:
        return f"{s // 60}m ago"
    return iso(t) or "?"
