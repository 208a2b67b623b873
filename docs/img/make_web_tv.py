"""Draw docs/img/web-tv-14.png, web-tv-50.png and web-tv-200.png: the wall screen (``?tv=1``)
at 1920x1080 over 14, 50 and 200 simulated hosts, in headless Chromium against the hub's
real app (tests/support/web_hub.py), with a day of history so the waste panel shows.

    python docs/img/make_web_tv.py            # after a change to the wall screen's looks
    python docs/img/make_web_tv.py 50 --out /tmp/shots   # one size, elsewhere
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[1]))  # (the checkout's root: ``tests.support``)

from tests.support.web_hub import DocHub, browser, fleet_doc, history_db, set_size  # noqa: E402

#: name -> (hosts in all, of which down): a team's 14 mixed hosts; 50 of 8 GPUs (400) that
#: answer and 2 down; 200 of 8 GPUs, which page.
FLEETS = {14: (14, 1), 50: (52, 2), 200: (200, 4)}


def fleet(hosts: int) -> dict[str, Any]:
    total, down = FLEETS[hosts]
    doc = fleet_doc(total, 8, seed=hosts, failing=down)
    if hosts == 14:  # a real team's fleet: some 4-GPU and 2-GPU machines among the 8s
        for i, h in enumerate(doc["hosts"]):
            if h["gpus"] and i % 3 == 1:
                h["gpus"] = h["gpus"][:4]
            elif h["gpus"] and i % 5 == 4:
                h["gpus"] = h["gpus"][:2]
    return doc


def shoot(hosts: int, out: Path, width: int = 1920, height: int = 1080) -> Path:
    with tempfile.TemporaryDirectory() as tmp:
        history_db(Path(tmp) / "history.sqlite3")
        h = DocHub(fleet(hosts), Path(tmp), history=True)
        b = browser(width, height)
        try:
            set_size(b, width, height)
            b.get(h.url + "?tv=1")
            deadline = time.monotonic() + 30
            while not b.execute_script("return window.gputopBoard.conn === 'live' && "
                                       "!document.getElementById('waste').hidden"):
                if time.monotonic() > deadline:
                    raise SystemExit("the page did not go live")
                time.sleep(0.1)
            time.sleep(1.2)  # the panels are drawn at most once a second
            path = out / f"web-tv-{hosts}.png"
            b.save_screenshot(str(path))
            return path
        finally:
            b.quit()
            h.stop()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("hosts", nargs="*", type=int, default=sorted(FLEETS),
                    help=f"one or more of {sorted(FLEETS)} (default: all)")
    ap.add_argument("--out", type=Path, default=HERE)
    args = ap.parse_args()
    if set(args.hosts) - set(FLEETS):
        ap.error(f"hosts: one of {sorted(FLEETS)}")
    args.out.mkdir(parents=True, exist_ok=True)
    for n in args.hosts:
        print(f"wrote {shoot(n, args.out)}")


if __name__ == "__main__":
    main()
