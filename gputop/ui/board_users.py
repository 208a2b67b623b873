"""The per-user view's records: who holds how many GPUs across the fleet and what they run.

Apart from the board model's rows: worked out only when someone opens the view, from the
hosts' answers and the shared file, never in the per-frame pass."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from datetime import datetime

from gputop.model import HostSnapshot
from gputop.reservations.state import StoreState
from gputop.text import clean
from gputop.ui.board_rows import UserLoad


def user_loads(host_order: Iterable[str], snapshots: Mapping[str, HostSnapshot],
               state: StoreState, now: datetime) -> list[UserLoad]:
    """Who holds how many GPUs across the fleet (running processes or reservations active
    at ``now``) and what they run: most GPUs first."""
    loads: dict[str, UserLoad] = {}
    for host in host_order:
        snap = snapshots.get(host)
        if snap is None or not snap.ok:
            continue
        # A pid seen again is the same process: once per GPU for its memory, once per
        # host for the count (one process on two GPUs is one process).
        pids: set[int] = set()
        for g in snap.gpus:
            label = f"{clean(host)}:{'?' if g.index is None else g.index}"
            on_gpu: set[int] = set()
            for p in g.processes:
                if p.pid in on_gpu:
                    continue
                on_gpu.add(p.pid)
                load = loads.setdefault(clean(p.user) or "?", UserLoad(clean(p.user) or "?"))
                if label not in load.running:
                    load.running.append(label)
                load.memory_mib += p.gpu_memory_mib or 0
                if p.pid in pids:
                    continue
                pids.add(p.pid)
                load.processes += 1
                cmd = clean(p.command or "?").split(" ", 1)
                name = cmd[0].rsplit("/", 1)[-1] + (" " + cmd[1] if len(cmd) > 1 else "")
                load.commands[name] = load.commands.get(name, 0) + 1
    for r in state.active(now):
        user = clean(r.user)
        loads.setdefault(user, UserLoad(user)).reserved.append(clean(r.target))
    return sorted(loads.values(), key=lambda u: (-u.gpus, u.user))
