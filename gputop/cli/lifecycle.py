"""Exit codes and ending cleanly on a signal: the ground every subcommand stands on.

Exit codes are API: 0 done, 1 refused, 2 usage/config/store error, 3 no host answered
(``--json``/``--once``: the output is written, and every host in it is an error), 4 the hub
(``[hub] url``, ``--hub``) is down or answered garbage (nothing is written), 130
interrupted (128 + the signal's number for SIGTERM and SIGHUP too).
"""

from __future__ import annotations

import asyncio
import os
import signal
from collections.abc import Callable, Coroutine
from typing import Any

#: Signals that end ``--json``/``--once`` cleanly: every remote loop is ended first.
EXIT_SIGNALS = (signal.SIGTERM, signal.SIGHUP, signal.SIGINT)


def run_until_signal(make: Callable[[], Coroutine[Any, Any, int]], *,
                     paced: bool = False) -> int:
    """Run a coroutine; SIGTERM, SIGHUP or SIGINT cancel it, so its ``finally`` blocks end
    every remote loop before the process goes. Exit code 128 + the signal's number. A
    second signal while that cleanup runs ends the process at once. ``paced``: on a loop
    the coroutine may pace (:mod:`gputop.pacing`)."""

    async def main() -> int:
        loop = asyncio.get_running_loop()
        task = asyncio.current_task()
        assert task is not None
        got: list[int] = []

        def on_signal(signum: int) -> None:
            if got:
                os._exit(128 + signum)
            got.append(signum)
            task.cancel()

        for sig in EXIT_SIGNALS:
            loop.add_signal_handler(sig, on_signal, sig)
        try:
            return await make()
        except asyncio.CancelledError:
            if got:
                return 128 + got[0]
            raise
        finally:
            for sig in EXIT_SIGNALS:
                loop.remove_signal_handler(sig)

    if paced:
        from gputop.pacing import run_paced

        return run_paced(main())
    return asyncio.run(main())
