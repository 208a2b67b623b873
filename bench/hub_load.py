"""The hub under load: 1,000 simulated hosts x 8 GPUs and 50 event streams, some of
which never read.

    python -m bench.hub_load [--hosts 1000 --gpus 8 --seconds 60 --out bench/results/hub-load.md]

One real hub process (tests/support/demo_hub.py: ``gputop.hub.server.serve`` over
``DemoSource`` hosts, 2 s interval, the default 64 MiB window and 10 s write deadline).
Phase 1: no subscribers. Phase 2: 50 streams from one client process: 35 read
``update`` events, 10 read ``patch`` events (``?patches=1``), all counting bytes and
events without parsing them (the hub's cost is measured, not a reader's); 5 never read
(a 4 KiB receive buffer) and come with the oldest retained ``Last-Event-ID``, and come
back each time the hub closes them. Throughout, ``/-/healthy`` is asked every 0.5 s on a
fresh connection. Reported per phase: the hub's CPU (share of one core, /proc/PID/stat),
its RSS (peak and last, /proc/PID/status), the retained window's bytes (/metrics), the
healthy latency (median, p99, max), events read and the non-readers' connections closed.
Writes a Markdown table to ``--out`` and prints each row as a JSON line.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import re
import selectors
import socket
import statistics
import struct
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
TICK = os.sysconf("SC_CLK_TCK")
ADDR = "127.0.62.1"


def free_port() -> int:
    with socket.socket() as s:
        s.bind((ADDR, 0))
        return int(s.getsockname()[1])


def cpu_s(pid: int) -> float:
    f = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(f[11]) + int(f[12])) / TICK


def rss_mib(pid: int) -> float:
    m = re.search(r"VmRSS:\s+(\d+) kB", Path(f"/proc/{pid}/status").read_text())
    return int(m.group(1)) / 1024 if m else 0.0


def metric(url: str, name: str) -> float:
    with urllib.request.urlopen(url + "metrics", timeout=30) as r:
        body = r.read().decode()
    m = re.search(rf"^{name} (\S+)$", body, re.M)
    return float(m.group(1)) if m else float("nan")


class Streams(mp.Process):
    """``readers`` streams that read everything (``patch_readers`` of them ask for
    patches) and ``stuck`` that never read, reopened when the hub closes them: a process
    of its own, so the healthy probe is not waiting on its reads."""

    def __init__(self, port: int, readers: int, patch_readers: int, stuck: int) -> None:
        super().__init__(daemon=True)
        self.port, self.stop = port, mp.Event()
        self.counts = mp.Array("q", 3)  # bytes, events, non-readers found closed
        self.readers, self.patch_readers, self.stuck_n = readers, patch_readers, stuck

    @property
    def bytes(self) -> int:
        return int(self.counts[0])

    @property
    def events(self) -> int:
        return int(self.counts[1])

    @property
    def stuck_closed(self) -> int:
        return int(self.counts[2])

    def _open(self, path: str, last: str, *, read: bool = True) -> socket.socket:
        s = socket.socket()
        if not read:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        s.connect((ADDR, self.port))
        extra = f"Last-Event-ID: {last}\r\n" if last else ""
        s.sendall(f"GET {path} HTTP/1.1\r\nHost: {ADDR}\r\n{extra}\r\n".encode())
        if read:
            s.setblocking(False)
            self.sel.register(s, selectors.EVENT_READ)
        return s

    def run(self) -> None:
        self.sel = selectors.DefaultSelector()
        self.oldest = ""
        self.stuck: list[socket.socket] = []
        for i in range(self.readers):
            self._open(f"/api/v1/events{'?patches=1' if i < self.patch_readers else ''}", "")
        while not self.stop.is_set():
            for key, _ in self.sel.select(0.2):
                s = key.fileobj
                assert isinstance(s, socket.socket)
                try:
                    data = s.recv(1 << 20)
                except OSError:
                    data = b""
                if not data:
                    self.sel.unregister(s)
                    s.close()
                    continue
                self.counts[0] += len(data)
                self.counts[1] += data.count(b"\nid: ")
                if not self.oldest:
                    m = re.search(rb"\nid: ([0-9a-f]+-[0-9]+)\n", data)
                    if m:
                        self.oldest = m.group(1).decode()
            self._stuck()
        for s in self.stuck:
            s.close()

    def _stuck(self) -> None:
        """Keep ``stuck_n`` non-readers open, with the first id seen (the window's
        oldest by the time they come)."""
        if not self.oldest:
            return
        for s in list(self.stuck):
            # (TCP_INFO's state, not a read: it still reads nothing. 1 is ESTABLISHED.)
            if struct.unpack("B", s.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 1))[0] == 1:
                continue
            self.stuck.remove(s)
            s.close()
            self.counts[2] += 1
        while len(self.stuck) < self.stuck_n:
            self.stuck.append(self._open("/api/v1/events", self.oldest, read=False))


def healthy_loop(url: str, out: list[float], stop: threading.Event) -> None:
    while not stop.is_set():
        t0 = time.perf_counter()
        try:
            with urllib.request.urlopen(url + "-/healthy", timeout=30) as r:
                r.read()
            out.append(time.perf_counter() - t0)
        except OSError:
            out.append(float("inf"))
        stop.wait(0.5)


def phase(name: str, hub: subprocess.Popen[bytes], url: str, seconds: float,
          streams: Streams | None) -> dict[str, Any]:
    lat: list[float] = []
    stop = threading.Event()
    t = threading.Thread(target=healthy_loop, args=(url, lat, stop), daemon=True)
    t.start()
    c0, t0, rss = cpu_s(hub.pid), time.monotonic(), [rss_mib(hub.pid)]
    b0, e0 = (streams.bytes, streams.events) if streams else (0, 0)
    retained = [metric(url, "gputop_hub_retained_bytes")]
    cut0 = metric(url, "gputop_hub_connections_stalled_total")
    while time.monotonic() - t0 < seconds:
        time.sleep(1)
        rss.append(rss_mib(hub.pid))
    wall = time.monotonic() - t0
    cpu = cpu_s(hub.pid) - c0
    stop.set()
    t.join(35)
    retained.append(metric(url, "gputop_hub_retained_bytes"))
    cut = metric(url, "gputop_hub_connections_stalled_total") - cut0
    ok = sorted(x for x in lat if x != float("inf"))
    q = statistics.quantiles(ok, n=100, method="inclusive") if len(ok) >= 2 else [0.0] * 99
    row = {"phase": name, "seconds": round(wall, 1),
           "hub_cpu_percent_of_core": round(100 * cpu / wall, 1),
           "rss_mib_peak": round(max(rss), 1), "rss_mib_last": round(rss[-1], 1),
           "retained_mib_max": round(max(retained) / 2**20, 1),
           "healthy_ms_median": round(1000 * statistics.median(ok), 1) if ok else None,
           "healthy_ms_p99": round(1000 * q[98], 1) if ok else None,
           "healthy_ms_max": round(1000 * max(ok), 1) if ok else None,
           "healthy_failed": len(lat) - len(ok),
           "events_read": (streams.events - e0) if streams else 0,
           "mib_read": round(((streams.bytes - b0) if streams else 0) / 2**20, 1),
           "nonreaders_closed": streams.stuck_closed if streams else 0,
           "hub_stalled_closed": int(cut),
           "load_average": os.getloadavg()[0]}
    print(json.dumps(row), flush=True)
    return row


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--hosts", type=int, default=1000)
    ap.add_argument("--gpus", type=int, default=8)
    ap.add_argument("--interval", type=float, default=2.0)
    ap.add_argument("--seconds", type=float, default=60.0)
    ap.add_argument("--quiet-seconds", type=float, default=30.0)
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "hub-load.md"))
    args = ap.parse_args()
    port = free_port()
    url = f"http://{ADDR}:{port}/"
    t_start = time.monotonic()
    hub = subprocess.Popen([sys.executable, "-m", "tests.support.demo_hub", "--hosts",
                            str(args.hosts), "--gpus", str(args.gpus), "--interval",
                            str(args.interval), "--listen", f"{ADDR}:{port}",
                            # (all 50 streams come from one address)
                            "--max-subscribers-per-client", "200"],
                           stdout=subprocess.DEVNULL, cwd=ROOT)
    rows = []
    try:
        while True:
            try:
                with urllib.request.urlopen(url + "-/ready", timeout=5) as r:
                    if r.status == 200:
                        break
            except OSError:
                time.sleep(0.5)
        ready_s = time.monotonic() - t_start
        rows.append(phase("no subscribers", hub, url, args.quiet_seconds, None))
        streams = Streams(port, readers=45, patch_readers=10, stuck=5)
        streams.start()
        time.sleep(3)
        rows.append(phase("50 subscribers (35 updates, 10 patches, 5 never read)", hub,
                          url, args.seconds, streams))
        streams.stop.set()
        streams.join(10)
        streams.terminate()
    finally:
        hub.terminate()
        hub.wait(30)
    write(Path(args.out), args, rows, ready_s)


def write(out: Path, args: argparse.Namespace, rows: list[dict[str, Any]],
          ready_s: float) -> None:
    lines = [
        "# The hub under load (`bench/hub_load.py`)", "",
        f"`python bench/hub_load.py --hosts {args.hosts} --gpus {args.gpus} --seconds "
        f"{args.seconds:g}`: one hub process over {args.hosts} simulated hosts x "
        f"{args.gpus} GPUs (`DemoSource`, inside the hub's process: its CPU includes "
        f"simulating them), {args.interval:g} s interval, 64 MiB retained window, 10 s "
        f"write deadline; ready after {ready_s:.0f} s. Phase 2 adds 50 streams: 35 read "
        "updates, 10 read patches (bytes counted, not parsed), 5 never read, come with "
        "the oldest retained `Last-Event-ID` and come back each time they are closed. "
        "`/-/healthy` asked every 0.5 s on a new connection throughout. Measured on the "
        "2-core development machine shared with other engineers' test runs (the load "
        "average is in the table): compare rows, not machines.", "",
        "| phase | hub CPU (% of a core) | RSS peak / last (MiB) | retained (MiB, max) | "
        "/-/healthy median / p99 / max (ms) | failed | events read | MiB read | "
        "non-readers seen closed (hub's count) | load avg |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['phase']} | {r['hub_cpu_percent_of_core']} | "
                     f"{r['rss_mib_peak']} / {r['rss_mib_last']} | {r['retained_mib_max']} | "
                     f"{r['healthy_ms_median']} / {r['healthy_ms_p99']} / "
                     f"{r['healthy_ms_max']} | {r['healthy_failed']} | {r['events_read']} | "
                     f"{r['mib_read']} | {r['nonreaders_closed']} ({r['hub_stalled_closed']}) | "
                     f"{r['load_average']:.1f} |")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
