"""Where a reservation is (``Target``) and the terms it is made on (``Terms``).

Every path that makes a reservation (``reserve``, a share, a grant from the queue, ``run``)
takes the same terms, so they are one value, and one function makes the reservation
(:func:`new_reservation`): its id unique in the file, its job and login the same on every
path.
"""

from __future__ import annotations

import math
import secrets
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timedelta

from gputop.reservations.records import Job, Reservation


@dataclass(frozen=True)
class Target:
    host: str
    gpu: int
    uuid: str | None = None
    #: A MIG GPU instance id; None: the whole GPU.
    instance: int | None = None

    @property
    def label(self) -> str:
        return f"{self.host}:{self.gpu}" + ("" if self.instance is None else f"/{self.instance}")


@dataclass(frozen=True)
class Terms:
    """How long (``seconds``, at most ``max_seconds``: the config's ``max_duration``), with
    what note, for whom (``user``/``machine``; empty: who this gputop is to the store),
    tied to which job, and as a memory share (``share_mib``) or the whole GPU.

    ``job`` and ``login`` are asked per host (``job(host)``, ``login(host)``): one request
    may reserve GPUs on several hosts, where its job runs and the account this gputop logs
    in as differ; a one-host request is the same with one host."""

    seconds: float
    max_seconds: float = math.inf
    note: str = ""
    user: str = ""
    machine: str = ""
    job: Callable[[str], Job | None] | None = None
    login: Callable[[str], str | None] | None = None
    share_mib: int | None = None

    def job_on(self, host: str) -> Job | None:
        return self.job(host) if self.job is not None else None

    def login_on(self, host: str) -> str | None:
        return self.login(host) if self.login is not None else None


def tied(job: Job | None) -> Callable[[str], Job | None] | None:
    """``Terms.job`` for one job that every reservation of a request ends with."""
    return None if job is None else (lambda _host: job)


def new_reservation(at: Target, terms: Terms, now: datetime,
                    taken: set[str] | None = None) -> Reservation:
    """A new reservation of ``at`` on ``terms`` from ``now``. ``taken``: the ids already in
    the file; the new id is not one of them (release goes by id) and is added to it."""
    while True:
        rid = secrets.token_hex(6)
        if taken is None or rid not in taken:
            break
    if taken is not None:
        taken.add(rid)
    return Reservation(id=rid, host=at.host, gpu=at.gpu, user=terms.user,
                       machine=terms.machine, created=now,
                       expires=now + timedelta(seconds=terms.seconds), uuid=at.uuid,
                       note=terms.note, job=terms.job_on(at.host), instance=at.instance,
                       share_mib=terms.share_mib, login=terms.login_on(at.host))
