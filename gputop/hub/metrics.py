"""The ``--json`` document as Prometheus metric families (prometheus-client; no I/O).

Every value a GPU could not report (``null``) is left out, never exported as 0. Label
values are whatever the hosts and the shared file said (GPU names, users), cut to
``MAX_LABEL`` characters; prometheus-client escapes them in the text format, so a hostile
name stays one label value. Who holds what is an info-style series (value 1, the holder
a label), at most ``MAX_HOLDERS_PER_GPU`` per GPU, so a GPU with a thousand processes of
a thousand made-up users cannot flood Prometheus.
"""

from __future__ import annotations

import platform
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    InfoMetricFamily,
    Metric,
)
from prometheus_client.exposition import generate_latest
from prometheus_client.registry import Collector, CollectorRegistry

from gputop import __version__
from gputop.hubclient.schema import schema

#: Every flag a GPU or instance may carry (the schema's own list): one 0/1 series each.
FLAGS: tuple[str, ...] = tuple(
    schema()["$defs"]["gpu"]["properties"]["flags"]["items"]["enum"])
MAX_LABEL = 128
MAX_HOLDERS_PER_GPU = 8
#: gputop_reservation_info's series at most (a team holds tens to hundreds at once).
MAX_RESERVATION_SERIES = 2000
MIB = 1024 * 1024
GPU_LABELS = ["host", "gpu", "uuid", "model"]
MIG_LABELS = [*GPU_LABELS, "mig_instance", "profile"]


def _label(value: Any) -> str:
    text = "" if value is None else str(value)
    return text if len(text) <= MAX_LABEL else text[: MAX_LABEL - 1] + "…"


@dataclass(frozen=True)
class HostCounts:
    """The hub's own counts for one host (``Collector.stats``)."""

    answers: int
    errors: Mapping[str, int]
    last_answer_age_s: float | None


@dataclass(frozen=True)
class HubCounts:
    """The hub's own collection stats."""

    ready: bool
    start_time: float
    folds: int
    updates: int
    fold_cpu_s: float
    subscribers: int
    dropped: int
    refused: int
    retained_bytes: int = 0
    connections_refused: int = 0
    connections_stalled: int = 0


def families(doc: Mapping[str, Any], hosts: Mapping[str, HostCounts],
             hub: HubCounts) -> list[Metric]:
    """Every family the hub exports, from the document and the hub's counts."""
    g = _Gauges()
    for h in doc.get("hosts", ()):
        name = _label(h.get("name"))
        g.host_up.add_metric([name], 1.0 if h.get("status") == "ok" else 0.0)
        g.host_gpus.add_metric([name], float(len(h.get("gpus", ()))))
        seen: set[tuple[str, ...]] = set()
        for gpu in h.get("gpus", ()):
            _gpu(g, name, gpu, seen)
    for name, c in hosts.items():
        host = _label(name)
        g.answers.add_metric([host], float(c.answers))
        if c.last_answer_age_s is not None:
            g.age.add_metric([host], c.last_answer_age_s)
        for kind, n in sorted(c.errors.items()):
            g.errors.add_metric([host, kind], float(n))
    held: set[tuple[str, ...]] = set()
    now = str(doc.get("time", ""))
    for r in doc.get("reservations") or ():
        # Every active reservation, its host's answer or not (a host that is down reports
        # no GPUs, so no gputop_gpu_holder_info): one series per holder and GPU/instance,
        # those that ended since the list was made left out (ISO times compare as text),
        # at most MAX_RESERVATION_SERIES (a file may hold 10,000).
        if str(r.get("expires", "")) <= now:
            continue
        labels = (_label(r.get("host")), _label(r.get("gpu")), _label(r.get("instance")),
                  "share" if r.get("share_mib") is not None else "reservation",
                  _label(r.get("user")))
        if labels not in held:
            if len(held) >= MAX_RESERVATION_SERIES:
                break
            held.add(labels)
            g.reservation.add_metric(list(labels), 1.0)
    summary = doc.get("summary")
    if isinstance(summary, Mapping):  # (the document's one count, not one of its own)
        for fam, part in ((g.fleet_hosts, "hosts"), (g.fleet_gpus, "gpus"),
                          (g.fleet_mig, "instances")):
            for cls, n in (summary.get(part) or {}).items():
                if cls != "total":
                    fam.add_metric([_label(cls)], float(n))
    queue = doc.get("queue")
    if queue is not None:
        g.queue_len.add_metric([], float(len(queue)))
        for pos, w in enumerate(queue, 1):
            g.waiter.add_metric([str(pos), _label(w.get("user")), _label(w.get("id"))],
                                float(w.get("count", 0)))
    g.file_ok.add_metric([], 0.0 if "reservations_error" in doc else 1.0)
    g.build.add_metric([], {"version": __version__, "python": platform.python_version()})
    g.ready.add_metric([], 1.0 if hub.ready else 0.0)
    g.start.add_metric([], hub.start_time)
    g.folds.add_metric([], float(hub.folds))
    g.updates.add_metric([], float(hub.updates))
    g.fold_cpu.add_metric([], hub.fold_cpu_s)
    g.subs.add_metric([], float(hub.subscribers))
    g.dropped.add_metric([], float(hub.dropped))
    g.refused.add_metric([], float(hub.refused))
    g.retained.add_metric([], float(hub.retained_bytes))
    g.conn_refused.add_metric([], float(hub.connections_refused))
    g.conn_stalled.add_metric([], float(hub.connections_stalled))
    return g.all()


def _gpu(g: _Gauges, host: str, gpu: Mapping[str, Any], seen: set[tuple[str, ...]]) -> None:
    labels = [host, _label(gpu.get("index")), _label(gpu.get("uuid")), _label(gpu.get("name"))]
    if tuple(labels) in seen:
        # A host that reports one GPU twice (its nvidia-smi is its admin's): a second set
        # of the same series would be duplicate samples, which Prometheus drops with an
        # error and promtool refuses. The first report stands.
        return
    seen.add(tuple(labels))
    g.info.add_metric(labels, 1.0)
    util = gpu.get("utilization_percent")
    if util is not None:
        g.util.add_metric(labels, util / 100.0)
    _put(g.mem_used, labels, gpu.get("memory_used_mib"), MIB)
    _put(g.mem_total, labels, gpu.get("memory_total_mib"), MIB)
    _put(g.temp, labels, gpu.get("temperature_c"))
    _put(g.power, labels, gpu.get("power_draw_w"))
    procs = gpu.get("processes", ())
    g.procs.add_metric(labels, float(len(procs)))
    r = gpu.get("reservation")
    shares = gpu.get("shares") or ()
    g.reserved.add_metric(labels, 0.0 if r is None and not shares else 1.0)
    by_holder: dict[str, float] = {}  # (one series per holder: two shares of one are summed)
    for s in shares:
        who = _label(s.get("user"))
        if who in by_holder or len(by_holder) < MAX_HOLDERS_PER_GPU:
            by_holder[who] = by_holder.get(who, 0.0) + float(s.get("share_mib") or 0) * MIB
    for who, size in by_holder.items():
        g.share.add_metric([*labels, who], size)
    flags = set(gpu.get("flags", ()))
    for f in FLAGS:
        g.flag.add_metric([*labels, f], 1.0 if f in flags else 0.0)
    _holders(g, labels, [], r, procs, shares)
    instances: set[tuple[str, ...]] = set()
    for inst in gpu.get("instances", ()):
        il = [*labels, _label(inst.get("gpu_instance_id")), _label(inst.get("profile"))]
        if tuple(il) in instances:
            continue
        instances.add(tuple(il))
        _put(g.mig_used, il, inst.get("memory_used_mib"), MIB)
        _put(g.mig_total, il, inst.get("memory_total_mib"), MIB)
        iprocs = inst.get("processes", ())
        g.mig_procs.add_metric(il, float(len(iprocs)))
        ir = inst.get("reservation")
        g.mig_reserved.add_metric(il, 0.0 if ir is None else 1.0)
        iflags = set(inst.get("flags", ()))
        for f in FLAGS:
            g.mig_flag.add_metric([*il, f], 1.0 if f in iflags else 0.0)
        _holders(g, labels, il[4:], ir, iprocs)


def _holders(g: _Gauges, labels: list[str], inst: list[str], r: Mapping[str, Any] | None,
             procs: Iterable[Mapping[str, Any]],
             shares: Iterable[Mapping[str, Any]] = ()) -> None:
    """``gputop_gpu_holder_info``: the reservation's holder (or each share's), then each
    process owner."""
    instance = inst[0] if inst else ""
    seen: list[tuple[str, str]] = []
    if r is not None:
        seen.append(("reservation", _label(r.get("user"))))
    for s in shares:
        if len(seen) >= MAX_HOLDERS_PER_GPU:
            break
        who = ("share", _label(s.get("user")))
        if who not in seen:
            seen.append(who)
    for p in procs:
        if len(seen) >= MAX_HOLDERS_PER_GPU:
            break
        who = ("process", _label(p.get("user") or "?"))
        if who not in seen:
            seen.append(who)
    for kind, user in seen:
        g.holder.add_metric([*labels, instance, kind, user], 1.0)


def _put(fam: GaugeMetricFamily, labels: Sequence[str], value: Any, scale: float = 1.0) -> None:
    if value is not None:
        fam.add_metric(labels, float(value) * scale)


class _Gauges:
    """One instance of every family, filled per scrape."""

    def __init__(self) -> None:
        G, C = GaugeMetricFamily, CounterMetricFamily
        self.info = G("gputop_gpu_info", "A GPU the hub sees (value 1).", labels=GPU_LABELS)
        self.util = G("gputop_gpu_utilization_ratio", "GPU utilisation, 0 to 1.",
                      labels=GPU_LABELS)
        self.mem_used = G("gputop_gpu_memory_used_bytes", "GPU memory in use.",
                          labels=GPU_LABELS)
        self.mem_total = G("gputop_gpu_memory_total_bytes", "GPU memory in all.",
                           labels=GPU_LABELS)
        self.temp = G("gputop_gpu_temperature_celsius", "GPU temperature.", labels=GPU_LABELS)
        self.power = G("gputop_gpu_power_watts", "GPU power draw.", labels=GPU_LABELS)
        self.procs = G("gputop_gpu_processes", "Compute processes on the GPU.",
                       labels=GPU_LABELS)
        self.reserved = G("gputop_gpu_reserved",
                          "1 when a reservation (or a memory share) holds the GPU.",
                          labels=GPU_LABELS)
        self.share = G("gputop_gpu_share_bytes", "A memory share of the GPU, by holder.",
                       labels=[*GPU_LABELS, "holder"])
        self.flag = G("gputop_gpu_flag", "1 when the GPU carries the flag.",
                      labels=[*GPU_LABELS, "flag"])
        self.holder = G("gputop_gpu_holder_info",
                        "Who holds the GPU or MIG instance (value 1): its reservation's "
                        "holder and its processes' owners.",
                        labels=[*GPU_LABELS, "mig_instance", "kind", "holder"])
        self.reservation = G("gputop_reservation_info",
                             "An active reservation (value 1), whatever its host answered: "
                             "host, GPU index, MIG instance (empty: the whole GPU), kind "
                             "(reservation or share) and holder.",
                             labels=["host", "gpu", "mig_instance", "kind", "holder"])
        self.mig_used = G("gputop_mig_memory_used_bytes",
                          "MIG instance memory in use (as of the last MIG inventory).",
                          labels=MIG_LABELS)
        self.mig_total = G("gputop_mig_memory_total_bytes", "MIG instance memory in all.",
                           labels=MIG_LABELS)
        self.mig_procs = G("gputop_mig_processes", "Compute processes on the MIG instance.",
                           labels=MIG_LABELS)
        self.mig_reserved = G("gputop_mig_reserved",
                              "1 when a reservation (its own or its GPU's) holds the instance.",
                              labels=MIG_LABELS)
        self.mig_flag = G("gputop_mig_flag", "1 when the MIG instance carries the flag.",
                          labels=[*MIG_LABELS, "flag"])
        self.host_up = G("gputop_host_up", "1 when the host's last answer was data.",
                         labels=["host"])
        self.host_gpus = G("gputop_host_gpus", "GPUs in the host's last answer.",
                           labels=["host"])
        self.age = G("gputop_host_last_answer_age_seconds",
                     "Seconds since the host last answered (data or error).", labels=["host"])
        self.answers = C("gputop_host_answers", "Answers from the host (data or error).",
                         labels=["host"])
        self.errors = C("gputop_host_errors", "Error answers from the host, by kind.",
                        labels=["host", "kind"])
        self.fleet_hosts = G("gputop_fleet_hosts",
                             "Hosts by state (up, down, waiting): the document's summary.",
                             labels=["state"])
        self.fleet_gpus = G("gputop_fleet_gpus",
                            "GPUs by class, each in exactly one (free, busy, reserved, "
                            "shared, down, unknown): the document's summary.",
                            labels=["class"])
        self.fleet_mig = G("gputop_fleet_mig_instances",
                           "MIG instances by class: the document's summary.",
                           labels=["class"])
        self.queue_len = G("gputop_queue_waiters", "Waiters in the queue.")
        self.waiter = G("gputop_queue_waiter_gpus",
                        "GPUs a waiter asks for, by queue position.",
                        labels=["position", "user", "id"])
        self.file_ok = G("gputop_reservations_file_ok",
                         "1 when the reservations file could be read.")
        self.build = InfoMetricFamily("gputop_hub_build", "The hub's version.")
        self.ready = G("gputop_hub_ready", "1 once every host answered once or timed out.")
        self.start = G("gputop_hub_start_time_seconds", "When the hub started (Unix time).")
        self.folds = C("gputop_hub_folds", "Times the hub folded answers into its document.")
        self.updates = C("gputop_hub_updates", "Document changes published to subscribers.")
        self.fold_cpu = C("gputop_hub_fold_cpu_seconds",
                          "CPU time spent folding answers into the document.")
        self.subs = G("gputop_hub_subscribers", "Open event streams.")
        self.dropped = C("gputop_hub_subscribers_dropped",
                         "Event streams ended for falling behind.")
        self.refused = C("gputop_hub_subscribers_refused",
                         "Event streams refused: too many open.")
        self.retained = G("gputop_hub_retained_bytes",
                          "Bytes of events kept for streams that resume (bounded).")
        self.conn_refused = C("gputop_hub_connections_refused",
                              "HTTP connections closed at once: too many open.")
        self.conn_stalled = C("gputop_hub_connections_stalled",
                              "HTTP connections closed for not reading their answers, or "
                              "for sending no request in time.")

    def all(self) -> list[Metric]:
        return [v for v in vars(self).values() if isinstance(v, Metric)]


class _Families(Collector):
    def __init__(self, make: Any) -> None:
        self._make = make

    def collect(self) -> Iterator[Metric]:
        yield from self._make()


def render(make: Any) -> bytes:
    """The text exposition of ``make()``'s families (a registry of its own, nothing
    global: no process or platform collectors)."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Families(make))
    return generate_latest(registry)
