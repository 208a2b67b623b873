"""The shared reservations file under concurrency, crashes, hostile content and permissions."""

from __future__ import annotations

import json
import multiprocessing
import os
import random
import signal
import stat
import subprocess
import sys
from datetime import timedelta
from pathlib import Path

import pytest

from gputop.model import iso, utcnow
from gputop.reservations import Invalid, Refused, Store, StoreError, Target, release, reserve
from gputop.reservations.records import MAX_USER_BYTES, MAX_USER_ENTRIES
from gputop.reservations.state import OverBudget
from gputop.reservations.store import MAX_FILE_BYTES, nfs_lock_problem

H = 3600.0


def make(store: Store, host: str, gpu: int, user: str, note: str = "") -> None:
    reserve(store, [Target(host, gpu)], seconds=H, max_seconds=7 * 86400, user=user, note=note)


def test_reserve_extend_release(tmp_path: Path) -> None:
    store = Store(tmp_path / "r.json")
    make(store, "h", 0, "ann", "first")
    (r,) = store.read().active()
    reserve(store, [Target("h", 0)], seconds=2 * H, max_seconds=86400, user="ann")
    (again,) = store.read().active()
    assert again.id == r.id and again.expires > r.expires and again.note == "first"
    assert release(store, [Target("h", 0)], user="ann")[0].id == r.id
    assert store.read().active() == []


def test_conflict_names_holder_until_and_note(tmp_path: Path) -> None:
    store = Store(tmp_path / "r.json")
    make(store, "h", 1, "ann", "training run 7")
    with pytest.raises(Refused) as exc:
        make(store, "h", 1, "bob")
    msg = str(exc.value)
    assert "ann" in msg and "training run 7" in msg and "h:1" in msg and "until" in msg


def test_several_gpus_all_or_nothing(tmp_path: Path) -> None:
    store = Store(tmp_path / "r.json")
    make(store, "h", 2, "ann")
    before = (tmp_path / "r.json").read_bytes()
    with pytest.raises(Refused):
        reserve(store, [Target("h", 0), Target("h", 1), Target("h", 2)], seconds=H,
                max_seconds=86400, user="bob")
    assert (tmp_path / "r.json").read_bytes() == before
    assert [(r.host, r.gpu) for r in store.read().active()] == [("h", 2)]


def test_release_someone_elses_needs_force_and_is_recorded(tmp_path: Path) -> None:
    store = Store(tmp_path / "r.json")
    make(store, "h", 0, "ann")
    with pytest.raises(Refused, match="--force"):
        release(store, [Target("h", 0)], user="bob")
    (gone,) = release(store, [Target("h", 0)], user="bob", force=True)
    assert gone.user == "ann"
    (event,) = json.loads((tmp_path / "r.json").read_text())["events"]
    assert event["action"] == "force-release" and event["by"] == "bob"
    assert event["reservation"]["user"] == "ann"


def test_release_mine_only_touches_mine(tmp_path: Path) -> None:
    store = Store(tmp_path / "r.json")
    make(store, "h", 0, "ann")
    make(store, "h", 1, "bob")
    make(store, "g", 0, "ann")
    assert {(r.host, r.gpu) for r in release(store, None, user="ann")} == {("h", 0), ("g", 0)}
    assert [r.user for r in store.read().active()] == ["bob"]


def test_expired_are_ignored_then_pruned(tmp_path: Path) -> None:
    path = tmp_path / "r.json"
    past = utcnow() - timedelta(hours=5)
    path.write_text(json.dumps({"version": 1, "events": [], "reservations": [{
        "id": "old", "host": "h", "gpu": 0, "user": "ann", "machine": "m",
        "created": iso(past), "expires": iso(past + timedelta(hours=4)), "note": ""}]}))
    store = Store(path)
    assert store.read().active() == [] and len(store.read().reservations) == 1
    make(store, "h", 0, "bob")  # not a conflict: ann's has expired
    assert [r.user for r in store.read().reservations] == ["bob"]


def test_duration_and_note_limits(tmp_path: Path) -> None:
    store = Store(tmp_path / "r.json")
    with pytest.raises(Invalid):
        reserve(store, [Target("h", 0)], seconds=8 * 86400, max_seconds=7 * 86400, user="a")
    with pytest.raises(Invalid, match="at most"):
        reserve(store, [Target("h", 0)], seconds=H, max_seconds=86400, user="a", note="x" * 501)
    with pytest.raises(Invalid, match="control"):
        reserve(store, [Target("h", 0)], seconds=H, max_seconds=86400, user="a",
                note="\x1b]0;owned\x07")
    assert not (tmp_path / "r.json").exists()


# -- hostile and broken files: a clear error, and the bytes stay as they were --------------

BROKEN = {
    "not-json": b'{"version": 1, "reservations": [',
    "wrong-version": b'{"version": 5, "reservations": []}',
    "not-object": b"[1, 2, 3]",
    "missing-field": b'{"version": 1, "reservations": [{"id": "x", "host": "h", "gpu": 0}]}',
    "bad-type": (b'{"version": 1, "reservations": [{"id": "x", "host": "h", "gpu": "0", '
                 b'"user": "u", "machine": "m", "created": "2026-01-01T00:00:00Z", '
                 b'"expires": "2026-01-01T04:00:00Z"}]}'),
    "huge-note": (b'{"version": 1, "reservations": [{"id": "x", "host": "h", "gpu": 0, '
                  b'"user": "u", "machine": "m", "created": "2026-01-01T00:00:00Z", '
                  b'"expires": "2099-01-01T04:00:00Z", "note": "' + b"A" * 100_000 + b'"}]}'),
    "oversized": b'{"version": 1, "reservations": [], "pad": "' + b" " * MAX_FILE_BYTES + b'"}',
    "binary": b"\xff\xfe\x00garbage",
}


@pytest.mark.parametrize("kind", sorted(BROKEN))
def test_broken_file_is_reported_and_left_untouched(tmp_path: Path, kind: str) -> None:
    path = tmp_path / "r.json"
    path.write_bytes(BROKEN[kind])
    store = Store(path)
    with pytest.raises(StoreError) as exc:
        store.read()
    assert str(path) in str(exc.value)
    with pytest.raises(StoreError):
        make(store, "h", 0, "ann")
    with pytest.raises(StoreError):
        release(store, None, user="ann")
    assert path.read_bytes() == BROKEN[kind]


def test_cli_on_broken_file_exits_2_and_keeps_it(tmp_path: Path) -> None:
    path = tmp_path / "r.json"
    path.write_bytes(BROKEN["wrong-version"])
    cfg = tmp_path / "hosts.toml"
    cfg.write_text(f'hosts = ["h"]\n[reservations]\npath = "{path}"\n')
    for args in (["reservations"], ["release", "--mine"]):
        r = subprocess.run([sys.executable, "-m", "gputop", "--config", str(cfg), *args],
                           capture_output=True, text=True, timeout=30)
        assert r.returncode == 2, r.stderr
        assert "unknown version 5" in r.stderr and str(path) in r.stderr
        assert "Traceback" not in r.stderr
    assert path.read_bytes() == BROKEN["wrong-version"]


def test_markup_in_a_note_is_shown_as_plain_text(tmp_path: Path) -> None:
    path = tmp_path / "r.json"
    path.write_text(json.dumps({"version": 1, "events": [], "reservations": [{
        "id": "x", "host": "h", "gpu": 0, "user": "mallory",
        "machine": "m", "created": iso(utcnow()), "expires": iso(utcnow() + timedelta(hours=1)),
        "note": "[bold]hi[/bold] [red]x[/]"}]}))
    cfg = tmp_path / "hosts.toml"
    cfg.write_text(f'hosts = ["h"]\n[reservations]\npath = "{path}"\n')
    r = subprocess.run([sys.executable, "-m", "gputop", "--config", str(cfg), "reservations"],
                       capture_output=True, text=True, timeout=30)
    assert r.returncode == 0
    assert "[bold]hi[/bold] [red]x[/]" in r.stdout


def test_a_forged_look_alike_user_is_refused_not_shown(tmp_path: Path) -> None:
    """A user name that cleaning would change could pass for someone else on every screen
    (gtalice vs gtalice + ESC[0m): the file is hostile, reported and left untouched."""
    path = tmp_path / "r.json"
    raw = json.dumps({"version": 1, "events": [], "reservations": [{
        "id": "x", "host": "h", "gpu": 0, "user": "gtalice\x1b[0m",
        "machine": "m", "created": iso(utcnow()), "expires": iso(utcnow() + timedelta(hours=1)),
        "note": "alice: do not touch"}]}).encode()
    path.write_bytes(raw)
    cfg = tmp_path / "hosts.toml"
    cfg.write_text(f'hosts = ["h"]\n[reservations]\npath = "{path}"\n')
    r = subprocess.run([sys.executable, "-m", "gputop", "--config", str(cfg), "reservations",
                        "--json"], capture_output=True, text=True, timeout=30)
    assert r.returncode == 2 and "user: not a name" in r.stderr, r.stderr
    assert "\x1b" not in r.stdout + r.stderr
    assert path.read_bytes() == raw


# -- links and permissions -------------------------------------------------------------------


def test_symlinked_lock_file_is_refused(tmp_path: Path) -> None:
    target = tmp_path / "elsewhere"
    target.write_text("x")
    (tmp_path / "r.json.lock").symlink_to(target)
    with pytest.raises(StoreError, match="symbolic link"):
        make(Store(tmp_path / "r.json"), "h", 0, "ann")
    assert target.read_text() == "x"


def test_a_hard_link_at_the_lock_path_is_not_made_group_writable(tmp_path: Path) -> None:
    """A teammate who plants a hard link to your private file at the lock path must not get
    gputop to chmod that file g+rw for them."""
    private = tmp_path / "private"
    private.write_text("secret")
    private.chmod(0o600)
    os.link(private, tmp_path / "r.json.lock")
    make(Store(tmp_path / "r.json"), "h", 0, "ann")
    assert stat.S_IMODE(private.stat().st_mode) == 0o600


def test_files_are_created_group_writable(tmp_path: Path) -> None:
    old = os.umask(0o022)
    try:
        make(Store(tmp_path / "r.json"), "h", 0, "ann")
    finally:
        os.umask(old)
    for name in ("r.json", "r.json.lock", "r.json.flock"):
        assert (tmp_path / name).stat().st_mode & 0o060 == 0o060, name


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to hand a directory to a group")
def test_setgid_team_directory_gives_files_the_team_group(tmp_path: Path) -> None:
    import grp

    from fleet import ensure_test_users

    if "gtbob" not in ensure_test_users():
        pytest.skip("test user gtbob unavailable")
    team = tmp_path / "team"
    team.mkdir()
    gid = grp.getgrnam("gtbob").gr_gid
    os.chown(team, -1, gid)
    team.chmod(0o2775)  # setgid: new files take the directory's group
    make(Store(team / "r.json"), "h", 0, "ann")
    for name in ("r.json", "r.json.lock", "r.json.flock"):
        st = (team / name).stat()
        assert st.st_gid == gid and st.st_mode & 0o060 == 0o060, name


def _as_user_release(path: str, uid: int, gid: int, out: multiprocessing.Queue) -> None:  # type: ignore[type-arg]
    os.setgid(gid)
    os.setuid(uid)  # a real other user from here on: the kernel enforces permissions
    try:
        release(Store(Path(path)), None, user="gtbob")
        out.put("no error")
    except StoreError as exc:
        out.put(str(exc))


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to become another user")
def test_permission_problem_names_path_and_fix(tmp_path: Path) -> None:
    import pwd

    from fleet import ensure_test_users

    if "gtbob" not in ensure_test_users():
        pytest.skip("test user gtbob unavailable")
    shared = tmp_path / "shared"
    shared.mkdir()
    for d in (tmp_path, shared):
        d.chmod(0o755)  # root's directory: readable, not writable, for gtbob
    pw = pwd.getpwnam("gtbob")
    ctx = multiprocessing.get_context("fork")
    out: multiprocessing.Queue = ctx.Queue()  # type: ignore[type-arg]
    child = ctx.Process(target=_as_user_release,
                        args=(str(shared / "r.json"), pw.pw_uid, pw.pw_gid, out))
    child.start()
    child.join(30)
    msg = out.get(timeout=5)
    assert "permission denied" in msg and str(shared) in msg and "chmod g+w" in msg
    assert not (shared / "r.json").exists()


def test_nfs_without_locks_is_reported(tmp_path: Path) -> None:
    mounts = tmp_path / "mounts"
    mounts.write_text(
        "/dev/vda / ext4 rw,relatime 0 0\n"
        "fs:/export/team /shared/team nfs4 rw,vers=4.2,local_lock=all,addr=10.0.0.1 0 0\n"
        "fs:/export/ok /shared/ok nfs4 rw,vers=4.2,local_lock=none 0 0\n")
    assert nfs_lock_problem(Path("/shared/team/gputop"), str(mounts)) is not None
    assert "local_lock=all" in (nfs_lock_problem(Path("/shared/team"), str(mounts)) or "")
    assert nfs_lock_problem(Path("/shared/ok/x"), str(mounts)) is None
    assert nfs_lock_problem(Path("/home/me"), str(mounts)) is None


# -- concurrency: 16 processes x 25 operations, zero lost updates ---------------------------

WORKERS, OPS = 16, 12


def _worker(path: str, p: int, results: multiprocessing.Queue) -> None:  # type: ignore[type-arg]
    store = Store(Path(path))
    won = 0
    try:
        make(store, "shared", 0, f"user{p}")
        won = 1
    except Refused:
        pass
    for i in range(OPS):
        make(store, f"host{p}", i, f"user{p}")
        if i % 3 == 0:
            release(store, [Target(f"host{p}", i)], user=f"user{p}")
    results.put(won)


def test_sixteen_writers_lose_no_update(tmp_path: Path) -> None:
    path = tmp_path / "r.json"
    ctx = multiprocessing.get_context("fork")
    results: multiprocessing.Queue = ctx.Queue()  # type: ignore[type-arg]
    procs = [ctx.Process(target=_worker, args=(str(path), p, results)) for p in range(WORKERS)]
    for pr in procs:
        pr.start()
    for pr in procs:
        pr.join(120)
        assert pr.exitcode == 0
    assert sum(results.get(timeout=5) for _ in procs) == 1  # exactly one won the shared GPU
    state = Store(path).read()
    got = {(r.host, r.gpu) for r in state.active() if r.host != "shared"}
    want = {(f"host{p}", i) for p in range(WORKERS) for i in range(OPS) if i % 3}
    assert got == want
    assert len(state.reservations) == len(want) + 1
    assert not list(tmp_path.glob(".r.json.tmp.*"))


# -- crashes: kill -9 at random moments never leaves a broken file --------------------------

CRASH_WRITER = """
import sys
from pathlib import Path
from gputop.reservations import Store, Target, reserve, release
store = Store(Path(sys.argv[1]))
n = int(sys.argv[2])
print("ready", flush=True)
i = 0
while True:
    reserve(store, [Target(f"w{n}", i % 50)], seconds=3600, max_seconds=86400, user="crash",
            note="x" * (i % 400))
    if i % 2:
        release(store, [Target(f"w{n}", (i - 1) % 50)], user="crash")
    i += 1
"""


def test_sigkill_at_random_moments_leaves_a_valid_file(tmp_path: Path) -> None:
    path = tmp_path / "r.json"
    make(Store(path), "keep", 0, "ann", "must survive")
    rng = random.Random(1234)
    for round_ in range(25):
        procs = [subprocess.Popen([sys.executable, "-c", CRASH_WRITER, str(path), str(k)],
                                  stdout=subprocess.PIPE, text=True) for k in range(2)]
        for pr in procs:
            assert pr.stdout is not None and pr.stdout.readline() == "ready\n"
        # The random moment is the point of this test: not a wait for an event.
        import time

        time.sleep(rng.uniform(0.0, 0.08))
        for pr in procs:
            pr.send_signal(signal.SIGKILL)
            pr.wait()
        state = Store(path).read()  # always parses and validates
        assert ("keep", 0) in {(r.host, r.gpu) for r in state.active()}, round_
    # A later writer cleans up the temp files of the killed ones.
    make(Store(path), "after", 0, "ann")
    assert not list(tmp_path.glob(".r.json.tmp.*"))


# -- valid JSON, hostile content: a StoreError naming the file, never another exception ------


def rec(**over: object) -> dict[str, object]:
    base: dict[str, object] = {
        "id": "a1", "host": "h", "gpu": 0, "user": "ann", "machine": "m",
        "created": iso(utcnow()), "expires": iso(utcnow() + timedelta(hours=1)), "note": ""}
    base.update(over)
    return {k: v for k, v in base.items() if v is not DROP}


DROP = object()


def doc(*records: object, **top: object) -> bytes:
    d: dict[str, object] = {"version": 1, "reservations": list(records), "events": []}
    d.update(top)
    return json.dumps(d).encode()


HOSTILE = {
    "deep-nesting": (b'{"version": 1, "reservations": [], "events": '
                     + b"[" * 100_000 + b"]" * 100_000 + b"}"),
    "time-underflows-utc": doc(rec(created="0001-01-01T00:00:00+01:00")),
    "time-overflows-utc": doc(rec(expires="9999-12-31T23:59:59-01:00")),
    "time-year-1": doc(rec(created="0001-01-01T00:00:00+00:00")),
    "gpu-5000-digits": (b'{"version": 1, "reservations": [{"gpu": ' + b"9" * 5000 + b"}]}"),
    "gpu-huge": doc(rec(gpu=2**63)),
    "gpu-negative": doc(rec(gpu=-1)),
    "gpu-float": doc(rec(gpu=1.0)),
    "gpu-bool": doc(rec(gpu=True)),
    "gpu-nan": b'{"version": 1, "reservations": [{"gpu": NaN}]}',
    "infinity": b'{"version": 1, "reservations": [], "events": [Infinity]}',
    "version-true": b'{"version": true, "reservations": []}',
    "version-float": b'{"version": 1.0, "reservations": []}',
    "duplicate-ids": doc(rec(id="same"), rec(id="same", gpu=1, user="bob")),
    "two-on-one-gpu": doc(rec(id="a"), rec(id="b", user="bob")),
    "record-not-object": doc("h:0"),
    "record-null": doc(None),
    "user-number": doc(rec(user=7)),
    "user-escape": doc(rec(user="ann\x1b[0m")),
    "user-zero-width": doc(rec(user="a\u200bnn")),
    "user-spaces": doc(rec(user="   ")),
    "user-markup": doc(rec(user="[red]ann[/]")),
    "host-bidi": doc(rec(host="h\u202e")),
    "id-newline": doc(rec(id="a\nb")),
    "note-escape": doc(rec(note="hi \x1b]0;pwned\x07")),
    "note-bidi": doc(rec(note="\u202eevil")),
    "host-empty": doc(rec(host="")),
    "host-huge": doc(rec(host="h" * 100_000)),
    "id-object": doc(rec(id={"a": 1})),
    "note-array": doc(rec(note=["x"])),
    "uuid-number": doc(rec(uuid=5)),
    "created-missing": doc(rec(created=DROP)),
    "created-number": doc(rec(created=1_700_000_000)),
    "time-naive": doc(rec(expires="2099-01-01T00:00:00")),
    "lone-surrogate": b'{"version": 1, "reservations": [{"id": "a", "host": "\\ud800", '
                      b'"gpu": 0, "user": "u", "machine": "m", "created": "2026-01-01T00:00:00Z",'
                      b' "expires": "2099-01-01T00:00:00Z"}]}',
    "bom": b"\xef\xbb\xbf" + doc(rec()),
    "unknown-top-level": doc(rec(), extra={"kept": "nowhere"}),
    "reservations-object": b'{"version": 1, "reservations": {}}',
    "event-not-object": doc(rec(), events=[1]),
    "event-deep": doc(rec(), events=[{"time": iso(utcnow()), "action": "force-release",
                                      "by": "b", "machine": "m",
                                      "reservation": rec(note=DROP, uuid=[[[[[]]]]])}]),
    # Deep enough to break json.dumps(indent=1) on the next write, shallow enough to parse.
    "event-nested": doc(rec(), events=[{"x": json.loads("[" * 900 + "]" * 900)}]),
}


@pytest.mark.parametrize("kind", sorted(HOSTILE))
def test_hostile_valid_json_is_a_store_error_and_left_untouched(tmp_path: Path,
                                                                kind: str) -> None:
    path = tmp_path / "r.json"
    path.write_bytes(HOSTILE[kind])
    store = Store(path)
    with pytest.raises(StoreError) as exc:
        store.read()
    assert str(path) in str(exc.value) and "untouched" in str(exc.value)
    with pytest.raises(StoreError):
        make(store, "h", 3, "ann")
    with pytest.raises(StoreError):
        release(store, None, user="ann")
    assert path.read_bytes() == HOSTILE[kind]


def _mutations(rng: random.Random) -> list[object]:
    return [None, True, False, 0, -1, 1.5, 2**40, "", "x" * 300, "\u202e", [], {}, [None],
            {"a": [1]}, "2026-01-01T00:00:00Z", "9999-12-31T23:59:59-23:59",
            rng.randint(-10, 10), rng.random()]


def test_fuzz_hostile_documents_give_store_error_or_a_valid_state(tmp_path: Path) -> None:
    """Replace every field at every level with hostile values: the store either reads a
    state it can write back and read again, or says StoreError; nothing else escapes."""
    rng = random.Random(8)
    path = tmp_path / "r.json"
    event = {"time": iso(utcnow()), "action": "force-release", "by": "b", "machine": "m",
             "reservation": rec(id="e")}
    base = {"version": 1, "reservations": [rec(), rec(id="b", gpu=1)], "events": [event]}
    paths: list[tuple[object, ...]] = [("version",), ("reservations",), ("events",)]
    paths += [("reservations", 0, k) for k in rec()] + [("events", 0, k) for k in event]
    paths += [("events", 0, "reservation", k) for k in rec()]
    outcomes = {"error": 0, "ok": 0}
    for p in paths:
        for value in _mutations(rng):
            d = json.loads(json.dumps(base))
            target = d
            for k in p[:-1]:
                target = target[k]
            target[p[-1]] = value
            path.write_bytes(json.dumps(d).encode())
            try:
                Store(path).read()
            except StoreError:
                outcomes["error"] += 1
                continue
            outcomes["ok"] += 1
            make(Store(path), "fuzz", 0, "zed")  # what was read can be written back...
            Store(path).read()  # ...and read again
    assert outcomes["error"] > 100 and outcomes["ok"] > 5, outcomes


def test_too_large_message_gives_the_real_size(tmp_path: Path) -> None:
    path = tmp_path / "r.json"
    size = MAX_FILE_BYTES * 2 + 17
    path.write_bytes(b" " * size)
    with pytest.raises(StoreError, match=f"{size} bytes is larger than"):
        Store(path).read()


def test_release_by_id_removes_exactly_that_reservation(tmp_path: Path) -> None:
    store = Store(tmp_path / "r.json")
    make(store, "h", 0, "ann")
    make(store, "h", 1, "bob")
    # A file where ann's and bob's share an id: releasing ann's must not take bob's.
    d = json.loads((tmp_path / "r.json").read_text())
    d["reservations"][1]["id"] = d["reservations"][0]["id"]
    (tmp_path / "r.json").write_text(json.dumps(d))
    with pytest.raises(StoreError, match="duplicate id"):
        release(store, [Target("h", 0)], user="ann")
    assert len(json.loads((tmp_path / "r.json").read_text())["reservations"]) == 2


# -- never write a file gputop would refuse to read ---------------------------------------


def test_refuses_to_write_more_bytes_than_a_reader_accepts(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """500-character notes of emoji are 12 bytes a character once escaped: about 670 of
    them pass every per-request check but would make a file no reader accepts (the
    per-user budget, lifted here, is a separate guard: many users together)."""
    import gputop.reservations.state as state_mod

    monkeypatch.setattr(state_mod, "MAX_USER_ENTRIES", 10_000)
    monkeypatch.setattr(state_mod, "MAX_USER_BYTES", 2 * MAX_FILE_BYTES)
    path = tmp_path / "r.json"
    store = Store(path)
    note = "\U0001f600" * 500
    reserve(store, [Target("h", i) for i in range(600)], seconds=H, max_seconds=86400,
            user="ann", note=note)
    before = path.read_bytes()
    with pytest.raises(StoreError) as exc:
        reserve(store, [Target("h", i) for i in range(600, 700)], seconds=H,
                max_seconds=86400, user="ann", note=note)
    msg = str(exc.value)
    assert "refusing to write" in msg and str(MAX_FILE_BYTES) in msg and str(path) in msg
    assert path.read_bytes() == before
    make(store, "h", 600, "ann", note)  # one more still fits
    assert len(store.read().reservations) == 601


def test_refuses_to_write_more_reservations_than_a_reader_accepts(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import gputop.reservations.state as state_mod  # where the file is encoded and decoded

    monkeypatch.setattr(state_mod, "MAX_RESERVATIONS", 5)
    store = Store(tmp_path / "r.json")
    reserve(store, [Target("h", i) for i in range(5)], seconds=H, max_seconds=86400,
            user="ann")
    with pytest.raises(StoreError, match="refusing to write 6 reservations"):
        make(store, "h", 9, "ann")
    assert len(store.read().reservations) == 5


def test_cli_reserve_that_would_overflow_the_file_exits_2(tmp_path: Path) -> None:
    path = tmp_path / "r.json"
    big = "\U0001f600" * 500
    now = utcnow()
    records = [rec(id=f"r{i}", host="g", gpu=i, note=big, created=iso(now),
                   expires=iso(now + timedelta(hours=5))) for i in range(672)]
    path.write_bytes(doc(*records))
    assert Store(path).read()  # readable as it is
    cfg = tmp_path / "hosts.toml"
    cfg.write_text('[[hosts]]\nname = "h"\ngpus = 16\n[defaults]\ntimeout = 0.5\n'
                   f'[reservations]\npath = "{path}"\n')
    before = path.read_bytes()
    spec = "h:" + ",".join(str(i) for i in range(10))  # within the user's budget
    r = subprocess.run([sys.executable, "-m", "gputop", "--config", str(cfg), "reserve", spec,
                        "--note", big], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2, r.stderr
    assert "refusing to write" in r.stderr and "Traceback" not in r.stderr
    assert path.read_bytes() == before


@pytest.mark.parametrize("kind", ["directory", "fifo"])
def test_not_a_regular_file_is_a_store_error_not_a_hang(tmp_path: Path, kind: str) -> None:
    path = tmp_path / "r.json"
    if kind == "directory":
        path.mkdir()
    else:
        os.mkfifo(path)
    cfg = tmp_path / "hosts.toml"
    cfg.write_text(f'hosts = ["h"]\n[reservations]\npath = "{path}"\n')
    for args in (["reservations"], ["release", "--mine"]):
        r = subprocess.run([sys.executable, "-m", "gputop", "--config", str(cfg), *args],
                           capture_output=True, text=True, timeout=20)
        assert r.returncode == 2 and "not a regular file" in r.stderr, r.stderr
    assert path.is_dir() if kind == "directory" else path.is_fifo()


def test_one_users_flood_is_refused_for_them_alone(tmp_path: Path) -> None:
    """5,000 GPUs with 500-character notes for a week (the flood that made a 4 MB file and
    then every other user's write fail): refused with the numbers, nothing written; the
    others still reserve, and the flooder's own budget still takes what fits."""
    path = tmp_path / "r.json"
    store = Store(path)
    make(store, "h", 0, "bob")
    before = path.read_bytes()
    flood = [Target("gpu-003", i) for i in range(5000)]
    with pytest.raises(OverBudget) as exc:
        reserve(store, flood, seconds=7 * 86400, max_seconds=7 * 86400, user="mallory",
                note="x" * 500)
    msg = str(exc.value)
    assert "mallory would hold 5000" in msg and f"at most {MAX_USER_ENTRIES}" in msg
    assert path.read_bytes() == before
    # Within the budget in entries, past it in bytes: refused on bytes.
    with pytest.raises(OverBudget, match=f"{MAX_USER_BYTES // 1024} kB"):
        reserve(store, flood[:MAX_USER_ENTRIES], seconds=H, max_seconds=7 * 86400,
                user="mallory", note="\U0001f600" * 500)
    reserve(store, flood[:MAX_USER_ENTRIES], seconds=H, max_seconds=7 * 86400,
            user="mallory", note="x" * 500)
    with pytest.raises(OverBudget):  # one more
        make(store, "gpu-003", MAX_USER_ENTRIES, "mallory")
    make(store, "h", 1, "bob", "x" * 500)  # everyone else is unaffected
    make(store, "gpu-003", 4999, "carol")
    assert len(path.read_bytes()) < MAX_FILE_BYTES // 8
    assert release(store, [Target("gpu-003", 0)], user="mallory")  # shrinking is never refused


def test_a_user_already_past_the_budget_may_shrink_and_others_write(tmp_path: Path) -> None:
    """A file from before the budget (an older gputop), one user far past it: nobody is
    locked out, that user may release and extend, just not grow."""
    path = tmp_path / "r.json"
    now = utcnow()
    path.write_text(json.dumps({"version": 1, "events": [], "reservations": [
        {"id": f"r{i}", "host": "h", "gpu": i, "user": "mallory", "machine": "m",
         "created": iso(now), "expires": iso(now + timedelta(hours=5)), "uuid": None,
         "note": ""} for i in range(200)]}))
    store = Store(path)
    make(store, "h", 500, "bob")
    release(store, [Target("h", 0)], user="mallory")
    make(store, "h", 1, "mallory")  # extends one of hers: no growth
    with pytest.raises(OverBudget, match="mallory would hold 200"):
        make(store, "h", 300, "mallory")
    assert len(store.read().reservations) == 200
