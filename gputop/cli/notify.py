"""``gputop notify me | test | status``: a person's own routes in the shared store, one
test notice through them, and what was delivered lately (docs/notifications.md). The
senders load only when a notify command runs (every command parses this parser)."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from gputop.cli.targets import open_store
from gputop.config.load import Config
from gputop.errors import EXIT_ERROR, EXIT_OK, GputopError
from gputop.reservations.ops import local_time, whoami
from gputop.text import clean


def add_notify(sub: Any, add: Any) -> None:
    p = add("notify", "your own notification routes: me, test, status; the sender: run",
            "Say where your notices go (gputop notify me --email ADDR | --ntfy URL | "
            "--webhook URL | --off), send yourself a test (notify test), list your routes "
            "and the last deliveries (notify status). Routes live in the shared "
            "reservations file under your login: only you can change yours, and the team "
            "can read them.")
    nsub = p.add_subparsers(dest="notify_command", metavar="ACTION")
    me = nsub.add_parser("me", help="set or remove your route",
                         description="Set your own route (one of each kind) or remove them "
                         "all with --off.")
    how = me.add_mutually_exclusive_group(required=True)
    how.add_argument("--email", metavar="ADDR", help="mail to this address")
    how.add_argument("--ntfy", metavar="URL", help="an ntfy topic URL (https://ntfy.sh/x)")
    how.add_argument("--webhook", metavar="URL",
                     help="your own endpoint: the notice as JSON (the team can read the URL)")
    how.add_argument("--off", action="store_true", help="remove all of your routes")
    nsub.add_parser("test", help="send one test notice to yourself through your routes",
                    description="Send one test notice through your routes, here and now, "
                    "and say what happened to each.")
    run = nsub.add_parser("run", help="the team's sender, for a team without a hub",
                          description="Poll the fleet and the reservations file and send "
                          "the team's notices (grants, expiry warnings, endings, idle and "
                          "misuse flags, hosts down) until stopped. One sender per team: "
                          "a team whose hub (gputop serve) has [notify] already has one.")
    run.add_argument("--print-unit", action="store_true",
                     help="print a systemd user unit that runs it, and exit")
    nsub.add_parser("status", help="your routes and the last deliveries",
                    description="List your routes and the last deliveries this machine's "
                    "sender recorded.")


def cmd_notify(config: Config, args: argparse.Namespace) -> int:
    action = getattr(args, "notify_command", None)
    if action == "me":
        return _me(config, args)
    if action == "test":
        return _test(config)
    if action == "status":
        return _status(config)
    if action == "run":
        from gputop.cli.notify_run import notify_run

        return notify_run(config, args)
    print("gputop: notify: give an action: me, test, status or run", file=sys.stderr)
    return EXIT_ERROR


def _me(config: Config, args: argparse.Namespace) -> int:
    from gputop.notify.routes import clear_routes, set_route

    store = open_store(config)
    if args.off:
        n = clear_routes(store)
        print(f"removed {n} route(s): no notices for {clean(whoami(store)[0])}"
              + (f" (except mail at your login@{config.notify.email_domain})"
                 if config.notify.email_domain else ""))
        return EXIT_OK
    kind, target = next((k, v) for k, v in (("email", args.email), ("ntfy", args.ntfy),
                                            ("webhook", args.webhook)) if v)
    r = set_route(store, kind, target)
    print(f"{clean(r.user)}: your notices now also go to {r.kind} {clean(r.target)}")
    return EXIT_OK


def _test(config: Config) -> int:
    from gputop.notify.delivery import Notifier, status_path
    from gputop.notify.notice import Notice
    from gputop.notify.routes import routes_for

    store = open_store(config)
    user = whoami(store)[0]
    routes = routes_for(store.read(), user, config.notify)
    if not routes:
        raise GputopError("you have no route: set one with gputop notify me --email ADDR "
                          "(or --ntfy URL, --webhook URL)")
    notifier = Notifier(config.notify, lambda u: routes,
                        status_file=status_path(config.notify, config.history.path)).start()
    try:
        notifier.submit(Notice("test", user, "test", f"gputop test notice for {user}",
                               ("If you read this, gputop can reach you here.",)))
        limit = config.notify.attempts * (config.notify.timeout_s + 1) + 60
        notifier.wait_idle(limit)
    finally:
        notifier.close()
    failed = 0
    for d in notifier.last()[-len(routes):]:
        failed += d.result != "sent"
        print(f"{d.channel} {clean(d.target)}: {d.result}"
              + (f" after {d.attempts} tries" if d.attempts > 1 else "")
              + (f" ({clean(d.error)})" if d.error else ""))
    return EXIT_ERROR if failed else EXIT_OK


def _status(config: Config) -> int:
    from gputop.notify.delivery import read_status, status_path
    from gputop.notify.routes import own_routes

    store = open_store(config)
    user = whoami(store)[0]
    mine = own_routes(store.read(), user)
    if not mine:
        print(f"{clean(user)}: no routes" + (
            f" (mail goes to {clean(user)}@{config.notify.email_domain})"
            if config.notify.email_domain else ": gputop notify me --email ADDR sets one"))
    for r in mine:
        print(f"{r.kind:8} {clean(r.target)}  (set {local_time(r.set)})")
    path = status_path(config.notify, config.history.path)
    last = [d for d in read_status(path) if d.get("user") == user]
    if last:
        print(f"last deliveries ({path}):")
    for d in last[-10:]:
        print("  " + "  ".join(clean(str(d.get(k, ""))) for k in
                               ("time", "kind", "channel", "target", "result", "error")))
    return EXIT_OK
