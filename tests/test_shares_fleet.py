"""Memory shares of a GPU (issue 21), with real users against real sshd hosts.

``share-h100`` has two H100 80GB GPUs (the stand-in replays the real capture: 81559 MiB,
79.6G); gtalice runs a notebook on GPU 0 (20000 MiB), gtbob a job on GPU 1. ``share-rtx``
is an idle RTX 2080 SUPER (8G, the only idle capture): the untouched GPU that best fit
leaves whole even where it is the tighter fit. "carol" is the user
running the tests (root): a third real account.
"""

from __future__ import annotations

import json
import os
import pwd
import signal
import sqlite3
import subprocess
import sys
import time
from collections.abc import Iterator
from typing import Any

import jsonschema
import pytest

from tests.support.as_user import (
    need_test_users,
    run_as,
    shared_tmp,
    start_as,
    team_dir,
    user_home,
    wait_as,
)
from tests.support.fleet import Fleet, GpuProcess, Host, gpu_uuid
from tests.support.recorder_proc import running, stop_recorder
from tests.support.shared_fleet import need_sshd, world_readable

HOST = "share-h100"
CAROL = pwd.getpwuid(os.getuid()).pw_name
TOTAL = 81559  # the H100 capture's memory.total (MiB)


@pytest.fixture(scope="module")
def share_fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    need_sshd()
    need_test_users()
    f = Fleet(world_readable(tmp_path_factory.mktemp("shares")), [
        Host(HOST, "127.0.8.2", gpus=("h100", "h100"), processes=[
            GpuProcess("gtalice", "python -m jupyter notebook", gpu=0, mem_mib=20000),
            GpuProcess("gtbob", "python eval.py", gpu=1, mem_mib=5000),
        ]),
        Host("share-rtx", "127.0.8.3", gpus=("rtx2080",)),
    ]).start()
    yield f
    f.stop()


@pytest.fixture
def gputop(share_fleet: Fleet) -> Iterator[Any]:
    """``gputop ARGS`` as a real user (gtalice by default), on a fresh shared file."""
    with shared_tmp() as tmp:
        res = team_dir(tmp) / "reservations.json"
        cfg = share_fleet.write_config(timeout=20.0, interval=1.0)
        text = cfg.read_text().replace(
            f'path = "{share_fleet.root / "reservations.json"}"',
            f'path = "{res}"\nshare_grace = "2s"')
        cfg = tmp / "hosts.toml"
        cfg.write_text(text)
        cfg.chmod(0o644)
        homes = {u: user_home(share_fleet, tmp, u) for u in ("gtalice", "gtbob", CAROL)}

        def run(*args: str, user: str = "gtalice") -> Any:
            env = share_fleet.env() | {"HOME": str(homes[user]), "USER": user,
                                       "LOGNAME": user, "TZ": "UTC"}
            return run_as(user, ["--config", str(cfg), *args], env, tmp)

        run.path = res  # type: ignore[attr-defined]
        run.config = cfg  # type: ignore[attr-defined]
        run.tmp = tmp  # type: ignore[attr-defined]
        run.env = lambda user: share_fleet.env() | {  # type: ignore[attr-defined]
            "HOME": str(homes[user]), "USER": user, "LOGNAME": user, "TZ": "UTC"}
        yield run


def shares(gputop: Any) -> list[tuple[str, int, str, int]]:
    doc = json.loads(gputop.path.read_text())
    return [(r["host"], r["gpu"], r["user"], r["share_mib"]) for r in doc["reservations"]
            if "share_mib" in r]


def gpu_doc(gputop: Any, user: str = "gtbob", index: int = 0) -> dict[str, Any]:
    r = gputop("--json", user=user)
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    host = next(h for h in doc["hosts"] if h["name"] == HOST)
    return dict(next(g for g in host["gpus"] if g["index"] == index))


def test_done_when_three_people_share_one_gpu(gputop: Any, schema: Any) -> None:
    # alice and bob each hold 30G of the 80G GPU
    r = gputop("reserve", f"{HOST}:0", "--share", "30G", "--for", "2h", "--note", "notebook")
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith(f"reserved a 30G share of {HOST}:0 until ")
    assert "49.6G of 79.6G left unshared" in r.stdout
    r = gputop("reserve", f"{HOST}:0", "--share", "30G", user="gtbob")
    assert r.returncode == 0, r.stderr
    assert "19.6G of 79.6G left unshared" in r.stdout
    # carol's 30G is refused naming the room left; her 16G is accepted
    r = gputop("reserve", f"{HOST}:0", "--share", "30G", user=CAROL)
    assert r.returncode == 1
    assert (f"{HOST}:0 has 19.6G ({TOTAL - 2 * 30720} MiB) of 79.6G left unshared "
            "(gtalice 30G, gtbob 30G); asked for 30G") in r.stderr
    r = gputop("reserve", f"{HOST}:0", "--share", "16G", user=CAROL)
    assert r.returncode == 0, r.stderr
    assert shares(gputop) == [(HOST, 0, "gtalice", 30720), (HOST, 0, "gtbob", 30720),
                              (HOST, 0, CAROL, 16384)]
    # a whole reservation of that GPU is refused (a sharer's too), and the file is as it was
    before = gputop.path.read_bytes()
    for who in ("gtbob", "gtalice"):
        r = gputop("reserve", f"{HOST}:0", user=who)
        assert r.returncode == 1
        assert f"{HOST}:0: a 30G share of it is held by gtalice" in r.stderr
    assert gputop.path.read_bytes() == before
    # a bare whole-GPU `free` does not offer the shared GPU
    r = gputop("free", "--count", "3", "--host", HOST, user="gtbob")
    assert f"{HOST}:0" not in r.stdout
    # everyone sees the shares: holder, size, what the holder uses now, time left
    g = gpu_doc(gputop)
    jsonschema.validate(json.loads(gputop("--json").stdout), schema)
    assert g["reservation"] is None
    assert [(s["user"], s["share_mib"], s["used_mib"]) for s in g["shares"]] == [
        ("gtalice", 30720, 20000), ("gtbob", 30720, 0), (CAROL, 16384, 0)]
    assert g["unshared_mib"] == TOTAL - 2 * 30720 - 16384
    assert all(0 < s["seconds_left"] <= 4 * 3600 for s in g["shares"])
    assert g["flags"] == []  # nobody runs there who holds no share
    # --once: the GPU's line and one per share
    once = gputop("--once", user="gtbob").stdout
    assert "shared, 3.6G unshared" in once
    assert any("share" in ln and "19.5/30G" in ln and "gtalice" in ln
               for ln in once.splitlines())
    # release takes your own share only; --force records whose it took
    r = gputop("release", f"{HOST}:0", user="gtbob")
    assert r.returncode == 0 and r.stdout == f"released {HOST}:0\n"
    assert [s[2] for s in shares(gputop)] == ["gtalice", CAROL]
    r = gputop("release", f"{HOST}:0", user="gtbob")
    assert r.returncode == 1 and "use --force" in r.stderr
    r = gputop("release", f"{HOST}:0", "--force", user="gtbob")
    assert r.returncode == 0, r.stderr
    doc = json.loads(gputop.path.read_text())
    assert doc["reservations"] == [] and doc["version"] == 3
    assert [(e["action"], e["reservation"]["user"]) for e in doc["events"]] == [
        ("force-release", "gtalice"), ("force-release", CAROL)]


def test_a_holder_growing_past_the_share_is_flagged_after_the_grace(
        gputop: Any, share_fleet: Fleet) -> None:
    assert gputop("reserve", f"{HOST}:0", "--share", "30G").returncode == 0
    assert gputop("reserve", f"{HOST}:0", "--share", "16G", user="gtbob").returncode == 0
    h = share_fleet.hosts[HOST]
    notebook = h.processes[0]
    pid, out, err = start_as("gtbob", ["--config", str(gputop.config), "--json", "--watch"],
                             gputop.env("gtbob"), gputop.tmp, "watch")
    try:
        def docs() -> list[dict[str, Any]]:
            lines = out.read_text().splitlines() if out.exists() else []
            return [dict(next(g for g in next(x for x in json.loads(ln)["hosts"]
                                               if x["name"] == HOST)["gpus"]
                              if g["index"] == 0)) for ln in lines if ln.endswith("}")]

        def wait_for(pred: Any, what: str) -> list[dict[str, Any]]:
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline:
                got = docs()
                if any(pred(g) for g in got):
                    return got
                time.sleep(0.1)
            raise AssertionError(f"no document {what}: {err.read_text()[-2000:]}")

        alice = lambda g: g["shares"][0]  # noqa: E731
        wait_for(lambda g: alice(g)["used_mib"] == 20000, "with the notebook at 20000 MiB")
        notebook.mem_mib = 40960  # the notebook grows to 40G: over its 30G share
        share_fleet.set_scenario(h, "ok")
        got = wait_for(lambda g: "over-share" in alice(g)["flags"], "flagging over-share")
        over = [g for g in got if alice(g)["used_mib"] == 40960]
        # the first look at 40G is within the grace: not flagged yet; later ones are
        assert "over-share" not in alice(over[0])["flags"]
        flagged = next(g for g in over if "over-share" in alice(g)["flags"])
        assert "over-share" in flagged["flags"]  # the GPU says so too
        assert "over-share" not in flagged["shares"][1]["flags"]  # bob's share is not over
        notebook.mem_mib = 20000
        share_fleet.set_scenario(h, "ok")
        wait_for(lambda g: alice(g)["used_mib"] == 20000
                 and "over-share" not in g["flags"], "after the notebook shrank")
    finally:
        notebook.mem_mib = 20000
        share_fleet.set_scenario(h, "ok")
        os.killpg(pid, signal.SIGTERM)
        wait_as(pid)


def test_free_share_picks_the_shared_gpu_and_run_share_sets_the_environment(
        gputop: Any) -> None:
    assert gputop("reserve", f"{HOST}:0", "--share", "30G").returncode == 0
    # best fit: the GPU already shared before the untouched, idle RTX (a tighter fit)
    r = gputop("free", "--share", "4G", user="gtbob")
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines() == [f"{HOST}:0", "share-rtx:0"]
    r = gputop("free", "--share", "16G", user="gtbob")
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines() == [f"{HOST}:0"]
    r = gputop("free", "--share", "4G")  # alice holds a share of it: resize that instead
    assert r.stdout.splitlines() == ["share-rtx:0"]
    r = gputop("free", "--share", "16G", "--json", user="gtbob")
    first = json.loads(r.stdout)["free"][0]
    assert (first["host"], first["shared"], first["unshared_mib"]) == (HOST, True,
                                                                     TOTAL - 30720)
    # run --share: reserves (best fit), tells the job, releases at exit
    r = gputop("run", "--share", "16G", "--", "sh", "-c",
               'echo "share=$GPUTOP_SHARE_MIB frac=$GPUTOP_SHARE_FRACTION '
               'xla=$XLA_PYTHON_CLIENT_MEM_FRACTION/$XLA_CLIENT_MEM_FRACTION '
               'tf=$TF_FORCE_GPU_ALLOW_GROWTH dev=$CUDA_VISIBLE_DEVICES"', user="gtbob")
    assert r.returncode == 0, r.stderr
    frac = f"{16384 * 1000 // TOTAL / 1000:g}"
    assert (f"share=16384 frac={frac} xla={frac}/{frac} tf=true "
            f"dev={gpu_uuid(HOST, 0)}") in r.stdout
    assert f"running on a 16G share of {HOST}:0" in r.stderr
    assert "released " + f"{HOST}:0" in r.stderr
    assert shares(gputop) == [(HOST, 0, "gtalice", 30720)]
    # free --share --reserve takes the best fit; stdout stays HOST:GPU for scripts
    r = gputop("free", "--share", "16G", "--reserve", "--for", "1h", user="gtbob")
    assert r.returncode == 0, r.stderr
    assert r.stdout == f"{HOST}:0\n" and "reserved a 16G share" in r.stderr
    # resizing your own share, within the room the others leave
    r = gputop("reserve", f"{HOST}:0", "--share", "40G", user="gtbob")
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith(f"resized your share of {HOST}:0 from 16G to 40G")
    r = gputop("reserve", f"{HOST}:0", "--share", "50G", user="gtbob")
    assert r.returncode == 1 and "has 49.6G" in r.stderr
    # a GPU reserved whole takes no share, and a share on a MIG instance is refused
    assert gputop("reserve", "share-rtx:0", user=CAROL).returncode == 0
    r = gputop("reserve", "share-rtx:0", "--share", "4G")
    assert r.returncode == 1 and "share-rtx:0 is reserved by" in r.stderr
    r = gputop("reserve", f"{HOST}:1/3", "--share", "8G")
    assert r.returncode == 2 and "MIG instance is reserved whole" in r.stderr
    r = gputop("reserve", f"{HOST}:0", "--share", "16")
    assert r.returncode == 2 and "needs a unit" in r.stderr


def test_a_share_waiter_is_served_when_room_frees(gputop: Any) -> None:
    assert gputop("reserve", f"{HOST}:0", "--share", "30G").returncode == 0
    assert gputop("reserve", f"{HOST}:0", "--share", "30G", user="gtbob").returncode == 0
    pid, out, err = start_as(CAROL, ["--config", str(gputop.config), "free", "--share",
                                     "30G", "--wait", "--host", HOST, "--for", "1h"],
                             gputop.env(CAROL), gputop.tmp, "waiter")
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:  # carol is in the queue, for a share
            q = json.loads(gputop.path.read_text()).get("queue", [])
            if q:
                break
            time.sleep(0.05)
        assert q[0]["user"] == CAROL and q[0]["share_mib"] == 30720
        assert gputop("release", f"{HOST}:0", user="gtbob").returncode == 0
        # someone not in the queue cannot take the room carol waits for: refused by the
        # queue's claim while she waits, for want of room once she has it
        r = gputop("reserve", f"{HOST}:0", "--share", "30G", user="gtbob")
        assert r.returncode == 1
        assert "the queue waits for" in r.stderr or "left unshared" in r.stderr
        assert wait_as(pid, 60) == 0, err.read_text()
    finally:
        if os.path.exists(f"/proc/{pid}"):
            os.killpg(pid, signal.SIGTERM)
            wait_as(pid)
    assert out.read_text() == f"{HOST}:0\n"
    assert shares(gputop) == [(HOST, 0, "gtalice", 30720), (HOST, 0, CAROL, 30720)]


def test_the_report_counts_each_shares_fraction(gputop: Any) -> None:
    assert gputop("reserve", f"{HOST}:0", "--share", "30G").returncode == 0
    assert gputop("reserve", f"{HOST}:0", "--share", "16G", user="gtbob").returncode == 0
    db = gputop.tmp / "history.sqlite3"
    env = gputop.env(CAROL)
    rec = subprocess.Popen([sys.executable, "-m", "gputop", "--config", str(gputop.config),
                            "record", "--db", str(db)], env=env, stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE, text=True)
    with running(rec):
        deadline = time.monotonic() + 60
        n = 0
        while time.monotonic() < deadline and n < 4:
            if db.exists():
                try:
                    c = sqlite3.connect(f"file:{db}?mode=ro", uri=True)
                    n = c.execute("SELECT COUNT(*) FROM samples s JOIN hosts h ON "
                                  "h.id = s.host WHERE h.name = ? AND ok = 1",
                                  (HOST,)).fetchone()[0]
                    c.close()
                except sqlite3.Error:
                    pass
            time.sleep(0.1)
        assert n >= 4, "the recorder wrote too few samples"
        stop_recorder(rec)
    r = subprocess.run([sys.executable, "-m", "gputop", "--config", str(gputop.config),
                        "report", "--db", str(db), "--since", "1h", "--json"], env=env,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    users = {u["user"]: u for u in doc["users"]}
    gpu0 = next(g for g in doc["gpus"] if g["host"] == HOST and g["index"] == 0)
    hours = gpu0["gpu_hours"]
    assert hours > 0
    alice, bob = users["gtalice"], users["gtbob"]
    # each share is its fraction of the GPU's memory, in reserved GPU-hours
    assert alice["reserved_hours"] == pytest.approx(hours * 30720 / TOTAL, rel=1e-6)
    assert bob["reserved_hours"] == pytest.approx(hours * 16384 / TOTAL, rel=1e-6)
    assert alice["shared_hours"] == pytest.approx(alice["reserved_hours"])
    # used and idle per share: alice's notebook runs there, bob runs nothing on GPU 0
    assert alice["reserved_idle_hours"] == 0 and alice["used_hours"] > 0
    assert bob["shared_idle_hours"] == pytest.approx(bob["reserved_hours"], rel=1e-6)
    assert gpu0["reserved_hours"] == pytest.approx(hours * (30720 + 16384) / TOTAL, rel=1e-6)
    text = subprocess.run([sys.executable, "-m", "gputop", "--config", str(gputop.config),
                           "report", "--db", str(db), "--since", "1h"], env=env,
                          capture_output=True, text=True, timeout=60).stdout
    assert "OF IT SHARED" in text and "SHARED IDLE" in text
