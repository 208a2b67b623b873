"""The checks every table's parser shares: one TOML table read key by key, durations,
host names, URLs; each mistake a ``ConfigError`` that names the file and the key."""

from __future__ import annotations

import ipaddress
import re
from pathlib import Path
from typing import Any

import platformdirs

from gputop.errors import GputopError

APP = "gputop"


class ConfigError(GputopError):
    """A config mistake: ``str()`` is the one-line message shown to the user. Exit 2."""

    reason = "config"

    def __init__(self, path: Path | str, key: str | None, message: str) -> None:
        self.path, self.key, self.message = str(path), key, message
        where = f"{self.path}: {key}" if key else self.path
        super().__init__(f"{where}: {message}")


def user_data(name: str) -> Path:
    """``name`` in the user's data directory: where a file the config leaves out lives."""
    return Path(platformdirs.user_data_dir(APP)) / name


_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([smhdw]?)\s*$")
_UNIT_SECONDS = {"": 60.0, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0, "w": 604800.0}


def parse_duration(text: str) -> float:
    """``"90m"``, ``"2h"``, ``"1.5d"``, ``"45"`` (minutes) to seconds; ValueError otherwise."""
    m = _DURATION.match(text)
    if not m or float(m.group(1)) <= 0:
        raise ValueError(f"not a duration: {text!r} (use e.g. 90m, 2h, 1d)")
    return float(m.group(1)) * _UNIT_SECONDS[m.group(2)]


NAME = re.compile(r"^[A-Za-z0-9_.@-][A-Za-z0-9_.@+-]*$")
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


#: scp's rule: a colon before the first slash makes ``HOST:/path`` remote.
_REMOTE = re.compile(r"^(?P<host>[^/:]+):(?P<path>.*)$")


def split_remote(value: str) -> tuple[str, str] | None:
    """``(HOST, /path)`` for an scp-style ``HOST:/path``; None for a local path."""
    m = _REMOTE.match(value)
    return (m.group("host"), m.group("path")) if m else None


def remote_problem(host: str, rpath: str) -> str | None:
    """What is wrong with ``HOST:/path`` as a reservations file, or None."""
    if not NAME.match(host) or host_problem(host):
        return f"{host!r} is not a host name (letters, digits, '.', '-', '_', '@' only)"
    if not rpath.startswith("/"):
        return f"the path on {host} must be absolute (HOST:/abs/path), not {rpath!r}"
    if rpath.endswith("/") or any(c in rpath for c in "\0\n\r"):
        return f"{rpath!r} is not a file path"
    return None


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


def listen_problem(text: str) -> str | None:
    """Why ``text`` cannot be ``gputop serve``'s HOST:PORT (None: it can)."""
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit():
        return f"{text!r}: expected HOST:PORT, e.g. 127.0.0.1:9847"
    if not 0 < int(port) < 65536:
        return f"{text!r}: port {int(port)} is out of range (1 to 65535)"
    return None


class Table:
    """Reads one TOML table, checking types and rejecting unknown keys, naming the key."""

    def __init__(self, path: Path, prefix: str, data: Any) -> None:
        self.path, self.prefix = path, prefix
        if not isinstance(data, dict):
            raise ConfigError(path, prefix, f"must be a table, not {_tname(data)}")
        self.data = data
        self.used: set[str] = set()

    def key(self, k: str) -> str:
        return f"{self.prefix}.{k}" if self.prefix else k

    def error(self, k: str, message: str) -> ConfigError:
        return ConfigError(self.path, self.key(k), message)

    def get(self, k: str, types: type | tuple[type, ...], default: Any = None) -> Any:
        self.used.add(k)
        if k not in self.data:
            return default
        v = self.data[k]
        if isinstance(v, bool) and bool not in (types if isinstance(types, tuple) else (types,)):
            raise self.error(k, f"must be {_names(types)}, not a boolean")
        if not isinstance(v, types):
            raise self.error(k, f"must be {_names(types)}, not {_tname(v)}")
        return v

    def number(self, k: str, default: float, *, minimum: float) -> float:
        v = float(self.get(k, (int, float), default))
        if v < minimum:
            raise self.error(k, f"must be at least {minimum:g}")
        return v

    def duration(self, k: str, default: float) -> float:
        v = self.get(k, (str, int, float), None)
        if v is None:
            return default
        try:
            return parse_duration(str(v))
        except ValueError as exc:
            raise self.error(k, str(exc)) from None

    def path_value(self, k: str) -> Path | None:
        """A path key: relative to the config file; an empty one is a mistake."""
        v = self.get(k, str)
        if v is None:
            return None
        if not v.strip():
            raise self.error(k, "must not be empty")
        p = Path(v).expanduser()
        return p if p.is_absolute() else self.path.parent / p

    def done(self) -> None:
        unknown = sorted(set(self.data) - self.used)
        if unknown:
            known = ", ".join(sorted(self.used))
            raise self.error(unknown[0], f"unknown key (known keys here: {known})")


def _tname(v: Any) -> str:
    return {dict: "a table", list: "an array", str: "a string", bool: "a boolean"}.get(
        type(v), type(v).__name__
    )


def _names(types: type | tuple[type, ...]) -> str:
    ts = types if isinstance(types, tuple) else (types,)
    words = {str: "a string", int: "an integer", float: "a number", bool: "true or false",
             list: "an array", dict: "a table"}
    return " or ".join(dict.fromkeys(words.get(t, t.__name__) for t in ts))
