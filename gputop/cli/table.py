"""The one-shot, human-readable table (``gputop --once``, and ``gputop`` into a pipe).

One line per GPU, like ``gpustat``: host, index, model, load, memory, users, reservation and
flags; a MIG instance has a line of its own under its GPU (its holder on it); a failed host
is one line with its error, then one per reservation on it (from the shared file: a down
host reports no GPU to hang them on). The fleet's summary (``summary.fleet_summary``, the
one every reader shows) is the last line. Every string from elsewhere goes through
:func:`gputop.text.clean`, and widths are counted in terminal cells (a wide or zero-width
character cannot shift the columns). Colour is the caller's choice (a terminal only).
"""

from __future__ import annotations

import unicodedata
from collections.abc import Sequence
from datetime import datetime
from typing import Any

from gputop.model import FleetSnapshot, GpuInfo, HostSnapshot, MigInstance
from gputop.reservations.flags import (
    IdleTracker,
    gpu_flags,
    instance_index,
    instance_reservation,
    instance_view,
    is_free,
    reservation_index,
    share_flags,
    unshared_mib,
)
from gputop.reservations.ops import format_duration, left_text, size_text
from gputop.reservations.records import Reservation
from gputop.reservations.shares import holder_use_mib, share_index
from gputop.reservations.state import StoreState
from gputop.reservations.summary import CLASSES, INSTANCE_CLASSES, fleet_summary
from gputop.text import clean

HEADER = ("HOST", "GPU", "MODEL", "UTIL", "MEMORY", "USERS", "RESERVED", "FLAGS")
RIGHT = {1, 3, 4}
#: Columns given up first when the line is too wide, with the narrowest they get.
SHRINK = ((2, 8), (5, 6), (6, 8), (7, 6), (0, 6))
#: Then, on a very narrow terminal: flags, reservation and users go, the rest gets tight.
LAST_RESORT = ((7, 0), (6, 0), (5, 0), (2, 3), (0, 3))

RESET = "\x1b[0m"
STYLE = {"host": "\x1b[1m", "free": "\x1b[32m", "busy": "\x1b[33m", "hot": "\x1b[31m",
         "reserved": "\x1b[35m", "flag": "\x1b[1;31m", "error": "\x1b[31m", "dim": "\x1b[2m"}


def cell_width(text: str) -> int:
    """Terminal cells: East Asian wide characters take two, combining/format ones none."""
    w = 0
    for ch in text:
        if unicodedata.combining(ch) or unicodedata.category(ch) in ("Mn", "Me", "Cf"):
            continue
        w += 2 if unicodedata.east_asian_width(ch) in ("W", "F") else 1
    return w


def fit(text: str, width: int) -> str:
    """``text`` cut to ``width`` cells, with an ellipsis when cut."""
    if cell_width(text) <= width:
        return text
    out, used = "", 0
    for ch in text:
        w = cell_width(ch)
        if used + w > width - 1:
            break
        out, used = out + ch, used + w
    return out + "…" if width > 0 else ""


def _pad(text: str, width: int, right: bool) -> str:
    gap = " " * max(0, width - cell_width(text))
    return gap + text if right else text + gap


def _model(name: str | None) -> str:
    t = clean(name) or "?"
    return t[len("NVIDIA "):] if t.startswith("NVIDIA ") and len(t) > 7 else t


def _memory(g: GpuInfo) -> str:
    if g.memory_total_mib is None:
        return "?" if g.memory_used_mib is None else f"{g.memory_used_mib / 1024:.1f}G/?"
    used = "?" if g.memory_used_mib is None else f"{g.memory_used_mib / 1024:.1f}"
    return f"{used}/{g.memory_total_mib / 1024:.0f}G"


def _reserved(r: Reservation | None, now: datetime) -> str:
    if r is None:
        return "-"
    return f"{clean(r.user)} {left_text(r, now)}"


def _ago(host: HostSnapshot, now: datetime) -> str:
    if host.last_ok is None:
        return "never answered"
    return f"last ok {format_duration(max(0.0, (now - host.last_ok).total_seconds()))} ago"


Row = tuple[list[str], list[str]]  # (cells, styles)


def _rows(snapshot: FleetSnapshot, state: StoreState | None, tracker: IdleTracker | None,
          now: datetime) -> tuple[list[Row], list[tuple[str, str]]]:
    held = reservation_index(state, now)
    inst_held = instance_index(state, now)
    shared = share_index(state, now)
    rows: list[Row] = []
    errors: list[tuple[str, str]] = []  # placed after the GPU lines' widths are known
    for host in snapshot.hosts:
        name = clean(host.name)
        if host.error is not None:
            rows.append(([name], ["error"]))
            message, ago = clean(host.error.message), _ago(host, now)
            # (one pair of brackets: a message may end in its own, "(waiting to retry)")
            text = (f"{message[:-1]}; {ago})" if message.endswith(")") and "(" in message
                    else f"{message} ({ago})")
            errors.append((name, f"{host.error.kind}: {text}"))
            rows.extend(_down_rows(host.name, state, now))
            continue
        if not host.gpus:
            rows.append(([name], ["dim"]))
            errors.append((name, "no GPUs"))
            continue
        for g in host.gpus:
            sh = shared.get((host.name, g.index)) if shared and g.index is not None else None
            if sh:
                rows.extend(_shared_rows(name, host.name, g, sh, tracker, now))
                continue
            r = held.get((host.name, g.index)) if g.index is not None else None
            idle = tracker.is_idle_holder(host.name, g.index, now) if tracker else False
            unused = (r is not None and tracker is not None
                      and tracker.reservation_idle(host.name, g, r, now))
            flags = ",".join(gpu_flags(g, r, idle, unused))
            util = "?" if g.utilization_percent is None else f"{g.utilization_percent}%"
            load = ("free" if is_free(g) else "dim" if g.utilization_percent is None
                    else "busy" if g.utilization_percent < 80 else "hot")
            users = ",".join(clean(u) for u in g.users) or "-"
            idx = "?" if g.index is None else str(g.index)
            rows.append(([name, idx, _model(g.name), util, _memory(g), users, _reserved(r, now),
                          flags], ["host", "", "", load, "", "", "reserved" if r else "",
                                   "flag"]))
            for inst in g.instances:
                rows.append(_instance_row(host.name, g, inst, held, inst_held, tracker, now))
    return rows, errors


def _instance_row(host: str, g: GpuInfo, inst: MigInstance,
                  held: dict[tuple[str, int], Reservation],
                  inst_held: dict[tuple[str, int, int], Reservation],
                  tracker: IdleTracker | None, now: datetime) -> Row:
    """A MIG instance's line under its GPU: its profile, memory, users and holder (its own
    reservation, else its GPU's)."""
    view = instance_view(g, inst)
    r = instance_reservation(held, inst_held, host, g, inst)
    unused = (r is not None and tracker is not None
              and tracker.reservation_idle(host, view, r, now))
    gi = "?" if inst.gpu_instance_id is None else str(inst.gpu_instance_id)
    users = ",".join(clean(u) for u in view.users) or "-"
    return (["", f"/{gi}", clean(inst.profile) or "MIG", "", _memory(view), users,
             _reserved(r, now), ",".join(gpu_flags(view, r, False, unused))],
            ["", "", "dim", "", "", "", "reserved" if r else "", "flag"])


def _down_rows(host: str, state: StoreState | None, now: datetime) -> list[Row]:
    """A host in error: every active reservation on it, one line each, under its error."""
    if state is None:
        return []
    out: list[Row] = []
    for r in state.active(now):
        if r.host != host:
            continue
        what = (f"/{r.instance}" if r.instance is not None
                else f"share {size_text(r.share_mib)}" if r.share_mib is not None else "")
        out.append((["", str(r.gpu), what, "", "", "", _reserved(r, now), ""],
                    ["", "", "dim", "", "", "", "reserved", ""]))
    return out


def summary_line(summary: dict[str, Any]) -> str:
    """The document's ``summary`` in one line: hosts, then whole GPUs by class (a class
    with none left out, but free, busy and reserved), then MIG instances."""
    hosts, gpus, insts = summary["hosts"], summary["gpus"], summary["instances"]
    parts = [f"{hosts['up']} up"] + [f"{hosts[k]} {k}" for k in ("down", "waiting") if hosts[k]]
    classes = [f"{gpus[c]} {c}" for c in CLASSES
               if gpus[c] or c in ("free", "busy", "reserved")]
    line = f"{' · '.join(parts)} | {' · '.join(classes)} of {gpus['total']} GPUs"
    if insts["total"]:
        line += (" | MIG: " + " · ".join(f"{insts[c]} {c}" for c in INSTANCE_CLASSES
                                         if insts[c]) + f" of {insts['total']}")
    return line


def _shared_rows(name: str, host: str, g: GpuInfo, shares: tuple[Reservation, ...],
                 tracker: IdleTracker | None, now: datetime) -> list[Row]:
    """A shared GPU: its line (the unshared rest where the reservation goes), then one
    line per share: holder, what their processes use of the share, time left, flags."""
    flags, per = share_flags(host, g, shares, tracker, now)
    util = "?" if g.utilization_percent is None else f"{g.utilization_percent}%"
    rest = unshared_mib(g, shares)
    users = ",".join(clean(u) for u in g.users) or "-"
    idx = "?" if g.index is None else str(g.index)
    out: list[Row] = [([name, idx, _model(g.name), util, _memory(g), users,
                        f"shared, {'?' if rest is None else size_text(rest)} unshared",
                        ",".join(flags)], ["host", "", "", "busy", "", "", "reserved", "flag"])]
    for r, f in zip(shares, per):
        used = holder_use_mib(g, r)
        out.append((["", "", "share", "", f"{used / 1024:.1f}/{size_text(r.share_mib or 0)}",
                     clean(r.user),
                     f"{clean(r.user)} {left_text(r, now)}",
                     ",".join(f)], ["", "", "dim", "", "", "", "reserved", "flag"]))
    return out


def render(snapshot: FleetSnapshot, state: StoreState | None = None, *,
           tracker: IdleTracker | None = None, width: int | None = None,
           color: bool = False, now: datetime | None = None) -> str:
    """The table as text, one line per GPU (a header first); ``width`` None: no limit."""
    now = now or snapshot.time
    rows, errors = _rows(snapshot, state, tracker, now)
    gpu_rows = [cells for cells, _ in rows if len(cells) == len(HEADER)]
    widths = [max(cell_width(c[i]) for c in [list(HEADER), *gpu_rows]) for i in
              range(len(HEADER))]
    if errors:  # a host that failed is named in full too: it is what the reader looks for
        widths[0] = max(widths[0], *(cell_width(h) for h, _ in errors))
    if not any(row[7] for row in gpu_rows):
        widths[7] = 0
    if width is not None:
        _shrink(widths, width)
    lines = [_line(list(HEADER), [""] * len(HEADER), widths, False)]
    err = iter(errors)
    for cells, styles in rows:
        if len(cells) == 1:
            host, message = next(err)
            head = _pad(fit(host, widths[0]), widths[0], False)
            text = fit(message, width - widths[0] - 2) if width is not None else message
            if color:
                head = STYLE["host"] + head + RESET
                text = STYLE[styles[0]] + text + RESET
            lines.append(f"{head}  {text}")
            continue
        lines.append(_line(cells, styles, widths, color))
    text = summary_line(fleet_summary(snapshot.hosts, state, now))
    lines.append(fit(text, width) if width is not None else text)
    return "\n".join(line.rstrip() for line in lines) + "\n"


def _shrink(widths: list[int], limit: int) -> None:
    """Narrow the columns, least useful first, until the line fits ``limit`` cells."""
    def total() -> int:
        shown = [w for w in widths if w]
        return sum(shown) + 2 * (len(shown) - 1)

    for floors in (SHRINK, LAST_RESORT):
        for i, floor in floors:
            excess = total() - limit
            if excess <= 0:
                return
            widths[i] = max(min(widths[i], floor), widths[i] - excess)


def _line(cells: Sequence[str], styles: Sequence[str], widths: Sequence[int],
          color: bool) -> str:
    parts = []
    last = max(i for i, w in enumerate(widths) if w)
    for i, (text, style) in enumerate(zip(cells, styles)):
        if not widths[i]:
            continue
        cell = fit(text, widths[i])
        if i != last or i in RIGHT:
            cell = _pad(cell, widths[i], i in RIGHT)
        if color and style:
            cell = STYLE[style] + cell + RESET
        parts.append(cell)
    return "  ".join(parts)
