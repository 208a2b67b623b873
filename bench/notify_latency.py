"""From a release to the grant notice arriving, end to end, on a real sshd host.

One loopback sshd host with one GPU; the sender (``serve_notices``: the hub's collection
and the watcher, as ``gputop notify run`` runs it) with the real delivery to a local aiohttp
webhook receiver (the waiter's own ``--webhook`` route) and a local aiosmtpd server (mail
at login@email_domain). Each round: someone holds the GPU, a real ``gputop free --wait``
queues, the holder releases (time 0), the waiter's gputop grants itself, and the notice
arrives at both. Also: the sender's CPU while 1,000 expiry warnings a minute go out,
against none. Writes bench/results/notify.md.

    python -m bench.notify_latency [--rounds 20] [--interval 1]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import resource
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import replace
from datetime import timedelta
from pathlib import Path
from typing import Any

from gputop.config.load import load_config
from gputop.hub.notifying import serve_notices
from gputop.notify.routes import set_route
from gputop.notify.sender import make_notifier, make_watcher
from gputop.reservations.state import StoreState
from gputop.reservations.store import Store
from gputop.reservations.terms import Target, Terms, new_reservation
from tests.support.fleet import Fleet, Host
from tests.support.notify_servers import receiver, smtp_server

ROOT = Path(__file__).resolve().parents[1]


def run_sender(cfg: Any, memory: Path) -> tuple[threading.Thread, Any, list[Any]]:
    loop = asyncio.new_event_loop()
    task: list[Any] = []
    notifier = make_notifier(cfg)
    watcher = make_watcher(cfg, notifier, memory)

    async def main() -> None:
        task.append(asyncio.current_task())
        await serve_notices(cfg, watcher)

    def go() -> None:
        try:
            loop.run_until_complete(main())
        except asyncio.CancelledError:
            pass

    t = threading.Thread(target=go, daemon=True)
    t.start()
    while not task:
        time.sleep(0.01)
    return t, notifier, [loop, task[0]]


def cpu_s() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--interval", type=float, default=1.0)
    ap.add_argument("--cpu-s", type=float, default=60.0, help="each CPU measurement's length")
    a = ap.parse_args()
    tmp = Path(os.environ.get("TMPDIR", "/tmp")) / f"gputop-notify-bench-{os.getpid()}"
    tmp.mkdir(mode=0o755)
    (tmp / "fleet").mkdir(mode=0o755)
    fleet = Fleet(tmp / "fleet", [Host("n1", "127.0.236.2", gpus=("rtx2080",))]).start()
    os.environ["HOME"] = str(fleet.home)
    os.environ.pop("SSH_AUTH_SOCK", None)
    res = tmp / "reservations.json"
    store = Store(res)
    with receiver() as rec, smtp_server() as box:
        cfgp = tmp / "hosts.toml"
        cfgp.write_text(fleet.write_config(interval=a.interval, timeout=20.0).read_text()
                        .replace(str(fleet.root / "reservations.json"), str(res))
                        + f'\n[notify]\nfrom = "gputop@lab.example"\n'
                        f'smtp = "{box.host}:{box.port}"\nemail_domain = "lab.example"\n')
        cfg = load_config(str(cfgp))
        set_route(store, "webhook", rec.url + "/ok/me")
        set_route(store, "email", "me@lab.example")
        env = fleet.env() | {"GPUTOP_CONFIG": str(cfgp)}
        thread, notifier, (loop, task) = run_sender(cfg, tmp / "sent.json")
        hook, mail = [], []
        try:
            for i in range(a.rounds):
                def hold(s: StoreState, now: Any) -> StoreState:
                    r = new_reservation(Target("n1", 0),
                                        Terms(3600, user="someone", machine="m"), now)
                    return replace(s, reservations=(r,))
                store.update(hold)
                w = subprocess.Popen([sys.executable, "-m", "gputop", "free", "--wait",
                                      "--count", "1", "--for", "10m"], env=env,
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
                while not store.read().queue:
                    time.sleep(0.02)
                n_hook = len(rec.got)
                n_mail = len(box.mails)
                t0 = time.monotonic()
                store.update(lambda s, now: replace(s, reservations=()))
                rec.wait_for("/ok/me", n_hook + 1, 60)
                t_hook = time.monotonic() - t0
                box.wait_for(n_mail + 1, 60)
                t_mail = time.monotonic() - t0
                w.wait(60)
                hook.append(t_hook)
                mail.append(t_mail)
                print(f"round {i + 1}: webhook {t_hook:.2f} s, mail {t_mail:.2f} s", flush=True)
            # CPU: the sender idle, then with 1,000 expiry warnings a minute (17 a second:
            # reservations made to end within the warning, each a new occurrence).
            store.update(lambda s, now: replace(s, reservations=()))
            time.sleep(2 * a.interval)
            c0 = cpu_s()
            time.sleep(a.cpu_s)
            idle_cpu = cpu_s() - c0
            c0 = cpu_s()
            start = time.monotonic()
            end = start + a.cpu_s
            made = 0
            while time.monotonic() < end:
                def more(s: StoreState, now: Any, k: int = made) -> StoreState:
                    rs = [r for r in s.reservations if r.expires > now][-500:]
                    r = new_reservation(Target("n1", 1 + k % 60000),
                                        Terms(600, user=f"u{k % 50}", machine="m"), now)
                    return replace(s, reservations=(*rs, replace(
                        r, expires=now + timedelta(seconds=600))))
                store.update(more)
                made += 1
                time.sleep(max(0.0, start + made * 60 / 1000 - time.monotonic()))
            busy_cpu = cpu_s() - c0
        finally:
            loop.call_soon_threadsafe(task.cancel)
            thread.join(30)
            notifier.close()
            fleet.stop()
    counts = notifier.counters.snapshot()
    md = ["# Notifications: from a release to the grant notice", "",
          f"One loopback sshd host, interval {a.interval:g} s; the sender is `gputop notify "
          "run`'s (the hub's collection and the watcher) with the real delivery; a real "
          "`gputop free --wait` grants itself after each release. Goal: within one "
          "interval plus 1 s.", "",
          "| | median | worst |", "|---|---|---|",
          f"| webhook ({len(hook)} grants) | {statistics.median(hook):.2f} s | "
          f"{max(hook):.2f} s |",
          f"| mail, aiosmtpd ({len(mail)} grants) | {statistics.median(mail):.2f} s | "
          f"{max(mail):.2f} s |", "",
          f"Sender process CPU over {a.cpu_s:g} s: {idle_cpu:.2f} s with no events, "
          f"{busy_cpu:.2f} s with {made} new reservations inside the expiry warning "
          f"({made * 60 / a.cpu_s:.0f} a minute, each an expiry notice, 50 users: "
          "digests). The CPU counts the whole bench process: the sender and its delivery, "
          "but also the writes to the reservations file and the SMTP server and receiver "
          "taking every mail and POST. Counted by the delivery: "
          + ", ".join(f"{c}/{r} {n}" for (c, r), n in sorted(counts.items())) + ".", "",
          "The test process also runs the receivers and the SMTP server; a hung receiver's "
          "effect on delivery is measured in bench/results/notify-delivery.md.", ""]
    out = ROOT / "bench" / "results" / "notify.md"
    out.write_text("\n".join(md))
    print("\n".join(md))


if __name__ == "__main__":
    main()
