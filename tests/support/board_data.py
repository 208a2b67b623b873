"""A fixed fleet for the board's tests: real captures through the real parser, fixed clock.

Nothing here fakes the UI: the GPUs are what ``parse_remote_output`` makes of real
nvidia-smi output (tests/data), the reservations are written through the real store.
"""

from __future__ import annotations

from dataclasses import replace
from datetime import datetime, timedelta, timezone
from pathlib import Path

from gputop.config.load import Config
from gputop.config.tables import Defaults, History, HostConfig, Reservations
from gputop.model import GpuInfo, HostError, HostSnapshot, ProcessInfo
from gputop.reservations.state import StoreState
from gputop.reservations.store import Store
from gputop.reservations.terms import Target, Terms, new_reservation
from gputop.sources.nvidia_smi import GPU_QUERY, parse_remote_output
from gputop.sources.protocol import frame
from tests.support.fleet import CAPTURES, project_capture

# In the future, so the store (which prunes by the wall clock) keeps the seeded reservations.
NOW = datetime(2030, 6, 1, 12, 0, 0, tzinfo=timezone.utc)
HOSTILE_USER = "[red]x[/]\x1b]0;pwned\x07"  # no blanks: ps prints one word
HOSTILE_CMD = "python [link=http://evil]click[/link] \x1b[2J\u202etxt.exe"


def gpus_from(captures: list[str], procs: dict[int, list[tuple[int, str, int, str]]]
              ) -> list[GpuInfo]:
    """Rows from real captures, renumbered like a multi-GPU host, with processes by
    (pid, user, MiB, command) attached through the real parser."""
    rows, apps, owners, args = [], [], [], []
    for i, cap in enumerate(captures):
        cells = project_capture(CAPTURES[cap], GPU_QUERY).rstrip("\n").split(", ")
        cells[2], cells[3] = str(i), f"GPU-{i:08d}-test"  # after timestamp, count
        rows.append(", ".join(cells))
        for pid, user, mib, cmd in procs.get(i, []):
            apps.append(f"2026/07/14 08:12:53.500, GPU-{i:08d}-test, {pid}, {mib}")
            owners.append(f"{pid} {user} 01:02:03")
            args.append(f"{pid} {cmd}")
    lines = frame("0" * 32, gpu=("\n".join(rows), 0), apps=("\n".join(apps), 0),
                  owners=("\n".join(owners), 0), args=("\n".join(args), 0))
    result = parse_remote_output(lines, "0" * 32)
    assert result.error is None, result.error
    return result.gpus


def fixed_snapshots(now: datetime = NOW) -> list[HostSnapshot]:
    h100 = gpus_from(["h100", "h100", "h100", "h100"], {
        0: [(4242, "alice", 19000, "python train.py --model vit-l --epochs 90")],
        1: [(4300, "bob", 30000, "python -m torch.distributed.run finetune.py")],
        3: [(4400, HOSTILE_USER, 512, HOSTILE_CMD)],
    })
    h100[2] = replace(h100[2], utilization_percent=0, memory_used_mib=0,
                      memory_utilization_percent=0)
    mixed = gpus_from(["l40s", "rtx2080", "h100-mig"], {
        2: [(5000, "carol", 11000, "vllm serve model")],
    })
    mixed[0] = replace(mixed[0], utilization_percent=0)
    return [
        HostSnapshot(name="gpu-h100", time=now - timedelta(seconds=1), gpus=tuple(h100),
                     last_ok=now, tags=("h100", "training")),
        HostSnapshot(name="gpu-mixed", time=now - timedelta(seconds=1), gpus=tuple(mixed),
                     last_ok=now, tags=("dev",)),
        HostSnapshot(name="gpu-down", time=now, error=HostError(
            "unreachable", "connection refused"), last_ok=now - timedelta(minutes=7)),
        HostSnapshot(name="gpu-stale", time=now - timedelta(minutes=5), gpus=(GpuInfo(
            index=0, name="Tesla V100-PCIE-32GB", utilization_percent=50, memory_used_mib=9000,
            memory_total_mib=32768, processes=(ProcessInfo(77, "dave", "python old.py", 9000,
                                                           60),)),),
            last_ok=now - timedelta(minutes=5)),
    ]


def board_config(tmp: Path) -> Config:
    return Config(path=None, hosts=tuple(HostConfig(name=n) for n in
                                         ("gpu-h100", "gpu-mixed", "gpu-down", "gpu-stale")),
                  defaults=Defaults(interval=2.0, timeout=3.0),
                  reservations=Reservations(path=tmp / "reservations.json"),
                  history=History(path=tmp / "history.sqlite3"))


def seed(store: Store, now: datetime = NOW) -> None:
    def change(state: StoreState, _now: datetime) -> StoreState:
        return StoreState(reservations=(
            new_reservation(
                Target("gpu-h100", 1),
                Terms(4 * 3600, note="ablation [i]sweep[/i]", user="bob", machine="ws-bob"),
                now - timedelta(hours=1)),
            # Made 30 min ago, unused: past the idle-reservation grace period (15 min).
            new_reservation(
                Target("gpu-mixed", 1), Terms(120 * 60, user="erin", machine="ws-erin"),
                now - timedelta(minutes=30)),
        ))
    store.update(change)
