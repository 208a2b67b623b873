"""What the subcommands share: ``HOST:GPU`` targets, sizes, durations, one look at
the hosts, and the queue request their options make.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from collections.abc import Sequence
from dataclasses import replace

from gputop.config.load import Config, reserving_problem
from gputop.config.tables import HostConfig
from gputop.config.values import parse_duration
from gputop.hubclient.poller import open_poller
from gputop.model import HostSnapshot, utcnow
from gputop.poller import first_answer_s
from gputop.reservations import open as store_open
from gputop.reservations.filelock import StoreError
from gputop.reservations.ops import Invalid, format_duration, whoami
from gputop.reservations.queue import (
    Request,
)
from gputop.reservations.records import MAX_USER_ENTRIES, Reservation
from gputop.reservations.shares import parse_size_mib
from gputop.reservations.store import ReservationStore
from gputop.reservations.targets import BY_UUID, check_targets, resolve_uuids, with_held
from gputop.reservations.terms import Target
from gputop.text import clean


def resolve_mig(config: Config, targets: list[Target],
                 snaps: dict[str, HostSnapshot] | None = None) -> list[Target]:
    """Targets given by MIG uuid as ``HOST:GPU/GI``, from the live hosts."""
    if not any(t.gpu == BY_UUID for t in targets):
        return targets
    if snaps is None:
        names = {t.host for t in targets if t.gpu == BY_UUID}
        snaps = {h.name: h for h in asyncio.run(poll_hosts(config, names))}
    return resolve_uuids(targets, snaps)

def check_hosts(config: Config, targets: Sequence[Target]) -> None:
    names = [h.name for h in config.hosts]
    for t in targets:
        if t.host not in names:
            raise Invalid(f"unknown host {t.host!r}; hosts in {config.path or 'the config'}: "
                          + (", ".join(names) or "none (each host you reserve on must be "
                             "in your hosts.toml, also with a hub)"))

def check_reservable(config: Config, command: str) -> None:
    """``command`` reserves: refused before anything where nothing can be (see
    ``reserving_problem``)."""
    problem = reserving_problem(config)
    if problem:
        raise Invalid(f"{command} reserves, and {problem}")

def nobody_answered(hosts: Sequence[HostSnapshot]) -> str | None:
    """Where hosts were asked and none answered, what to say instead of "none free":
    nothing is known to be free, and waiting would wait on a broken set-up."""
    if not hosts or any(h.error is None for h in hosts):
        return None
    return (f"no host answered ({not_answering(hosts, names_only=True)}), so nothing is "
            "known to be free (gputop --once says why)")

async def poll_hosts(config: Config, names: set[str] | None = None) -> list[HostSnapshot]:
    """One look at the hosts (``names``: only those), answered by the first-answer
    deadline: a host past it is ``slow``, and none of its GPUs is offered."""
    if names is not None:
        config = replace(config, hosts=tuple(h for h in config.hosts if h.name in names))
    # One look: one query per host, as `--json` does (starting streams and waiting for
    # their first samples made `free` and `reserve` take seconds).
    poller = open_poller(config, one_look=True,
                         say=lambda m: print(f"gputop: {m}", file=sys.stderr))
    try:
        return list((await poller.snapshot(first_answer_s(config))).hosts)
    finally:
        await poller.aclose()

def reservation_seconds(config: Config, text: str | None) -> float:
    """``--for``: a clear message for what cannot be a reservation's length."""
    if text is None:
        return config.reservations.default_s
    try:
        seconds = parse_duration(text)
    except ValueError:
        seconds = 0.0
    longest = format_duration(config.reservations.max_s)
    if seconds > config.reservations.max_s:
        raise Invalid(f"--for {text}: longer than the longest reservation here, {longest} "
                      "([reservations] max_duration): ask for that or less, and again "
                      "before it ends")
    if not seconds > 0:
        raise Invalid(f"--for {text}: say how long to reserve, more than zero and at most "
                      f"{longest}: type e.g. --for 30m, --for 2h or --for 1d (to give a "
                      "GPU back: gputop release HOST:GPU)")
    return seconds

def validate_gpus(config: Config, targets: list[Target],
                   snaps: dict[str, HostSnapshot] | None = None) -> list[Target]:
    """Check GPU indices against the live hosts and record UUIDs (renumbering shows later).
    A host that does not answer is checked against its GPUs as the history or its
    ``gpus = N`` know them (none known: refused); a warning says so and the index is kept.
    A GPU that someone else is using can be reserved, with a warning naming them.
    ``snaps`` receives the hosts as polled."""
    from gputop.history.known import known_gpus
    from gputop.jobs.remote import logins

    store = open_store(config)
    me = whoami(store)[0]
    if snaps is None:
        snaps = {}
    snaps.update({h.name: h for h in asyncio.run(poll_hosts(config, {t.host for t in targets}))})
    down = {n for n, h in snaps.items() if not h.ok}
    known = with_held(known_gpus(config, down), read_quietly(store), me, down, utcnow()) \
        if down else None
    out, warnings = check_targets(targets, snaps, me, logins(config), known)
    for w in warnings:
        print(f"gputop: warning: {w}", file=sys.stderr)
    return out

def open_store(config: Config) -> ReservationStore:
    """The config's reservations file (a path, or ``HOST:/path`` over SSH), read with its
    ``max_duration`` (an expiry further ahead counts as created + max_duration and is
    flagged ``beyond-max``): :func:`gputop.reservations.open.open_store`."""
    return store_open.open_store(config)

def host_config(config: Config, name: str) -> HostConfig:
    return next(h for h in config.hosts if h.name == name)

def reap_ended_jobs(config: Config, store: ReservationStore) -> None:
    """Release job-tied reservations whose job has ended (see gputop.jobs.reap)."""
    if not any(r.job is not None for r in read_quietly(store)):
        return
    from gputop.jobs.reap import check_jobs

    for r in asyncio.run(check_jobs(config, store)):
        print(f"gputop: released {clean(r.host)}:{r.gpu} of {clean(r.user)}: its job has "
              "ended", file=sys.stderr)

def read_quietly(store: ReservationStore) -> tuple[Reservation, ...]:
    try:
        return store.read().reservations
    except StoreError:
        return ()

def queue_request(config: Config, args: argparse.Namespace, *, one_host: bool) -> Request:
    """``--count``, ``--min-free-memory``, ``--host`` / ``--tag`` as a queue request."""
    if args.count < 1:
        raise Invalid("--count must be at least 1")
    if args.count > MAX_USER_ENTRIES and (getattr(args, "reserve", True)
                                          or getattr(args, "wait", False)):
        raise Invalid(f"--count {args.count}: more than the {MAX_USER_ENTRIES} GPUs one user "
                      "may hold in the shared file")
    min_mib = parse_size_mib(args.min_free_memory) if args.min_free_memory else 0
    if args.host and args.tag:
        raise Invalid("give --host or --tag, not both")
    hosts: tuple[str, ...] = ()
    want = ""
    if args.host:
        check_hosts(config, [Target(args.host, 0)])
        hosts, want = (args.host,), f"--host {args.host}"
    elif args.tag:
        hosts = tuple(h.name for h in config.hosts if args.tag in h.tags)
        if not hosts:
            tags = sorted({t for h in config.hosts for t in h.tags})
            raise Invalid(f"no host has the tag {args.tag!r}; tags in "
                          f"{config.path or 'the config'}: {', '.join(tags) or 'none'}")
        want = f"--tag {args.tag}"
    return Request(args.count, min_mib, hosts, one_host, want)

def max_wait_s(text: str | None) -> float | None:
    if text is None:
        return None
    try:
        return parse_duration(text)
    except ValueError:
        raise Invalid(f"--max-wait {text}: not a duration (use e.g. 30m, 2h)") from None


def not_answering(hosts: Sequence[HostSnapshot], *, names_only: bool = False) -> str:
    """Why fewer were found may be hosts that did not answer: say which (at most three),
    so nobody queues behind a typo or a missing key instead of fixing it. ``names_only``:
    just those names and kinds (``a: timeout, b: host-key and 3 more``)."""
    down = [h for h in hosts if h.error is not None]
    if not down:
        return ""
    sep = ": " if names_only else " ("
    named = ", ".join(f"{clean(h.name)}{sep}{h.error.kind}{'' if names_only else ')'}"
                      for h in down[:3] if h.error)
    more = f" and {len(down) - 3} more" if len(down) > 3 else ""
    if names_only:
        return named + more
    return (f"; {len(down)} of {len(hosts)} host(s) did not answer: {named}{more} "
            "(gputop --once says why)")
