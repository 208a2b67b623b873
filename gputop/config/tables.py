"""One frozen dataclass per table of ``hosts.toml``, its attributes named as its keys (a
duration's with ``_s``: seconds). Each default is written once, here; each table's
``parse`` reads its keys and names the one that is wrong."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from gputop.config.values import (
    NAME,
    ConfigError,
    Table,
    host_problem,
    hub_url_problem,
    listen_problem,
    remote_problem,
    split_remote,
    user_data,
)

ENV_RESERVATIONS = "GPUTOP_RESERVATIONS"
#: ``[[hosts]] gpus`` at most: more than any one machine has.
MAX_HOST_GPUS = 256


@dataclass(frozen=True)
class HostConfig:
    """One ``[[hosts]]`` table (or one name in a top-level ``hosts = [...]``)."""

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

    @classmethod
    def parse(cls, t: Table) -> HostConfig:
        name = t.get("name", str)
        if name is None:
            raise t.error("name", "is required")
        if not NAME.match(name):
            raise t.error("name", f"{name!r} is not a host name (letters, digits, '.', '-', "
                          "'_', '@' only)")
        problem = host_problem(name)
        if problem:
            raise t.error("name", f"{name!r} {problem}")
        port = t.get("port", int)
        if port is not None and not 0 < port < 65536:
            raise t.error("port", "must be between 1 and 65535")
        tags = t.get("tags", list, [])
        if not all(isinstance(x, str) for x in tags):
            raise t.error("tags", "must be an array of strings")
        address = t.get("address", str)
        if address is not None:
            problem = host_problem(address, user_part=False)
            if problem:
                raise t.error("address", f"{address!r} {problem}")
        user = t.get("user", str)
        gpus = t.get("gpus", int)
        if gpus is not None and not 1 <= gpus <= MAX_HOST_GPUS:
            raise t.error("gpus", f"must be between 1 and {MAX_HOST_GPUS} (the number of "
                          "GPUs the host has)")
        local = t.get("local", bool, False)
        if local:
            for key, value in (("address", address), ("port", port), ("user", user)):
                if value is not None:  # NVML reads this machine: an SSH setting is ignored
                    raise t.error(key, "cannot be used with local = true")
        t.done()
        return cls(name, address, port, user, tuple(tags), local, gpus)


@dataclass(frozen=True)
class Defaults:
    """``[defaults]``: how each host is read."""

    interval: float = 2.0
    timeout: float = 10.0
    #: How long a host's nvidia-smi stream may take to its first sample (a GPU without
    #: persistence mode can take tens of seconds to initialise); meanwhile it is "starting".
    #: Never less than ``timeout`` unless set.
    first_sample_timeout: float = 60.0
    #: How long a one-shot look (``--once``, ``--json``, ``free``, ...) waits for the
    #: hosts' first answers: a host past it is ``slow`` and left out, so one hung host
    #: never holds the answer for the whole ``timeout``. Never more than ``timeout``.
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
    #: How long a GPU must hold memory at ~0 % utilisation to be flagged ``idle-holder``
    #: (``idle_holder_after``).
    idle_holder_s: float = 1800.0

    @classmethod
    def parse(cls, t: Table) -> Defaults:
        interval = t.number("interval", cls.interval, minimum=0.1)
        timeout = t.number("timeout", cls.timeout, minimum=0.5)
        first_sample = t.number("first_sample_timeout", max(cls.first_sample_timeout, timeout),
                                minimum=0.5)
        # (a number is seconds, as timeout's; a string a duration: "2s", "1.5s")
        answer = t.get("first_answer", (str, int, float), min(cls.first_answer, timeout))
        first_answer = float(answer) if not isinstance(answer, str) else t.duration(
            "first_answer", 0)
        if not 0 < first_answer <= timeout:
            raise t.error("first_answer", "must be more than zero and at most the timeout "
                          f"({timeout:g}s)")
        collection = t.get("collection", str, cls.collection)
        if collection not in ("stream", "query"):
            raise t.error("collection", 'must be "stream" or "query"')
        ssh_cfg = t.get("ssh_config", (str, list))
        if isinstance(ssh_cfg, list) and not all(isinstance(x, str) for x in ssh_cfg):
            raise t.error("ssh_config", "must be a path or an array of paths")
        done = cls(
            interval=interval, timeout=timeout, first_sample_timeout=first_sample,
            first_answer=first_answer, wait_all=t.get("wait_all", bool, cls.wait_all),
            collection=collection,
            max_connecting=int(t.number("max_connecting", cls.max_connecting, minimum=1)),
            ssh_config=None if ssh_cfg is None else tuple(
                Path(x).expanduser() for x in ([ssh_cfg] if isinstance(ssh_cfg, str)
                                               else ssh_cfg)),
            theme=t.get("theme", str, cls.theme),
            idle_holder_s=t.duration("idle_holder_after", cls.idle_holder_s),
        )
        t.done()
        return done


@dataclass(frozen=True)
class Reservations:
    """``[reservations]``: the shared file and how long things last."""

    #: ``path``, else ``$GPUTOP_RESERVATIONS``. ``HOST:/abs/path``: the file lives on
    #: ``host`` (an SSH destination, or a configured host's name) and is read and written
    #: over SSH; then ``path`` is that absolute path on ``host``.
    path: Path = field(default_factory=lambda: user_data("reservations.json"))
    host: str | None = None
    #: ``default_duration``: ``gputop reserve`` without ``--for``.
    default_s: float = 4 * 3600.0
    #: ``max_duration``: longer requests are refused.
    max_s: float = 7 * 86400.0
    #: A reservation is flagged ``idle-reservation`` only after this long without a process
    #: of its holder on the GPU (``idle_grace``).
    idle_grace_s: float = 900.0
    #: A share is flagged ``over-share`` only after its holder's processes used more than
    #: the share this long (``share_grace``).
    share_grace_s: float = 300.0
    #: A job-tied reservation is released once its job has been seen gone for this long
    #: (``job_grace``).
    job_grace_s: float = 30.0

    @classmethod
    def located(cls, value: str | None, base: Path | None, file: Path | str,
                key: str | None) -> Reservations:
        """Where ``value`` puts the file (a local path relative to ``base``'s folder when
        given); a bad ``HOST:/path`` is an error at ``file``'s ``key``."""
        if not value:
            return cls()
        remote = split_remote(value)
        if remote:
            problem = remote_problem(*remote)
            if problem:
                raise ConfigError(file, key, problem)
            return cls(path=Path(remote[1]), host=remote[0])
        p = Path(value).expanduser()
        return cls(path=p if p.is_absolute() or base is None else base.parent / p)

    @classmethod
    def parse(cls, t: Table, env: str | None) -> Reservations:
        value = t.get("path", str)
        where = (cls.located(value, t.path, t.path, t.key("path")) if value
                 else cls.located(env, None, t.path, ENV_RESERVATIONS))
        default_s = t.duration("default_duration", cls.default_s)
        max_s = t.duration("max_duration", cls.max_s)
        if default_s > max_s:
            raise t.error("default_duration", "is longer than max_duration")
        done = cls(path=where.path, host=where.host, default_s=default_s, max_s=max_s,
                   idle_grace_s=t.duration("idle_grace", cls.idle_grace_s),
                   share_grace_s=t.duration("share_grace", cls.share_grace_s),
                   job_grace_s=t.duration("job_grace", cls.job_grace_s))
        t.done()
        return done


@dataclass(frozen=True)
class History:
    """``[history]``: the SQLite file and how long each tier is kept."""

    path: Path = field(default_factory=lambda: user_data("history.sqlite3"))
    keep_raw_s: float = 2 * 86400.0
    keep_minutes_s: float = 30 * 86400.0
    #: None: forever.
    keep_hours_s: float | None = None

    @classmethod
    def parse(cls, t: Table) -> History:
        path = t.path_value("path") or cls().path
        keep_minutes_s = t.duration("keep_minutes", cls.keep_minutes_s)
        keep_hours_s = cls.keep_hours_s
        if t.get("keep_hours", (str, int, float)) != "forever":
            keep_hours_s = t.duration("keep_hours", 0.0) or cls.keep_hours_s
        if keep_hours_s is not None and keep_hours_s < max(keep_minutes_s, 86400.0):
            # The board's last day and a report's edges read hours wherever minutes are gone.
            raise t.error("keep_hours", "must be at least 1d and at least keep_minutes (or "
                          "\"forever\", the default)")
        done = cls(path=path, keep_raw_s=t.duration("keep_raw", cls.keep_raw_s),
                   keep_minutes_s=keep_minutes_s, keep_hours_s=keep_hours_s)
        t.done()
        return done


@dataclass(frozen=True)
class Hub:
    """``[hub]``: a hub to read instead of SSHing to every host (``url``, or ``--hub``),
    what to do when it is down (``fallback``: "none", a clear error, or "direct", poll the
    hosts), its bearer token's file, where ``gputop serve`` listens, and its retained
    window of events in MiB (``retain_mb``; None: the server's default)."""

    url: str | None = None
    fallback: str = "none"
    token_file: Path | None = None
    listen: str | None = None
    retain_mb: int | None = None

    @classmethod
    def parse(cls, t: Table) -> Hub:
        url = t.get("url", str, cls.url)
        problem = hub_url_problem(url) if url is not None else None
        if problem:
            raise t.error("url", problem)
        fallback = t.get("fallback", str, cls.fallback)
        if fallback not in ("none", "direct"):
            raise t.error("fallback", 'must be "none" or "direct"')
        token_file = t.path_value("token_file") or cls.token_file
        listen = t.get("listen", str, cls.listen)
        problem = listen_problem(listen) if listen is not None else None
        if problem:
            raise t.error("listen", problem)
        retain_mb = t.get("retain_mb", int, cls.retain_mb)
        if retain_mb is not None and not 1 <= retain_mb <= 65536:
            raise t.error("retain_mb", "must be between 1 and 65536 (MiB)")
        t.done()
        return cls(url=url, fallback=fallback, token_file=token_file, listen=listen,
                   retain_mb=retain_mb)
