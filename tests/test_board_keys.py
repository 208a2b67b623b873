"""Keys first at fleet scale: the filter's per-host memo and pruning keep exactly
the rows the rule keeps while typing and deleting; a key holds the feed thread, the drain
and the board's own garbage collection for a moment, and the hold is bounded.

(Latency itself is measured by bench/board_scale.py keys, not asserted here.)
"""

from __future__ import annotations

import asyncio
import gc
import time
from datetime import timedelta
from pathlib import Path

import pytest

from gputop.config.load import Config
from gputop.config.tables import Defaults, HostConfig, Reservations
from gputop.model import HostSnapshot, utcnow
from gputop.poller import Poller
from gputop.reservations.state import StoreState
from gputop.reservations.terms import Target, Terms, new_reservation
from gputop.sources.demo import DemoSource
from gputop.ui import feed as feed_module
from gputop.ui import intake as intake_module
from gputop.ui.app import GputopApp
from gputop.ui.board_model import BoardModel, SortMode
from gputop.ui.board_rows import GpuRow, HostRow

MODELS = ("NVIDIA H100 80GB HBM3", "NVIDIA A100-SXM4-80GB", "NVIDIA L40S")


def _fleet(n: int) -> list[DemoSource]:
    return [DemoSource(f"node{i:02d}", MODELS[i % 3], 4, 81559, 700.0, seed=i)
            for i in range(n)]


async def _answer(model: BoardModel, sources: list[DemoSource]) -> None:
    for s in sources:
        gpus, err = await s.query()
        model.ingest(HostSnapshot(name=s.name, gpus=tuple(gpus), error=err,
                                  tags=("h100",) if "H100" in s._model else ()))


def _by_rule(model: BoardModel) -> list[GpuRow]:
    """The GPU rows the filter keeps, by the rule itself: the unfiltered board's GPU rows
    (a fresh model: no memo) whose words (host, tags, model, users, holders) hold every
    term, and with free-only those that are free, in the unfiltered board's order."""
    whole = BoardModel(host_order=list(model.host_order), clock=model.clock, me=model.me)
    whole.snapshots, whole.last_good = model.snapshots, model.last_good
    whole.state, whole.sort_mode, whole.collapsed = model.state, model.sort_mode, model.collapsed
    terms = model.filter_text.lower().split()
    out = []
    for row in whole.rows():
        if not isinstance(row, GpuRow) or (model.free_only and not row.free):
            continue
        holders = [r.user for r in (row.reservation, row.share, *row.shares) if r]
        words = [row.host, *model.snapshots[row.host].tags, row.gpu.name or "",
                 *row.gpu.users, *holders]
        if all(any(t in w.lower() for w in words) for t in terms):
            out.append(row)
    return out


def _check_rule(model: BoardModel) -> list[GpuRow]:
    """The board shows the rule's GPU rows, under a header for each of their hosts when
    grouped by host (every host here answers)."""
    shown, kept = model.rows(), _by_rule(model)
    assert [r.key for r in shown if isinstance(r, GpuRow)] == [r.key for r in kept], (
        model.sort_mode, model.free_only, model.filter_text)
    heads = [r.host for r in shown if isinstance(r, HostRow)]
    assert heads == (list(dict.fromkeys(r.host for r in kept)) if model.sort_mode == "host"
                     else [])
    return kept


async def test_typing_and_deleting_keeps_exactly_the_rows_of_the_rule() -> None:
    """Type a filter a key at a time (each step narrows: the memo's refinement path), delete
    it (each step widens: a full look), hosts answering in between (new rows, memo gone),
    with free-only and every sort order: the rows are those of the rule each time."""
    sources = _fleet(24)
    now = utcnow()
    model = BoardModel(host_order=[s.name for s in sources], clock=utcnow, me="amira")
    model.set_state(StoreState(reservations=(
        new_reservation(
            Target("node03", 1), Terms(3600, user="chen", machine="m"), now - timedelta(minutes=1)),
        new_reservation(
            Target("node07", 0), Terms(3600, user="amira", machine="m"),
            now - timedelta(minutes=1)))))
    await _answer(model, sources)
    typed = ["n", "no", "node", "node0", "node07", "node07 a", "node07 am", "node07 ami"]
    words = ["h", "h1", "h10", "h100", "h100 c", "h100 ch", "h100 che", "h100 chen"]
    sorts: tuple[SortMode, ...] = ("host", "utilization", "free-memory")
    for sort in sorts:
        model.sort_mode = sort
        for free_only in (False, True):
            model.free_only = free_only
            for seq in (typed, words, ["a100", "l40s"]):
                for i, text in enumerate([*seq, *reversed(seq[:-1]), ""]):
                    model.filter_text = text
                    if i % 3 == 2:  # some hosts answer between two keys
                        await _answer(model, sources[i % 5::4])
                    _check_rule(model)
    model.sort_mode, model.free_only, model.filter_text = "host", False, "node07 chen"
    assert [r.key for r in model.rows()] == []  # chen holds node03:1, not node07
    model.filter_text = "node03 chen"
    assert _check_rule(model) != []


async def test_a_hold_is_bounded_and_the_feed_then_runs() -> None:
    """The feed waits while the board holds it, never longer than MAX_HOLD_S in a row,
    and then runs MIN_RUN_S before it honours a hold again."""
    cfg = Config(path=None, hosts=(HostConfig("node00"),),
                 defaults=Defaults(interval=2.0, timeout=5.0),
                 reservations=Reservations(path=Path("/nonexistent/r.json")))
    thread = feed_module.FeedThread(Poller(cfg, _fleet(1)), lambda s: None)
    t = time.monotonic()
    thread.hold(t + 0.05)
    thread._wait_if_held()
    assert 0.04 <= time.monotonic() - t < 0.2
    t = time.monotonic()
    thread.hold(t + 60)  # a key held down: the board keeps asking
    thread._wait_if_held()
    waited = time.monotonic() - t
    assert feed_module.MAX_HOLD_S - 0.01 <= waited < feed_module.MAX_HOLD_S + 0.2
    t = time.monotonic()
    thread._wait_if_held()  # within MIN_RUN_S of that: runs
    assert time.monotonic() - t < 0.02
    thread.hold(0.0)
    await thread.poller.aclose()


async def test_a_key_holds_the_feed_the_drain_and_the_collector(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    sources = _fleet(6)
    cfg = Config(path=None, hosts=tuple(HostConfig(s.name) for s in sources),
                 defaults=Defaults(interval=0.5, timeout=5.0),
                 reservations=Reservations(path=tmp_path / "r.json"))
    collected: list[int] = []

    def collect(gen: int = 2) -> int:
        collected.append(gen)
        return 0

    monkeypatch.setattr(gc, "collect", collect)
    app = GputopApp(cfg, sources=sources, user="amira")
    async with app.run_test(size=(120, 30)) as pilot:
        for _ in range(100):
            if len(app.model.snapshots) == len(sources) and app.intake.feed is not None:
                break
            await asyncio.sleep(0.05)
        feed = app.intake.feed
        assert feed is not None
        monkeypatch.setattr(gc, "freeze", lambda: collected.append(-1))
        app.intake.collect_young()
        assert collected == [2, -1]  # once, with the first answers in: collect, freeze
        app.intake._last_gc -= intake_module.GC_PERIOD_S
        collected.clear()
        app.intake.collect_young()
        assert collected == [0]  # no key: the board collects young garbage itself
        t = time.monotonic()
        await pilot.press("j")
        assert feed.hold_until >= t + intake_module.KEY_HOLD_S  # the key holds the feed...
        assert app.intake._key_hold_until == feed.hold_until
        app.intake._key_hold_until = time.monotonic() + 1  # (pilot.press waited past it: idle)
        app.intake.collect_young()
        assert collected == [0]  # ...and the collector
        # (no await from here on: the drain's own timer cannot run in between)
        snap = HostSnapshot(name="node00", gpus=app.model.snapshots["node00"].gpus)
        app.intake._inbox.put(snap)
        app.intake._key_hold_until = time.monotonic() + 1
        app.intake._last_drain = time.perf_counter()
        app.intake.drain()
        assert app.model.snapshots["node00"] is not snap  # ...and the drain
        app.intake._key_hold_until = 0.0
        app.intake.drain()
        assert app.model.snapshots["node00"] is snap
        app.intake.collect_young()
        assert collected == [0]  # (its period, GC_PERIOD_S, has not passed)
        app.intake._last_gc -= intake_module.GC_PERIOD_S
        app.intake.collect_young()
        assert collected == [0, 0]
        # Answers count only up to the fleet's size (a collection walks at most every
        # host's last answer): a fleet smaller than GC_ANSWERS is collected by time.
        app.intake._answers_since_gc = 10 * intake_module.GC_ANSWERS
        app.intake.collect_young()
        assert collected == [0, 0]
        monkeypatch.setattr(intake_module, "GC_ANSWERS", len(app.model.snapshots))
        app.intake.collect_young()
        assert collected == [0, 0, 0]
    assert intake_module.KEY_HOLD_S < feed_module.MAX_HOLD_S
