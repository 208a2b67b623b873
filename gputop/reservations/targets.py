"""``HOST:GPU`` targets: parsed from text and checked against the hosts as looked at.

Pure logic, shared by the commands (``gputop reserve``, ``release``) and the agents'
tools (``gputop mcp``): both accept and refuse the same targets with the same words.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime

from gputop.model import HostSnapshot
from gputop.reservations.flags import instance_view, other_users
from gputop.reservations.ops import Invalid, Target
from gputop.reservations.records import Reservation
from gputop.text import clean

_ITEM = r"(?:\d+(?:/\d+)?|MIG-[0-9A-Za-z/-]+)"

_SPEC = re.compile(rf"^(?P<host>[^:\s]+):(?P<gpus>{_ITEM}(?:,{_ITEM})*)$")

#: A target given by MIG uuid, until ``resolve_uuids`` finds its GPU and instance.
BY_UUID = -1


@dataclass(frozen=True)
class Known:
    """A host's GPUs as known without its answer now: from the history database (its
    latest good answer there) or from ``gpus = N`` in hosts.toml. ``instances``: the MIG
    instances (GI ids) of each GPU where known; a GPU not in it cannot be checked, so an
    instance of it is refused."""

    gpus: frozenset[int]
    source: str
    instances: Mapping[int, frozenset[int]] = field(default_factory=dict)


#: How to make a host that never answered reservable (said with each refusal).
GPUS_HINT = "give its [[hosts]] entry gpus = N (its number of GPUs), or reserve once it answers"


def parse_targets(specs: Sequence[str]) -> list[Target]:
    """``HOST:GPU[,GPU...]`` arguments to targets (duplicates dropped, order kept). A GPU
    may be a MIG instance: ``GPU/GI`` (GPU index, GPU instance id) or its ``MIG-...`` uuid
    (resolved against the live host by ``resolve_uuids``)."""
    out: dict[tuple[str, int, int | None, str | None], Target] = {}
    for spec in specs:
        m = _SPEC.match(spec)
        if not m:
            hint = ("several hosts: one argument each, e.g. gpu-01:0 gpu-02:1"
                    if spec.count(":") > 1 else
                    "e.g. gpu-01:0,1; a MIG instance: gpu-01:0/3 or gpu-01:MIG-<uuid>")
            raise Invalid(f"{spec!r} is not HOST:GPU[,GPU...] ({hint})")
        host = m.group("host")
        for item in m.group("gpus").split(","):
            if item.startswith("MIG-"):
                t = Target(host, BY_UUID, item)
            else:
                gpu, _, gi = item.partition("/")
                t = Target(host, int(gpu), None, int(gi) if gi else None)
            out.setdefault((t.host, t.gpu, t.instance, t.uuid), t)
    return list(out.values())


def resolve_uuids(targets: Sequence[Target], snaps: Mapping[str, HostSnapshot]
                  ) -> list[Target]:
    """Targets given by MIG uuid as ``HOST:GPU/GI``, from the hosts as looked at."""
    out = []
    for t in targets:
        if t.gpu != BY_UUID:
            out.append(t)
            continue
        h = snaps[t.host]
        hit = next(((g, i) for g in h.gpus for i in g.instances
                    if i.uuid == t.uuid and g.index is not None
                    and i.gpu_instance_id is not None), None)
        if hit is None:
            why = (f"it did not answer ({h.error.kind})" if h.error else
                   "it has no MIG instance with that uuid")
            raise Invalid(f"cannot find {t.host}:{clean(t.uuid or '')}: {why}; "
                          "give it as HOST:GPU/INSTANCE")
        g, inst = hit
        assert g.index is not None
        out.append(Target(t.host, g.index, g.uuid, inst.gpu_instance_id))
    return out


def with_held(known: Mapping[str, Known] | None, held: Iterable[Reservation], me: str,
              hosts: Collection[str], now: datetime) -> dict[str, Known]:
    """``known`` and, on ``hosts`` (those that did not answer), each GPU (and MIG instance)
    that a live reservation of ``me``'s names in the shared file: its holder may extend
    it there. Only the holder's own entries count: anyone in the team can write an entry
    into the file, and someone else's (forged) entry must not prove a GPU to anyone."""
    out = dict(known or {})
    mine = [r for r in held if r.user == me and r.host in hosts and r.active(now)]
    for host in sorted({r.host for r in mine}):
        gpus = frozenset(r.gpu for r in mine if r.host == host)
        insts = {g: frozenset(r.instance for r in mine if r.host == host and r.gpu == g
                              and r.instance is not None) for g in gpus}
        said = "your live reservation in the shared file"
        k = out.get(host)
        if k is None:
            out[host] = Known(gpus, said, {g: i for g, i in insts.items() if i})
            continue
        merged = dict(k.instances)
        for g, i in insts.items():
            if i:
                merged[g] = merged.get(g, frozenset()) | i
        if gpus <= k.gpus and merged == k.instances:
            continue  # nothing new: its source stays as it was
        out[host] = Known(k.gpus | gpus, f"{k.source} and {said}", merged)
    return out


def _check_known(t: Target, h: HostSnapshot, known: Known | None) -> None:
    """A target on a host that did not answer: refused (Invalid) unless ``known`` says the
    host has that GPU (and instance), so that nobody can fill the shared file with GPUs
    that do not exist."""
    assert h.error is not None
    why = f"{t.host} did not answer ({h.error.kind})"
    if known is None:
        raise Invalid(f"{why} and gputop has never seen its GPUs (not in the history "
                      f"either), so it cannot reserve {t.label} there: {GPUS_HINT}")
    if t.gpu not in known.gpus:
        raise Invalid(f"{why}; it has no GPU {t.gpu} as far as gputop knows ({known.source}: "
                      + ", ".join(str(i) for i in sorted(known.gpus)) + f"): {GPUS_HINT}")
    if t.instance is not None and t.instance not in known.instances.get(t.gpu, ()):
        insts = known.instances.get(t.gpu)
        raise Invalid(f"{why}; " + (
            f"its GPU {t.gpu} has no MIG instance {t.instance} as far as gputop knows "
            f"({known.source}: " + (", ".join(f"{t.gpu}/{i}" for i in sorted(insts))
                                    or "not split") + ")"
            if insts is not None else
            f"gputop does not know the MIG instances of its GPU {t.gpu} ({known.source})")
            + "; reserve the whole GPU, or the instance once the host answers")


def check_targets(targets: Sequence[Target], snaps: Mapping[str, HostSnapshot], me: str,
                  login: Callable[[str], str | None] | None = None,
                  known: Mapping[str, Known] | None = None
                  ) -> tuple[list[Target], list[str]]:
    """Check GPU indices (and MIG instances) against the hosts as looked at and record
    UUIDs (renumbering shows later): (the targets, warnings to show). A host that did not
    answer is checked against ``known`` (its GPUs as the history or hosts.toml know them):
    a warning, and the index is kept; a GPU not known there is refused. A GPU someone
    else uses may be reserved, with a warning naming them (not your own login on that
    host, ``login(host)``). Refuses (Invalid) a GPU or instance the host does not have,
    naming the ones it has."""
    out, warnings = [], []
    for t in resolve_uuids(targets, snaps):
        h = snaps[t.host]
        if not h.ok:
            assert h.error is not None
            k = (known or {}).get(t.host)
            _check_known(t, h, k)
            assert k is not None
            warnings.append(f"could not check {t.label} ({h.error.kind}: "
                            f"{clean(h.error.message)}); reserving by index, as known "
                            f"from {k.source}")
            out.append(t)
            continue
        by_index = {g.index: g for g in h.gpus if g.index is not None}
        if t.gpu not in by_index:
            raise Invalid(f"{t.host} has no GPU {t.gpu}; its GPUs: "
                          + ", ".join(str(i) for i in sorted(by_index)))
        g = by_index[t.gpu]
        if t.instance is not None:
            insts = {i.gpu_instance_id: i for i in g.instances
                     if i.gpu_instance_id is not None}
            if t.instance not in insts:
                raise Invalid(f"{t.host}:{t.gpu} has no MIG instance {t.instance}; "
                              + ("its instances: " + ", ".join(
                                  f"{t.gpu}/{i} ({clean(insts[i].profile or '?')})"
                                  for i in sorted(insts)) if insts else "it is not split"))
            g = instance_view(g, insts[t.instance])
        others = other_users(g, me, login(t.host) if login else None)
        if others:
            warnings.append(f"{t.label} is in use by {', '.join(clean(u) for u in others)}; "
                            "reserving it anyway")
        out.append(Target(t.host, t.gpu, g.uuid, t.instance))
    return out, warnings
