"""The queue, measured on the real-sshd test fleet.

    python -m bench.queue_bench                     # 20 trials, 50 waiters for 30 s
    python -m bench.queue_bench --trials 5 --waiters 10 --seconds 10   # quick

1. Grant latency: a GPU held by someone, one ``gputop free --wait`` waiting for it at the
   default interval (2 s). The reservation is released; the time until the waiter's
   reservation is in the file (read every 2 ms) is one trial. Bound: one refresh interval
   plus one store write (the median write time is measured here too).
2. Contention: ``--waiters`` processes ``gputop free --wait`` at the default interval for
   GPUs that never come free, for ``--seconds``. A probe process tries the lock without
   blocking every millisecond; the share of tries that find it held is how much of the
   time the lock is held (target: < 5 %).

Writes ``bench/results/queue.md`` and ``queue.json``.
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import fcntl
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from gputop.reservations.state import StoreState
from gputop.reservations.store import Store
from gputop.reservations.terms import Target, Terms, new_reservation
from tests.support.fleet import Fleet, GpuProcess, Host, sshd_available

ROOT = Path(__file__).resolve().parents[1]

OUT = ROOT / "bench" / "results"
INTERVAL = 2.0  # the default refresh interval


def block(store: Store, gpus: list[tuple[str, int]]) -> None:
    def change(state: StoreState, now: Any) -> StoreState:
        return replace(state, reservations=state.reservations + tuple(
            new_reservation(
                Target(h, g), Terms(3600, user="someone", machine="m"), now) for h, g in gpus))
    store.update(change)


def release_all(store: Store, user: str) -> None:
    store.update(lambda s, now: replace(s, reservations=tuple(
        r for r in s.reservations if r.user != user)))


#: gputop, with the per-person limit on places in the queue lifted: every waiter here runs
#: as one uid but stands for one person of a team of 50.
RUNNER = ("import sys, gputop.reservations.queue as q; q.MAX_PLACES_PER_USER = 10**6; "
          "from gputop.cli import main; sys.exit(main(sys.argv[1:]))")


def waiter(cfg: Path, env: dict[str, str], count: int) -> subprocess.Popen[bytes]:
    return subprocess.Popen([sys.executable, "-c", RUNNER, "--config", str(cfg), "free",
                             "--wait", "--count", str(count)], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def grant_latency(fleet: Fleet, cfg: Path, store: Store, trials: int, how: str
                  ) -> dict[str, Any]:
    """``how``: "release" (the holder releases its reservation: a file change) or "exit"
    (the process using the GPU ends: the next nvidia-smi no longer lists it)."""
    env = fleet.env()
    me = None
    out: list[float] = []
    host = fleet.hosts["b2"]
    job = host.processes[:]
    i = 0
    while i < trials:
        if how == "release":
            block(store, [("b1", 0)])
        else:
            host.processes[:] = job
            fleet.set_scenario(host, "ok")
        p = waiter(cfg, env, 1)
        deadline = time.monotonic() + 60
        while not store.read().queue:
            if p.poll() == 0:  # served before it could be seen waiting: the GPU's job
                break          # was not listed yet (the scenario just switched); again
            if time.monotonic() > deadline or p.poll() is not None:
                raise RuntimeError("the waiter did not join the queue")
            time.sleep(0.01)
        if p.poll() == 0:
            for user in {r.user for r in store.read().reservations if r.user != "someone"}:
                release_all(store, user)
            time.sleep(INTERVAL)
            continue
        i += 1
        # Let it connect and reach its steady loop; release at a point of its interval
        # that differs from trial to trial.
        time.sleep(3 * INTERVAL + ((i - 1) % 10) * INTERVAL / 10)
        if how == "release":
            release_all(store, "someone")
        else:
            host.processes[:] = []
            fleet.set_scenario(host, "ok")
        t0 = time.monotonic()
        while True:
            rs = store.read().reservations
            if any(r.user != "someone" for r in rs):
                break
            if time.monotonic() - t0 > 30:
                raise RuntimeError("no grant within 30 s")
            time.sleep(0.002)
        out.append(time.monotonic() - t0)
        me = me or next(r.user for r in rs)
        p.wait(30)
        release_all(store, me)
        print(f"  {how} trial {i}: {out[-1] * 1000:.0f} ms", flush=True)
    writes = []
    for _ in range(50):
        t = time.monotonic()
        block(store, [("b1", 0)])
        writes.append(time.monotonic() - t)
        release_all(store, "someone")
    return {"trials": trials, "median_s": statistics.median(out), "max_s": max(out),
            "all_s": out, "interval_s": INTERVAL,
            "store_write_median_s": statistics.median(writes),
            "store_write_max_s": max(writes)}


def probe(lock_path: Path, seconds: float) -> tuple[int, int]:
    """(tries, held): non-blocking lock attempts, one a millisecond."""
    fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o664)
    tries = held = 0
    end = time.monotonic() + seconds
    try:
        while time.monotonic() < end:
            tries += 1
            try:
                fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                fcntl.lockf(fd, fcntl.LOCK_UN)
            except OSError as exc:
                if exc.errno not in (errno.EAGAIN, errno.EACCES):
                    raise
                held += 1
            time.sleep(0.001)
    finally:
        os.close(fd)
    return tries, held


def contention(fleet: Fleet, cfg: Path, store: Store, n: int, seconds: float
               ) -> dict[str, Any]:
    cfg = fleet.write_config(["b0"], timeout=30.0, interval=INTERVAL)
    block(store, [("b0", 0), ("b0", 1)])
    env = fleet.env()
    procs = [waiter(cfg, env, 2) for _ in range(n)]
    try:
        t = time.monotonic()
        while len(store.read().queue) < n:
            if time.monotonic() - t > 300:
                raise RuntimeError(f"only {len(store.read().queue)} of {n} waiters queued")
            time.sleep(0.1)
        joined = time.monotonic() - t
        print(f"  {n} waiters queued in {joined:.1f}s", flush=True)
        time.sleep(INTERVAL)
        tries, held = probe(store.lock_path, seconds)
        queued = len(store.read().queue)
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(30)
    return {"waiters": n, "seconds": seconds, "tries": tries, "held": held,
            "held_fraction": held / max(1, tries), "still_queued": queued,
            "left_after_sigterm": len(store.read().queue)}


def report(r: dict[str, Any]) -> str:
    g, c, gr = r["grant"], r["contention"], r["grant_release"]
    bound = g["interval_s"] + g["store_write_max_s"]

    def row(what: str, x: dict[str, Any]) -> str:
        return (f"| {what} | {x['median_s'] * 1000:.0f} ms | {x['max_s'] * 1000:.0f} ms | "
                f"{bound * 1000:.0f} ms |")

    row_exit = row("its process ending (the next `nvidia-smi` no longer lists it)", g)
    row_release = row("its reservation being released (the waiter stats the file every "
                      "0.2 s)", gr)
    return f"""# Queue benchmark

Run: `python -m bench.queue_bench --trials {g['trials']} --waiters {c['waiters']} --seconds \
{c['seconds']:g}` on {r['machine']}, {r['when']}. The fleet's sshd, the waiters and the probe
share the machine's cores (other work ran on it too).

## Time from a GPU becoming free to the head waiter holding it

One `gputop free --wait --count 1` at the default interval ({g['interval_s']:g} s). The GPU
becomes free at a different point of the waiter's interval in each trial; measured: the
time until the waiter's reservation is in the file ({g['trials']} trials each).

| the GPU becomes free by | median | max | bound (interval + one store write) |
|---|---|---|---|
{row_exit}
{row_release}

Store write (lock, read, validate, write, fsync, rename): median \
{g['store_write_median_s'] * 1000:.1f} ms, max {g['store_write_max_s'] * 1000:.1f} ms. \
Within the bound: {'yes' if max(g['max_s'], gr['max_s']) <= bound else 'NO'}.

## Store contention: {c['waiters']} waiters polling at the default interval

{c['waiters']} `gputop free --wait` processes waiting for GPUs that never come free, for
{c['seconds']:g} s: the lock was found held in {c['held']} of {c['tries']} non-blocking tries
(one a millisecond): **{c['held_fraction'] * 100:.2f} %** of the time (target < 5 %).
Waiters read the file without the lock and take it only to renew their lease (every
half lease, 15 s) or to take a grant. After SIGTERM to all of them, waiters left in the
queue: {c['left_after_sigterm']} (each leaves at once).
"""


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--trials", type=int, default=20)
    ap.add_argument("--waiters", type=int, default=50)
    ap.add_argument("--seconds", type=float, default=30.0)
    a = ap.parse_args()
    why = sshd_available()
    if why:
        print(why)
        return 2
    root = Path(tempfile.mkdtemp(prefix="gputop-qbench-", dir="/tmp"))
    root.chmod(0o755)
    fleet = Fleet(root, [Host("b0", "127.0.7.2", gpus=("rtx2080", "rtx2080")),
                         Host("b1", "127.0.7.3", gpus=("rtx2080",)),
                         Host("b2", "127.0.7.4", gpus=("rtx2080",),
                              processes=[GpuProcess(None, "python job.py", mem_mib=4000)])]
                  ).start()
    try:
        store = Store(root / "reservations.json")
        print("grant latency", flush=True)
        cfg = fleet.write_config(["b2"], timeout=30.0, interval=INTERVAL)
        grant = grant_latency(fleet, cfg, store, a.trials, "exit")
        cfg = fleet.write_config(["b1"], timeout=30.0, interval=INTERVAL)
        grant_release = grant_latency(fleet, cfg, store, a.trials, "release")
        print("contention", flush=True)
        cont = contention(fleet, cfg, store, a.waiters, a.seconds)
    finally:
        fleet.stop()
    import platform

    r = {"grant": grant, "grant_release": grant_release, "contention": cont,
         "machine": f"{os.cpu_count()} cores, {platform.platform()}",
         "when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "queue.json").write_text(json.dumps(r, indent=1) + "\n")
    (OUT / "queue.md").write_text(report(r))
    print(report(r))
    return 0


if __name__ == "__main__":
    sys.exit(main())
