"""The team's configured sender, as the deciding side gets it: the delivery Notifier over
``[notify]`` and each person's routes in the store (read when each notice is sent)."""

from __future__ import annotations

from pathlib import Path

from gputop.config.load import Config
from gputop.notify.delivery import Notifier, start_notifier
from gputop.notify.watcher import Watcher, default_path
from gputop.reservations.open import open_store


def configured(config: Config) -> bool:
    """Whether the config has a ``[notify]`` table (even an empty one: each person's own
    routes need no team key)."""
    return config.notify_sends


def make_notifier(config: Config) -> Notifier:
    """The started delivery (``close`` it when done)."""
    return start_notifier(config, open_store(config))


def make_watcher(config: Config, notifier: Notifier, memory: Path | None = None) -> Watcher:
    """The watcher over ``notifier``, remembering in ``memory`` (default ``default_path``)."""
    return Watcher(notifier, memory or default_path(), warn_s=config.notify.expiry_warning_s)
