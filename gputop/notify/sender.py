"""The team's configured sender, as the deciding side gets it: the delivery Notifier over
``[notify]`` and each person's routes in the store (read when each notice is sent)."""

from __future__ import annotations

from pathlib import Path

from gputop.config import Config
from gputop.notify.delivery import Notifier, status_path
from gputop.notify.routes import store_routes
from gputop.notify.watcher import Watcher, default_path
from gputop.sources.shared_file import open_store


def configured(config: Config) -> bool:
    """Whether the config has a ``[notify]`` table (even an empty one: each person's own
    routes need no team key)."""
    return config.notify_sends


def make_notifier(config: Config) -> Notifier:
    """The started delivery (``close`` it when done)."""
    return Notifier(config.notify, store_routes(open_store(config), config.notify),
                    status_file=status_path(config.notify, config.history_path)).start()


def make_watcher(config: Config, notifier: Notifier, memory: Path | None = None) -> Watcher:
    """The watcher over ``notifier``, remembering in ``memory`` (default ``default_path``)."""
    return Watcher(notifier, memory or default_path(), warn_s=config.notify.expiry_warning_s)
