"""A simulated fleet for ``gputop --demo``: realistic models, changing load, a host down.

The demo feeds the same poller and board as a real fleet; only the sources are simulated.
It writes its reservations to a temporary folder, never to the team's file, and removes
the folder when it ends (:func:`demo_session`).
"""

from __future__ import annotations

import contextlib
import random
import tempfile
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Literal

from gputop.config.load import Config
from gputop.config.tables import Defaults, History, HostConfig, Reservations
from gputop.model import GpuInfo, HostError, ProcessInfo, utcnow
from gputop.reservations.state import StoreState
from gputop.reservations.store import Store
from gputop.reservations.terms import Target, Terms, new_reservation

#: (host, model, GPU count, memory MiB, power limit W, tags)
FLEET = (
    ("atlas", "NVIDIA H100 80GB HBM3", 8, 81559, 700.0, ("h100", "training")),
    ("boreas", "NVIDIA A100-SXM4-80GB", 4, 81920, 400.0, ("a100",)),
    ("cirrus", "NVIDIA L40S", 4, 46068, 350.0, ("l40s", "inference")),
    ("dorado", "NVIDIA GeForce RTX 4090", 2, 24564, 450.0, ("rtx", "dev")),
    ("eridani", "Tesla V100-PCIE-32GB", 4, 32768, 250.0, ("v100",)),
    ("fornax", "NVIDIA H100 80GB HBM3", 8, 81559, 700.0, ("h100",)),
)
DOWN = "fornax"
USERS = ("amira", "bjorn", "chen", "dana", "emeka", "farah")
JOBS = ("python train.py --config configs/vit_l.yaml", "python -m torch.distributed.run "
        "--nproc_per_node 4 finetune.py", "jupyter-kernel --ip 0.0.0.0",
        "python eval.py --ckpt runs/42/best.pt", "vllm serve meta-llama/Llama-3-8B")


class DemoSource:
    """One simulated host; each query advances its own clock a step."""

    kind: Literal["demo"] = "demo"
    #: Not a stream, nothing odd to report, no backoff to forget (see ``Source``).
    warnings: tuple[str, ...] = ()
    first_sample_s: float | None = None
    paced = False

    def __init__(self, name: str, model: str, count: int, memory: int, power: float,
                 seed: int = 0) -> None:
        self.name = name
        self.connects = 0
        self._model, self._count, self._memory, self._power = model, count, memory, power
        self._rng = random.Random(f"{seed}:{name}")
        self._tick = 0
        self._jobs: dict[int, list[ProcessInfo]] = {}
        self._mig = "Disabled" if "A100" in model or "H100" in model else None
        self._static = [(i, f"GPU-demo-{name}-{i}", f"00000000:{i + 1:02X}:00.0")
                        for i in range(count)]
        self._idle = [self._gpu(static, 0, min(3, memory), ()) for static in self._static]
        for i in range(count):
            if self._rng.random() < 0.65:
                self._jobs[i] = [self._job(i)]

    def _job(self, gpu: int) -> ProcessInfo:
        r = self._rng
        return ProcessInfo(pid=r.randint(2000, 90000), user=r.choice(USERS),
                           command=r.choice(JOBS), gpu_memory_mib=r.randint(4000,
                                                                             self._memory - 2000),
                           elapsed_s=r.randint(60, 200000))

    def reset(self) -> None:
        """Nothing to forget: every query tries the host anew."""

    async def query(self) -> tuple[list[GpuInfo], HostError | None]:
        if self.name == DOWN:
            return [], HostError("unreachable", "connection refused")
        self._tick += 1
        r = self._rng
        if r.random() < 0.05 and self._jobs:  # a job ends now and then
            self._jobs.pop(r.choice(list(self._jobs)))
        elif r.random() < 0.05 and len(self._jobs) < self._count:
            gpu = r.choice([i for i in range(self._count) if i not in self._jobs])
            self._jobs[gpu] = [self._job(gpu)]
        # (Built with ``from_row`` and an idle GPU's row reused: the board's benchmarks
        # run a thousand of these, and what they measure is the board, not this.)
        gpus = []
        for i, static in enumerate(self._static):
            jobs = self._jobs.get(i)
            if not jobs:
                gpus.append(self._idle[i])
                continue
            procs = tuple(jobs)
            squatter = i == 1 and self.name == "boreas"  # memory held, no work
            util = 0 if squatter else int(60 + 35 * r.random())
            mem = min(sum(p.gpu_memory_mib or 0 for p in procs), self._memory)
            gpus.append(self._gpu(static, util, mem, procs))
        return gpus, None

    def _gpu(self, static: tuple[object, ...], util: int, mem: int,
             procs: tuple[ProcessInfo, ...]) -> GpuInfo:
        index, uuid, bus_id = static
        return GpuInfo.from_row((
            index, uuid, self._model, bus_id, util, util // 3, mem, self._memory,
            32 + util // 3, round(self._power * (0.1 + 0.8 * util / 100), 1), self._power,
            None, "P0" if util else "P8", self._mig, "550.90.07", None, False, None, procs))

    async def close(self) -> None:
        return None


def demo_config(reservations: Path, interval: float = 1.0) -> Config:
    # (Its history beside its reservations, never yours: a hub of the demo served the
    # real database's waste, beyond loopback where told to listen there.)
    return Config(path=None, defaults=Defaults(interval=interval, timeout=5.0,
                                               idle_holder_s=20.0),
                  hosts=tuple(HostConfig(name=n, tags=tags) for n, *_, tags in FLEET),
                  reservations=Reservations(path=reservations),
                  history=History(path=reservations.parent / "history.sqlite3"))


def demo_sources(seed: int = 0) -> list[DemoSource]:
    return [DemoSource(n, m, c, mem, p, seed) for n, m, c, mem, p, _ in FLEET]


def seed_reservations(store: Store) -> None:
    """A couple of teammates' reservations, so the board has some to show."""
    def change(state: StoreState, now: object) -> StoreState:
        t = utcnow()
        return StoreState(reservations=(
            new_reservation(Target("atlas", 3), Terms(
                3 * 3600, note="ablation sweep, please ask first", user="chen",
                machine="laptop-chen"), t),
            new_reservation(Target("cirrus", 0), Terms(
                2 * 3600, note="demo for the review on Friday", user="dana",
                machine="ws-dana"), t - timedelta(hours=1)),
        ))
    store.update(change)


@contextlib.contextmanager
def demo_session(interval: float = 1.0) -> Iterator[tuple[Config, list[DemoSource]]]:
    """The demo's config and sources, with seeded reservations in a temporary folder that
    is removed when the session ends (however the board or ``--json`` ended)."""
    with tempfile.TemporaryDirectory(prefix="gputop-demo-") as tmp:
        config = demo_config(Path(tmp) / "reservations.json", interval)
        seed_reservations(Store(config.reservations.path))
        yield config, demo_sources()
