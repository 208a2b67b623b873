"""What delivery costs from the sending side: from ``Notifier.submit`` to the notice
arriving at a real local webhook receiver (aiohttp) and a real local SMTP server
(aiosmtpd), N times, while a third route's receiver hangs for 60 s on every notice (its
try limit is 60 s): the hung route must delay nothing else.

    python bench/notify_delivery.py --runs 20

Prints one JSON line (seconds); bench/results/notify-delivery.md says what it measured.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

from notify_servers import receiver, smtp_server  # noqa: E402

from gputop.notify.delivery import Notifier  # noqa: E402
from gputop.notify.notice import Notice, Route  # noqa: E402
from gputop.notify_config import NotifyConfig  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=20)
    args = ap.parse_args()
    with receiver() as rec, smtp_server() as box:
        cfg = NotifyConfig(sender="gputop@lab.example", smtp_host=box.host,
                           smtp_port=box.port, timeout_s=60, attempts=1)
        routes = {"ann": [Route("webhook", rec.url + "/ok/ann"),
                          Route("email", "ann@lab.example")],
                  "hung": [Route("webhook", rec.url + "/hang/x")]}
        n = Notifier(cfg, lambda u: routes[u]).start()
        hook: list[float] = []
        mail: list[float] = []
        for i in range(args.runs):
            n.submit(Notice("granted", "hung", f"h{i}", "granted: gpu-01:0"))
            t0 = time.perf_counter()
            n.submit(Notice("granted", "ann", f"a{i}", "granted: gpu-01:0",
                            ("gputop run --on gpu-01:0 -- python train.py",)))
            rec.wait_for("/ok/ann", i + 1, 30)
            hook.append(time.perf_counter() - t0)
            box.wait_for(i + 1, 30)
            mail.append(time.perf_counter() - t0)
        hung_tries = rec.hits.get("/hang/x", 0)
        n.close(1)
    out = {"runs": args.runs,
           "webhook_median_s": round(statistics.median(hook), 4),
           "webhook_worst_s": round(max(hook), 4),
           "smtp_median_s": round(statistics.median(mail), 4),
           "smtp_worst_s": round(max(mail), 4),
           "hung_route_tries_meanwhile": hung_tries}
    print(json.dumps(out))


if __name__ == "__main__":
    main()
