"""``gputop record`` against real sshd hosts with known owners, a reservation, idle time and
a host that goes down; ``gputop report`` must match what the test did, within one sample
interval per transition."""

from __future__ import annotations

import json
import shlex
import signal
import sqlite3
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import replace
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import pytest

from gputop.reservations.store import Store
from gputop.reservations.terms import Target, Terms, new_reservation
from tests.support.fleet import Fleet, GpuProcess, Host
from tests.support.recorder_proc import running, stop_recorder
from tests.support.shared_fleet import need_sshd, world_readable

INTERVAL = 0.5
PHASE = 1.5


@pytest.fixture
def history_fleet(tmp_path: Path) -> Iterator[Fleet]:
    need_sshd()
    (tmp_path / "fleet").mkdir()
    f = Fleet(world_readable(tmp_path / "fleet"), [
        # alpha: an H100 at 100 % under gtalice's job, unreserved
        Host("alpha", "127.0.2.2", processes=[GpuProcess("gtalice", "python train.py")]),
        # beta: an idle RTX 2080 (0 %) that gtbob reserved
        Host("beta", "127.0.2.3", gpus=("rtx2080",)),
    ]).start()
    yield f
    f.stop()


def _iso(t: float) -> str:
    return datetime.fromtimestamp(t, timezone.utc).isoformat()


def _report(cfg: Path, start: float, end: float) -> tuple[Any, dict[str, Any], dict[str, Any]]:
    """``gputop report --json`` over [start, end]: the document, its users and its hosts
    (these two by name)."""
    r = subprocess.run([sys.executable, "-m", "gputop", "--config", str(cfg), "report",
                        "--from", _iso(start), "--to", _iso(end), "--json"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    return doc, {u["user"]: u for u in doc["users"]}, {h["host"]: h for h in doc["hosts"]}


def _wait_for_samples(db: Path, hosts: int, deadline: float) -> None:
    while time.monotonic() < deadline:
        if db.exists():
            try:
                c = sqlite3.connect(f"file:{db}?mode=ro", uri=True)
                n = c.execute("SELECT COUNT(DISTINCT host) FROM samples WHERE ok = 1"
                              ).fetchone()[0]
                c.close()
                if n >= hosts:
                    return
            except sqlite3.Error:
                pass
        time.sleep(0.1)
    raise AssertionError("the recorder wrote no samples in time")


def _record(fleet: Fleet, cfg: Path) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-m", "gputop", "--config", str(cfg), "record"],
                            env=fleet.env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)


def test_recorded_run_matches_the_ground_truth(history_fleet: Fleet, tmp_path: Path) -> None:
    fleet = history_fleet
    db = tmp_path / "history.sqlite3"
    cfg = fleet.write_config(timeout=2.0, interval=INTERVAL,
                             extra=f'[history]\npath = "{db}"\n')
    Store(fleet.root / "reservations.json").update(lambda st, now: replace(
        st, reservations=(*st.reservations,
                          new_reservation(
                              Target("beta", 0), Terms(3600, user="gtbob", machine="m"), now))))
    rec = _record(fleet, cfg)
    with running(rec):
        _wait_for_samples(db, 2, time.monotonic() + 30)
        t0 = time.time()
        time.sleep(PHASE)
        # gtbob starts a job on his reserved GPU: it holds memory at 0 % load
        beta = fleet.hosts["beta"]
        job = GpuProcess("gtbob", "python eval.py", gpu=0)
        job.popen = subprocess.Popen(
            ["bash", "-c", f"exec -a {shlex.quote(job.argv0)} sleep 86400"], user="gtbob",
            start_new_session=True, cwd="/", stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL)
        beta.processes.append(job)
        fleet.set_scenario(beta, "ok")
        t1 = time.time()
        time.sleep(PHASE)
        fleet.stop_sshd(fleet.hosts["alpha"])  # alpha goes down
        t2 = time.time()
        time.sleep(PHASE)
        t3 = time.time()
        time.sleep(1.5)  # the last samples get committed
        stop_recorder(rec)

    _, users, hosts = _report(cfg, t0, t3)
    c = sqlite3.connect(f"file:{db}?mode=ro", uri=True)
    # one sample interval, as recorded (a loaded machine stretches it a little)
    unit = max(INTERVAL, c.execute("SELECT MAX(dt) FROM samples WHERE t >= ?",
                                   (int(t0 * 1000),)).fetchone()[0] / 1000)
    c.close()

    def near(hours: float, seconds: float, transitions: int) -> None:
        assert abs(hours * 3600 - seconds) <= unit * transitions + 0.05, (hours * 3600,
                                                                          seconds, unit)

    alice, bob = users["gtalice"], users["gtbob"]
    near(alice["used_hours"], t2 - t0, 2)
    near(alice["unreserved_hours"], t2 - t0, 2)
    assert alice["reserved_hours"] == 0 and alice["held_idle_hours"] == 0
    assert alice["mean_utilization_used"] == pytest.approx(100)
    near(bob["reserved_hours"], t3 - t0, 2)
    near(bob["reserved_idle_hours"], t1 - t0, 2)
    near(bob["used_hours"], t3 - t1, 2)
    near(bob["held_idle_hours"], t3 - t1, 2)
    assert bob["unreserved_hours"] == 0
    alpha, beta_ = hosts["alpha"], hosts["beta"]
    near(alpha["busy_hours"], t2 - t0, 2)
    near(alpha["no_data_hours"], t3 - t2, 2)
    assert alpha["mean_utilization"] == pytest.approx(100)  # down is no data, not 0 %
    near(beta_["held_idle_hours"], t3 - t0, 2)
    assert beta_["busy_hours"] == 0 and beta_["no_data_hours"] == 0

    # A second recorder on the same file, killed with SIGKILL: the database stays valid.
    rec = _record(fleet, cfg)
    try:
        time.sleep(2.5)
    finally:
        rec.send_signal(signal.SIGKILL)
        rec.wait()
    c = sqlite3.connect(f"file:{db}?mode=ro", uri=True)
    assert c.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
    c.close()
    r = subprocess.run([sys.executable, "-m", "gputop", "--config", str(cfg), "report",
                        "--since", "1h"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert "gtbob" in r.stdout


def test_json_watch_can_record_while_it_runs(history_fleet: Fleet, tmp_path: Path) -> None:
    db = tmp_path / "history.sqlite3"
    cfg = history_fleet.write_config(timeout=2.0, interval=INTERVAL,
                                     extra=f'[history]\npath = "{db}"\n')
    p = subprocess.Popen([sys.executable, "-m", "gputop", "--config", str(cfg), "--json",
                          "--watch", "--record"], env=history_fleet.env(),
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        _wait_for_samples(db, 2, time.monotonic() + 30)
    finally:
        p.terminate()
        p.wait(15)
    r = subprocess.run([sys.executable, "-m", "gputop", "--config", str(cfg), "report",
                        "--since", "10m", "--by", "host", "--csv"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert {ln.split(",")[0] for ln in r.stdout.splitlines()[1:]} == {"alpha", "beta"}
    # a database it cannot use stops it before it starts, naming the file
    db.unlink()
    db.write_bytes(b"not a database" * 100)
    r = subprocess.run([sys.executable, "-m", "gputop", "--config", str(cfg), "--json",
                        "--watch", "--record"], env=history_fleet.env(),
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and str(db) in r.stderr and r.stdout == ""


@pytest.fixture
def forged_fleet(tmp_path: Path) -> Iterator[Fleet]:
    need_sshd()
    (tmp_path / "fleet").mkdir()
    f = Fleet(world_readable(tmp_path / "fleet"), [
        Host("alpha", "127.0.2.2", processes=[GpuProcess("gtalice", "python train.py")]),
        Host("gamma", "127.0.2.4", scenario="unreachable"),  # down all along
    ]).start()
    yield f
    f.stop()


def test_forged_holders_are_not_kept_and_a_host_down_all_along_is_reported(
        forged_fleet: Fleet, tmp_path: Path) -> None:
    """While `gputop record` runs against real hosts, a careless teammate writes a new holder
    of alpha:0 into the shared file every 50 ms (ten per refresh): no name held for a
    single refresh gets rows of its own (only the few a stalled writer left for two
    refreshes may), their time is all there under (other names), and gamma, down before
    any GPU of it was seen, is in the report as host-hours with its GPUs unknown."""
    fleet = forged_fleet
    db = tmp_path / "history.sqlite3"
    cfg = fleet.write_config(timeout=2.0, interval=INTERVAL,
                             extra=f'[history]\npath = "{db}"\n')
    store = Store(fleet.root / "reservations.json")

    def forge(i: int) -> None:
        store.update(lambda st, now: replace(st, reservations=(
            new_reservation(
                Target("alpha", 0), Terms(3600, user=f"forged{i}", machine="m"), now),)))

    forge(0)
    rec = _record(fleet, cfg)
    forged = 1
    with running(rec):
        _wait_for_samples(db, 1, time.monotonic() + 30)
        t0 = time.time()
        while time.time() - t0 < 8 * INTERVAL:
            forge(forged)
            forged += 1
            time.sleep(0.05)
        t1 = time.time()
        time.sleep(1.5)  # the last samples get committed
        stop_recorder(rec)
    c = sqlite3.connect(f"file:{db}?mode=ro", uri=True)
    names = [n for (n,) in c.execute("SELECT name FROM users")]
    samples = c.execute("SELECT COUNT(*) FROM samples s JOIN hosts h ON h.id = s.host "
                        "WHERE h.name = 'alpha'").fetchone()[0]
    c.close()
    # forged0 (held before recording began) and the last one (held to the end) stayed
    kept = [n for n in names if n.startswith("forged")
            and n not in ("forged0", f"forged{forged - 1}")]
    assert forged > 30 and samples >= 8
    assert len(kept) <= max(2, samples // 4), (kept, samples)  # main: one per read
    assert "gtalice" in names and "(other names)" in names

    doc, users, hosts = _report(cfg, t0, t1)
    span = t1 - t0
    slack = 3 * INTERVAL + 0.1  # a sample interval at each end, and a loaded machine's
    held = sum(u["reserved_hours"] for u in users.values()) * 3600
    assert abs(held - span) <= slack  # every second of alpha:0 held by someone
    assert users["(other names)"]["reserved_hours"] * 3600 >= span - slack * (1 + len(kept))
    assert abs(users["gtalice"]["used_hours"] * 3600 - span) <= slack
    assert set(hosts) == {"alpha", "gamma"}
    gamma = hosts["gamma"]
    assert gamma["gpus"] is None and gamma["gpu_hours"] == 0
    assert abs(gamma["unknown_gpus_hours"] * 3600 - span) <= slack
    assert doc["headline"]["no_data_hours"] == 0  # gamma's are host-hours, not GPU-hours
    r = subprocess.run([sys.executable, "-m", "gputop", "--config", str(cfg), "report",
                        "--from", _iso(t0), "--to", _iso(t1), "--by", "host"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert "gamma: down" in r.stdout and "GPUs unknown" in r.stdout
