"""``gputop serve``: run the hub (see gputop.hub) until stopped."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from gputop.cli.lifecycle import run_until_signal
from gputop.config.load import HUB_MAX_CONNECTIONS, Config
from gputop.config.values import listen_problem
from gputop.errors import EXIT_ERROR, EXIT_OK
from gputop.extras import require
from gputop.sources import Source

if TYPE_CHECKING:
    from importlib.abc import Traversable


def hub_command(config: Config, args: argparse.Namespace) -> list[str]:
    """``gputop serve`` as its service runs it: this very gputop and the options this run
    was given, the hosts file as an absolute path (a unit reads no ``~/.bashrc``, so
    ``$GPUTOP_CONFIG`` would not reach it)."""
    from gputop.history.unit import this_gputop

    cmd = this_gputop("serve")
    if config.path is not None:
        cmd += ["--config", str(config.path.expanduser().absolute())]
    if args.listen:
        cmd += ["--listen", args.listen]
    if args.interval is not None:
        cmd += ["--interval", f"{args.interval:g}"]
    if args.timeout is not None:
        cmd += ["--timeout", f"{args.timeout:g}"]
    if args.max_subscribers != 64:
        cmd += ["--max-subscribers", str(args.max_subscribers)]
    if args.max_connections != HUB_MAX_CONNECTIONS:
        cmd += ["--max-connections", str(args.max_connections)]
    for flag, value in (("--retain-mb", args.retain_mb), ("--write-timeout", args.write_timeout),
                        ("--idle-timeout", args.idle_timeout),
                        ("--first-request-timeout", args.first_request_timeout),
                        ("--max-connections-per-client", args.max_connections_per_client),
                        ("--max-subscribers-per-client", args.max_subscribers_per_client)):
        if value is not None:
            cmd += [flag, f"{value:g}"]
    return cmd


def serve_demo(args: argparse.Namespace, overrides: Callable[[Config], Config]) -> int:
    """``gputop serve --demo``: a hub of the built-in simulated fleet (its reservations in
    a temporary folder, removed when it stops), to see the web board, /metrics and the
    event stream without a host."""
    from gputop.sources.demo import demo_session

    if args.print_unit:
        print("gputop: --print-unit writes the unit of your hosts' hub, not the demo's",
              file=sys.stderr)
        return EXIT_ERROR
    with demo_session() as (config, sources):
        # (--interval and --timeout as for your hosts: checked the same way)
        return cmd_serve(overrides(config), args, sources=list(sources))


def cmd_serve(config: Config, args: argparse.Namespace,
              sources: list[Source] | None = None) -> int:
    require("hub")
    from gputop.hub.server import DEFAULT_LISTEN, read_token, serve

    listen = args.listen or config.hub.listen or DEFAULT_LISTEN
    problem = listen_problem(listen)
    if problem:
        print(f"gputop: --listen {problem}", file=sys.stderr)
        return EXIT_ERROR
    if not 1 <= args.max_subscribers <= 10_000:
        print("gputop: --max-subscribers must be between 1 and 10000", file=sys.stderr)
        return EXIT_ERROR
    if not 1 <= args.max_connections <= 100_000:
        print("gputop: --max-connections must be between 1 and 100000", file=sys.stderr)
        return EXIT_ERROR
    for flag, value, bound, of in (
            ("--max-connections-per-client", args.max_connections_per_client,
             args.max_connections, "--max-connections"),
            ("--max-subscribers-per-client", args.max_subscribers_per_client,
             args.max_subscribers, "--max-subscribers")):
        if value is not None and not 1 <= value <= bound:
            print(f"gputop: {flag} must be between 1 and {of} ({bound})", file=sys.stderr)
            return EXIT_ERROR
    if args.retain_mb is not None and not 1 <= args.retain_mb <= 65536:
        print("gputop: --retain-mb must be between 1 and 65536", file=sys.stderr)
        return EXIT_ERROR
    for flag, value in (("--write-timeout", args.write_timeout),
                        ("--idle-timeout", args.idle_timeout),
                        ("--first-request-timeout", args.first_request_timeout)):
        if value is not None and not 0.1 <= value <= 3600:
            print(f"gputop: {flag} must be between 0.1 and 3600 seconds", file=sys.stderr)
            return EXIT_ERROR
    if args.print_unit:
        from gputop.history.unit import unit_text

        sys.stdout.write(unit_text(hub_command(config, args), shipped(HUB_UNIT)))
        return EXIT_OK
    if not config.hosts:
        print(f"gputop: {config.path or 'the config'}: hosts: serve polls the config's "
              "hosts, and there are none (add [[hosts]] tables)", file=sys.stderr)
        return EXIT_ERROR
    if config.hub.url is not None:
        print("gputop: serve polls the hosts itself: it ignores [hub] url (a hub does not "
              "read another hub)", file=sys.stderr)
    token = None
    if config.hub.token_file is not None:
        try:
            token = read_token(config.hub.token_file)
        except ValueError as exc:
            print(f"gputop: {config.path}: hub.token_file: {exc}", file=sys.stderr)
            return EXIT_ERROR

    cfg = config.with_hub(url=None)

    async def main() -> int:
        extra: dict[str, Any] = {}
        extra["retain_bytes"] = (args.retain_mb or cfg.hub.retain_mb) << 20
        if args.write_timeout is not None:
            extra["write_timeout_s"] = args.write_timeout
        if args.idle_timeout is not None:
            extra["idle_s"] = args.idle_timeout
        if args.first_request_timeout is not None:
            extra["first_request_s"] = args.first_request_timeout
        if sources is not None:
            from gputop.hub.collector import Collector
            from gputop.poller import Poller

            extra["collector"] = Collector(cfg, Poller(cfg, sources))
        from gputop.notify.sender import configured, make_notifier, make_watcher

        notifier = make_notifier(cfg) if configured(cfg) else None
        if notifier is not None:  # [notify]: this hub is the team's sender
            # (said once: a team that also runs `gputop notify run` would send twice)
            print(f"gputop: hub: sending notices ([notify] in {cfg.path}; one sender per "
                  "team: stop any gputop notify run)", file=sys.stderr, flush=True)
            extra["watcher"] = make_watcher(cfg, notifier)
            extra["notify_metrics"] = notifier.counters.prometheus
        try:
            await serve(cfg, listen, token=token, max_subscribers=args.max_subscribers,
                        max_connections=args.max_connections,
                        max_connections_per_client=args.max_connections_per_client,
                        max_subscribers_per_client=args.max_subscribers_per_client, **extra)
        except OSError as exc:
            print(f"gputop: cannot listen on {listen}: {exc.strerror or exc}",
                  file=sys.stderr)
            return EXIT_ERROR
        finally:
            if notifier is not None:
                notifier.close()
        return EXIT_OK

    return run_until_signal(main)


def add_serve(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    from gputop.cli.options import for_subcommand

    p = sub.add_parser(
        "serve", parents=for_subcommand("serve"),
        help="run a hub: poll every host once for the whole team and serve /metrics "
        "(Prometheus), the --json snapshot and its event stream",
        description="Poll every host of the config once, for everybody, and serve it "
        "read-only over HTTP: /metrics (Prometheus), /api/v1/snapshot (the --json "
        "document), /api/v1/events (Server-Sent Events), /-/ready, /-/healthy and the "
        "wall board's page. Readers point [hub] url (or --hub URL) at it. See docs/hub.md.")
    p.add_argument("--listen", metavar="HOST:PORT",
                   help="where to listen (default: [hub] listen, else 127.0.0.1:9847; "
                   "beyond loopback only when told)")
    p.add_argument("--max-subscribers", type=int, default=64, metavar="N",
                   help="event streams open at once (default 64); one more is refused")
    p.add_argument("--max-connections", type=int, default=HUB_MAX_CONNECTIONS, metavar="N",
                   help=f"HTTP connections open at once (default {HUB_MAX_CONNECTIONS}); one "
                   "more is closed at once (each idle one closes after 30 s)")
    p.add_argument("--max-connections-per-client", type=int, metavar="N",
                   help="connections open at once from one address (default: a quarter of "
                   "--max-connections, at least 16); behind a reverse proxy every client "
                   "is the proxy: set it to --max-connections and bound clients there")
    p.add_argument("--max-subscribers-per-client", type=int, metavar="N",
                   help="event streams open at once from one address (default: a quarter "
                   "of --max-subscribers, at least 4); behind a proxy, as above")
    p.add_argument("--retain-mb", type=int, metavar="MIB",
                   help="MiB of recent events kept for streams that resume (default: [hub] "
                   "retain_mb, else 64); a reader further behind gets a snapshot")
    p.add_argument("--write-timeout", type=float, metavar="S",
                   help="close a connection whose client takes no bytes for S seconds "
                   "(default 10)")
    p.add_argument("--idle-timeout", type=float, metavar="S",
                   help="close a kept-alive connection with no request for S seconds "
                   "(default 30)")
    p.add_argument("--first-request-timeout", type=float, metavar="S",
                   help="close a new connection that has not sent a whole request within "
                   "S seconds (default 10)")
    p.add_argument("--demo", dest="serve_demo", action="store_true",
                   help="serve the built-in simulated fleet instead (no hosts file, no SSH): "
                   "the web board, /metrics and the event stream to try")
    prints = p.add_mutually_exclusive_group()
    prints.add_argument("--print-unit", action="store_true",
                        help="print a systemd user unit that runs this gputop's hub (with "
                        "this --config, --listen, --interval, --timeout) and exit")
    prints.add_argument("--print-scrape-config", dest="print_shipped", action="store_const",
                        const=SCRAPE_CONFIG,
                        help="print the Prometheus scrape job that ships with gputop and exit")
    prints.add_argument("--print-grafana-dashboard", dest="print_shipped",
                        action="store_const", const=GRAFANA_DASHBOARD,
                        help="print the Grafana dashboard (JSON) that ships with gputop and "
                        "exit")


#: The hub's deploy files that ``serve --print-...`` prints (in gputop/hub/deploy/).
SCRAPE_CONFIG = "prometheus-scrape.yml"
GRAFANA_DASHBOARD = "grafana-dashboard.json"
HUB_UNIT = "gputop-hub.service"


def shipped(name: str) -> Traversable:
    """A file of gputop/hub/deploy/ as installed: found through importlib.resources, so it
    is read from a wheel (pipx, uv tool), a zip or a checkout alike, and nobody has to find
    site-packages."""
    from importlib.resources import files

    return files("gputop.hub").joinpath("deploy").joinpath(name)


def print_shipped(name: str) -> int:
    """Print a file of gputop/hub/deploy/ as installed (see ``shipped``)."""
    sys.stdout.write(shipped(name).read_text(encoding="utf-8"))
    return EXIT_OK
