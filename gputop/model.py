"""The snapshot model: frozen, JSON-serialisable records shared by every layer.

A value that a GPU or driver could not report is ``None`` (JSON ``null``), never 0:
"0 % busy" and "unknown" must stay distinguishable on the board and in scripts.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any, Literal

#: 2: GPUs gained ``instances`` (MIG) and processes their GPU / compute instance ids.
#: 3: memory shares (``shares``, ``unshared_mib``, ``share_mib``, the ``over-share`` flag).
#: 3 also: the document may carry the wait queue (``queue``), so a hub's readers see waiters.
#: 4: every active reservation (``reservations``), also those of hosts that are down.
#: 5: the fleet's ``summary``, counted once (``reservations.summary``) for every reader.
SCHEMA_VERSION = 5

#: Classified reasons a host produced no (or partial) data. The JSON schema lists the same.
ErrorKind = Literal[
    "unreachable",  # connection refused, no route, DNS failure
    "timeout",  # no SSH banner, or a query that did not return in time
    "auth",  # authentication refused
    "host-key",  # unknown or changed host key
    "no-nvidia-smi",  # nvidia-smi not on the remote PATH
    "driver",  # nvidia-smi / NVML cannot talk to the driver
    "no-devices",  # "No devices were found"
    "parse",  # output that is not what was asked for
    "no-nvml",  # local host: the NVML library is missing
    "starting",  # nvidia-smi's stream has not sent its first sample yet (not a timeout)
    "slow",  # a one-shot look's first-answer deadline passed first (not yet a timeout)
    "ssh",  # any other SSH protocol failure
    "error",  # anything else, with the message
]
ERROR_KINDS: tuple[str, ...] = ErrorKind.__args__  # type: ignore[attr-defined]


def utcnow() -> datetime:
    return datetime.now(timezone.utc)


def iso(ts: datetime | None) -> str | None:
    """UTC ISO-8601 with a ``Z``, second precision: stable and sortable in JSON. (Each
    second's text is worked out once: a ``--watch`` line has two per host, mostly alike.)"""
    if ts is None:
        return None
    second = int(ts.timestamp() // 1)
    text = _ISO.get(second)
    if text is None:
        if len(_ISO) >= 256:
            _ISO.clear()
        text = _ISO[second] = (ts.astimezone(timezone.utc).replace(microsecond=0)
                               .isoformat().replace("+00:00", "Z"))
    return text


#: ISO text by Unix second.
_ISO: dict[int, str] = {}


@dataclass(frozen=True)
class ProcessInfo:
    pid: int
    user: str | None = None
    command: str | None = None
    gpu_memory_mib: int | None = None
    elapsed_s: int | None = None
    #: On a MIG GPU: the instance it runs on (None: not MIG, or not known).
    gpu_instance_id: int | None = None
    compute_instance_id: int | None = None

    def to_dict(self) -> dict[str, Any]:
        return {"pid": self.pid, "user": self.user, "command": self.command,
                "gpu_memory_mib": self.gpu_memory_mib, "elapsed_s": self.elapsed_s,
                "gpu_instance_id": self.gpu_instance_id,
                "compute_instance_id": self.compute_instance_id}


class _HoldsMemoryAndProcesses:
    """What a whole GPU and a MIG instance have in common: memory and processes."""

    memory_used_mib: int | None
    memory_total_mib: int | None
    processes: tuple[ProcessInfo, ...]

    @property
    def memory_free_mib(self) -> int:
        """Free memory, 0 when the total is unknown (such a GPU is never "best free")."""
        if self.memory_total_mib is None:
            return 0
        return self.memory_total_mib - (self.memory_used_mib or 0)

    @property
    def users(self) -> tuple[str, ...]:
        """Distinct process owners, in first-seen order."""
        return tuple(dict.fromkeys(p.user for p in self.processes if p.user))


@dataclass(frozen=True)
class MigInstance(_HoldsMemoryAndProcesses):
    """One MIG device of a GPU: a compute instance inside a GPU instance.

    Utilisation is None: NVML reports none per MIG instance, and "unknown" is not 0.
    Memory is as of the host's last MIG inventory (see ``gputop.sources.mig``).
    """

    gpu_instance_id: int | None = None
    compute_instance_id: int | None = None
    device_index: int | None = None
    uuid: str | None = None
    profile: str | None = None
    memory_used_mib: int | None = None
    memory_total_mib: int | None = None
    utilization_percent: int | None = None
    processes: tuple[ProcessInfo, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        return {"gpu_instance_id": self.gpu_instance_id,
                "compute_instance_id": self.compute_instance_id,
                "device_index": self.device_index, "uuid": self.uuid, "profile": self.profile,
                "memory_used_mib": self.memory_used_mib,
                "memory_total_mib": self.memory_total_mib,
                "utilization_percent": self.utilization_percent,
                "processes": [p.to_dict() for p in self.processes]}


@dataclass(frozen=True)
class GpuInfo(_HoldsMemoryAndProcesses):
    index: int | None = None
    uuid: str | None = None
    name: str | None = None
    bus_id: str | None = None
    utilization_percent: int | None = None
    memory_utilization_percent: int | None = None
    memory_used_mib: int | None = None
    memory_total_mib: int | None = None
    temperature_c: int | None = None
    power_draw_w: float | None = None
    power_limit_w: float | None = None
    fan_percent: int | None = None
    pstate: str | None = None
    mig_mode: str | None = None
    driver_version: str | None = None
    #: "Enabled"/"Disabled": without persistence every nvidia-smi start re-initialises the GPU.
    persistence_mode: str | None = None
    #: The driver could not get a handle for this GPU ("GPU is lost", "Unknown Error").
    lost: bool = False
    lost_reason: str | None = None
    processes: tuple[ProcessInfo, ...] = ()
    #: MIG instances (MIG enabled and the inventory known), in nvidia-smi's device order.
    instances: tuple[MigInstance, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        # Its fields are all it holds, in their order (frozen: nothing else is ever set), so
        # a copy of them is the dict (``dataclasses.asdict`` deep-copies every value: too
        # slow on every refresh of 200 hosts x 8 GPUs).
        d = dict(self.__dict__)
        d["processes"] = [p.to_dict() for p in self.processes]
        d["instances"] = [i.to_dict() for i in self.instances]
        return d

    def with_processes(self, processes: tuple[ProcessInfo, ...]) -> GpuInfo:
        """``replace(self, processes=processes)`` without the generated ``__init__`` (a
        GPU with processes gets them this way on every sample: see ``from_row``)."""
        g = object.__new__(type(self))
        d = g.__dict__
        d.update(self.__dict__)
        d["processes"] = processes
        return g

    @classmethod
    def from_fields(cls, fields: dict[str, Any]) -> GpuInfo:
        """A GPU from a dict of its fields by name (checked by the caller: e.g. a hub's
        document, see gputop.hubclient.client), the others' defaults; built as ``from_row``.
        ``fields`` must hold fields only."""
        g = object.__new__(cls)
        d = g.__dict__
        d.update(_GPU_DEFAULTS)
        d.update(fields)
        return g

    @classmethod
    def from_row(cls, values: Sequence[Any]) -> GpuInfo:
        """A GPU from its first ``len(values)`` fields in order, the others' defaults.

        What ``GpuInfo(*values)`` builds, without the generated ``__init__``'s 20
        ``object.__setattr__`` calls: the parser builds one per GPU per sample, and at
        fleet scale those calls were most of what parsing cost."""
        g = object.__new__(cls)
        d = g.__dict__
        d.update(_GPU_DEFAULTS)  # (every field, in order; then the given ones over them)
        d.update(zip(_GPU_FIELDS, values))
        return g


_GPU_FIELDS = tuple(f.name for f in dataclasses.fields(GpuInfo))
#: Every field's default (all of GpuInfo's fields have one), in order.
_GPU_DEFAULTS = {f.name: f.default for f in dataclasses.fields(GpuInfo)}


@dataclass(frozen=True)
class HostError:
    kind: ErrorKind
    message: str

    def to_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, "message": self.message}


@dataclass(frozen=True)
class HostSnapshot:
    """One host's state at one poll. ``error`` set means ``gpus`` is empty."""

    name: str
    time: datetime = field(default_factory=utcnow)
    gpus: tuple[GpuInfo, ...] = ()
    error: HostError | None = None
    #: When this host last answered successfully (kept across errors by the poller).
    last_ok: datetime | None = None
    source: Literal["ssh", "nvml", "demo", "none"] = "ssh"
    tags: tuple[str, ...] = ()
    #: What looked wrong in data that is still shown (e.g. two GPUs with one index).
    warnings: tuple[str, ...] = ()
    #: Probe cost: seconds the host's nvidia-smi stream took to its first sample.
    first_sample_s: float | None = None

    @property
    def ok(self) -> bool:
        return self.error is None

    def head_dict(self) -> dict[str, Any]:
        """``to_dict`` but the GPUs (the --watch writer serialises those one by one)."""
        return {
            "name": self.name,
            "status": "ok" if self.error is None else "error",
            "error": None if self.error is None else self.error.to_dict(),
            "time": iso(self.time),
            "last_ok": iso(self.last_ok),
            "source": self.source,
            "tags": list(self.tags),
            "warnings": list(self.warnings),
            "first_sample_s": self.first_sample_s,
        }

    def to_dict(self) -> dict[str, Any]:
        return self.head_dict() | {"gpus": [g.to_dict() for g in self.gpus]}


@dataclass(frozen=True)
class FleetSnapshot:
    hosts: tuple[HostSnapshot, ...]
    time: datetime = field(default_factory=utcnow)

    def to_dict(self) -> dict[str, Any]:
        return {
            "version": SCHEMA_VERSION,
            "time": iso(self.time),
            "hosts": [h.to_dict() for h in self.hosts],
        }
