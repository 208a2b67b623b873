"""What to tell and when, derived from two looks at the reservations file, the flags and the
clock (no hosts needed: these are pure functions and the watcher's memory)."""

from __future__ import annotations

from dataclasses import replace
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

from gputop.model import iso
from gputop.notify.bell import desktop
from gputop.notify.events import Seen, digest, ended, expiring, flag_conditions, store_notices
from gputop.notify.notice import Notice
from gputop.notify.watcher import Watcher
from gputop.reservations.records import Job, Reservation, Waiter
from gputop.reservations.state import StoreState

T0 = datetime(2026, 12, 5, 12, 0, tzinfo=timezone.utc)
MIN = timedelta(minutes=1)
SEC = timedelta(seconds=1)


class Recorder:
    """A Notifier that keeps what it was handed."""

    def __init__(self) -> None:
        self.got: list[Notice] = []

    def submit(self, notice: Notice) -> None:
        self.got.append(notice)


def res(rid: str, user: str = "alice", gpu: int = 0, *, host: str = "h1",
        created: datetime = T0 - 60 * MIN, expires: datetime = T0 + 60 * MIN,
        job: Job | None = None, note: str = "") -> Reservation:
    return Reservation(rid, host, gpu, user, "m", created, expires, note=note, job=job)


def waiter(wid: str, user: str = "alice", count: int = 1,
           created: datetime = T0 - 10 * MIN) -> Waiter:
    return Waiter(wid, user, "m", count, created, T0 + 5 * MIN)


def event(action: str, by: str, r: Reservation, at: datetime = T0) -> dict[str, Any]:
    return {"time": iso(at), "action": action, "by": by, "machine": "m",
            "reservation": r.to_dict()}


def look(*rs: Reservation, queue: tuple[Waiter, ...] = (), events: tuple[dict[str, Any], ...]
         = (), at: datetime = T0) -> Seen:
    return Seen(StoreState(reservations=rs, queue=queue, events=events), at)


# --- expiry warnings ------------------------------------------------------------------------

def test_expiring_exactly_at_the_warning_is_warned_and_a_second_later_is_not() -> None:
    at = res("a", expires=T0 + 15 * MIN)
    later = res("b", gpu=1, expires=T0 + 15 * MIN + timedelta(seconds=1))
    got = expiring(look(at, later), 15 * 60)
    assert [n.key for n in got] == [f"expiring:a:{iso(at.expires)}"]
    n = got[0]
    assert n.user == "alice" and "15 min" in n.title
    assert "gputop extend h1:0 --for 1h" in "\n".join(n.lines)


def test_one_extended_after_its_warning_is_warned_again_before_its_new_end() -> None:
    r = res("a", expires=T0 + 10 * MIN)
    rec = Recorder()
    w = Watcher(rec, warn_s=15 * 60)
    w.observe(look(r).state, [], T0)
    w.observe(look(r).state, [], T0 + MIN)  # the same warning: once
    ext = replace(r, expires=T0 + 70 * MIN)
    w.observe(look(ext).state, [], T0 + 2 * MIN)  # extended: nothing to say now
    assert [n.kind for n in rec.got] == ["expiring"]
    w.observe(look(ext).state, [], T0 + 56 * MIN)
    assert [n.key for n in rec.got] == [f"expiring:a:{iso(r.expires)}",
                                        f"expiring:a:{iso(ext.expires)}"]


# --- endings ----------------------------------------------------------------------------

def test_a_forced_release_names_who_released_it() -> None:
    r = res("a")
    got = ended(look(r), look(events=(event("force-release", "bob", r),), at=T0 + MIN))
    assert len(got) == 1
    n = got[0]
    assert (n.kind, n.user, n.key) == ("ended", "alice", "ended:a")
    assert "released by bob" in n.title and n.fields["by"] == "bob"


def test_a_job_tied_reservation_whose_job_ended() -> None:
    r = res("a", job=Job(pid=123, session=True))
    got = ended(look(r), look(events=(event("job-ended", "alice", r),), at=T0 + MIN))
    assert [(n.user, n.fields["why"]) for n in got] == [("alice", "ended with its job")]


def test_expired_in_the_file_or_pruned_is_told_and_released_by_its_holder_is_not() -> None:
    gone = res("a", expires=T0 + MIN // 2)
    kept = res("b", gpu=1, expires=T0 + MIN // 2)
    mine = res("c", gpu=2)  # released by alice herself: she knows
    got = ended(look(gone, kept, mine), look(kept, at=T0 + MIN))
    assert sorted((n.key, n.fields["why"]) for n in got) == [("ended:a", "expired"),
                                                             ("ended:b", "expired")]


# --- grants -----------------------------------------------------------------------------

def test_a_waiter_granted_gets_the_command_to_use_its_gpus() -> None:
    w = waiter("w1", count=2)
    other = waiter("w2", user="bob", created=T0 - 5 * MIN)
    new = (res("r1", created=T0, gpu=0), res("r2", created=T0, gpu=1))
    got = store_notices(look(queue=(w, other)), look(*new, queue=(other,), at=T0 + MIN))
    granted = [n for n in got if n.kind == "granted"]
    assert len(granted) == 1
    n = granted[0]
    assert (n.user, n.key) == ("alice", "granted:w1")
    assert "CUDA_VISIBLE_DEVICES=0,1 on h1" in n.lines and "ssh h1" in n.lines


def test_a_waiter_removed_or_leaving_is_not_granted() -> None:
    w, v = waiter("w1"), waiter("w2", user="bob")
    removed = {"time": iso(T0), "action": "queue-remove", "by": "carol", "machine": "m",
               "waiter": w.to_dict()}
    # bob left and happens to reserve by hand before he joined: not a grant either
    before = res("r9", user="bob", created=T0 - 20 * MIN)
    got = store_notices(look(queue=(w, v)), look(before, events=(removed,), at=T0 + MIN))
    assert [n for n in got if n.kind == "granted"] == []


# --- flags, digest, the watcher's memory ------------------------------------------------------

def gpu_doc(flags: list[str], users: list[str], rid: str = "a", holder: str = "alice",
            index: int = 0) -> dict[str, Any]:
    return {"index": index, "flags": flags,
            "reservation": {"id": rid, "user": holder, "expires": iso(T0 + 60 * MIN)},
            "processes": [{"user": u, "pid": 1} for u in users], "instances": [], "shares": []}


def host_doc(*gpus: dict[str, Any], name: str = "h1", ok: bool = True) -> dict[str, Any]:
    return {"name": name, "status": "ok" if ok else "error",
            "error": None if ok else {"kind": "unreachable", "message": "x"},
            "gpus": list(gpus)}


def test_unreserved_use_is_told_to_the_holder_and_to_the_user_running_there() -> None:
    conds = flag_conditions([host_doc(gpu_doc(["unreserved-use"], ["alice", "bob"]))])
    who = sorted((n.user, n.kind) for n in conds.values())
    assert who == [("alice", "unreserved-use"), ("bob", "unreserved-use")]


def test_many_notices_for_one_person_become_one_digest() -> None:
    rs = [res(f"r{i}", gpu=i, expires=T0 + 5 * MIN) for i in range(5)]
    many = expiring(look(*rs, res("b", user="bob", gpu=9, expires=T0 + 5 * MIN)))
    out = digest(many, over=3)
    assert sorted((n.user, n.kind) for n in out) == [("alice", "digest"), ("bob", "expiring")]
    d = next(n for n in out if n.kind == "digest")
    assert len(d.lines) == 5 and d.fields["count"] == "5"


def test_a_restarted_watcher_sends_no_duplicates(tmp_path: Path) -> None:
    path = tmp_path / "sent.json"
    r = res("a", expires=T0 + 10 * MIN)
    hosts = [host_doc(gpu_doc(["idle-reservation"], [], rid="a"))]
    first = Recorder()
    Watcher(first, path).observe(look(r).state, hosts, T0)
    assert sorted(n.kind for n in first.got) == ["expiring", "idle"]
    again = Recorder()
    w = Watcher(again, path)  # restarted: the same flag still stands, the same warning
    w.observe(look(r).state, hosts, T0 + MIN)
    assert again.got == []
    # the holder came back (flag cleared), then left again past the cool-down: a new
    # occurrence
    w.observe(look(r).state, [host_doc(gpu_doc([], ["alice"], rid="a"))], T0 + 2 * MIN)
    w.observe(look(r).state, hosts, T0 + 40 * MIN)
    idle = [n for n in again.got if n.kind == "idle"]  # (and its end, by then)
    assert len(idle) == 1
    assert idle[0].key != first.got[[n.kind for n in first.got].index("idle")].key


def test_a_standing_flag_is_told_once_through_its_hosts_failed_looks() -> None:
    """A host that fails a look reports no GPUs: that is not the flag cleared, so the
    flag standing before and after is one occurrence, told once."""
    r = res("a", expires=T0 + 600 * MIN)
    idle = [host_doc(gpu_doc(["idle-reservation"], [], rid="a"))]
    failed = [host_doc(name="h1", ok=False)]
    rec = Recorder()
    w = Watcher(rec)
    for i, hosts in enumerate((idle, failed, idle, failed, idle)):
        w.observe(look(r).state, hosts, T0 + i * MIN)
    assert [n.kind for n in rec.got] == ["idle"]


def test_a_flag_that_flaps_is_one_occurrence_until_it_stays_away() -> None:
    """A job started and stopped on someone's reserved GPU, again and again: one notice
    to each of them, not one per start; back after the cool-down, a new one."""
    r = res("a", expires=T0 + 600 * MIN)
    used = [host_doc(gpu_doc(["unreserved-use"], ["bob"], rid="a"))]
    quiet = [host_doc(gpu_doc([], [], rid="a"))]
    rec = Recorder()
    w = Watcher(rec)
    for i in range(12):
        w.observe(look(r).state, used if i % 2 == 0 else quiet, T0 + i * 2 * SEC)
    assert sorted((n.kind, n.user) for n in rec.got) == [
        ("unreserved-use", "alice"), ("unreserved-use", "bob")]
    w.observe(look(r).state, used, T0 + 40 * MIN)  # after the cool-down
    assert len(rec.got) == 4


def test_a_standing_flags_key_is_never_forgotten_to_make_room() -> None:
    """The memory is bounded; a flood of other keys does not push out one whose flag
    still stands (it would be sent again)."""
    r = res("a", expires=T0 + 6000 * MIN)
    idle = [host_doc(gpu_doc(["idle-reservation"], [], rid="a"))]
    rec = Recorder()
    w = Watcher(rec)
    w.observe(look(r).state, idle, T0)
    w.sent.update(dict.fromkeys(f"other:{i}" for i in range(6000)))
    w.observe(look(r).state, idle, T0 + MIN)  # trims the memory
    w.observe(look(r).state, idle, T0 + 2 * MIN)
    assert [n.kind for n in rec.got] == ["idle"]


def test_a_broken_memory_file_is_read_as_empty(tmp_path: Path) -> None:
    path = tmp_path / "sent.json"
    path.write_text('{"sent": [1, {"x": 2}], "open": [], "down": {"h": "nonsense"}}')
    rec = Recorder()
    Watcher(rec, path).observe(look(res("a", expires=T0 + MIN)).state, [], T0)
    assert [n.kind for n in rec.got] == ["expiring"]


def test_a_host_down_past_its_grace_is_told_to_the_team_once_and_its_return_too() -> None:
    rec = Recorder()
    w = Watcher(rec, host_grace_s=300)
    down, up = [host_doc(name="h2", ok=False)], [host_doc(name="h2")]
    w.observe(None, down, T0)
    w.observe(None, down, T0 + 4 * MIN)
    assert rec.got == []
    w.observe(None, down, T0 + 5 * MIN)
    w.observe(None, down, T0 + 6 * MIN)
    w.observe(None, up, T0 + 7 * MIN)
    w.observe(None, up, T0 + 8 * MIN)
    assert [(n.kind, n.user) for n in rec.got] == [("host-down", None), ("host-up", None)]
    # a blip shorter than the grace says nothing, coming back either
    w.observe(None, down, T0 + 9 * MIN)
    w.observe(None, up, T0 + 10 * MIN)
    assert len(rec.got) == 2


def test_hostile_text_cannot_end_the_sequence_early() -> None:
    seq = desktop("t", "gpu\x07\x1b]0;owned\x07; rm -rf")
    body = seq.split("\x1b]777;notify;t;", 1)[1]
    assert body.count("\x07") == 1 and body.endswith("\x07")
    assert "\x1b" not in body and ";" not in body[:-1]


def test_the_senders_unit_runs_this_gputop_notify_run(tmp_path: Path, capsys: Any) -> None:
    from gputop.cli.notify_run import print_unit
    from gputop.config.load import load_config

    cfg = tmp_path / "my hosts.toml"
    cfg.write_text('[[hosts]]\nname = "h1"\n')
    assert print_unit(load_config(str(cfg))) == 0
    unit = capsys.readouterr().out
    start = next(line for line in unit.splitlines() if line.startswith("ExecStart="))
    assert " notify run --config " in start and f'"{cfg}"' in start
    assert "# Written by `gputop notify run --print-unit`" in unit
