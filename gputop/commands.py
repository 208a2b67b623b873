"""The reservation commands for scripts: reserve, release, reservations, free.

Each returns an exit code (0 done, 1 refused, 2 usage/config/store error) and prints what
a script needs on stdout (``host:index`` lines or JSON), diagnostics on stderr.
"""

from __future__ import annotations

import argparse
import asyncio
import re
import sys
from collections.abc import Callable, Sequence
from dataclasses import replace
from datetime import datetime
from typing import Any, TextIO

from gputop.config import Config, HostConfig, parse_duration
from gputop.history.db import HistoryError
from gputop.model import HostSnapshot, iso, utcnow
from gputop.output import write_document
from gputop.poller import Poller
from gputop.reservations import (
    Invalid,
    Refused,
    Reservation,
    Store,
    StoreError,
    Target,
    flags,
    release,
)
from gputop.reservations.flags import FreeGpu, free_gpus, other_users
from gputop.reservations.ops import Outcome, format_duration, local_time, reserve_outcomes, whoami
from gputop.reservations.queue import (
    DEFAULT_LEASE_S,
    Request,
    could_use,
    request_of,
    unsatisfiable,
)
from gputop.reservations.store import MAX_LEASE_S, Job, StoreState
from gputop.text import clean, excerpt

EXIT_OK, EXIT_REFUSED, EXIT_ERROR = 0, 1, 2

_ITEM = r"(?:\d+(?:/\d+)?|MIG-[0-9A-Za-z/-]+)"
_SPEC = re.compile(rf"^(?P<host>[^:\s]+):(?P<gpus>{_ITEM}(?:,{_ITEM})*)$")
#: A target given by MIG uuid, until ``_resolve_mig`` finds its GPU and instance.
_BY_UUID = -1
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]?)(?:i?B)?\s*$", re.IGNORECASE)


def parse_targets(specs: Sequence[str]) -> list[Target]:
    """``HOST:GPU[,GPU...]`` arguments to targets (duplicates dropped, order kept). A GPU
    may be a MIG instance: ``GPU/GI`` (GPU index, GPU instance id) or its ``MIG-...`` uuid
    (resolved against the live host by ``_resolve_mig``)."""
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
                t = Target(host, _BY_UUID, item)
            else:
                gpu, _, gi = item.partition("/")
                t = Target(host, int(gpu), None, int(gi) if gi else None)
            out.setdefault((t.host, t.gpu, t.instance, t.uuid), t)
    return list(out.values())


def _resolve_mig(config: Config, targets: list[Target],
                 snaps: dict[str, HostSnapshot] | None = None) -> list[Target]:
    """Targets given by MIG uuid as ``HOST:GPU/GI``, from the live hosts."""
    if not any(t.gpu == _BY_UUID for t in targets):
        return targets
    if snaps is None:
        names = {t.host for t in targets if t.gpu == _BY_UUID}
        snaps = {h.name: h for h in asyncio.run(_poll(config, names))}
    out = []
    for t in targets:
        if t.gpu != _BY_UUID:
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


def parse_size_mib(text: str) -> int:
    """``20G``, ``512M``, ``1.5T`` to MiB; a bare number is refused (MiB or GiB?)."""
    m = _SIZE.match(text)
    if not m:
        raise Invalid(f"not a memory size: {text!r} (use e.g. 20G or 512M)")
    if not m.group(2):  # "20" meant as 20 GB would pick a GPU with 20 MiB free
        raise Invalid(f"memory size {text!r} needs a unit: e.g. {text.strip()}G or "
                      f"{text.strip()}M")
    factor = {"K": 1 / 1024, "M": 1, "G": 1024, "T": 1024 * 1024}[m.group(2).upper()]
    return int(float(m.group(1)) * factor)


def _check_hosts(config: Config, targets: Sequence[Target]) -> None:
    names = [h.name for h in config.hosts]
    for t in targets:
        if t.host not in names:
            raise Invalid(f"unknown host {t.host!r}; hosts in {config.path or 'the config'}: "
                          + ", ".join(names))


async def _poll(config: Config, names: set[str] | None = None) -> list[HostSnapshot]:
    from dataclasses import replace

    if names is not None:
        config = replace(config, hosts=tuple(h for h in config.hosts if h.name in names))
    # One look: one query per host, as `--json` does (starting streams and waiting for
    # their first samples made `free` and `reserve` take seconds).
    poller = Poller(replace(config, collection="query"))
    try:
        return list((await poller.snapshot()).hosts)
    finally:
        await poller.aclose()


def _duration(config: Config, text: str | None) -> float:
    """``--for``: a clear message for what cannot be a reservation's length."""
    if text is None:
        return config.reservation_default_s
    try:
        seconds = parse_duration(text)
    except ValueError:
        seconds = 0.0
    if not 0 < seconds <= config.reservation_max_s:
        raise Invalid(f"--for {text}: say how long to reserve, more than zero and at most "
                      f"{format_duration(config.reservation_max_s)}: type e.g. --for 30m, "
                      "--for 2h or --for 1d (to give a GPU back: gputop release HOST:GPU)")
    return seconds


def _validate_gpus(config: Config, targets: list[Target],
                   snaps: dict[str, HostSnapshot] | None = None) -> list[Target]:
    """Check GPU indices against the live hosts and record UUIDs (renumbering shows later).
    A host that does not answer cannot be checked: say so and keep the index. A GPU that
    someone else is using can be reserved, with a warning naming them. ``snaps`` receives
    the hosts as polled."""
    me = whoami()[0]
    if snaps is None:
        snaps = {}
    snaps.update({h.name: h for h in asyncio.run(_poll(config, {t.host for t in targets}))})
    out = []
    for t in _resolve_mig(config, targets, snaps):
        h = snaps[t.host]
        if not h.ok:
            assert h.error is not None
            print(f"gputop: warning: could not check {t.label} ({h.error.kind}: "
                  f"{clean(h.error.message)}); reserving by index only", file=sys.stderr)
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
            g = flags.instance_view(g, insts[t.instance])
        others = other_users(g, me)
        if others:
            print(f"gputop: warning: {t.label} is in use by "
                  f"{', '.join(clean(u) for u in others)}; reserving it anyway",
                  file=sys.stderr)
        out.append(Target(t.host, t.gpu, g.uuid, t.instance))
    return out


def _until(r: Reservation) -> str:
    left = format_duration(max(0.0, (r.expires - utcnow()).total_seconds()))
    return f"until {local_time(r.expires)} ({left} left)"


def _print_outcomes(made: Sequence[Outcome], out: TextIO) -> None:
    """One line per GPU saying what happened, in local time (``--json`` keeps UTC)."""
    for o in made:
        r, gpu = o.reservation, clean(o.reservation.target)
        if o.action == "reserved":
            print(f"reserved {gpu} {_until(r)}", file=out)
        elif o.action == "untied":
            assert o.previous is not None and o.previous.job is not None
            pid = o.previous.job.pid
            print(f"reserved {gpu} {_until(r)}: no longer tied to its job"
                  + (f" (pid {pid})" if pid is not None else "")
                  + "; it stays when the job ends", file=out)
        elif o.action == "extended":
            assert o.previous is not None
            print(f"extended your reservation of {gpu} {_until(r)} (was until "
                  f"{local_time(o.previous.expires)})", file=out)
        else:
            print(f"kept your reservation of {gpu} {_until(r)}: it already lasts longer "
                  "than asked" + (" (note updated)" if o.previous and o.previous.note != r.note
                                  else ""), file=out)


def cmd_reserve(config: Config, args: argparse.Namespace) -> int:
    targets = parse_targets(args.targets)
    _check_hosts(config, targets)
    seconds = _duration(config, args.duration)
    job = _until_exit(config, targets, args.until_exit) if args.until_exit is not None else None
    store = Store(config.reservations_path)
    _reap(config, store)
    snaps: dict[str, HostSnapshot] = {}
    targets = _validate_gpus(config, targets, snaps)
    check = None if args.skip_queue else _queue_claim(config, targets, snaps)
    made = reserve_outcomes(store, targets, seconds=seconds,
                            max_seconds=config.reservation_max_s, note=args.note or "",
                            job=job, check=check,
                            event="skip-queue" if args.skip_queue else None)
    _print_outcomes(made, sys.stdout)
    if job is not None:
        print(f"tied to process {job.pid} on {targets[0].host}: released once it has ended",
              file=sys.stdout)
    return EXIT_OK


def _queue_claim(config: Config, targets: Sequence[Target], snaps: dict[str, HostSnapshot]
                 ) -> Callable[[StoreState, datetime], None]:
    """The queue's claim on a direct reservation, checked under the lock: a GPU that a
    waiter (not you) could use is theirs to wait for (the order rule: ``reserve`` comes
    after every waiter). The GPU is judged as if empty: reserving a busy GPU would still
    keep it from the waiter once it frees. A GPU you already hold is yours to extend."""
    hosts = list(snaps.values())
    fleet = [h.name for h in config.hosts]
    me = whoami()[0]

    def gpu_of(t: Target) -> FreeGpu | None:
        h = snaps.get(t.host)
        g = next((g for g in h.gpus if g.index == t.gpu), None) if h and h.ok else None
        if g is None:  # not checked (the host did not answer): the queue cannot judge it
            return None
        empty = replace(g, memory_used_mib=0, processes=())
        return FreeGpu(t.host, empty)

    def check(state: StoreState, now: datetime) -> None:
        queue = [w for w in state.waiting(now) if w.user != me]
        if not queue:
            return
        mine = {(r.host, r.gpu) for r in state.active(now) if r.user == me}
        for t in targets:
            if (t.host, t.gpu) in mine:
                continue
            f = gpu_of(t)
            if f is None:  # not checked (its host did not answer): the queue cannot
                # judge it, so it is anyone's who waits for GPUs on that host
                claim = [w for w in queue if request_of(w).accepts(t.host)]
                unjudged = True
            else:
                claim = [w for w in queue if could_use([request_of(w)], hosts, fleet)(f)]
                unjudged = False
            if claim:
                w = claim[0]
                how = ("the queue hands out whole GPUs: --skip-queue reserves the instance "
                       "anyway" if t.instance is not None else
                       f"Join the queue: gputop free --wait --host {clean(t.host)} (or "
                       "--skip-queue to reserve it anyway")
                raise Refused(
                    f"{clean(t.label)} is one the queue waits for"
                    + (f" ({clean(t.host)} did not answer, so it cannot be checked)"
                       if unjudged else "")
                    + f": {len(queue)} waiting, first who could use it: {clean(w.user)} "
                    f"(since {local_time(w.created)}, for {w.count} GPU(s)"
                    + (f", {excerpt(w.want, 60)}" if w.want else "") + f"). {how}; that is "
                    "recorded in the file with your name" + (")" if t.instance is None
                                                              else ""))

    return check


def _until_exit(config: Config, targets: Sequence[Target], pid: int) -> Job:
    """``--until-exit PID``: the process must exist now, on the one host reserved on."""
    from gputop.jobs.remote import JobHostError, alive_on

    hosts = {t.host for t in targets}
    if len(hosts) != 1:
        raise Invalid("--until-exit ties the reservation to a process on one host; "
                      f"these GPUs are on {len(hosts)} hosts")
    if not 1 <= pid < 2**31:
        raise Invalid(f"--until-exit {pid}: not a process id")
    host = _host(config, next(iter(hosts)))
    try:
        alive = asyncio.run(alive_on(config, host))
    except JobHostError as exc:
        raise Refused(f"cannot check process {pid} on {host.name}: {exc}") from None
    if not alive.has(pid, False):
        raise Invalid(f"--until-exit {pid}: no such process on {host.name}")
    return Job(pid, session=False, start=alive.start_of(pid))


def _host(config: Config, name: str) -> HostConfig:
    return next(h for h in config.hosts if h.name == name)


def _reap(config: Config, store: Store) -> None:
    """Release job-tied reservations whose job has ended (see gputop.jobs.reap)."""
    if not any(r.job is not None for r in _read_quietly(store)):
        return
    from gputop.jobs.reap import check_jobs

    for r in asyncio.run(check_jobs(config, store)):
        print(f"gputop: released {clean(r.host)}:{r.gpu} of {clean(r.user)}: its job has "
              "ended", file=sys.stderr)


def _read_quietly(store: Store) -> tuple[Reservation, ...]:
    try:
        return store.read().reservations
    except StoreError:
        return ()


def _request(config: Config, args: argparse.Namespace, *, one_host: bool) -> Request:
    """``--count``, ``--min-free-memory``, ``--host`` / ``--tag`` as a queue request."""
    if args.count < 1:
        raise Invalid("--count must be at least 1")
    min_mib = parse_size_mib(args.min_free_memory) if args.min_free_memory else 0
    if args.host and args.tag:
        raise Invalid("give --host or --tag, not both")
    hosts: tuple[str, ...] = ()
    want = ""
    if args.host:
        _check_hosts(config, [Target(args.host, 0)])
        hosts, want = (args.host,), f"--host {args.host}"
    elif args.tag:
        hosts = tuple(h.name for h in config.hosts if args.tag in h.tags)
        if not hosts:
            tags = sorted({t for h in config.hosts for t in h.tags})
            raise Invalid(f"no host has the tag {args.tag!r}; tags in "
                          f"{config.path or 'the config'}: {', '.join(tags) or 'none'}")
        want = f"--tag {args.tag}"
    return Request(args.count, min_mib, hosts, one_host, want)


def _max_wait(text: str | None) -> float | None:
    if text is None:
        return None
    try:
        return parse_duration(text)
    except ValueError:
        raise Invalid(f"--max-wait {text}: not a duration (use e.g. 30m, 2h)") from None


def _wait(config: Config, store: Store, req: Request, args: argparse.Namespace, *,
          seconds: float, job: Job | None = None) -> tuple[int, list[Reservation]]:
    """Wait in the queue (Ctrl-C, SIGTERM, SIGHUP leave it at once): (exit code, grant)."""
    from gputop.cli import run_until_signal
    from gputop.jobs.reap import check_jobs
    from gputop.jobs.wait import WaitedTooLong, wait_for_gpus

    got: list[Reservation] = []
    lease = args.lease if args.lease is not None else DEFAULT_LEASE_S
    if not 1 <= lease <= MAX_LEASE_S:  # (NaN fails both)
        raise Invalid(f"--lease must be between 1 and {MAX_LEASE_S:.0f} seconds")
    max_wait = _max_wait(args.max_wait)

    def say(msg: str) -> None:
        print(f"gputop: {msg}", file=sys.stderr, flush=True)

    async def main() -> int:
        last_reap = [0.0]
        pending: set[asyncio.Task[Any]] = set()

        def reaper() -> None:  # in the background, at most every few intervals
            loop = asyncio.get_running_loop()
            if loop.time() - last_reap[0] < max(5.0, 3 * config.interval) or pending:
                return
            last_reap[0] = loop.time()
            t = loop.create_task(check_jobs(config, store))
            pending.add(t)
            t.add_done_callback(pending.discard)

        try:
            got.extend(await wait_for_gpus(
                config, store, req, seconds=seconds, note=args.note or "", lease_s=lease,
                max_wait=max_wait, say=say, job=(lambda h: job) if job else None,
                reaper=reaper))
        except WaitedTooLong as exc:
            say(str(exc))
            return EXIT_REFUSED
        finally:
            for t in pending:
                t.cancel()
        return EXIT_OK

    code = run_until_signal(main)
    if code != EXIT_OK or not got:
        _notify(args, "timeout" if code == EXIT_REFUSED else "interrupted", [])
        return code or EXIT_REFUSED, []
    _notify(args, "granted", got)
    return EXIT_OK, got


def _notify(args: argparse.Namespace, result: str, got: Sequence[Reservation]) -> None:
    """The terminal bell, and ``--notify CMD`` (your own shell command) with the result in
    its environment: GPUTOP_RESULT, GPUTOP_GPUS (HOST:GPU,...), GPUTOP_UUIDS."""
    import os
    import subprocess

    if sys.stderr.isatty():
        sys.stderr.write("\a")
        sys.stderr.flush()
    if not getattr(args, "notify", None):
        return
    env = dict(os.environ, GPUTOP_RESULT=result,
               GPUTOP_GPUS=",".join(f"{r.host}:{r.gpu}" for r in got),
               GPUTOP_UUIDS=",".join(r.uuid or "" for r in got))
    try:
        # Your own command line, as you typed it; the results are only in its environment.
        subprocess.run(["/bin/sh", "-c", args.notify], env=env, stdin=subprocess.DEVNULL,
                       timeout=60, check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        print(f"gputop: --notify failed: {exc}", file=sys.stderr)


def cmd_release(config: Config, args: argparse.Namespace) -> int:
    if args.waiter is not None:
        if args.mine or args.targets:
            raise Invalid("give --waiter ID alone (not with HOST:GPU or --mine)")
        from gputop.reservations.queue import remove_waiter

        w = remove_waiter(Store(config.reservations_path), args.waiter, force=args.force)
        print(f"removed waiter {w.id} ({clean(w.user)}, for {w.count} GPU(s)"
              + (f", {excerpt(w.want, 60)}" if w.want else "") + ") from the queue")
        return EXIT_OK
    if args.mine and args.targets:
        raise Invalid("give HOST:GPU arguments or --mine, not both")
    if not args.mine and not args.targets:
        now = utcnow()
        mine = sorted((r for r in Store(config.reservations_path).read().active(now)
                       if r.user == whoami()[0]), key=lambda r: (r.host, r.gpu, r.instance or -1))
        held = ("; yours now: " + ", ".join(clean(r.target) for r in mine)
                if mine else "; you hold no reservations now")
        raise Invalid("say what to release: gputop release HOST:GPU[,GPU...] (e.g. "
                      "gputop release gpu-01:0,1), or gputop release --mine for all of yours"
                      + held)
    targets = None if args.mine else parse_targets(args.targets)
    if targets:
        _check_hosts(config, targets)
        targets = _resolve_mig(config, targets)
    gone = release(Store(config.reservations_path), targets, force=args.force)
    for r in gone:
        print(f"released {clean(r.target)}" + (f" (held by {clean(r.user)})"
                                                     if r.user != whoami()[0] else ""))
    if not gone:
        print("nothing to release", file=sys.stderr)
    return EXIT_OK


def cmd_reservations(config: Config, args: argparse.Namespace) -> int:
    _reap(config, Store(config.reservations_path))
    state = Store(config.reservations_path).read()
    now = utcnow()
    active = sorted(state.active(now), key=lambda r: (r.host, r.gpu, r.instance or -1))
    queue = state.waiting(now)
    if args.json:
        write_document({"version": 1, "time": iso(now),
                        "reservations": [r.to_dict() for r in active],
                        "queue": [w.to_dict() for w in queue]}, sys.stdout)
        return EXIT_OK
    for i, w in enumerate(queue):
        print(f"waiting {i + 1}: {clean(w.user)} for {w.count} GPU(s)"
              + (f" ({excerpt(w.want, 60)})" if w.want else "")
              + f" since {local_time(w.created)} [id {w.id}]")
    if not active:
        print("no reservations", file=sys.stderr)
        return EXIT_OK
    rows = [("GPU", "USER", "UNTIL", "LEFT", "NOTE")] + [
        (clean(r.target), clean(r.user), local_time(r.expires),
         format_duration((r.expires - now).total_seconds()), clean(r.note)[:60])
        for r in active]
    widths = [max(len(row[i]) for row in rows) for i in range(4)]
    for row in rows:
        print("  ".join(c.ljust(w) for c, w in zip(row, widths)) + "  " + row[4])
    return EXIT_OK


def cmd_free(config: Config, args: argparse.Namespace) -> int:
    req = _request(config, args, one_host=False)
    store = Store(config.reservations_path)
    _reap(config, store)
    if args.wait:  # --wait queues for a reservation: it implies --reserve
        seconds = _duration(config, args.duration)
        code, got = _wait(config, store, req, args, seconds=seconds)
        if code != EXIT_OK:
            if args.json:
                write_document({"version": 1, "reserved": False, "free": []}, sys.stdout)
            return code
        _print_outcomes([Outcome("reserved", r) for r in got], sys.stderr)
        if args.json:
            write_document({"version": 1, "reserved": True, "free": [
                {"host": g.host, "gpu": g.gpu, "uuid": g.uuid, "expires": iso(g.expires)}
                for g in got]}, sys.stdout)
        else:
            for g in got:
                print(f"{g.host}:{g.gpu}")
        return EXIT_OK
    hosts = asyncio.run(_poll(config, set(req.hosts) or None))
    me = whoami()[0]
    state = store.read()
    # The order rule: without --wait you come after every waiter, so you may take only
    # GPUs that no waiter could use.
    waiters = [request_of(w) for w in state.waiting()]
    taken = could_use(waiters, hosts, [h.name for h in config.hosts])
    found = [f for f in free_gpus(hosts, state, req.min_free_mib, user=me)
             if req.fits(f) and not taken(f)
             and not (args.whole and f.instance)][: args.count]
    if len(found) < args.count:
        print(f"gputop: {len(found)} free GPU(s) found, {args.count} wanted"
              + (f" ({len(waiters)} waiting in the queue; --wait joins it)" if waiters else
                 " (--wait to queue for them)"), file=sys.stderr)
        if args.json:
            write_document({"version": 1, "free": []}, sys.stdout)
        return EXIT_REFUSED
    expires: dict[str, str | None] = {}
    if args.reserve:
        seconds = _duration(config, args.duration)
        made = reserve_outcomes(
            store, [Target(f.host, f.gpu.index or 0, f.gpu.uuid,
                           f.instance.gpu_instance_id if f.instance else None) for f in found],
            seconds=seconds, max_seconds=config.reservation_max_s, note=args.note or "")
        _print_outcomes(made, sys.stderr)  # stdout stays HOST:GPU lines for scripts
        # An instance covered by your whole-GPU reservation: that one's expiry.
        for f in found:
            r = next((o.reservation for o in made if o.reservation.target == f.label), None) \
                or next((o.reservation for o in made
                         if o.reservation.target == f"{f.host}:{f.gpu.index}"), None)
            expires[f.label] = iso(r.expires) if r else None
    if args.json:
        write_document({"version": 1, "reserved": bool(args.reserve), "free": [
            {"host": f.host, "gpu": f.gpu.index, "uuid": f.gpu.uuid, "name": f.gpu.name,
             "memory_free_mib": f.free_mib}
            | ({"instance": f.instance.gpu_instance_id, "profile": f.instance.profile,
                "mig_uuid": f.instance.uuid} if f.instance else {})
            | ({"expires": expires.get(f.label)} if args.reserve else {})
            for f in found]}, sys.stdout)
    else:
        for f in found:
            print(f.label)
    return EXIT_OK


def cmd_record(config: Config, args: argparse.Namespace) -> int:
    from pathlib import Path

    from gputop.history.live import record_forever

    try:
        asyncio.run(record_forever(config, Path(args.db).expanduser() if args.db else None))
    except asyncio.CancelledError:  # SIGTERM: stopped cleanly, everything committed
        pass
    return EXIT_OK


def cmd_report(config: Config, args: argparse.Namespace) -> int:
    from gputop.history.cli import report

    return report(config, args)


def cmd_run(config: Config, args: argparse.Namespace) -> int:
    argv = list(args.cmd)
    if argv and argv[0] == "--":
        argv = argv[1:]
    if not argv:
        raise Invalid("say what to run: gputop run [--count N] ... -- CMD ARGS...")
    req = _request(config, args, one_host=True)
    seconds = (_duration(config, args.duration) if args.duration
               else config.reservation_max_s)
    store = Store(config.reservations_path)
    _reap(config, store)
    pending = Job(None, session=True)  # tied to the job from the start (see jobs.reap)
    got: list[Reservation] = []
    if args.wait:
        code, got = _wait(config, store, req, args, seconds=seconds, job=pending)
        if code != EXIT_OK:
            return code
    else:
        from gputop.reservations.queue import reserve_now

        hosts = asyncio.run(_poll(config, set(req.hosts) or None))
        fleet = [h.name for h in config.hosts]
        why = unsatisfiable(req, hosts, fleet)
        if why:
            raise Invalid(f"{why}; ask for fewer GPUs or less memory (or name other hosts)")
        made = reserve_now(store, req, hosts, seconds=seconds, note=args.note or "",
                           job=lambda h: pending, fleet=fleet)
        if made is None:
            waiting = len(store.read().waiting())
            print(f"gputop: not {req.count} free GPU(s) on one host"
                  + (f" that none of the {waiting} waiting could use" if waiting else "")
                  + "; --wait to queue for them", file=sys.stderr)
            return EXIT_REFUSED
        got = made
    from gputop.jobs.run import run_on

    host = _host(config, got[0].host)
    print(f"gputop: running on {', '.join(f'{clean(r.host)}:{r.gpu}' for r in got)}",
          file=sys.stderr, flush=True)

    def say(msg: str) -> None:
        print(f"gputop: {msg}", file=sys.stderr, flush=True)

    return asyncio.run(run_on(config, host, store, got, argv, say))




COMMANDS = {"reserve": cmd_reserve, "release": cmd_release, "reservations": cmd_reservations,
            "free": cmd_free, "run": cmd_run, "record": cmd_record, "report": cmd_report}


def _queue_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--count", type=int, default=1, metavar="N", help="how many (default 1)")
    p.add_argument("--min-free-memory", metavar="SIZE", help="e.g. 20G")
    p.add_argument("--host", metavar="HOST", help="only this host")
    p.add_argument("--tag", metavar="TAG", help="only hosts with this tag")
    p.add_argument("--max-wait", metavar="DURATION", help="with --wait: give up after this")
    p.add_argument("--notify", metavar="CMD",
                   help="with --wait: run this shell command when the wait ends "
                   "(GPUTOP_RESULT, GPUTOP_GPUS, GPUTOP_UUIDS in its environment)")
    p.add_argument("--lease", type=float, metavar="SECONDS", help=argparse.SUPPRESS)


def add_subcommands(parser: argparse.ArgumentParser,
                    parents: Sequence[argparse.ArgumentParser] = ()) -> Any:
    """The reservation subcommands; ``parents`` adds the global options to each, so they
    work after the subcommand too. Returns the subparsers, for the CLI to add its own."""
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    parents = list(parents)
    p = sub.add_parser("reserve", parents=parents,
                       help="reserve GPUs: HOST:GPU[,GPU...] (all or nothing); "
                       "a MIG instance: HOST:GPU/INSTANCE or HOST:MIG-<uuid>")
    p.add_argument("targets", nargs="+", metavar="HOST:GPU[,GPU...]")
    p.add_argument("--for", dest="duration", metavar="DURATION",
                   help="how long, e.g. 90m, 2h, 1d (default from the config: 4h)")
    p.add_argument("--note", help="what it is for (shown to the team)")
    p.add_argument("--until-exit", type=int, metavar="PID",
                   help="release it once process PID (on that host) has ended")
    p.add_argument("--skip-queue", action="store_true",
                   help="reserve even a GPU that people in the queue wait for (recorded in "
                   "the file with your name)")
    p = sub.add_parser("release", parents=parents,
                       help="release GPUs you reserved, or a place in the queue (--waiter)")
    p.add_argument("targets", nargs="*", metavar="HOST:GPU[,GPU...]")
    p.add_argument("--mine", action="store_true", help="release all of your reservations")
    p.add_argument("--force", action="store_true",
                   help="release someone else's reservation or waiter (recorded with your "
                   "name)")
    p.add_argument("--waiter", metavar="ID",
                   help="take waiter ID (from gputop reservations) out of the queue: "
                   "your own, or with --force anyone's")
    p = sub.add_parser("reservations", parents=parents, help="list current reservations")
    p.add_argument("--json", action="store_true", help="print JSON")
    p = sub.add_parser("free", parents=parents,
                       help="list idle, unreserved GPUs (and MIG instances), best first")
    _queue_options(p)
    p.add_argument("--whole", action="store_true", help="whole GPUs only, no MIG instances")
    p.add_argument("--reserve", action="store_true", help="reserve what was found, atomically")
    p.add_argument("--wait", action="store_true",
                   help="not enough free: wait your turn in the team's queue, then reserve "
                   "(implies --reserve)")
    p.add_argument("--for", dest="duration", metavar="DURATION", help="with --reserve")
    p.add_argument("--note", help="with --reserve")
    p.add_argument("--json", action="store_true", help="print JSON")
    p = sub.add_parser("run", parents=parents,
                       help="reserve GPUs on one host, run CMD there on them, release them")
    _queue_options(p)
    p.add_argument("--wait", action="store_true", help="wait your turn in the queue")
    p.add_argument("--for", dest="duration", metavar="DURATION",
                   help="longest the reservation lasts (default: max_duration); it is "
                   "released when the job ends")
    p.add_argument("--note", help="what it is for (shown to the team)")
    p.add_argument("cmd", nargs=argparse.REMAINDER, metavar="-- CMD ARGS",
                   help="the command and its arguments")
    p = sub.add_parser("record", parents=parents,
                       help="record every host's GPUs, owners and reservations "
                       "into the history database (runs until stopped)")
    p.add_argument("--db", metavar="FILE", help="history database (default: [history] path)")
    p = sub.add_parser("report", parents=parents,
                       help="GPU-hours used, reserved and wasted, per user, host "
                       "and GPU, from the history database")
    p.add_argument("--db", metavar="FILE", help="history database (default: [history] path)")
    p.add_argument("--since", metavar="DURATION", help="the last DURATION, e.g. 7d (default)")
    p.add_argument("--from", dest="start", metavar="DATE",
                   help="start: 2026-11-01 or 2026-11-01T09:00 (local time unless it says)")
    p.add_argument("--to", dest="end", metavar="DATE", help="end (default: now)")
    p.add_argument("--by", choices=("user", "host", "gpu"), default="user",
                   help="the table to show (default: user)")
    fmt = p.add_mutually_exclusive_group()
    fmt.add_argument("--json", action="store_true", help="print everything as JSON")
    fmt.add_argument("--csv", action="store_true", help="print the --by table as CSV")
    p.add_argument("--plot", metavar="FILE", help="also draw FILE.png or FILE.svg "
                   "(needs matplotlib: pip install 'gputop[plot]')")
    return sub


def run_command(config: Config, args: argparse.Namespace) -> int:
    try:
        return COMMANDS[args.command](config, args)
    except Refused as exc:
        print(f"gputop: refused: {exc}", file=sys.stderr)
        return EXIT_REFUSED
    except (Invalid, ValueError) as exc:
        print(f"gputop: {exc}", file=sys.stderr)
        return EXIT_ERROR
    except StoreError as exc:
        print(f"gputop: {exc}", file=sys.stderr)
        return EXIT_ERROR
    except HistoryError as exc:
        print(f"gputop: {exc}", file=sys.stderr)
        return EXIT_ERROR
