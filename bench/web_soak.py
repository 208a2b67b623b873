"""The web board left open: memory and script time over ten minutes at 200 hosts x 8 GPUs.

    python -m bench.web_soak [--seconds 600 --hosts 200 --gpus 8 --interval 2 --tv]

A real hub (``gputop.hub`` collector and server) over simulated hosts (``DemoSource``,
as ``bench/hub.py demo-hub``), read by the page in headless Chromium (Debian's
``chromium`` + ``chromium-driver``, through Selenium). Every ``--every`` seconds: the JS
heap after a forced garbage collection, the DOM's node count and listeners (Chrome's
``Memory.getDOMCounters``), the plain JS objects alive, and the script time of the
updates since the last sample (the page's own ``performance.measure`` entries). The
test suite runs a short version (tests/test_web_board.py::
test_memory_holds_over_many_updates).

Prints one JSON line per sample and a summary line; bench/results/web.md holds the numbers.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

from tests.support.hubs import free_port, get
from tests.support.web_hub import browser, chromium_missing

ROOT = Path(__file__).resolve().parents[1]

ADDR = "127.0.24.9"


def plain_objects(b: object) -> int:
    """Plain JS objects alive (the hub's host, GPU and process objects are plain objects:
    one kept past its update counts here)."""
    cdp = b.execute_cdp_cmd  # type: ignore[attr-defined]
    proto = cdp("Runtime.evaluate", {"expression": "Object.prototype", "objectGroup": "m"})
    found = cdp("Runtime.queryObjects", {"prototypeObjectId": proto["result"]["objectId"],
                                         "objectGroup": "m"})
    n = cdp("Runtime.callFunctionOn", {
        "objectId": found["objects"]["objectId"], "returnByValue": True,
        "functionDeclaration": "function () { return this.filter((o) =>"
                               " Object.getPrototypeOf(o) === Object.prototype).length; }"})
    cdp("Runtime.releaseObjectGroup", {"objectGroup": "m"})
    return int(n["result"]["value"])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seconds", type=float, default=600)
    ap.add_argument("--every", type=float, default=30)
    ap.add_argument("--hosts", type=int, default=200)
    ap.add_argument("--gpus", type=int, default=8)
    ap.add_argument("--interval", type=float, default=2.0)
    ap.add_argument("--tv", action="store_true", help="the wall-screen mode (?tv=1)")
    args = ap.parse_args()
    missing = chromium_missing()
    if missing:
        sys.exit(f"web_soak: {missing}")
    port = free_port(ADDR)
    hub = subprocess.Popen([sys.executable, "-m", "bench.hub", "demo-hub",
                            "--hosts", str(args.hosts), "--gpus", str(args.gpus),
                            "--interval", str(args.interval), "--listen", f"{ADDR}:{port}"],
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=ROOT)
    url = f"http://{ADDR}:{port}/"
    b = None
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                if get(url + "-/ready", timeout=2)[0] == 200:
                    break
            except OSError:
                pass
            time.sleep(0.2)
        b = browser(1920, 1080)
        b.get(url + ("?tv=1" if args.tv else ""))
        while not b.execute_script("return window.gputopBoard && window.gputopBoard.conn"
                                   " === 'live'"):
            time.sleep(0.2)
        samples = []
        start = time.monotonic()
        while True:
            b.execute_cdp_cmd("HeapProfiler.collectGarbage", {})
            heap = b.execute_cdp_cmd("Runtime.getHeapUsage", {})["usedSize"]
            dom = b.execute_cdp_cmd("Memory.getDOMCounters", {})
            objects = plain_objects(b)
            times = b.execute_script(
                "const e = performance.getEntriesByName('gputop-update').map(x => x.duration);"
                "performance.clearMeasures('gputop-update'); return e;")
            s = {"t": round(time.monotonic() - start), "heap_mb": round(heap / 1e6, 2),
                 "nodes": dom["nodes"], "listeners": dom["jsEventListeners"],
                 "objects": objects,
                 "updates": b.execute_script("return window.gputopBoard.updates"),
                 "conn": b.execute_script("return window.gputopBoard.conn"),
                 "n": len(times),
                 "median_ms": round(statistics.median(times), 2) if times else None,
                 "p99_ms": round(sorted(times)[int(len(times) * 0.99)], 2) if times else None,
                 "max_ms": round(max(times), 2) if times else None}
            samples.append(s)
            print(json.dumps(s), flush=True)
            if time.monotonic() - start >= args.seconds:
                break
            time.sleep(args.every)
        first, last = samples[1] if len(samples) > 2 else samples[0], samples[-1]
        print(json.dumps({"summary": True, "seconds": last["t"], "hosts": args.hosts,
                          "gpus": args.gpus, "tv": args.tv, "updates": last["updates"],
                          "heap_mb": [first["heap_mb"], last["heap_mb"]],
                          "nodes": [first["nodes"], last["nodes"]],
                          "objects": [first["objects"], last["objects"]],
                          "max_ms": max(s["max_ms"] or 0 for s in samples)}), flush=True)
    finally:
        if b is not None:
            b.quit()
        hub.terminate()
        hub.wait(10)


if __name__ == "__main__":
    main()
