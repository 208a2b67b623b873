"""The board's model keeps each host's summary counts and rows' keys from its last answer,
makes its rows when they are first looked at (``_host_rows``, ``HostRows``) and keeps a row
whose GPU object an answer left as it was (a hub's patch); a frame joins them
(``BoardModel.frame``). The counts and keys, worked out without the rows, are what the rows
say. On random sequences
(numbers moving, processes coming and going, GPUs lost, MIG instances, hosts down, stale
and back, GPU objects reused as a patch leaves them, reservations and shares made and
expiring, the clock moving past the idle-holder threshold, sorts, filters, free only,
collapse) a frame is exactly the frame a model with no kept rows works out."""

from __future__ import annotations

import random
from dataclasses import replace
from datetime import datetime, timedelta

import pytest

from gputop.model import HostError, HostSnapshot, MigInstance, ProcessInfo
from gputop.reservations.flags import instance_index, reservation_index
from gputop.reservations.records import Reservation
from gputop.reservations.state import StoreState
from gputop.reservations.summary import gpu_class, instance_class
from gputop.reservations.terms import Target, Terms, new_reservation
from gputop.ui.board_model import BoardModel, SortMode
from gputop.ui.board_rows import Summary
from tests.support.board_data import NOW, fixed_snapshots

_MIG = (MigInstance(gpu_instance_id=3, compute_instance_id=0, device_index=0, uuid="MIG-3",
                    profile="1g.10gb", memory_used_mib=0, memory_total_mib=9856,
                    utilization_percent=None, processes=()),)


def _answer(rnd: random.Random, s: HostSnapshot, now: datetime) -> HostSnapshot:
    what = rnd.random()
    if what < 0.6 and s.gpus:
        gpus = list(s.gpus)
        i = rnd.randrange(len(gpus))
        how = rnd.random()
        if how < 0.4:
            gpus[i] = replace(gpus[i], utilization_percent=rnd.choice([0, 5, 90, None]),
                              memory_used_mib=rnd.choice([0, 100, 20000]))
        elif how < 0.6:
            gpus[i] = gpus[i].with_processes(rnd.choice([(), (ProcessInfo(
                9, rnd.choice(["ann", "bob", "zed"]), "python z.py", 5, 5),)]))
        elif how < 0.7:
            gpus[i] = replace(gpus[i], lost=not gpus[i].lost)
        elif how < 0.8:
            gpus[i] = replace(gpus[i], mig_mode="Enabled", instances=rnd.choice([(), _MIG]))
        # (else: every GPU object as it was, as a hub's patch of the host's time leaves it)
        return replace(s, gpus=tuple(gpus), time=now - timedelta(seconds=1), error=None)
    if what < 0.8:
        return replace(s, error=HostError("timeout", "no answer"), time=now)
    return replace(s, error=None, gpus=s.gpus or fixed_snapshots()[0].gpus,
                   time=now - timedelta(seconds=rnd.choice([1, 100])))


def _reservations(rnd: random.Random, hosts: list[str], now: datetime) -> StoreState:
    out: list[Reservation] = []
    for _ in range(rnd.randint(0, 3)):
        made = now - timedelta(minutes=rnd.randint(0, 40))
        out.append(new_reservation(
            Target(rnd.choice(hosts), rnd.randint(0, 3)),
            Terms(user=rnd.choice(["ann", "bob"]), machine="ws",
                  seconds=rnd.choice([60, 3600]), share_mib=rnd.choice([None, None, 1000])),
            made))
    return StoreState(reservations=tuple(out))


def _summary_from_rows(model: BoardModel) -> Summary:
    """The summary as each host's rows say it (the counts are worked out without making
    the rows: they must agree): a GPU counts once (not its instances' or shares' rows),
    in the class the summary's rule gives its row and its instances' rows."""
    s = Summary()
    util: list[int] = []
    for host in model.host_order:
        snap = model.snapshots.get(host)
        if snap is None or (snap.error is not None and snap.error.kind == "starting"):
            s.hosts_waiting += 1
            continue
        if not snap.ok:
            s.hosts_down += 1
            continue
        s.hosts_up += 1
        now = model.clock()
        rows = model.gpu_rows(host, now, reservation_index(model.state, now),
                              instance_index(model.state, now))
        for i, r in enumerate(rows):
            if r.instance is not None or r.share is not None:
                continue
            s.gpus += 1
            insts = []
            for ir in rows[i + 1:]:
                if ir.instance is None:
                    break
                c = instance_class(r.gpu, ir.gpu, ir.reservation is not None)
                s.instances[c] = s.instances.get(c, 0) + 1
                insts.append(c)
            c = gpu_class(r.gpu, r.reservation is not None, bool(r.shares), insts)
            setattr(s, c, getattr(s, c) + 1)
            if r.gpu.utilization_percent is not None:
                util.append(r.gpu.utilization_percent)
            s.mem_used_mib += r.gpu.memory_used_mib or 0
            s.mem_total_mib += r.gpu.memory_total_mib or 0
    s.util_percent = sum(util) / len(util) if util else None
    return s


@pytest.mark.parametrize("seed", range(12))
def test_a_frame_from_kept_rows_is_the_frame_worked_out_anew(seed: int) -> None:
    rnd = random.Random(seed)
    snaps = {s.name: s for s in fixed_snapshots()}
    hosts = list(snaps)
    clock = [NOW]
    kept, anew = (BoardModel(host_order=list(hosts), clock=lambda: clock[0], me="ann",
                             idle_holder_s=60) for _ in range(2))
    for _step in range(80):
        roll = rnd.random()
        if roll < 0.7:
            name = rnd.choice(hosts)
            snaps[name] = _answer(rnd, snaps[name], clock[0])
            for m in (kept, anew):
                m.ingest(snaps[name])
        elif roll < 0.8:
            state = _reservations(rnd, hosts, clock[0])
            for m in (kept, anew):
                m.set_state(state)
        elif roll < 0.9:
            clock[0] += timedelta(seconds=rnd.choice([1, 2, 7, 61]))
        else:
            which = rnd.random()
            sort: SortMode = rnd.choice(["host", "utilization", "free-memory"])
            text = rnd.choice(["", "", "h100", "bob", "zed"])
            free_only = not kept.free_only
            collapsed = {rnd.choice(hosts)} if rnd.random() < 0.5 else set()
            for m in (kept, anew):
                if which < 0.3:
                    m.sort_mode = sort
                elif which < 0.5:
                    m.filter_text = text
                elif which < 0.7:
                    m.free_only = free_only
                else:
                    m.collapsed = set(collapsed)
        rows, keys, summary = kept.frame()
        anew._row_cache.clear()  # (nothing kept: every host's rows worked out now)
        want_rows, want_keys, want_summary = anew.frame()
        assert keys == want_keys == [r.key for r in rows]
        assert rows == want_rows
        assert summary == want_summary == _summary_from_rows(anew)
