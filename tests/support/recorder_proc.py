"""A ``gputop record`` child in a test: killed if the test leaves it running (a failed
assertion), stopped the way a service manager stops it otherwise."""

from __future__ import annotations

import contextlib
import signal
import subprocess
from collections.abc import Iterator


@contextlib.contextmanager
def running(rec: subprocess.Popen[str]) -> Iterator[subprocess.Popen[str]]:
    """``rec``, killed and reaped on the way out if it is still running."""
    try:
        yield rec
    finally:
        if rec.poll() is None:
            rec.kill()
            rec.wait()


def stop_recorder(rec: subprocess.Popen[str]) -> None:
    """SIGTERM: the recorder commits what it holds and exits 0 (its stderr if not)."""
    rec.send_signal(signal.SIGTERM)
    assert rec.wait(15) == 0, rec.communicate()[1]
