"""Memory shares in the store, the queue's order rule and the history, in-process: hostile
share records, concurrent sharers, an older gputop meeting a file with shares, waiters.
(The fleet-level "done when" is tests/test_shares_fleet.py.)"""

from __future__ import annotations

import importlib.util
import json
import multiprocessing
import subprocess
import sys
from dataclasses import replace
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import pytest

from gputop.history.db import HistoryDB
from gputop.history.recorder import Recorder
from gputop.history.report import collect, summarise
from gputop.model import GpuInfo, HostSnapshot, ProcessInfo, iso, utcnow
from gputop.reservations.filelock import StoreError
from gputop.reservations.flags import IdleTracker, annotate, share_fits
from gputop.reservations.ops import Invalid, Refused, release, reserve
from gputop.reservations.order import QueueView
from gputop.reservations.records import Waiter
from gputop.reservations.requests import Request
from gputop.reservations.shares import best_fit, parse_size_mib, reserve_share, size_text
from gputop.reservations.state import StoreState
from gputop.reservations.store import Store
from gputop.reservations.terms import Target, Terms, new_reservation

ROOT = Path(__file__).resolve().parents[1]
H = 3600.0
TOTAL = 81559  # an H100 80GB, as nvidia-smi reports it
G = 1024


def share(store: Store, user: str, gib: float, gpu: int = 0, host: str = "h",
          total: int = TOTAL) -> Any:
    return reserve_share(
        store, Target(host, gpu, f"GPU-{host}-{gpu}"), total,
        Terms(H, max_seconds=7 * 86400, user=user, machine="m", share_mib=int(gib * G)))


def test_shares_fit_whole_and_share_exclude_each_other(tmp_path: Path) -> None:
    path = tmp_path / "r.json"
    store = Store(path)
    assert share(store, "ann", 30).action == "reserved"
    assert share(store, "bob", 30).action == "reserved"
    with pytest.raises(Refused) as exc:
        share(store, "cat", 30)
    assert "19.6G (20119 MiB) of 79.6G left unshared (ann 30G, bob 30G)" in str(exc.value)
    assert share(store, "cat", 16).action == "reserved"
    before = path.read_bytes()
    for who in ("dan", "ann"):  # a whole reservation: refused, a sharer's too
        with pytest.raises(Refused):
            reserve(store, [Target("h", 0)], seconds=H, max_seconds=86400, user=who)
    assert path.read_bytes() == before
    # your own share: resized within the room the others leave, then kept
    assert share(store, "cat", 19.6).action == "resized"
    with pytest.raises(Refused):
        share(store, "cat", 19.7)
    assert share(store, "cat", 19.6).action in ("kept", "extended")
    # a GPU reserved whole takes no share, yours neither
    reserve(store, [Target("h", 1)], seconds=H, max_seconds=86400, user="ann")
    for who in ("bob", "ann"):
        with pytest.raises(Refused):
            share(store, who, 1, gpu=1)
    with pytest.raises(Invalid):  # bigger than the GPU
        share(store, "eve", 100, gpu=2)
    with pytest.raises(Invalid):
        reserve_share(
            store, Target("h", 2, instance=3), TOTAL,
            Terms(H, max_seconds=H, user="eve", share_mib=G))
    # release: your own share; someone else's needs --force and is recorded
    assert [r.user for r in release(store, [Target("h", 0)], user="bob")] == ["bob"]
    with pytest.raises(Refused):
        release(store, [Target("h", 0)], user="bob")
    gone = release(store, [Target("h", 0)], user="bob", force=True)
    assert sorted(r.user for r in gone) == ["ann", "cat"]
    doc = json.loads(path.read_text())
    assert [e["reservation"]["user"] for e in doc["events"]] == ["ann", "cat"]
    assert doc["version"] == 3  # the events still hold shares


def test_the_file_is_version_3_only_while_it_holds_a_share(tmp_path: Path) -> None:
    path = tmp_path / "r.json"
    store = Store(path)
    reserve(store, [Target("h", 1)], seconds=H, max_seconds=86400, user="ann")
    assert json.loads(path.read_text())["version"] == 1
    share(store, "ann", 8)
    assert json.loads(path.read_text())["version"] == 3
    release(store, [Target("h", 0)], user="ann")
    assert json.loads(path.read_text())["version"] == 1


def _old_store_module(monkeypatch: pytest.MonkeyPatch) -> Any:
    """gputop's store as it was before shares (the commit shares were built on)."""
    try:
        src = subprocess.run(["git", "-C", str(ROOT), "show",
                              "2e049d3:gputop/reservations/store.py"], capture_output=True,
                             text=True, timeout=30, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        pytest.skip("needs the git history (the store before shares)")
    spec = importlib.util.spec_from_loader("old_gputop_store", loader=None)
    assert spec is not None
    mod = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "old_gputop_store", mod)  # (its dataclasses look)
    exec(compile(src, "old_store.py", "exec"), mod.__dict__)
    return mod


def test_an_older_gputop_refuses_a_file_with_shares_and_leaves_it(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    old = _old_store_module(monkeypatch)
    path = tmp_path / "r.json"
    store = Store(path)
    share(store, "ann", 30)
    share(store, "bob", 30)
    before = path.read_bytes()
    with pytest.raises(old.StoreError) as exc:
        old.Store(path).read()
    assert "unknown version 3" in str(exc.value) and "upgrade gputop" in str(exc.value)
    with pytest.raises(old.StoreError):  # nor does it write over it
        old.Store(path).update(lambda st, now: st)
    assert path.read_bytes() == before
    # even forged as version 2, two shares of one GPU are no file an older gputop takes
    forged = json.loads(before)
    forged["version"] = 2
    path.write_text(json.dumps(forged))
    with pytest.raises(old.StoreError):
        old.Store(path).read()
    with pytest.raises(StoreError) as exc2:  # and this gputop says what is wrong with it
        store.read()
    assert "'share_mib' needs version 3" in str(exc2.value)


def _record(rid: str, **over: Any) -> dict[str, Any]:
    now = utcnow()
    d = {"id": rid, "host": "h", "gpu": 0, "user": "ann", "machine": "m", "created": iso(now),
         "expires": iso(now + timedelta(hours=1)), "uuid": None, "note": "",
         "share_mib": 1024}
    d.update(over)
    return {k: v for k, v in d.items() if v is not ...}


HOSTILE = {
    "zero": [_record("a", share_mib=0)],
    "negative": [_record("a", share_mib=-5)],
    "huge": [_record("a", share_mib=2**40)],
    "bool": [_record("a", share_mib=True)],
    "string": [_record("a", share_mib="16G")],
    "float": [_record("a", share_mib=1.5)],
    "null": [_record("a", share_mib=None)],
    "on-an-instance": [_record("a", instance=3)],
    "two-of-one-holder": [_record("a"), _record("b")],
    "share-and-whole-same-id": [_record("a"), _record("a", share_mib=...)],
}


@pytest.mark.parametrize("kind", sorted(HOSTILE))
def test_hostile_share_records_are_refused_and_left_untouched(tmp_path: Path,
                                                              kind: str) -> None:
    path = tmp_path / "r.json"
    raw = json.dumps({"version": 3, "reservations": HOSTILE[kind], "events": [],
                      "queue": []}).encode()
    path.write_bytes(raw)
    with pytest.raises(StoreError):
        Store(path).read()
    with pytest.raises(StoreError):
        share(Store(path), "bob", 1)
    assert path.read_bytes() == raw


def test_a_forged_share_blocks_only_its_gpu(tmp_path: Path) -> None:
    """A teammate's file entry claiming a whole GPU's memory as a share is advisory like
    any reservation of that GPU: it blocks that GPU, nobody's other GPU, and nothing is
    erased."""
    path = tmp_path / "r.json"
    path.write_text(json.dumps({"version": 3, "events": [], "queue": [], "reservations": [
        _record("f", user="mallory", share_mib=2**30)]}))
    store = Store(path)
    with pytest.raises(Refused) as exc:
        share(store, "ann", 1)
    assert "0M (0 MiB) of 79.6G left unshared (mallory 1048576G)" in str(exc.value)
    share(store, "ann", 1, gpu=1)
    assert len(store.read().reservations) == 2


def _sharer(path: str, user: str, out: Any) -> None:
    got = []
    store = Store(Path(path))
    for gpu in range(4):
        try:
            share(store, user, 10, gpu=gpu)
            got.append(gpu)
        except Refused:
            pass
    out.put((user, got))


def test_concurrent_sharers_lose_nothing_and_never_overcommit(tmp_path: Path) -> None:
    """16 people ask for 10G of each of 4 GPUs (79.6G) at once: exactly 7 fit on each."""
    path = tmp_path / "r.json"
    ctx = multiprocessing.get_context("fork")
    out: Any = ctx.Queue()
    procs = [ctx.Process(target=_sharer, args=(str(path), f"user{i}", out))
             for i in range(16)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
        assert p.exitcode == 0
    won = dict(out.get(timeout=5) for _ in procs)
    state = Store(path).read()
    for gpu in range(4):
        holders = sorted(r.user for r in state.active() if r.gpu == gpu)
        assert holders == sorted(u for u, gpus in won.items() if gpu in gpus)
        assert len(holders) == 7  # 7 x 10G = 70G of 79.6G: an 8th does not fit


def _gpu(index: int, util: int = 0, used: int = 100, total: int = TOTAL,
         procs: tuple[tuple[str, int], ...] = ()) -> GpuInfo:
    return GpuInfo(index=index, uuid=f"GPU-h-{index}", name="NVIDIA H100 80GB HBM3",
                   utilization_percent=util, memory_used_mib=used, memory_total_mib=total,
                   processes=tuple(ProcessInfo(pid=100 + i, user=u, gpu_memory_mib=m)
                                   for i, (u, m) in enumerate(procs)))


def _state(*shares: tuple[int, str, int], queue: tuple[Waiter, ...] = ()) -> StoreState:
    now = utcnow()
    return StoreState(tuple(new_reservation(
        Target("h", gpu), Terms(H, user=user, machine="m", share_mib=mib * G), now)
                            for gpu, user, mib in shares), (), queue)


def _waiter(user: str, count: int = 1, share_gib: int = 0, hosts: tuple[str, ...] = ()
            ) -> Waiter:
    now = utcnow()
    return Waiter(id=f"w{user}", user=user, machine="m", count=count, created=now,
                  lease=now + timedelta(seconds=30), hosts=hosts, share_mib=share_gib * G)


def test_best_fit_puts_a_shared_gpu_before_an_untouched_one() -> None:
    host = HostSnapshot("h", gpus=(_gpu(0, 100, 20000, procs=(("ann", 20000),)), _gpu(1),
                                   _gpu(2, total=24 * G), _gpu(3)))
    state = _state((0, "ann", 30))
    fits = share_fits([host], state, 16 * G, user="bob")
    # the shared GPU first; then untouched ones, tightest fit first
    assert [f.label for f in fits] == ["h:0", "h:2", "h:1", "h:3"]
    assert [f.label for f in best_fit(fits)] == ["h:0", "h:2", "h:1", "h:3"]
    # your own share's GPU is not offered again (resize it with reserve); no room: not offered
    assert next(f.label for f in share_fits([host], state, 16 * G, user="ann")) == "h:2"
    assert "h:0" not in [f.label for f in share_fits([host], state, 50 * G, user="bob")]


def test_the_order_rule_for_shares() -> None:
    host = HostSnapshot("h", gpus=(_gpu(0), _gpu(1)))
    fleet = ["h"]
    # a whole-GPU waiter ahead could use an untouched GPU: a share would spoil it
    whole = _waiter("ann", count=1)
    state = _state()
    assert QueueView(state, [host], utcnow(), fleet).share_taken([whole], "h", 0, 4 * G) == whole
    # ... but never a shared one
    state = _state((0, "cat", 10))
    assert QueueView(state, [host], utcnow(), fleet).share_taken([whole], "h", 0, 4 * G) is None
    # a share waiter ahead: spoilt only if it would no longer fit after the share
    sw = _waiter("bob", share_gib=60)
    assert QueueView(state, [host], utcnow(), fleet).share_taken([sw], "h", 0, 4 * G) is None
    assert QueueView(state, [host], utcnow(), fleet).share_taken([sw], "h", 0, 10 * G) == sw
    # a waiter for another host claims nothing here
    other = _waiter("dan", hosts=("elsewhere",))
    assert QueueView(_state(), [host], utcnow(), fleet).share_taken([other], "h", 0, 4 * G) is None
    # sizes: a share request can never use a MIG GPU, and needs the GPU's total known
    req = Request(1, share_mib=16 * G, one_host=True)
    assert req.sized(_gpu(0)) and not req.sized(replace(_gpu(0), mig_mode="Enabled"))
    assert not req.sized(replace(_gpu(0), memory_total_mib=None))


def test_over_share_after_the_grace_unreserved_use_and_idle_shares() -> None:
    state = _state((0, "ann", 30), (0, "bob", 16))
    t0 = max(r.created for r in state.reservations)
    tracker = IdleTracker(1800, 900, share_grace_s=60)

    def flags(at: float, *procs: tuple[str, int]) -> dict[str, Any]:
        snap = HostSnapshot("h", time=t0 + timedelta(seconds=at),
                            gpus=(_gpu(0, 50, 1000, procs=procs),))
        tracker.observe(snap)
        from gputop.model import FleetSnapshot

        doc = annotate(FleetSnapshot((snap,), time=snap.time), state, tracker)
        return dict(doc["hosts"][0]["gpus"][0])

    g = flags(0, ("ann", 20000), ("bob", 1000))
    assert g["flags"] == [] and [s["used_mib"] for s in g["shares"]] == [20000, 1000]
    assert flags(10, ("ann", 40000), ("bob", 1000))["flags"] == []  # over, within grace
    g = flags(71, ("ann", 40000), ("bob", 1000))
    assert g["flags"] == ["over-share"]
    assert [s["flags"] for s in g["shares"]] == [["over-share"], []]
    assert flags(72, ("ann", 30 * G), ("bob", 1000))["flags"] == []  # at the share: fine
    assert flags(73, ("ann", 40000), ("bob", 1000))["flags"] == []  # the grace starts over
    g = flags(80, ("ann", 1000), ("eve", 5))
    assert g["flags"] == ["unreserved-use"]  # eve holds no share of it
    assert g["unshared_mib"] == TOTAL - 46 * G
    # idle-reservation per share: bob's process was last seen at 73 s, idle_grace is 900 s
    g = flags(973, ("ann", 1000))
    assert [s["flags"] for s in g["shares"]] == [[], ["idle-reservation"]]
    assert g["flags"] == ["idle-reservation"]


def test_sizes() -> None:
    assert parse_size_mib("16G") == 16384 and parse_size_mib("512M") == 512
    for bad in ("16", "G", "-1G", "1e3G"):
        with pytest.raises(Invalid):
            parse_size_mib(bad)
    assert [size_text(m) for m in (30720, 20119, TOTAL, 512, 1536)] == [
        "30G", "19.6G", "79.6G", "512M", "1.5G"]


def test_history_counts_each_share_as_its_fraction(tmp_path: Path) -> None:
    t0 = datetime(2026, 11, 2, 8, 0, tzinfo=timezone.utc)
    rec = Recorder(HistoryDB(tmp_path / "h.sqlite3", writer=True), interval=10.0,
                   timeout=5.0, clock=lambda: 0.0)
    st = StoreState((new_reservation(
        Target("h", 0), Terms(H, user="ann", machine="m", share_mib=30 * G), t0),
                     new_reservation(
                         Target("h", 0), Terms(H, user="bob", machine="m", share_mib=16 * G), t0),
                     new_reservation(Target("h", 1), Terms(H, user="cat", machine="m"), t0)))
    rec.set_reservations(st)
    for i in range(7):  # 60 s recorded after the first sample
        rec.record(HostSnapshot("h", time=t0 + timedelta(seconds=10 * i), gpus=(
            _gpu(0, 0, 20000, procs=(("ann", 20000), ("eve", 100))), _gpu(1, 50))))
    rec.flush()
    rec.db.close()
    with HistoryDB(tmp_path / "h.sqlite3") as db:
        doc = summarise(collect(db, t0.timestamp(), (t0 + timedelta(seconds=61)).timestamp()))
    users = {u["user"]: u for u in doc["users"]}
    hours = 70 / 3600  # the first sample stands for one interval too
    A = pytest.approx
    assert users["ann"]["reserved_hours"] == A(hours * 30 * G / TOTAL)
    assert users["ann"]["shared_hours"] == A(hours * 30 * G / TOTAL)
    assert users["ann"]["reserved_idle_hours"] == 0  # her notebook runs there
    assert users["bob"]["shared_idle_hours"] == A(hours * 16 * G / TOTAL)  # his does not
    assert users["cat"]["reserved_hours"] == A(hours) and users["cat"]["shared_hours"] == 0
    assert users["eve"]["unreserved_hours"] == A(hours / 2)  # she holds no share
    assert users["ann"]["unreserved_hours"] == 0  # a sharer's use is reserved use
    gpu0 = next(g for g in doc["gpus"] if g["index"] == 0)
    assert gpu0["reserved_hours"] == A(hours * 46 * G / TOTAL)
    assert gpu0["held_idle_hours"] == A(hours)  # 0 % load while shared and used


def test_share_env_is_quoted_and_capped_below_the_share() -> None:
    from gputop.jobs.run import portable, remote_command, share_env

    r = new_reservation(
        Target("h", 0, "GPU-x"), Terms(H, user="ann", machine="m", share_mib=16 * G), utcnow())
    env = share_env([r], TOTAL)
    assert env["GPUTOP_SHARE_MIB"] == "16384"
    assert float(env["GPUTOP_SHARE_FRACTION"]) <= 16 * G / TOTAL
    assert env["XLA_CLIENT_MEM_FRACTION"] == env["XLA_PYTHON_CLIENT_MEM_FRACTION"]
    assert share_env([replace(r, share_mib=None)], TOTAL) == {}
    cmd = remote_command(["python", "nb.py"], "GPU-x", env | {"bad name;": "x"})
    assert "GPUTOP_SHARE_MIB=16384; export GPUTOP_SHARE_MIB;" in cmd
    assert "bad name" not in cmd and portable(cmd)

