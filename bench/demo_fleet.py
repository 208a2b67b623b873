"""The benchmarks' simulated fleet: ``hosts`` demo hosts (node0000, ...) of ``gpus`` H100s
each and their config. Imports gputop when called, so that a benchmark's ``--src`` (loaded by
:func:`bench.checkout.load_gputop` first) decides which checkout is timed."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from gputop.config.load import Config
    from gputop.sources.demo import DemoSource


def demo_fleet(hosts: int, gpus: int, reservations: Path) -> tuple[Config, list[DemoSource]]:
    """The config (interval 2 s, reservations at ``reservations``) and one source a host."""
    from gputop.config.load import Config
    from gputop.config.tables import Defaults, HostConfig, Reservations
    from gputop.sources.demo import DemoSource

    names = [f"node{i:04d}" for i in range(hosts)]
    sources = [DemoSource(n, "NVIDIA H100 80GB HBM3", gpus, 81559, 700.0) for n in names]
    cfg = Config(path=None, hosts=tuple(HostConfig(n) for n in names),
                 defaults=Defaults(interval=2.0, timeout=5.0),
                 reservations=Reservations(path=reservations))
    return cfg, sources
