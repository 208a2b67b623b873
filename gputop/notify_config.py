"""The ``[notify]`` table of hosts.toml: where notices go and how hard delivery tries.

Its own module (on the config's floor) so that the data layer can parse it without the
senders. Secrets (the team channel's URL, the SMTP password) are never in the shared
config: only the paths of files that the sender's account alone reads.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gputop.errors import GputopError

TEAM_FORMATS = ("slack", "mattermost", "teams", "json", "ntfy")
OVERFLOW = ("drop-oldest", "refuse")
_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([smhdw]?)\s*$")
_UNIT_SECONDS = {"": 60.0, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0, "w": 604800.0}
_HOST = re.compile(r"[A-Za-z0-9_.-]{1,253}|\[[0-9A-Fa-f:.]{2,45}\]")
_DOMAIN = re.compile(r"[A-Za-z0-9-]+(?:\.[A-Za-z0-9-]+)+")
_ADDRESS = re.compile(r"[A-Za-z0-9._%+-]{1,64}@[A-Za-z0-9-]+(?:\.[A-Za-z0-9-]+)+")


class NotifyConfigError(GputopError):
    """A bad ``[notify]`` key: the message names the file and the key (exit 2)."""

    reason = "config"

    def __init__(self, path: Path, key: str, message: str) -> None:
        super().__init__(f"{path}: notify.{key}: {message}")


@dataclass(frozen=True)
class NotifyConfig:
    #: The mail's From address (``from``).
    sender: str | None = None
    #: ``smtp = "host:port"`` (port 587 when left out); STARTTLS when the server offers it.
    smtp_host: str | None = None
    smtp_port: int = 587
    #: A file of two lines, user and password, readable by its owner only.
    smtp_auth_file: Path | None = None
    #: A file holding the team channel's webhook URL, and the channel's format.
    team_webhook_file: Path | None = None
    team_format: str = "slack"
    #: How long before a reservation ends its holder is told (``expiry_warning``).
    expiry_warning_s: float = 900.0
    #: A person without a route gets mail at ``login@email_domain`` (unset: nothing).
    email_domain: str | None = None
    #: Notices waiting to be sent; when full, the oldest is dropped or the new one refused.
    queue: int = 1000
    overflow: str = "drop-oldest"
    #: Tries per notice and route, the first wait between them (doubling), each try's limit.
    attempts: int = 4
    retry_s: float = 2.0
    timeout_s: float = 10.0
    #: Where the sender keeps its last deliveries (None: beside the history database).
    status_file: Path | None = None


def _duration(path: Path, key: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (str, int, float)):
        raise NotifyConfigError(path, key, "must be a duration such as 15m or 2h")
    m = _DURATION.match(str(value))
    if not m or float(m.group(1)) <= 0:
        raise NotifyConfigError(path, key, f"not a duration: {str(value)[:40]!r} (use e.g. "
                                "90m, 2h, 1d)")
    return float(m.group(1)) * _UNIT_SECONDS[m.group(2)]


def _file(path: Path, key: str, value: Any) -> Path:
    if not isinstance(value, str) or not value or "\0" in value:
        raise NotifyConfigError(path, key, "must be the path of a file")
    p = Path(value).expanduser()
    return p if p.is_absolute() else path.parent / p


def _int(path: Path, key: str, value: Any, lo: int, hi: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
        raise NotifyConfigError(path, key, f"must be an integer from {lo} to {hi}")
    return value


def _text(path: Path, key: str, value: Any, allowed: re.Pattern[str], what: str) -> str:
    if not isinstance(value, str) or not allowed.fullmatch(value):
        raise NotifyConfigError(path, key, f"must be {what}")
    return value


def parse_notify(table: Any, path: Path) -> NotifyConfig:
    """The ``[notify]`` table (a TOML table) as a NotifyConfig; an unknown key, a wrong type
    or a secret given inline is a NotifyConfigError naming ``path`` and the key."""
    if not isinstance(table, dict):
        raise NotifyConfigError(path, "", "must be a table")
    t = dict(table)
    out: dict[str, Any] = {}
    for key in sorted(t):
        v = t[key]
        if key == "from":
            out["sender"] = _text(path, key, v, _ADDRESS, "an e-mail address")
        elif key == "smtp":
            if not isinstance(v, str):
                raise NotifyConfigError(path, key, 'must be "host:port"')
            host, sep, port = v.rpartition(":")
            if not sep:
                host, port = v, "587"
            if not _HOST.fullmatch(host) or not port.isdigit() or not 0 < int(port) < 65536:
                raise NotifyConfigError(path, key, f'must be "host:port", not {v[:60]!r}')
            out["smtp_host"], out["smtp_port"] = host.strip("[]"), int(port)
        elif key in ("smtp_auth_file", "team_webhook_file", "status_file"):
            out[key] = _file(path, key, v)
        elif key == "team_format":
            if v not in TEAM_FORMATS:
                raise NotifyConfigError(path, key, f"must be one of {', '.join(TEAM_FORMATS)}")
            out[key] = v
        elif key == "expiry_warning":
            out["expiry_warning_s"] = _duration(path, key, v)
        elif key == "email_domain":
            out[key] = _text(path, key, v, _DOMAIN, "a mail domain such as lab.example")
        elif key == "queue":
            out[key] = _int(path, key, v, 1, 100_000)
        elif key == "overflow":
            if v not in OVERFLOW:
                raise NotifyConfigError(path, key, f"must be one of {', '.join(OVERFLOW)}")
            out[key] = v
        elif key == "attempts":
            out[key] = _int(path, key, v, 1, 20)
        elif key in ("retry", "timeout"):
            out[f"{key}_s"] = _duration(path, key, v)
        elif key in ("team_webhook", "smtp_password", "password", "webhook"):
            raise NotifyConfigError(path, key, "secrets are never in the shared config: put "
                                    "it in a file only the sender reads and name that file "
                                    "(team_webhook_file, smtp_auth_file)")
        else:
            known = ("attempts, email_domain, expiry_warning, from, overflow, queue, retry, "
                     "smtp, smtp_auth_file, status_file, team_format, team_webhook_file, "
                     "timeout")
            raise NotifyConfigError(path, key, f"unknown key (known keys here: {known})")
    if out.get("smtp_host") and "sender" not in out:
        raise NotifyConfigError(path, "from", "is needed with smtp (the mail's From address)")
    return NotifyConfig(**out)
