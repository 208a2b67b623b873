"""``hosts.toml``: where it is found, what it holds, and the ``Config`` it gives.

A mistake in the config is the user's to fix, so it is reported as one line naming the
file, the key (and the line where TOML gives one) and exits 2; never a traceback.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on 3.10 only
    import tomli as tomllib

import platformdirs

from gputop.config.notify import NotifyConfig, parse_notify
from gputop.config.tables import ENV_RESERVATIONS, Defaults, History, HostConfig, Hub, Reservations
from gputop.config.values import APP, ConfigError, Table

ENV_CONFIG = "GPUTOP_CONFIG"


@dataclass(frozen=True)
class Config:
    """The whole file: one attribute per table, named as the table."""

    path: Path | None
    hosts: tuple[HostConfig, ...]
    defaults: Defaults = field(default_factory=Defaults)
    reservations: Reservations = field(default_factory=Reservations)
    history: History = field(default_factory=History)
    hub: Hub = field(default_factory=Hub)
    #: ``[notify]``: channels, secrets' files and delivery bounds (docs/notifications.md).
    notify: NotifyConfig = field(default_factory=NotifyConfig)
    #: Whether the config has a ``[notify]`` table: then the hub (or ``gputop notify
    #: run``) is the team's sender (docs/notification-events.md).
    notify_sends: bool = False
    #: True when no config file was found: only the local machine is monitored.
    implicit: bool = False

    def host(self, name: str) -> HostConfig | None:
        return next((h for h in self.hosts if h.name == name), None)

    def with_defaults(self, **changes: Any) -> Config:
        """This config with some ``[defaults]`` changed (a command-line option, a one-shot
        look's collection)."""
        return replace(self, defaults=replace(self.defaults, **changes))

    def with_reservations(self, **changes: Any) -> Config:
        return replace(self, reservations=replace(self.reservations, **changes))

    def with_hub(self, **changes: Any) -> Config:
        return replace(self, hub=replace(self.hub, **changes))


def data_path(name: str) -> Path:
    """A file shipped with gputop (``themes``, ``hosts.example.toml``): the copy a wheel
    puts in the package (setup.py), else the source checkout's top level."""
    here = Path(__file__).resolve().parents[1]
    shipped = here / "data" / name
    return shipped if shipped.exists() else here.parent / name


def default_config_path() -> Path:
    return Path(platformdirs.user_config_dir(APP)) / "hosts.toml"


def find_config(cli_path: str | None) -> Path | None:
    """``--config``, else ``$GPUTOP_CONFIG``, else the user config dir's hosts.toml if present."""
    if cli_path:
        return Path(cli_path).expanduser()
    env = os.environ.get(ENV_CONFIG)
    if env:
        return Path(env).expanduser()
    p = default_config_path()
    return p if p.exists() else None


NO_CONFIG_HINT = (
    "no hosts.toml found: monitoring this machine only. To add hosts, run "
    "`gputop init-config` (it writes the documented example to {path}) and edit it, "
    "or pass --config FILE."
)


def load_config(cli_path: str | None = None) -> Config:
    path = find_config(cli_path)
    env_reservations = os.environ.get(ENV_RESERVATIONS)
    if path is None:
        return Config(
            path=None,
            hosts=(HostConfig(name="localhost", local=True),),
            reservations=Reservations.located(env_reservations, None,
                                              f"${ENV_RESERVATIONS}", None),
            implicit=True,
        )
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        raise ConfigError(path, None, "file not found") from None
    except OSError as exc:
        raise ConfigError(path, None, f"cannot read: {exc.strerror}") from None
    try:
        data = tomllib.loads(raw.decode("utf-8"))
    except UnicodeDecodeError:
        raise ConfigError(path, None, "not UTF-8 text") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(path, None, f"invalid TOML: {exc}") from None
    return parse_config(data, path, env_reservations)


def parse_config(data: dict[str, Any], path: Path, env_reservations: str | None = None
                 ) -> Config:
    """The file's tables, each read by its own dataclass's ``parse``; ``env_reservations``
    is ``$GPUTOP_RESERVATIONS``, used when ``[reservations] path`` is not set."""
    top = Table(path, "", data)

    def table(name: str) -> Table:
        return Table(path, name, top.get(name, dict, {}))

    defaults = Defaults.parse(table("defaults"))
    reservations = Reservations.parse(table("reservations"), env_reservations)
    history = History.parse(table("history"))
    hub = Hub.parse(table("hub"))
    notify_table = top.get("notify", dict)
    notify = parse_notify(notify_table or {}, path)
    raw_hosts = top.get("hosts", list, [])
    top.done()
    hosts: list[HostConfig] = []
    for i, item in enumerate(raw_hosts):
        h = HostConfig.parse(Table(path, f"hosts[{i}]",
                                   {"name": item} if isinstance(item, str) else item))
        if any(h.name == seen.name for seen in hosts):
            raise ConfigError(path, f"hosts[{i}].name", f"duplicate host name {h.name!r}")
        hosts.append(h)
    if not hosts and (hub.url is None or hub.fallback == "direct"):
        raise ConfigError(path, "hosts", "no hosts configured (add [[hosts]] tables)"
                          + (" for hub.fallback = \"direct\"" if hub.url else ""))
    return Config(path=path, hosts=tuple(hosts), defaults=defaults,
                  reservations=reservations, history=history, hub=hub, notify=notify,
                  notify_sends=notify_table is not None)


#: The hub's bound on open HTTP connections (``serve --max-connections``): without one, a
#: client opening sockets could use up the process's file limit, and with it the hub's own
#: SSH connections to the hosts.
HUB_MAX_CONNECTIONS = 256


def reserving_problem(config: Config) -> str | None:
    """Why nothing can be reserved with ``config`` (None: it can). Reserving needs its
    hosts in the hosts file, also with a hub: your own gputop checks jobs and logins there
    (over SSH), and ``reserve``/``release`` name them; a hub's other hosts are shown, never
    reserved (they would be held until max_duration, with nothing here able to see their
    job end)."""
    if config.hosts:
        return None
    return ("each host you reserve on must be in your hosts file, also with a hub: list "
            f"them as [[hosts]] in {config.path or default_config_path()}")
