"""What a waiter asks for (``Request``), and whether the hosts could ever give it: where
(``capacity``), never as far as the hosts that answered show (``unsatisfiable``), and
never as far as the known GPUs go (``ceiling``), so that a waiter asks only for what can
exist (see the order rule in :mod:`gputop.reservations.queue`).
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass

from gputop.model import GpuInfo, HostSnapshot
from gputop.reservations.flags import FreeGpu
from gputop.reservations.shares import mig_mode
from gputop.text import clean


@dataclass(frozen=True)
class Request:
    """What a waiter asks for: ``count`` GPUs with ``min_free_mib`` free, on ``hosts``
    (empty: any), all on one host if ``one_host``."""

    count: int
    min_free_mib: int = 0
    hosts: tuple[str, ...] = ()
    one_host: bool = False
    want: str = ""
    #: A memory share of one GPU (MiB), not whole GPUs (0).
    share_mib: int = 0

    def fits(self, f: FreeGpu) -> bool:
        if self.share_mib and (f.instance is not None or mig_mode(f.gpu)):
            return False
        return self.accepts(f.host) and f.free_mib >= max(self.min_free_mib, self.share_mib)

    def accepts(self, host: str) -> bool:
        return not self.hosts or host in self.hosts

    def sized(self, g: GpuInfo) -> bool:
        """Whether this GPU, empty, would have the memory asked for (unknown total: yes;
        a share: never a MIG GPU, and the total must be known)."""
        if self.share_mib and (mig_mode(g) or g.memory_total_mib is None):
            return False
        need = max(self.min_free_mib, self.share_mib)
        return (g.index is not None and not g.lost
                and (g.memory_total_mib is None or g.memory_total_mib >= need))


def capacity(req: Request, hosts: Iterable[HostSnapshot], fleet: Collection[str] | None,
             *, known_only: bool = False) -> tuple[set[str], bool]:
    """The hosts on which ``req`` could ever be met (see the order rule), and whether that
    is known for sure: every host it accepts (``req.hosts``, else ``fleet``) answered.
    ``known_only``: hosts that did not answer (or that this gputop does not know) count
    as no GPUs, not as room for anything: a waiter never holds GPUs back on the strength
    of capacity nobody here can see (a request for 50 GPUs naming an unreachable host
    would otherwise block every GPU it accepts, for good)."""
    seen = {h.name: sum(1 for g in h.gpus if req.sized(g))
            for h in hosts if h.ok and req.accepts(h.name)}
    accepted = set(req.hosts) if req.hosts else (set(fleet) if fleet is not None else None)
    complete = accepted is not None and accepted <= set(seen)
    if req.one_host:
        return {h for h, n in seen.items() if n >= req.count}, complete
    if sum(seen.values()) >= req.count or not (complete or known_only):
        return {h for h, n in seen.items() if n}, complete
    return set(), complete


def unsatisfiable(req: Request, hosts: Sequence[HostSnapshot],
                  fleet: Collection[str] | None) -> str | None:
    """Why no host ``req`` accepts could ever meet it, as far as the hosts that answered
    show (every host it accepts must have answered); None if it can be met or one of its
    hosts did not answer."""
    usable, complete = capacity(req, hosts, fleet)
    if usable or not complete:
        return None
    mine = [h for h in hosts if h.ok and req.accepts(h.name)]
    if not mine:
        return "no host to wait on"
    sizes = "; ".join(_size(h) for h in mine[:8]) + ("; ..." if len(mine) > 8 else "")
    need = (f"a {req.share_mib / 1024:g}G share of a GPU" if req.share_mib else
            f"{req.count} GPU(s)") + (f" with {req.min_free_mib / 1024:g}G free"
                                      if req.min_free_mib else "")
    where = "on one host" if req.one_host else "in all"
    return f"no host can ever give {need} {where} ({sizes})"


def _size(h: HostSnapshot) -> str:
    gpus = [g for g in h.gpus if g.index is not None and not g.lost]
    big = max((g.memory_total_mib or 0 for g in gpus), default=0)
    return f"{h.name} has {len(gpus)}" + (f", the largest {big / 1024:.3g}G" if big else "")


def ceiling(req: Request, hosts: Sequence[HostSnapshot],
            fleet: Collection[str] | None, known: Mapping[str, int] | None = None
            ) -> str | None:
    """Why ``req`` asks for more GPUs than its hosts' known GPUs could ever give, or None.
    A host that did not answer counts the GPUs ``known`` says it has (``gpus = N`` in
    hosts.toml), else none: a waiter never waits on GPUs nobody has seen (it may ask again
    once the host answers). None too when no host answered (nothing is known: the waiter
    says so and gives up later)."""
    if req.share_mib or not any(h.ok for h in hosts):
        return None
    accepted = list(req.hosts) if req.hosts else list(fleet or [h.name for h in hosts])
    seen = {h.name: h for h in hosts}
    counts: dict[str, int] = {}
    unknown: list[str] = []
    for name in dict.fromkeys(accepted):
        h = seen.get(name)
        if (h is None or not h.ok) and known and name in known:
            counts[name] = known[name]  # down, its count known: an upper bound
        elif h is None or not h.ok:
            unknown.append(name)
        else:
            counts[name] = sum(1 for g in h.gpus if req.sized(g))
    most = max(counts.values(), default=0) if req.one_host else sum(counts.values())
    if most >= req.count:
        return None
    size = (f" with {req.min_free_mib / 1024:g}G free" if req.min_free_mib else "")
    where = "the most on one host" if req.one_host else "in all"
    have = ", ".join(f"{clean(n)} {c}" for n, c in list(counts.items())[:8]) + (
        ", ..." if len(counts) > 8 else "")
    down = (f"; {len(unknown)} host(s) not answering, their GPUs unknown: "
            + ", ".join(clean(n) for n in unknown[:8]) + (", ..." if len(unknown) > 8 else "")
            if unknown else "")
    return (f"{req.count} GPUs{size} wanted, but the known GPUs can give {most} {where} "
            f"({have}{down})")
