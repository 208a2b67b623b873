"""``--json --watch`` lines built GPU by GPU (output.WatchDocuments): byte for byte the
document ``annotate`` + ``dumps`` make, refresh after refresh, while GPUs change, a host
goes down, reservations come and go, MIG instances and hostile strings are in it; a GPU
that did not change is not serialised again."""

from __future__ import annotations

import json
from dataclasses import replace
from datetime import timedelta
from pathlib import Path

from board_data import HOSTILE_USER, NOW, fixed_snapshots, seed

from gputop.model import FleetSnapshot, HostError, HostSnapshot, MigInstance, ProcessInfo
from gputop.output import WatchDocuments, dumps
from gputop.reservations import Store
from gputop.reservations.flags import IdleTracker, annotate
from gputop.reservations.store import StoreState, new_reservation


def _mig(snaps: list[HostSnapshot]) -> list[HostSnapshot]:
    """The first host's GPU 0 split into instances (3g.40gb holding a hostile user's job)."""
    h = snaps[0]
    g = h.gpus[0]
    p = ProcessInfo(pid=4242, user=HOSTILE_USER, command="\u202etrain", gpu_memory_mib=900,
                    gpu_instance_id=2, compute_instance_id=0)
    inst = (MigInstance(gpu_instance_id=2, compute_instance_id=0, device_index=0,
                        profile="3g.40gb", memory_used_mib=900, memory_total_mib=40448,
                        processes=(p,)),
            MigInstance(gpu_instance_id=9, compute_instance_id=0, device_index=1,
                        profile="1g.10gb", memory_total_mib=9984))
    g = replace(g, mig_mode="Enabled", processes=(p,), instances=inst)
    return [replace(h, gpus=(g, *h.gpus[1:])), *snaps[1:]]


def test_lines_equal_the_whole_document_and_unchanged_gpus_are_reused(
        tmp_path: Path) -> None:
    store = Store(tmp_path / "reservations.json")
    seed(store)
    state = store.read()
    tracker = IdleTracker(1800.0, 900.0)
    docs = WatchDocuments()
    snaps = _mig(fixed_snapshots())
    inst_res = new_reservation(snaps[0].name, 0, "carol", "m", NOW - timedelta(minutes=5),
                               3600, None, "\x1b[31m", 9)
    refreshes: list[tuple[list[HostSnapshot], StoreState | None, dict[str, str] | None]] = [
        (snaps, state, None),
        # every host answers again with equal data (new objects): all reused
        ([replace(h) for h in snaps], state, None),
        # the first host's GPU 1 draws more power; the second host goes down; a MIG
        # instance is reserved; the file could not be read this time
        ([replace(snaps[0], gpus=(snaps[0].gpus[0], replace(snaps[0].gpus[1],
                                                            power_draw_w=123.5),
                                  *snaps[0].gpus[2:])),
          HostSnapshot(name=snaps[1].name, time=NOW,
                       error=HostError("timeout", "no answer \x00\u2028"),
                       last_ok=NOW - timedelta(seconds=9)), *snaps[2:]],
         StoreState(reservations=(*state.reservations, inst_res)),
         {"reservations_error": "r.json: bad \u202e"}),
        ([], None, None),  # no hosts at all
        (snaps, None, None),  # the reservations gone: annotations change, all again
    ]
    for i, (hosts, st, extra) in enumerate(refreshes):
        for h in hosts:
            tracker.observe(h)
        fleet = FleetSnapshot(hosts=tuple(hosts), time=NOW + timedelta(seconds=2 * i))
        before = (docs.reused, docs.serialised)
        got = docs.text(fleet, st, tracker, extra)
        assert got == dumps(annotate(fleet, st, tracker) | (extra or {})), i
        assert got.isascii() and "\n" not in got
        json.loads(got)
        reused, fresh = docs.reused - before[0], docs.serialised - before[1]
        n = sum(len(h.gpus) for h in hosts)
        if i == 0:
            assert (reused, fresh) == (0, n)
        if i == 1:
            assert (reused, fresh) == (n, 0)
        if i == 2:
            assert fresh == 2 and reused > 0  # GPU 1's power; GPU 0's instance reservation
        if i == 4:
            assert fresh > 0
