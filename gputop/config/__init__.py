"""``hosts.toml``: ``load_config`` gives a ``Config`` with one attribute per table
(``config.defaults.interval``, ``config.reservations.path``, ``config.hub.url``, ...).

``values`` holds the checks every table shares, ``tables`` one dataclass per table (its
defaults and its parser), ``load`` finding and reading the file.
"""

from gputop.config.load import (
    ENV_CONFIG,
    HUB_MAX_CONNECTIONS,
    NO_CONFIG_HINT,
    Config,
    data_path,
    default_config_path,
    find_config,
    load_config,
    parse_config,
    reserving_problem,
)
from gputop.config.tables import (
    ENV_RESERVATIONS,
    MAX_HOST_GPUS,
    Defaults,
    History,
    HostConfig,
    Hub,
    Reservations,
)
from gputop.config.values import (
    APP,
    ConfigError,
    host_problem,
    hub_url_problem,
    listen_problem,
    parse_duration,
    remote_problem,
    split_remote,
)

__all__ = [
    "APP", "ENV_CONFIG", "ENV_RESERVATIONS", "HUB_MAX_CONNECTIONS", "MAX_HOST_GPUS",
    "NO_CONFIG_HINT", "Config", "ConfigError", "Defaults", "History", "HostConfig", "Hub",
    "Reservations", "data_path", "default_config_path", "find_config", "host_problem",
    "hub_url_problem", "listen_problem", "load_config", "parse_config", "parse_duration",
    "remote_problem", "reserving_problem", "split_remote",
]
