"""The web board's script time per update in each view, at 200 hosts x 8 GPUs.

    python -m bench.web_views [--hosts 200 --gpus 8 --updates 15]

The hub's real app holding a document the benchmark writes (tests/support/web_hub.py: DocHub),
read by the page in headless Chromium. Per view (by host, filtered, free only, sorted by
utilisation): the first snapshot's script time, then updates of 10 hosts and of every
host, each timed by the page's own ``performance.measure``. Prints one JSON line per
view and size; bench/results/web.md holds the numbers.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

from tests.support.web_hub import DocHub, browser, chromium_missing, churn, fleet_doc

ROOT = Path(__file__).resolve().parents[1]

VIEWS = ("", "?q=alice", "?free=1", "?sort=utilization", "?sort=free-memory")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--hosts", type=int, default=200)
    ap.add_argument("--gpus", type=int, default=8)
    ap.add_argument("--updates", type=int, default=15)
    args = ap.parse_args()
    missing = chromium_missing()
    if missing:
        sys.exit(f"web_views: {missing}")
    doc = fleet_doc(args.hosts, args.gpus, failing=3)
    hub = DocHub(doc, Path(tempfile.mkdtemp()))
    b = browser(1920, 1080)
    rnd = random.Random(1)
    try:
        for view in VIEWS:
            b.get(hub.url + view)
            while not b.execute_script("return window.gputopBoard && "
                                       "window.gputopBoard.conn === 'live'"):
                time.sleep(0.05)
            snap = b.execute_script("return performance.getEntriesByName('gputop-snapshot')"
                                    ".map(e => e.duration)")
            for n in (10, None):
                b.execute_script("performance.clearMeasures('gputop-update')")
                start = b.execute_script("return window.gputopBoard.updates")
                for i in range(args.updates):
                    hub.publish(churn(doc, rnd, n))
                    while b.execute_script("return window.gputopBoard.updates") < start + i + 1:
                        time.sleep(0.01)
                t = b.execute_script("return performance.getEntriesByName('gputop-update')"
                                     ".map(e => e.duration)")
                print(json.dumps({"view": view or "by host", "hosts_changed": n or args.hosts,
                                  "snapshot_ms": round(snap[0], 1),
                                  "median_ms": round(statistics.median(t), 2),
                                  "max_ms": round(max(t), 2), "updates": len(t)}), flush=True)
    finally:
        b.quit()
        hub.stop()


if __name__ == "__main__":
    main()
