"""``gputop notify run``: the team's notice sender for a team without a hub (the
recorder's pattern: one process polling the fleet and the store; ``--print-unit`` prints
its systemd user unit). A team with a hub lets ``gputop serve`` send instead.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from pathlib import Path

from gputop.config.load import Config
from gputop.errors import EXIT_ERROR, EXIT_OK

NOTIFY_UNIT = "gputop-notify.service"


def notify_command(config: Config) -> list[str]:
    """``gputop notify run`` as its service runs it: this gputop, the hosts file absolute."""
    from gputop.history.unit import this_gputop

    cmd = [*this_gputop("notify"), "run"]
    if config.path is not None:
        cmd += ["--config", str(Path(config.path).resolve())]
    return cmd


def print_unit(config: Config) -> int:
    from gputop.cli.serve import shipped
    from gputop.history.unit import unit_text

    sys.stdout.write(unit_text(notify_command(config), shipped(NOTIFY_UNIT)))
    return EXIT_OK


def notify_run(config: Config, args: argparse.Namespace) -> int:
    """Send until SIGTERM or Ctrl-C, through the ``[notify]`` delivery."""
    from gputop.cli.lifecycle import run_until_signal
    from gputop.hub.notifying import serve_notices
    from gputop.notify.sender import configured, make_notifier, make_watcher

    if getattr(args, "print_unit", False):
        return print_unit(config)
    if not config.hosts:
        print(f"gputop: {config.path or 'the config'}: hosts: notify run polls the config's "
              "hosts, and there are none (add [[hosts]] tables)", file=sys.stderr)
        return EXIT_ERROR
    if not configured(config):
        print(f"gputop: {config.path or 'the config'}: notify run sends through the [notify] "
              "table, and there is none (docs/notifications.md)", file=sys.stderr)
        return EXIT_ERROR
    notifier = make_notifier(config)
    watcher = make_watcher(config, notifier)
    print(f"gputop: sending notices for {len(config.hosts)} host(s); remembering what was "
          f"sent in {watcher.path}", file=sys.stderr, flush=True)

    async def main() -> int:
        await serve_notices(config, watcher)
        return EXIT_OK

    try:
        return run_until_signal(main)
    except asyncio.CancelledError:
        return EXIT_OK
    finally:
        notifier.close()
