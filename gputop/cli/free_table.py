"""What ``gputop free`` prints: on a terminal a small table a person reads (which GPU, its
model, free memory, load, and whether it is free because you reserved it yourself); in a
pipe one ``HOST:GPU`` line per GPU, which scripts read and which never changes.

Kept apart from :mod:`gputop.cli.free` (which decides *what* is free) so either can change
alone. Names come from hosts and the shared file: cleaned, and cut by terminal cells.
"""

from __future__ import annotations

import os
import shutil
import sys
from collections.abc import Sequence
from datetime import datetime
from typing import TextIO

from gputop.cli.table import RESET, STYLE, cell_width, fit
from gputop.reservations.flags import (
    FreeGpu,
    instance_index,
    instance_reservation,
    reservation_index,
)
from gputop.reservations.ops import format_duration
from gputop.reservations.records import Reservation
from gputop.reservations.state import StoreState
from gputop.text import clean

HEADER = ("GPU", "MODEL", "FREE", "LOAD", "RESERVED")
RIGHT = {2, 3}
#: The narrowest the model column gets before the reservation column gives way.
MODEL_MIN = 10


def is_terminal(out: TextIO) -> bool:
    return out.isatty()


def yours(f: FreeGpu, state: StoreState | None, now: datetime) -> Reservation | None:
    """The reservation that makes ``f`` free to you: ``free`` lists your own reservations
    (nobody else's), so any reservation on it is yours."""
    held, inst_held = reservation_index(state, now), instance_index(state, now)
    if f.gpu.index is None:
        return None
    if f.instance is not None:
        return instance_reservation(held, inst_held, f.host, f.gpu, f.instance)
    return held.get((f.host, f.gpu.index))


def _model(f: FreeGpu) -> str:
    name = clean(f.gpu.name) or "?"
    if name.startswith("NVIDIA ") and len(name) > 7:
        name = name[len("NVIDIA "):]
    if f.instance is not None:
        name += f" {clean(f.instance.profile) or 'MIG'}"
    return name


def _free(f: FreeGpu) -> str:
    total = (f.instance or f.gpu).memory_total_mib
    of = "" if total is None else f" of {total / 1024:.0f}G"
    return f"{f.free_mib / 1024:.1f}G{of}"


def _load(f: FreeGpu) -> str:
    if f.instance is not None:
        return "n/a"  # NVML reports no utilisation per MIG instance
    u = f.gpu.utilization_percent
    return "?" if u is None else f"{u}%"


def _reserved(f: FreeGpu, r: Reservation | None, now: datetime) -> str:
    if r is None:
        return "-"
    left = format_duration(max(0.0, (r.expires - now).total_seconds()))
    whole = " (whole GPU)" if f.instance is not None and r.instance is None else ""
    return f"yours{whole}, {left} left"


def render(found: Sequence[FreeGpu], state: StoreState | None, now: datetime, *,
           width: int | None = None, color: bool = False) -> str:
    """The table: a header, then one line per free GPU or instance, best first."""
    rows = [[clean(f.label), _model(f), _free(f), _load(f), _reserved(f, yours(f, state, now), now)]
            for f in found]
    widths = [max(cell_width(r[i]) for r in [list(HEADER), *rows]) for i in range(len(HEADER))]
    if width is not None:
        excess = sum(widths) + 2 * (len(widths) - 1) - width
        cut = min(max(0, excess), max(0, widths[1] - MODEL_MIN))
        widths[1] -= cut
        widths[4] = max(1, widths[4] - max(0, excess - cut))
    lines = []
    for n, cells in enumerate([list(HEADER), *rows]):
        parts = []
        for i, text in enumerate(cells):
            cell = fit(text, widths[i])
            gap = " " * (widths[i] - cell_width(cell))
            cell = gap + cell if i in RIGHT else cell + (gap if i < len(cells) - 1 else "")
            if color and n and i == 4 and text != "-":
                cell = STYLE["reserved"] + cell + RESET
            elif color and n and i == 0:
                cell = STYLE["host"] + cell + RESET
            parts.append(cell)
        lines.append("  ".join(parts).rstrip())
    return "\n".join(lines) + "\n"


def print_free(found: Sequence[FreeGpu], state: StoreState | None, now: datetime,
               out: TextIO | None = None) -> None:
    """The table on a terminal (narrowed to it; colour unless NO_COLOR or a dumb
    terminal), else ``HOST:GPU`` lines; ``out`` defaults to ``sys.stdout`` as it is now."""
    out = out or sys.stdout
    if not is_terminal(out):
        for f in found:
            out.write(f"{f.label}\n")
        return
    color = not os.environ.get("NO_COLOR") and os.environ.get("TERM") != "dumb"
    out.write(render(found, state, now, width=shutil.get_terminal_size().columns,
                     color=color))
