"""The paced event loop (gputop.pacing): fewer wake-ups for the same data, none delayed that
is ready, and an unpaced one that is asyncio's own."""

from __future__ import annotations

import asyncio
import socket
import threading
import time

import pytest

from gputop import pacing

#: The writer thread's sleep: the tests that watch pacing's own sleeps patch time.sleep.
_sleep = time.sleep


def _feed(sock: socket.socket, count: int, gap: float) -> threading.Thread:
    def run() -> None:
        for _ in range(count):
            sock.send(b"x")
            _sleep(gap)
    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


async def _read_all(sock: socket.socket, count: int, pace: float) -> int:
    """Wake-ups it took to read ``count`` bytes written 2.5 ms apart."""
    assert pacing.set_pace(pace)
    loop = asyncio.get_running_loop()
    got, wakes = [0], [0]
    done = loop.create_future()

    def readable() -> None:
        wakes[0] += 1
        got[0] += len(sock.recv(65536))
        if got[0] >= count and not done.done():
            done.set_result(None)

    sock.setblocking(False)
    loop.add_reader(sock.fileno(), readable)
    try:
        await asyncio.wait_for(done, 30)
    finally:
        loop.remove_reader(sock.fileno())
    return wakes[0]


def test_a_paced_loop_reads_everything_in_few_wakeups() -> None:
    a, b = socket.socketpair()
    with a, b:
        writer = _feed(a, 200, 0.0025)  # ~0.5 s of 400 small writes a second
        wakes = pacing.run_paced(_read_all(b, 200, 0.1))
        writer.join()
    # At most one wake-up per pace (0.5 s or more of writes: about 5, whatever the load).
    assert wakes <= int(0.5 / 0.1) + 8, wakes


def test_an_unpaced_loop_never_sleeps(monkeypatch: pytest.MonkeyPatch) -> None:
    slept: list[float] = []
    monkeypatch.setattr(time, "sleep", slept.append)
    a, b = socket.socketpair()
    with a, b:
        writer = _feed(a, 50, 0.002)
        pacing.run_paced(_read_all(b, 50, 0.0))
        writer.join()
    assert slept == []


def test_ready_work_is_never_delayed_by_the_pace(monkeypatch: pytest.MonkeyPatch) -> None:
    """A chain of ready callbacks polls with a zero timeout: no sleep, however long the
    pace (here an hour)."""
    slept: list[float] = []
    monkeypatch.setattr(time, "sleep", slept.append)

    async def chain() -> int:
        assert pacing.set_pace(3600)
        hops = 0
        for _ in range(200):
            await asyncio.sleep(0)
            hops += 1
        return hops

    assert pacing.run_paced(chain()) == 200
    assert slept == []


def test_a_timer_fires_at_most_one_pace_late() -> None:
    async def late() -> float:
        assert pacing.set_pace(0.2)
        await asyncio.sleep(0)  # a first poll: the pace counts from here
        t = time.monotonic()
        await asyncio.sleep(0.05)
        return time.monotonic() - t

    # (An upper bound only: sleeping longer than asked is what pacing does, up to a pace.)
    assert 0.05 <= pacing.run_paced(late()) < 5.0


def test_set_pace_outside_a_paced_loop_changes_nothing() -> None:
    async def plain() -> bool:
        return pacing.set_pace(0.05)

    assert asyncio.run(plain()) is False


def test_run_paced_cancels_what_main_left_running() -> None:
    cancelled: list[bool] = []

    async def main() -> str:
        async def forever() -> None:
            try:
                await asyncio.sleep(3600)
            except asyncio.CancelledError:
                cancelled.append(True)
                raise
        asyncio.get_running_loop().create_task(forever())
        await asyncio.sleep(0)
        return "done"

    assert pacing.run_paced(main()) == "done"
    assert cancelled == [True]
