"""``hosts.toml``: where it is found, what it may say, and errors that name file and key.

A mistake in the config is the user's to fix, so it is reported as one line naming the
file, the key (and the line where TOML gives one) and exits 2; never a traceback.
"""

from __future__ import annotations

import ipaddress
import os
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on 3.10 only
    import tomli as tomllib

import platformdirs

from gputop.errors import GputopError
from gputop.notify_config import NotifyConfig, parse_notify

APP = "gputop"
ENV_CONFIG = "GPUTOP_CONFIG"
ENV_RESERVATIONS = "GPUTOP_RESERVATIONS"


class ConfigError(GputopError):
    """A config mistake: ``str()`` is the one-line message shown to the user. Exit 2."""

    reason = "config"

    def __init__(self, path: Path | str, key: str | None, message: str) -> None:
        self.path, self.key, self.message = str(path), key, message
        where = f"{self.path}: {key}" if key else self.path
        super().__init__(f"{where}: {message}")


_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([smhdw]?)\s*$")
_UNIT_SECONDS = {"": 60.0, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0, "w": 604800.0}


def parse_duration(text: str) -> float:
    """``"90m"``, ``"2h"``, ``"1.5d"``, ``"45"`` (minutes) to seconds; ValueError otherwise."""
    m = _DURATION.match(text)
    if not m or float(m.group(1)) <= 0:
        raise ValueError(f"not a duration: {text!r} (use e.g. 90m, 2h, 1d)")
    return float(m.group(1)) * _UNIT_SECONDS[m.group(2)]


_NAME = re.compile(r"^[A-Za-z0-9_.@-][A-Za-z0-9_.@+-]*$")
#: One DNS-style label (letters, digits, '_', '-' inside); an ssh alias may also have '+'.
_LABEL = re.compile(r"^[A-Za-z0-9_](?:[A-Za-z0-9_+-]*[A-Za-z0-9_])?$")


def host_problem(text: str, *, user_part: bool = True) -> str | None:
    """Why ``text`` cannot be an SSH destination host, or None. A leading ``-`` would be
    read by ``ssh`` as an option (``-oProxyCommand=...``), so it is never accepted."""
    if text.startswith("-"):
        return "must not start with '-'"
    user, at, host = text.rpartition("@")
    if at and not user_part:
        return "has a user part (use the key user = instead)"
    if at and (not user or user.startswith("-") or "@" in user):
        return "has an empty or odd user part before '@'"
    if not host or len(host) > 253:
        return "is not a host name or IP address"
    try:
        ipaddress.ip_address(host[1:-1] if host.startswith("[") else host)
        return None
    except ValueError:
        pass
    labels = (host[:-1] if host.endswith(".") else host).split(".")
    if not all(_LABEL.match(label) for label in labels):
        return "is not a host name or IP address"
    if not user_part and "+" in host:
        return "is not a host name or IP address"
    return None


#: ``[[hosts]] gpus`` at most: more than any one machine has.
MAX_HOST_GPUS = 256


@dataclass(frozen=True)
class HostConfig:
    name: str
    #: Overrides ~/.ssh/config's HostName; by default ``name`` is resolved like ``ssh name``.
    address: str | None = None
    port: int | None = None
    user: str | None = None
    tags: tuple[str, ...] = ()
    #: Read this host in-process through NVML instead of SSH.
    local: bool = False
    #: ``gpus = N``: the host has GPUs 0..N-1. Lets a host that has never answered (nor is
    #: in the history) be reserved on; without it nothing is known there to reserve.
    gpus: int | None = None


@dataclass(frozen=True)
class Config:
    path: Path | None
    hosts: tuple[HostConfig, ...]
    interval: float = 2.0
    timeout: float = 10.0
    #: How long a host's nvidia-smi stream may take to its first sample (a GPU without
    #: persistence mode can take tens of seconds to initialise); meanwhile it is "starting".
    first_sample_timeout: float = 60.0
    #: How long a one-shot look (``--once``, ``--json``, ``free``, ...) waits for the
    #: hosts' first answers: a host past it is ``slow`` and left out, so one hung host
    #: never holds the answer for the whole ``timeout``.
    first_answer: float = 2.0
    #: Wait for every host up to its ``timeout`` instead (``--wait-all``).
    wait_all: bool = False
    #: "stream": long-running nvidia-smi loops per host; "query": two nvidia-smi and a ps
    #: per refresh (the old model; also what a host that cannot stream falls back to).
    collection: str = "stream"
    #: Cap on simultaneous SSH handshakes (a shared bastion drops beyond MaxStartups).
    max_connecting: int = 16
    ssh_config: tuple[Path, ...] | None = None
    theme: str | None = None
    reservations_path: Path = field(
        default_factory=lambda: Path(platformdirs.user_data_dir(APP)) / "reservations.json"
    )
    #: ``[reservations] path = "HOST:/abs/path"``: the file lives on ``HOST`` (an SSH
    #: destination, or a configured host's name) and is read and written over SSH; then
    #: ``reservations_path`` is that absolute path on ``HOST``.
    reservations_host: str | None = None
    reservation_default_s: float = 4 * 3600.0
    reservation_max_s: float = 7 * 86400.0
    #: How long a GPU must hold memory at ~0 % utilisation to be flagged ``idle-holder``.
    idle_holder_s: float = 1800.0
    #: A reservation is flagged ``idle-reservation`` only after this long without a process
    #: of its holder on the GPU (``[reservations] idle_grace``).
    idle_grace_s: float = 900.0
    #: A share is flagged ``over-share`` only after its holder's processes used more than
    #: the share this long (``[reservations] share_grace``).
    share_grace_s: float = 300.0
    #: A job-tied reservation is released once its job has been seen gone for this long
    #: (``[reservations] job_grace``).
    job_grace_s: float = 30.0
    #: True when no config file was found: only the local machine is monitored.
    implicit: bool = False
    #: The history database (``[history] path``) and how long each tier is kept.
    history_path: Path = field(
        default_factory=lambda: Path(platformdirs.user_data_dir(APP)) / "history.sqlite3"
    )
    history_raw_keep_s: float = 2 * 86400.0
    history_minute_keep_s: float = 30 * 86400.0
    history_hour_keep_s: float | None = None  # None: forever
    #: A hub to read instead of SSHing to every host (``[hub] url``, or ``--hub URL``),
    #: and what to do when it is down: "none" (a clear error) or "direct" (poll the hosts).
    hub_url: str | None = None
    hub_fallback: str = "none"
    #: A file holding the bearer token: the hub requires it, its clients send it.
    hub_token_file: Path | None = None
    #: Where ``gputop serve`` listens (``[hub] listen``; ``--listen`` overrides).
    hub_listen: str | None = None
    #: The hub's retained window of events, in MiB (``[hub] retain_mb``; ``--retain-mb``).
    hub_retain_mb: int | None = None
    #: ``[notify]``: channels, secrets' files and delivery bounds (docs/notifications.md).
    notify: NotifyConfig = field(default_factory=NotifyConfig)
    #: Whether the config has a ``[notify]`` table: then the hub (or ``gputop notify
    #: run``) is the team's sender (docs/notification-events.md).
    notify_sends: bool = False

    def host(self, name: str) -> HostConfig | None:
        return next((h for h in self.hosts if h.name == name), None)


def data_path(name: str) -> Path:
    """A file shipped with gputop (``themes``, ``hosts.example.toml``): the copy a wheel
    puts in the package (setup.py), else the source checkout's top level."""
    here = Path(__file__).resolve().parent
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
    if path is None:
        remote = split_remote(os.environ.get(ENV_RESERVATIONS) or "")
        problem = remote_problem(*remote) if remote else None
        if problem:
            raise ConfigError(f"${ENV_RESERVATIONS}", None, problem)
        return Config(
            path=None,
            hosts=(HostConfig(name="localhost", local=True),),
            reservations_path=_reservations_path(None, None),
            reservations_host=_reservations_host(None, None),
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
    return parse_config(data, path)


# --- validation ---------------------------------------------------------------------------


class _Table:
    """Reads one TOML table, checking types and rejecting unknown keys, naming the key."""

    def __init__(self, path: Path, prefix: str, data: Any) -> None:
        self.path, self.prefix = path, prefix
        if not isinstance(data, dict):
            raise ConfigError(path, prefix, f"must be a table, not {_tname(data)}")
        self.data = data
        self.used: set[str] = set()

    def key(self, k: str) -> str:
        return f"{self.prefix}.{k}" if self.prefix else k

    def get(self, k: str, types: type | tuple[type, ...], default: Any = None) -> Any:
        self.used.add(k)
        if k not in self.data:
            return default
        v = self.data[k]
        if isinstance(v, bool) and bool not in (types if isinstance(types, tuple) else (types,)):
            raise ConfigError(self.path, self.key(k), f"must be {_names(types)}, not a boolean")
        if not isinstance(v, types):
            raise ConfigError(self.path, self.key(k), f"must be {_names(types)}, not {_tname(v)}")
        return v

    def number(self, k: str, default: float, *, minimum: float) -> float:
        v = float(self.get(k, (int, float), default))
        if v < minimum:
            raise ConfigError(self.path, self.key(k), f"must be at least {minimum:g}")
        return v

    def duration(self, k: str, default: float) -> float:
        v = self.get(k, (str, int, float), None)
        if v is None:
            return default
        try:
            return parse_duration(str(v))
        except ValueError as exc:
            raise ConfigError(self.path, self.key(k), str(exc)) from None

    def done(self) -> None:
        unknown = sorted(set(self.data) - self.used)
        if unknown:
            known = ", ".join(sorted(self.used))
            raise ConfigError(
                self.path, self.key(unknown[0]), f"unknown key (known keys here: {known})"
            )


def _tname(v: Any) -> str:
    return {dict: "a table", list: "an array", str: "a string", bool: "a boolean"}.get(
        type(v), type(v).__name__
    )


def _names(types: type | tuple[type, ...]) -> str:
    ts = types if isinstance(types, tuple) else (types,)
    words = {str: "a string", int: "an integer", float: "a number", bool: "true or false",
             list: "an array", dict: "a table"}
    return " or ".join(dict.fromkeys(words.get(t, t.__name__) for t in ts))


#: scp's rule: a colon before the first slash makes ``HOST:/path`` remote.
_REMOTE = re.compile(r"^(?P<host>[^/:]+):(?P<path>.*)$")


def split_remote(value: str) -> tuple[str, str] | None:
    """``(HOST, /path)`` for an scp-style ``HOST:/path``; None for a local path."""
    m = _REMOTE.match(value)
    return (m.group("host"), m.group("path")) if m else None


def remote_problem(host: str, rpath: str) -> str | None:
    """What is wrong with ``HOST:/path`` as a reservations file, or None."""
    if not _NAME.match(host) or host_problem(host):
        return f"{host!r} is not a host name (letters, digits, '.', '-', '_', '@' only)"
    if not rpath.startswith("/"):
        return f"the path on {host} must be absolute (HOST:/abs/path), not {rpath!r}"
    if rpath.endswith("/") or any(c in rpath for c in "\0\n\r"):
        return f"{rpath!r} is not a file path"
    return None


def _reservations_host(value: str | None, base: Path | None) -> str | None:
    if not value:
        value = os.environ.get(ENV_RESERVATIONS)
    remote = split_remote(value) if value else None
    return remote[0] if remote else None


def _reservations_path(value: str | None, base: Path | None) -> Path:
    remote = split_remote(value or os.environ.get(ENV_RESERVATIONS) or "")
    if remote:
        return Path(remote[1])
    if value:
        p = Path(value).expanduser()
        return p if p.is_absolute() or base is None else base.parent / p
    env = os.environ.get(ENV_RESERVATIONS)
    if env:
        return Path(env).expanduser()
    return Path(platformdirs.user_data_dir(APP)) / "reservations.json"


def _data_path(value: str | None, base: Path, default: str) -> Path:
    """A path from the config: relative to the config file; default in the data dir."""
    if value:
        p = Path(value).expanduser()
        return p if p.is_absolute() else base.parent / p
    return Path(platformdirs.user_data_dir(APP)) / default


def _host(path: Path, key: str, item: Any) -> HostConfig:
    if isinstance(item, str):
        item = {"name": item}
    t = _Table(path, key, item)
    name = t.get("name", str)
    if name is None:
        raise ConfigError(path, t.key("name"), "is required")
    if not _NAME.match(name):
        raise ConfigError(
            path, t.key("name"),
            f"{name!r} is not a host name (letters, digits, '.', '-', '_', '@' only)",
        )
    problem = host_problem(name)
    if problem:
        raise ConfigError(path, t.key("name"), f"{name!r} {problem}")
    port = t.get("port", int)
    if port is not None and not 0 < port < 65536:
        raise ConfigError(path, t.key("port"), "must be between 1 and 65535")
    tags = t.get("tags", list, [])
    if not all(isinstance(x, str) for x in tags):
        raise ConfigError(path, t.key("tags"), "must be an array of strings")
    address = t.get("address", str)
    if address is not None:
        problem = host_problem(address, user_part=False)
        if problem:
            raise ConfigError(path, t.key("address"), f"{address!r} {problem}")
    user = t.get("user", str)
    gpus = t.get("gpus", int)
    if gpus is not None and not 1 <= gpus <= MAX_HOST_GPUS:
        raise ConfigError(path, t.key("gpus"), f"must be between 1 and {MAX_HOST_GPUS} (the "
                          "number of GPUs the host has)")
    local = t.get("local", bool, False)
    if local:
        for key, value in (("address", address), ("port", port), ("user", user)):
            if value is not None:  # NVML reads this machine: an SSH setting would be ignored
                raise ConfigError(path, t.key(key), "cannot be used with local = true")
    t.done()
    return HostConfig(name, address, port, user, tuple(tags), local, gpus)


def parse_config(data: dict[str, Any], path: Path) -> Config:
    top = _Table(path, "", data)
    d = _Table(path, "defaults", top.get("defaults", dict, {}))
    interval = d.number("interval", 2.0, minimum=0.1)
    timeout = d.number("timeout", 10.0, minimum=0.5)
    first_sample_timeout = d.number("first_sample_timeout", max(60.0, timeout), minimum=0.5)
    # (a number is seconds, as timeout's; a string a duration: "2s", "1.5s")
    answer = d.get("first_answer", (str, int, float), min(2.0, timeout))
    first_answer = float(answer) if not isinstance(answer, str) else d.duration("first_answer", 0)
    if not 0 < first_answer <= timeout:
        raise ConfigError(path, d.key("first_answer"), "must be more than zero and at most "
                          f"the timeout ({timeout:g}s)")
    wait_all = d.get("wait_all", bool, False)
    collection = d.get("collection", str, "stream")
    if collection not in ("stream", "query"):
        raise ConfigError(path, d.key("collection"), 'must be "stream" or "query"')
    max_connecting = int(d.number("max_connecting", 16, minimum=1))
    theme = d.get("theme", str)
    idle_holder_s = d.duration("idle_holder_after", 1800.0)
    ssh_cfg = d.get("ssh_config", (str, list))
    if isinstance(ssh_cfg, list) and not all(isinstance(x, str) for x in ssh_cfg):
        raise ConfigError(path, d.key("ssh_config"), "must be a path or an array of paths")
    d.done()

    r = _Table(path, "reservations", top.get("reservations", dict, {}))
    rvalue = r.get("path", str)
    remote = split_remote(rvalue or os.environ.get(ENV_RESERVATIONS) or "")
    if remote:
        problem = remote_problem(*remote)
        if problem:
            raise ConfigError(path, "reservations.path" if rvalue else ENV_RESERVATIONS,
                              problem)
    rpath = _reservations_path(rvalue, path)
    rhost = _reservations_host(rvalue, path)
    rdefault = r.duration("default_duration", 4 * 3600.0)
    rmax = r.duration("max_duration", 7 * 86400.0)
    if rdefault > rmax:
        raise ConfigError(path, "reservations.default_duration", "is longer than max_duration")
    idle_grace_s = r.duration("idle_grace", 900.0)
    share_grace_s = r.duration("share_grace", 300.0)
    job_grace_s = r.duration("job_grace", 30.0)
    r.done()

    hist = _Table(path, "history", top.get("history", dict, {}))
    hvalue = hist.get("path", str)
    if hvalue is not None and not hvalue.strip():
        raise ConfigError(path, "history.path", "must not be empty")
    hpath = _data_path(hvalue, path, "history.sqlite3")
    raw_keep = hist.duration("keep_raw", 2 * 86400.0)
    minute_keep = hist.duration("keep_minutes", 30 * 86400.0)
    hour_keep: float | None = None
    if hist.get("keep_hours", (str, int, float)) != "forever":
        hour_keep = hist.duration("keep_hours", 0.0) or None
    if hour_keep is not None and hour_keep < max(minute_keep, 86400.0):
        # The board's last day and a report's edges read hours wherever minutes are gone.
        raise ConfigError(path, "history.keep_hours", "must be at least 1d and at least "
                          "keep_minutes (or \"forever\", the default)")
    hist.done()

    hub = _Table(path, "hub", top.get("hub", dict, {}))
    hub_url = hub.get("url", str)
    if hub_url is not None:
        problem = hub_url_problem(hub_url)
        if problem:
            raise ConfigError(path, "hub.url", problem)
    hub_fallback = hub.get("fallback", str, "none")
    if hub_fallback not in ("none", "direct"):
        raise ConfigError(path, "hub.fallback", 'must be "none" or "direct"')
    token_value = hub.get("token_file", str)
    if token_value is not None and not token_value.strip():
        raise ConfigError(path, "hub.token_file", "must not be empty")
    token_file = _data_path(token_value, path, "") if token_value else None
    hub_listen = hub.get("listen", str)
    if hub_listen is not None and listen_problem(hub_listen):
        raise ConfigError(path, "hub.listen", str(listen_problem(hub_listen)))
    hub_retain_mb = hub.get("retain_mb", int)
    if hub_retain_mb is not None and not 1 <= hub_retain_mb <= 65536:
        raise ConfigError(path, "hub.retain_mb", "must be between 1 and 65536 (MiB)")
    hub.done()

    notify_table = top.get("notify", dict)
    notify = parse_notify(notify_table or {}, path)
    raw_hosts = top.get("hosts", list, [])
    top.done()
    hosts: list[HostConfig] = []
    seen: set[str] = set()
    for i, item in enumerate(raw_hosts):
        h = _host(path, f"hosts[{i}]", item)
        if h.name in seen:
            raise ConfigError(path, f"hosts[{i}].name", f"duplicate host name {h.name!r}")
        seen.add(h.name)
        hosts.append(h)
    if not hosts and (hub_url is None or hub_fallback == "direct"):
        raise ConfigError(path, "hosts", "no hosts configured (add [[hosts]] tables)"
                          + (" for hub.fallback = \"direct\"" if hub_url else ""))

    ssh_paths: tuple[Path, ...] | None = None
    if ssh_cfg is not None:
        items = [ssh_cfg] if isinstance(ssh_cfg, str) else ssh_cfg
        ssh_paths = tuple(Path(x).expanduser() for x in items)

    return Config(
        path=path,
        hosts=tuple(hosts),
        interval=interval,
        timeout=timeout,
        first_sample_timeout=first_sample_timeout,
        first_answer=first_answer,
        wait_all=wait_all,
        collection=collection,
        max_connecting=max_connecting,
        ssh_config=ssh_paths,
        theme=theme,
        reservations_path=rpath,
        reservations_host=rhost,
        reservation_default_s=rdefault,
        reservation_max_s=rmax,
        idle_holder_s=idle_holder_s,
        idle_grace_s=idle_grace_s,
        share_grace_s=share_grace_s,
        job_grace_s=job_grace_s,
        history_path=hpath,
        history_raw_keep_s=raw_keep,
        history_minute_keep_s=minute_keep,
        history_hour_keep_s=hour_keep,
        hub_url=hub_url,
        hub_fallback=hub_fallback,
        hub_token_file=token_file,
        hub_listen=hub_listen,
        hub_retain_mb=hub_retain_mb,
        notify=notify,
        notify_sends=notify_table is not None,
    )


def hub_url_problem(url: str) -> str | None:
    """Why ``url`` cannot be a hub's address (None: it can)."""
    from urllib.parse import urlsplit

    try:
        u = urlsplit(url)
        u.port  # noqa: B018 - raises on a bad port
    except ValueError as exc:
        return f"{url!r} is not a URL: {exc}"
    if u.scheme not in ("http", "https") or not u.hostname:
        return f"{url!r}: expected http://HOST:PORT/ (or https://)"
    if u.username or u.password or u.query or u.fragment:
        return f"{url!r}: no user, password, query or fragment (a token goes in [hub] token_file)"
    return None


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


def listen_problem(text: str) -> str | None:
    """Why ``text`` cannot be ``gputop serve``'s HOST:PORT (None: it can)."""
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit():
        return f"{text!r}: expected HOST:PORT, e.g. 127.0.0.1:9847"
    if not 0 < int(port) < 65536:
        return f"{text!r}: port {int(port)} is out of range (1 to 65535)"
    return None
