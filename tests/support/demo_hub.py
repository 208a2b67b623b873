"""A real ``gputop serve`` process over N simulated hosts (``DemoSource``: no sshd, so a
2-core machine can serve hundreds of GPUs' worth of events), with the hub's bounds set
small so tests and bench/hub_load.py need not wait long.

    python -m tests.support.demo_hub --hosts 100 --gpus 8 --listen 127.0.0.1:9850 [--token-file F]
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path


def main() -> None:
    from gputop.cli.lifecycle import run_until_signal
    from gputop.config.load import Config
    from gputop.config.tables import HostConfig
    from gputop.hub.collector import Collector
    from gputop.hub.server import read_token, serve
    from gputop.poller import Poller
    from gputop.sources.demo import DemoSource

    ap = argparse.ArgumentParser()
    ap.add_argument("--hosts", type=int, default=100)
    ap.add_argument("--gpus", type=int, default=8)
    ap.add_argument("--interval", type=float, default=1.0)
    ap.add_argument("--listen", required=True)
    ap.add_argument("--max-connections", type=int, default=256)
    ap.add_argument("--max-subscribers", type=int, default=200)
    ap.add_argument("--write-timeout", type=float, default=10.0)
    ap.add_argument("--idle-timeout", type=float, default=30.0)
    ap.add_argument("--retain-mb", type=int, default=64)
    ap.add_argument("--max-connections-per-client", type=int)
    ap.add_argument("--max-subscribers-per-client", type=int)
    ap.add_argument("--first-request-timeout", type=float, default=10.0)
    ap.add_argument("--token-file")
    args = ap.parse_args()
    names = [f"node{i:04d}" for i in range(args.hosts)]
    cfg = Config(path=None, hosts=tuple(HostConfig(n) for n in names), interval=args.interval,
                 timeout=5.0, reservations_path=Path(tempfile.mkdtemp()) / "r.json",
                 history_path=Path(tempfile.mkdtemp()) / "none.sqlite3")
    sources = [DemoSource(n, "NVIDIA H100 80GB HBM3", args.gpus, 81559, 700.0) for n in names]
    token = read_token(Path(args.token_file)) if args.token_file else None

    async def run() -> int:
        collector = Collector(cfg, Poller(cfg, sources))  # type: ignore[arg-type]
        await serve(cfg, args.listen, token=token, collector=collector,
                    max_subscribers=args.max_subscribers,
                    max_connections=args.max_connections, idle_s=args.idle_timeout,
                    max_connections_per_client=args.max_connections_per_client,
                    max_subscribers_per_client=args.max_subscribers_per_client,
                    first_request_s=args.first_request_timeout,
                    write_timeout_s=args.write_timeout, retain_bytes=args.retain_mb << 20)
        return 0

    run_until_signal(run)


if __name__ == "__main__":
    main()
