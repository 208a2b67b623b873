"""Every source the poller is given implements the whole ``Source`` protocol: the poller
reads each member directly (no ``getattr`` with a default), so a source missing one would
stop its host's loop. mypy checks the classes statically where the app builds them
(``build_sources``, ``run_board``, the board's queue); this checks the objects themselves,
as the app builds them, and what the poller copies from them onto a snapshot."""

from __future__ import annotations

import asyncio
import inspect
from pathlib import Path

from gputop.config.load import Config
from gputop.config.tables import HostConfig, Reservations
from gputop.poller import Poller, build_sources
from gputop.sources import Source
from gputop.sources.demo import demo_sources
from gputop.ui.feed import BoardSource

#: What the protocol declares: its annotated attributes, properties and methods.
MEMBERS = sorted({n for n in vars(Source) if not n.startswith("_")}
                 | set(Source.__annotations__))


def the_sources(tmp_path: Path) -> list[Source]:
    """One of each kind, built as the app builds them (no host is contacted)."""

    async def build() -> list[Source]:
        cfg = Config(path=None, hosts=(HostConfig("remote", address="127.0.0.1"),
                                       HostConfig("here", local=True)),
                     reservations=Reservations(path=tmp_path / "r.json"))
        built, jumps = build_sources(cfg)
        assert jumps is not None
        await jumps.close()
        return built

    sources = asyncio.run(build())
    return [*sources, demo_sources()[0], BoardSource("board", lambda _name: None)]


def test_the_protocol_names_what_the_poller_reads() -> None:
    assert {"name", "kind", "connects", "warnings", "first_sample_s", "paced", "reset",
            "query", "close"} <= set(MEMBERS)


def test_every_source_has_every_member_of_the_protocol(tmp_path: Path) -> None:
    sources = the_sources(tmp_path)
    assert sorted(type(s).__name__ for s in sources) == [
        "BoardSource", "DemoSource", "NvmlSource", "SshSource"]
    for source in sources:
        missing = [m for m in MEMBERS if not hasattr(source, m)]
        assert not missing, f"{type(source).__name__} lacks {missing}"
        for m in ("reset", "query", "close"):
            assert callable(getattr(source, m)), (type(source).__name__, m)
        for m in ("query", "close"):
            assert inspect.iscoroutinefunction(getattr(source, m)), (type(source).__name__, m)
        assert isinstance(source.warnings, tuple) and isinstance(source.paced, bool)
        assert source.first_sample_s is None  # (no stream has started)
        source.reset()


def test_the_poller_takes_a_sources_members_as_they_are() -> None:
    """What a source says (its warnings, its stream's first sample) is on the snapshot."""
    source = demo_sources()[0]
    source.warnings = ("GPU index 0 twice",)
    source.first_sample_s = 1.5
    poller = Poller(Config(path=None, hosts=(HostConfig(source.name),)), [source])
    (snap,) = asyncio.run(poller.snapshot()).hosts
    assert snap.ok and snap.warnings == ("GPU index 0 twice",)
    assert snap.first_sample_s == 1.5
