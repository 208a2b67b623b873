"""Table cells as ``rich.text.Text``: untrusted strings are cleaned and never parsed as markup.

``Text(...)`` takes its string literally, so a process called ``[bold red]x[/]`` shows as
exactly that; ``clean`` strips escape/control/bidi characters first.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime

from rich.cells import cell_len
from rich.text import Text

from gputop.model import GpuInfo
from gputop.reservations.ops import format_duration, left_text, size_text
from gputop.reservations.shares import holder_use_mib, room_mib
from gputop.text import clean, excerpt
from gputop.ui.board_rows import GpuRow, HostRow, Row, short_model

Columns = tuple[tuple[str, str, int | None], ...]
#: key, label, fixed width (None: as wide as its content). Wide terminals get everything.
COLUMNS: Columns = (
    ("gpu", "GPU", 22),
    ("util", "Util", 9),
    ("mem", "Memory", 14),  # "█████ 0.0/141G"
    ("users", "Users", 12),
    ("resv", "Reserved", 13),
    ("temp", "Temp", 4),
    ("power", "Power", 11),  # "1000W/1000W"
    ("flags", "Flags", None),
)
#: Below this many columns: temperature and power drop first (the details show them), the
#: rest narrows, so host, GPU, util, memory, users, reservation and flags fit 80 columns
#: without sideways scrolling. (At 120 the wide set leaves its flags 16 columns.)
WIDE_FROM = 120
NARROW: Columns = (
    ("gpu", "GPU", 18),  # " 0 H100 80GB HBM3": the index and a 14-character model
    ("util", "Util", 7),
    ("mem", "Memory", 11),  # "unreachable": an error's kind shows whole
    ("users", "Users", 10),
    ("resv", "Reserved", 10),
    ("flags", "Flags", None),
)


def columns_for(width: int) -> Columns:
    """The column set for a table this wide; the flags column takes what is left."""
    if width >= WIDE_FROM:
        return COLUMNS
    used = sum(w + 2 for _, _, w in NARROW if w is not None) + 2 + 1  # padding, scrollbar
    return (*NARROW[:-1], ("flags", "Flags", max(8, width - used)))


BLOCKS = " ▏▎▍▌▋▊▉█"
SHORT_FLAG_LABELS = {
    "unreserved-use": "⚠ unresvd",  # 11 columns at most: the flags column at 80
    "idle-reservation": "◌ idle resv",
    "idle-holder": "◔ idle hold",
    "lost": "✖ lost",
    "renumbered": "⚠ new index",
    "over-share": "▲ over share",
}
FLAG_LABELS = {
    "unreserved-use": "⚠ unreserved use",
    "idle-reservation": "◌ idle reservation",
    "idle-holder": "◔ idle holder",
    "lost": "✖ lost",
    "renumbered": "⚠ renumbered",
    "over-share": "▲ over its share",
}


@dataclass(frozen=True)
class Palette:
    free: str = "green"
    busy: str = "yellow"
    reserved: str = "magenta"
    error: str = "red"
    muted: str = "grey50"


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


def util_cell(g: GpuInfo, p: Palette, narrow: bool = False) -> Text:
    u = g.utilization_percent
    if u is None:
        return Text("  n/a", style=p.muted)
    t = bar(u / 100, 2 if narrow else 4, p.busy if u > 10 else p.free)
    t.append(f"{u:>4}%")
    return t


def mem_cell(g: GpuInfo, p: Palette, narrow: bool = False) -> Text:
    used, total = g.memory_used_mib, g.memory_total_mib
    frac = used / total if used is not None and total else None
    t = bar(frac, 2 if narrow else 5, p.busy if frac and frac > 0.05 else p.free)
    t.append(f" {gib(used)}/{gib(total)}G")
    return t


def short_bus(bus_id: str | None) -> str:
    """"00000000:07:00.0" -> "07:00.0": PCI domain 0 (nearly every machine's only one)
    goes, so a lost GPU's row names its bus whole at 80 columns (the details: in full)."""
    b = clean(bus_id) or "?"
    domain, sep, rest = b.partition(":")
    return rest if sep and domain.strip("0") == "" and rest else b


def power_text(g: GpuInfo) -> str:
    """"70W/700W": a unit on both (``70W/700`` read as two different things)."""
    if g.power_draw_w is None:
        return ""
    limit = "" if g.power_limit_w is None else f"/{g.power_limit_w:.0f}W"
    return f"{g.power_draw_w:.0f}W{limit}"


def fit(text: str, width: int) -> str:
    """``text`` in ``width`` columns, ending in ``…`` when it had to be cut (never cut
    silently: the details show it whole)."""
    if cell_len(text) <= width:
        return text
    t = Text(text)
    t.truncate(max(1, width), overflow="ellipsis")
    return t.plain


def time_left(r_expires: datetime, now: datetime) -> str:
    return format_duration(max(0.0, (r_expires - now).total_seconds()))


def share_cells(row: GpuRow, now: datetime, p: Palette, narrow: bool = False
                ) -> tuple[Text, ...]:
    """A share row, under its GPU: "share 30G", what the holder's processes use of it,
    the holder, the time left, the share's own flags."""
    r = row.share
    assert r is not None
    size = r.share_mib or 0
    used = holder_use_mib(row.gpu, r)
    label = Text("   ↳ ", style="bold")
    label.append(f"share {size_text(size)}", style=p.reserved)
    frac = used / size if size else None
    mem = bar(frac, 2 if narrow else 5, p.error if used > size else p.busy)
    mem.append(f" {gib(used)}/{gib(size)}G")
    labels = SHORT_FLAG_LABELS if narrow else FLAG_LABELS
    flags = Text(" ".join(labels.get(f, f) for f in row.flags),
                 style=p.error if row.flags else "")
    left = left_text(r, now)  # the user gives way, not the time
    room = ((NARROW if narrow else COLUMNS)[4][2] or 0) - len(left) - 1
    cells: tuple[Text, ...] = (label, Text(""), mem, Text(clean(r.user)),
                               Text(f"{fit(clean(r.user), room)} {left}", style=p.reserved))
    cells += (flags,) if narrow else (Text(""), Text(""), flags)
    if row.stale:
        for c in cells:
            c.stylize("dim")
    return cells


def gpu_cells(row: GpuRow, now: datetime, p: Palette, narrow: bool = False
              ) -> tuple[Text, ...]:
    if row.share is not None:
        return share_cells(row, now, p, narrow)
    g = row.gpu
    if row.reservation is not None or row.shares:
        label_style = p.reserved
    elif row.free:
        label_style = p.free
    else:
        label_style = ""
    idx = "?" if g.index is None else str(g.index)
    inst = row.instance
    if row.show_host:  # a sorted or flat view has no host headers: every row names it
        label = Text(f"{row.label} ", style="bold")
    elif inst is not None:  # a MIG instance, under its GPU: "/GI profile"
        label = Text(f"   /{inst.gpu_instance_id} ", style="bold")
    else:
        label = Text(f" {idx:>2} ", style="bold")
    mig = " MIG" if g.mig_mode == "Enabled" and inst is None else ""
    # The model is cut (with an ellipsis) before the MIG mark is: the mark says how to
    # read the rows under it, the details name the model whole.
    room = (NARROW if narrow else COLUMNS)[0][2] or 0
    room -= cell_len(label.plain) + len(mig)
    if inst is not None:
        label.append(fit(clean(inst.profile or "MIG instance"), room), style=label_style)
    else:
        label.append(fit(short_model(g.name) if not g.lost else f"lost {short_bus(g.bus_id)}",
                         room), style=label_style or (p.error if g.lost else ""))
    if mig:
        label.append(mig, style=p.muted)
    users = ",".join(row.users) or "—"
    resv = Text("—", style=p.muted)
    if row.reservation is not None:
        left = left_text(row.reservation, now)  # the user gives way, not the time
        room = ((NARROW if narrow else COLUMNS)[4][2] or 0) - len(left) - 1
        resv = Text(f"{fit(clean(row.reservation.user), room)} {left}", style=p.reserved)
    elif row.shares:  # the rows under it say who holds what; here: the unshared rest
        rest = (None if g.memory_total_mib is None else
                room_mib(g.memory_total_mib, row.shares))
        resv = Text(f"{'?' if rest is None else size_text(rest)} left", style=p.reserved)
    temp = Text("" if g.temperature_c is None or inst else f"{g.temperature_c}°")
    power = Text("" if inst else power_text(g))
    labels = SHORT_FLAG_LABELS if narrow else FLAG_LABELS
    flags = Text(" ".join(labels.get(f, f) for f in row.flags),
                 style=p.error if row.flags else "")
    cells: tuple[Text, ...] = (
        label, util_cell(g, p, narrow) if not g.lost else Text(""),
        mem_cell(g, p, narrow) if not g.lost else Text(""), Text(users), resv)
    cells += (flags,) if narrow else (temp, power, flags)
    if row.stale:
        for c in cells:
            c.stylize("dim")
    return cells


def gpu_count_text(gpus: int, instances: int) -> str:
    """"8 GPUs"; on a MIG host "2 GPUs, 4 MIG instances" (the rows under them are not more
    GPUs)."""
    t = f"{gpus} GPU" + ("s" if gpus != 1 else "")
    if instances:
        t += f", {instances} MIG instance" + ("s" if instances != 1 else "")
    return t


def host_cells(row: HostRow, now: datetime, p: Palette, narrow: bool = False
               ) -> tuple[Text, ...]:
    """A host's row. Its last cell spans the columns it does not fill (see
    ``BoardTable._render_row``): a host's count, tags and reason are not cut to one
    column's width, and what is cut ends in ``…`` (the details show it whole)."""
    name = clean(row.host)
    if row.snapshot is None:
        return (Text(f"… {name}", style=p.muted), Text("waiting", style=p.muted))
    if row.snapshot.error is not None and row.snapshot.error.kind == "starting":
        # nvidia-smi's loop is starting (seconds per GPU without persistence mode): no fault.
        return (Text(f"… {name}", style=p.muted), Text("starting", style=p.muted),
                Text(excerpt(row.snapshot.error.message, 160), style=p.muted))
    if row.error:
        err = row.snapshot.error
        assert err is not None
        reason = Text("never answered" if row.last_seen is None else
                      f"seen {_ago(row.last_seen, now)}", style=p.muted)
        reason.append("  ")
        reason.append(excerpt(err.message, 300), style=p.error)
        label = Text(f"✖ {name}", style=f"bold {p.error}")
        kind = Text(err.kind, style=f"bold {p.error}")
        return (label, Text("down", style=p.error), kind, reason)
    arrow = "▸" if row.collapsed else "▾"
    label = Text(f"{arrow} {name}", style="bold")
    rest = Text(gpu_count_text(row.gpu_count, row.instance_count), style=p.muted)
    if row.snapshot.tags:
        rest.append("  " + " ".join(clean(t) for t in row.snapshot.tags), style=p.muted)
    if row.stale:
        rest.append("  stale: seen " + _ago(row.last_seen, now), style=p.error)
    elif row.snapshot.warnings:  # e.g. two GPUs with one index: enter tells
        more = f" (+{len(row.snapshot.warnings) - 1})" if len(row.snapshot.warnings) > 1 else ""
        rest.append(f"  ⚠ {clean(row.snapshot.warnings[0])}{more}", style=p.busy)
    return (label, rest)


def row_cells(row: Row, now: datetime, p: Palette, narrow: bool = False) -> tuple[Text, ...]:
    if isinstance(row, GpuRow):
        return gpu_cells(row, now, p, narrow)
    return host_cells(row, now, p, narrow)


def _ago(t: datetime | None, now: datetime) -> str:
    if t is None:
        return "never"
    s = max(0, int((now - t).total_seconds()))
    if s < 60:
        return f"{s}s ago"
    if s < 3600:
        return f"{s // 60}m ago"
    if s < 2 * 86400:
        return f"{s // 3600}h ago"
    return f"{s // 86400}d ago"
