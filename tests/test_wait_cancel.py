"""A waiter cancelled the way the MCP SDK cancels an abandoned tool call leaves the queue
at once. The SDK cancels the handler's anyio scope, and an anyio scope cancels its task
again at every await until the task returns: a cleanup awaited in place stopped at its
first await and left the place in the file until its lease ran out (seen in CI as
test_mcp's "the agent's waiter never left", when the join's thread answered late on a
loaded machine). In-process, on a simulated host (a real source, no SSH)."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import anyio
import pytest

from gputop.config.load import Config
from gputop.config.tables import Defaults, HostConfig, Reservations
from gputop.jobs.wait import run_to_end, wait_for_gpus
from gputop.poller import Poller
from gputop.reservations.ops import Target, reserve
from gputop.reservations.queue import Queue, Request
from gputop.reservations.store import Store
from gputop.sources.demo import DemoSource


@pytest.mark.parametrize("late", [0.0, 0.5])
async def test_an_abandoned_wait_leaves_the_queue_under_an_anyio_cancel(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, late: float) -> None:
    """``late``: the join's thread answers this long after its write landed (0: at once)."""
    cfg = Config(path=None, hosts=(HostConfig(name="solo"),),
                 defaults=Defaults(interval=0.5, timeout=5.0),
                 reservations=Reservations(path=tmp_path / "res.json"))
    store = Store(cfg.reservations.path)
    reserve(store, [Target("solo", 0), Target("solo", 1)], seconds=3600,
            max_seconds=86400, user="teammate")
    real_join = Queue.join

    def slow_join(self: Queue) -> int:
        pos = real_join(self)
        time.sleep(late)
        return pos

    monkeypatch.setattr(Queue, "join", slow_join)
    poller = Poller(cfg, [DemoSource("solo", "NVIDIA H100 80GB HBM3", 2, 81559, 700.0)])
    scopes: list[anyio.CancelScope] = []

    async def waiter() -> None:
        with anyio.CancelScope() as scope:
            scopes.append(scope)
            await wait_for_gpus(cfg, store, Request(1, 0, ("solo",)), seconds=600,
                                lease_s=300, max_wait=120, say=lambda m: None, poller=poller)

    try:
        task = asyncio.create_task(waiter())
        deadline = time.monotonic() + 20
        while not store.read().queue:
            assert not task.done(), task.result()
            assert time.monotonic() < deadline, "the waiter never joined"
            await asyncio.sleep(0.01)
        scopes[0].cancel()
        await asyncio.wait_for(task, 15)
        assert store.read().queue == ()
        assert [r.user for r in store.read().reservations] == ["teammate", "teammate"]
    finally:
        await poller.aclose()


async def test_run_to_end_finishes_its_cleanup_then_passes_the_cancel_on() -> None:
    steps: list[str] = []

    async def cleanup() -> None:
        for i in range(5):
            await asyncio.sleep(0.01)
            steps.append(f"step {i}")

    async def cancelled_often() -> None:
        with anyio.CancelScope() as scope:
            scope.cancel()
            try:
                await asyncio.sleep(10)
            finally:
                await run_to_end(cleanup())
                steps.append("not reached: the cancel goes on")

    await cancelled_often()
    assert steps == [f"step {i}" for i in range(5)]

    async def failing() -> None:
        raise OSError("the store's disk went away")

    with pytest.raises(OSError, match="disk went away"):
        await run_to_end(failing())


async def test_a_waiter_with_no_hosts_in_its_file_is_refused_before_joining(
        tmp_path: Path) -> None:
    """A board reading a hub with no [[hosts]]: its Q joined the queue and was granted a
    hub host that nothing here checks, which `release HOST:GPU` then refused as unknown.
    Refused before joining, as free --wait is."""
    from gputop.reservations.ops import Invalid

    cfg = Config(path=None, hosts=(), defaults=Defaults(interval=0.5, timeout=5.0),
                 reservations=Reservations(path=tmp_path / "res.json"))
    store = Store(cfg.reservations.path)
    poller = Poller(cfg, [DemoSource("solo", "NVIDIA H100 80GB HBM3", 2, 81559, 700.0)])
    try:
        with pytest.raises(Invalid, match="each host you reserve on must be in your hosts "
                                          "file, also with a hub"):
            await wait_for_gpus(cfg, store, Request(1), seconds=600, lease_s=300,
                                max_wait=5, say=lambda m: None, poller=poller)
    finally:
        await poller.aclose()
    assert store.read().queue == () and store.read().reservations == ()
