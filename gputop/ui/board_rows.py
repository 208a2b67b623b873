"""What one board row is and how it is named: a GPU row, a host header, the keys that
follow a GPU (and its MIG instances and shares) across answers, and the summary's and the
per-user view's records. Plain data: the board model fills them, the widgets draw them.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from datetime import datetime

from gputop.model import GpuInfo, HostSnapshot, MigInstance
from gputop.reservations.records import Reservation
from gputop.text import clean


def short_model(name: str | None) -> str:
    """"NVIDIA GeForce RTX 2080 SUPER" -> "RTX 2080 SUPER": the part people say aloud."""
    if not name:
        return "?"
    n = clean(name)
    for prefix in ("NVIDIA ", "GeForce ", "Tesla ", "Quadro "):
        if n.startswith(prefix):
            n = n[len(prefix):]
    return n


def gpu_key(host: str, g: GpuInfo) -> str:
    """A GPU's identity on the board: host + uuid, else host + index (else bus id). The
    selection, the history and the reserve dialog follow this, never a row position."""
    if g.uuid:
        return f"{host}\x00{g.uuid}"
    if g.index is not None:
        return f"{host}\x00#{g.index}"
    return f"{host}\x00@{g.bus_id}"


def gpu_keys(host: str, gpus: Iterable[GpuInfo]) -> list[str]:
    """``gpu_key`` of each GPU, made unique: a uuid (or index) listed twice, as broken or
    hostile output may, falls back to index, then position, and never merges two rows."""
    keys: list[str] = []
    seen: set[str] = set()
    for pos, g in enumerate(gpus):
        key = gpu_key(host, g)
        if key in seen:
            key = f"{host}\x00#{g.index}" if g.index is not None else key
        if key in seen:
            key = f"{host}\x00%{pos}"
        n = 0
        while key in seen:  # (a hostile uuid such as "%2" is the position's key)
            n += 1
            key = f"{host}\x00%{pos}.{n}"
        seen.add(key)
        keys.append(key)
    return keys


def host_of(key: str) -> str:
    return key.split("\x00", 1)[0]


#: An instance row's key is its GPU's key, this, and its GPU instance id.
INSTANCE_SEP = "\x00/"


#: A share row's key is its GPU's key, this, and the share's holder.
SHARE_SEP = "\x00~"


#: A share row's key after its holder when the holder has two shares of one GPU (the
#: shared file is anyone's to write): this and the share's place.
SHARE_PLACE_SEP = "\x00."


def share_keys(gpu: str, shares: Iterable[Reservation]) -> list[str]:
    """The rows' keys of a GPU's shares, each its own: ``gpu`` + SHARE_SEP + the holder,
    and for a holder's second share of the GPU SHARE_PLACE_SEP and its place too."""
    out: list[str] = []
    seen: set[str] = set()
    for pos, r in enumerate(shares):
        key = f"{gpu}{SHARE_SEP}{r.user}"
        if key in seen:
            key = f"{key}{SHARE_PLACE_SEP}{pos}"
        seen.add(key)
        out.append(key)
    return out


def split_share(key: str) -> tuple[str, str | None]:
    """(the GPU's key, the share's holder) of a row key; None for any other row."""
    gpu, sep, user = key.rpartition(SHARE_SEP)
    return (gpu, user.split(SHARE_PLACE_SEP, 1)[0]) if sep else (key, None)


#: An instance row's key after its GPU instance id when that GPU instance has more than one
#: compute instance (``nvidia-smi mig -cci``): this and the compute instance's place.
COMPUTE_SEP = "\x00."


def instance_keys(gpu: str, instances: Iterable[MigInstance]
                  ) -> list[tuple[MigInstance, str]]:
    """The rows' keys of a GPU's MIG instances (those with a GPU instance id), each its
    own: the first compute instance of a GPU instance is ``gpu`` + INSTANCE_SEP + its id;
    another of the same GPU instance adds COMPUTE_SEP and its place (one key for two rows
    drew the second's values on both)."""
    out: list[tuple[MigInstance, str]] = []
    seen: set[str] = set()
    for pos, inst in enumerate(instances):
        if inst.gpu_instance_id is None:
            continue
        key = f"{gpu}{INSTANCE_SEP}{inst.gpu_instance_id}"
        if key in seen:
            key = f"{key}{COMPUTE_SEP}{pos}"
        seen.add(key)
        out.append((inst, key))
    return out


def split_instance(key: str) -> tuple[str, int | None]:
    """(the GPU's key, GPU instance id) of a row key; None for a GPU row."""
    gpu, sep, gi = key.rpartition(INSTANCE_SEP)
    gi = gi.split(COMPUTE_SEP, 1)[0]
    return (gpu, int(gi)) if sep and gi.isdigit() else (key, None)


@dataclass
class GpuRow:
    """One GPU as the board sees it right now."""

    host: str
    key: str  # see gpu_keys
    gpu: GpuInfo
    reservation: Reservation | None
    #: A tuple, not a list: most rows have none, and ``()`` is one shared object where a
    #: list was one more for the garbage collector per row per answer.
    flags: tuple[str, ...]
    stale: bool
    free: bool
    #: No host header above it (sorted views): the row names its host itself.
    show_host: bool = False
    #: A MIG instance row: ``gpu`` is then the instance seen as a GPU (its processes and
    #: memory, no utilisation), right under its GPU's row.
    instance: MigInstance | None = None
    #: A shared GPU's row: its shares (the rows under it show one each).
    shares: tuple[Reservation, ...] = ()
    #: A share row (``gpu`` is its GPU): one holder's share, under its GPU's row.
    share: Reservation | None = None

    @property
    def label(self) -> str:
        """``host:index`` (``host:index/instance``), the name people and ``gputop reserve``
        use."""
        gi = self.instance.gpu_instance_id if self.instance is not None else None
        return (f"{clean(self.host)}:{'?' if self.gpu.index is None else self.gpu.index}"
                + ("" if gi is None else f"/{gi}"))

    @property
    def users(self) -> tuple[str, ...]:
        return tuple(clean(u) for u in self.gpu.users)

    @property
    def free_mib(self) -> int:
        return self.gpu.memory_free_mib


@dataclass
class HostRow:
    """A host header (collapsible), or a host in error when ``error`` is set."""

    host: str
    snapshot: HostSnapshot | None
    gpu_count: int
    collapsed: bool
    stale: bool
    last_seen: datetime | None
    #: MIG instance rows under its GPUs (``gpu_count`` counts the GPUs only).
    instance_count: int = 0

    @property
    def key(self) -> str:
        return self.host

    @property
    def error(self) -> bool:
        return self.snapshot is not None and not self.snapshot.ok


Row = GpuRow | HostRow


@dataclass
class Summary:
    hosts_up: int = 0
    hosts_down: int = 0
    hosts_waiting: int = 0
    gpus: int = 0
    free: int = 0
    busy: int = 0
    reserved: int = 0
    shared: int = 0
    down: int = 0  # GPUs the driver lost
    unknown: int = 0
    #: MIG instances by class (none: no MIG instance anywhere).
    instances: dict[str, int] = field(default_factory=dict)
    util_percent: float | None = None
    mem_used_mib: int = 0
    mem_total_mib: int = 0


@dataclass
class UserLoad:
    """One person's share of the fleet, for the per-user view."""

    user: str
    running: list[str] = field(default_factory=list)  # "host:index" with their processes
    reserved: list[str] = field(default_factory=list)  # "host:index" they reserved
    processes: int = 0
    memory_mib: int = 0
    commands: dict[str, int] = field(default_factory=dict)

    @property
    def gpus(self) -> int:
        """GPUs held: running on or reserved (a reserved GPU they run on counts once)."""
        return len(set(self.running) | set(self.reserved))
