"""What to tell, derived in one place from two looks at the team's state and the clock.

Pure functions: ``store_notices`` compares the reservations file before and after (grants,
endings, expiry warnings), ``flag_conditions`` reads the misuse flags off the annotated
``--json`` hosts, ``digest`` folds one person's many notices into one. None of them keeps
anything: the watcher (``gputop.notify.watcher``) remembers what was sent, so that each
occurrence is told once, and across restarts too.

Every name and note here is a teammate's or a host's: it goes into notices as plain text
(each channel escapes it) and is bounded (``short_text``).
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from gputop.model import iso as _iso
from gputop.notify.notice import Notice, NoticeKind
from gputop.reservations.records import Reservation, Waiter
from gputop.reservations.state import StoreState

#: ``[notify] expiry_warning``'s default: warn this long before a reservation ends.
EXPIRY_WARNING_S = 15 * 60.0
#: More notices than this for one person in one pass become one ``digest``.
DIGEST_OVER = 3
#: A name or note in a notice keeps at most this many characters.
MAX_TEXT = 120


def iso(t: datetime) -> str:
    return _iso(t) or ""


@dataclass(frozen=True)
class Seen:
    """One look at the reservations file: its content and when it was read."""

    state: StoreState
    time: datetime


def short_text(text: Any) -> str:
    """Text bounded for a notice (a host, a target, an id): the fields compare equal."""
    s = str(text)
    return s if len(s) <= MAX_TEXT else s[:MAX_TEXT - 1] + "\u2026"


def _duration(seconds: float) -> str:
    m = max(0, round(seconds / 60))
    return f"{m} min" if m < 120 else f"{m // 60} h {m % 60:02d} min"


def use_lines(rs: Sequence[Reservation]) -> tuple[str, ...]:
    """How to use granted GPUs: per host, ``ssh HOST`` and the CUDA_VISIBLE_DEVICES line
    (a MIG instance or a share: which GPU it is on)."""
    by_host: dict[str, list[Reservation]] = {}
    for r in rs:
        by_host.setdefault(r.host, []).append(r)
    out = []
    for host, mine in by_host.items():
        gpus = ",".join(str(g) for g in sorted({r.gpu for r in mine}))
        out.append(f"ssh {short_text(host)}")
        out.append(f"CUDA_VISIBLE_DEVICES={gpus} on {short_text(host)}")
    return tuple(out)


def _fields(r: Reservation) -> dict[str, str]:
    f = {"host": short_text(r.host), "gpu": str(r.gpu), "target": short_text(r.target),
         "until": iso(r.expires), "reservation": short_text(r.id)}
    if r.note:
        f["note"] = short_text(r.note)
    if r.share_mib is not None:
        f["share_mib"] = str(r.share_mib)
    return f


def _removed_waiters(state: StoreState) -> set[str]:
    """Waiters taken out of the queue by a command (not granted)."""
    out = set()
    for e in state.events:
        w = e.get("waiter")
        if isinstance(w, dict) and isinstance(w.get("id"), str):
            out.add(w["id"])
    return out


def granted(old: Seen, new: Seen) -> list[Notice]:
    """A waiter whose place became reservations: it left the queue (not removed by a
    command) and its user holds reservations made since it joined that were not there
    before. Several places of one user granted at once share the new reservations out
    in the order they were made."""
    removed = _removed_waiters(new.state)
    still = {w.id for w in new.state.queue}
    before = {r.id for r in old.state.reservations}
    fresh: dict[str, list[Reservation]] = {}
    for r in sorted(new.state.reservations, key=lambda r: (r.created, r.id)):
        if r.id not in before and r.active(new.time):
            fresh.setdefault(r.user, []).append(r)
    out = []
    waiters: list[Waiter] = sorted(old.state.waiting(old.time), key=lambda w: w.created)
    for w in waiters:
        if w.id in still or w.id in removed:
            continue
        pool = fresh.get(w.user, [])
        got = [r for r in pool if r.created >= w.created][:1 if w.share_mib else w.count]
        if not got:
            continue
        for r in got:
            pool.remove(r)
        targets = ", ".join(short_text(r.target) for r in got)
        share = f" (a {got[0].share_mib} MiB share)" if w.share_mib else ""
        out.append(Notice(
            "granted", w.user, f"granted:{w.id}",
            f"Your GPUs are granted: {targets}{share}",
            (*use_lines(got), f"until {iso(got[0].expires)}"),
            {**_fields(got[0]), "targets": targets, "waiter": short_text(w.id)}))
    return out


def grant_notice(user: str, key: str, got: Sequence[Reservation]) -> Notice:
    """``granted`` for reservations a wait just made (an agent's ``wait_for_gpus``)."""
    targets = ", ".join(short_text(r.target) for r in got)
    return Notice("granted", user, key, f"Your GPUs are granted: {targets}",
                  (*use_lines(got), f"until {iso(got[0].expires)}" if got else ""),
                  {**(_fields(got[0]) if got else {}), "targets": targets})


def _extend_line(r: Reservation) -> str:
    if r.share_mib is not None:  # (extend takes whole GPUs; a share is renewed as made)
        return f"extend it: gputop reserve {short_text(r.target)} --for 1h --share {r.share_mib}M"
    return f"extend it: gputop extend {short_text(r.target)} --for 1h"


def expiring(new: Seen, warn_s: float = EXPIRY_WARNING_S) -> list[Notice]:
    """Every reservation that ends within ``warn_s`` (the bound included). The key holds
    the end: one extended after its warning is warned again before its new end."""
    out = []
    for r in new.state.active(new.time):
        left = (r.expires - new.time).total_seconds()
        if 0 < left <= warn_s:
            out.append(Notice(
                "expiring", r.user, f"expiring:{r.id}:{iso(r.expires)}",
                f"Your reservation of {short_text(r.target)} ends in {_duration(left)}",
                (_extend_line(r), f"ends {iso(r.expires)}"), _fields(r)))
    return out


def _audit(state: StoreState) -> dict[str, dict[str, Any]]:
    """The last audit event about each reservation id (force-release, job-ended)."""
    out = {}
    for e in state.events:
        rec = e.get("reservation")
        if isinstance(rec, dict) and isinstance(rec.get("id"), str):
            out[rec["id"]] = e
    return out


def ended(old: Seen, new: Seen) -> list[Notice]:
    """Reservations active before and not now: expired, their job ended, or released by
    someone else with ``--force`` (who, from the audit trail). One its holder released
    is not told: they did it."""
    now_ids = {r.id: r for r in new.state.reservations}
    audit = _audit(new.state)
    out = []
    for r in old.state.active(old.time):
        still = now_ids.get(r.id)
        if still is not None and still.active(new.time):
            continue
        e = audit.get(r.id)
        fields = _fields(r)
        lines: tuple[str, ...]
        if e is not None and e.get("action") == "force-release":
            by = short_text(e.get("by", "?"))
            why, lines = f"was released by {by} (--force)", (f"released by {by}",)
            fields["by"] = by
        elif e is not None and e.get("action") == "job-ended":
            why, lines = "ended with its job", ()
        elif (still or r).expires <= new.time:
            why, lines = "expired", (f"ended {iso(r.expires)}",)
        else:
            continue  # released by its holder
        fields["why"] = why
        out.append(Notice("ended", r.user, f"ended:{r.id}",
                          f"Your reservation of {short_text(r.target)} {why}", lines, fields))
    return out


def store_notices(old: Seen | None, new: Seen,
                  warn_s: float = EXPIRY_WARNING_S) -> list[Notice]:
    """Everything the reservations file says between two looks (the first look: only
    expiry warnings, as nothing is known to have changed)."""
    out = [] if old is None else granted(old, new) + ended(old, new)
    return out + expiring(new, warn_s)


def _owners(gdoc: Mapping[str, Any]) -> list[str]:
    return sorted({p["user"] for p in gdoc.get("processes") or ()
                   if isinstance(p, dict) and isinstance(p.get("user"), str) and p["user"]})


def _holder(rdoc: Mapping[str, Any]) -> set[str]:
    return {x for x in (rdoc.get("user"), rdoc.get("login")) if isinstance(x, str)}


def _flagged(host: str, where: str, gdoc: Mapping[str, Any], rdoc: Mapping[str, Any],
             flags: Iterable[str]) -> Iterable[tuple[str, Notice]]:
    rid, user = str(rdoc.get("id")), str(rdoc.get("user"))
    base = {"host": short_text(host), "target": short_text(where), "reservation": short_text(rid)}
    for flag in flags:
        if flag == "idle-reservation":
            yield f"idle:{rid}", Notice(
                "idle", user, "", f"Your reservation of {short_text(where)} has been idle",
                ("none of your processes ran on it for the idle grace; release it if "
                 f"you are done: gputop release {short_text(where)}",), base)
        elif flag == "over-share":
            yield f"over-share:{rid}", Notice(
                "over-share", user, "", f"You use more than your share of {short_text(where)}",
                (f"your share: {rdoc.get('share_mib')} MiB, used: {rdoc.get('used_mib')} MiB",),
                base)
        elif flag == "unreserved-use":
            holder = _holder(rdoc)
            others = [u for u in _owners(gdoc) if u not in holder]
            for other in others:
                yield f"unreserved-use:{rid}:{other}:holder", Notice(
                    "unreserved-use", user, "",
                    f"{short_text(other)} runs on your reserved GPU {short_text(where)}",
                    (), base | {"by": short_text(other)})
                yield f"unreserved-use:{rid}:{other}:user", Notice(
                    "unreserved-use", short_text(other), "",
                    f"You run on {short_text(where)}, reserved by {short_text(user)}",
                    (f"it is {short_text(user)}'s until {rdoc.get('expires')}",),
                    base | {"holder": short_text(user)})


def flag_conditions(hosts: Iterable[Mapping[str, Any]]) -> dict[str, Notice]:
    """The misuse flags standing now, by condition (``idle:RID``,
    ``unreserved-use:RID:USER:holder|user``, ``over-share:RID``), each with its notice
    (key left empty: the watcher numbers occurrences), from annotated ``--json`` hosts."""
    out: dict[str, Notice] = {}
    for h in hosts:
        name = str(h.get("name"))
        for g in h.get("gpus") or ():
            where = f"{name}:{g.get('index')}"
            r = g.get("reservation")
            if isinstance(r, dict):
                out.update(_flagged(name, where, g, r, g.get("flags") or ()))
            for s in g.get("shares") or ():
                out.update(_flagged(name, where, g, s, s.get("flags") or ()))
            if "unreserved-use" in (g.get("flags") or ()) and g.get("shares"):
                holders = set().union(*(_holder(s) for s in g["shares"]))
                for s in g["shares"]:
                    out.update(_shared_intruders(name, where, g, s, holders))
            for i in g.get("instances") or ():
                ir = i.get("reservation")
                if isinstance(ir, dict):
                    iw = f"{where}/{i.get('gpu_instance_id')}"
                    out.update(_flagged(name, iw, i, ir, i.get("flags") or ()))
    return out


def _shared_intruders(host: str, where: str, gdoc: Mapping[str, Any],
                      share: Mapping[str, Any], holders: set[str]
                      ) -> Iterable[tuple[str, Notice]]:
    """A shared GPU's ``unreserved-use``: someone holding no share runs on it."""
    for key, n in _flagged(host, where, gdoc, share, ("unreserved-use",)):
        if n.fields.get("by", n.user) not in holders:
            yield key, n


def host_notice(kind: NoticeKind, host: str, since: datetime) -> Notice:
    """``host-down`` / ``host-up``, for the team channel."""
    what = "is down" if kind == "host-down" else "is back up"
    return Notice(kind, None, f"{kind}:{host}:{iso(since)}", f"Host {short_text(host)} {what}",
                  (f"since {iso(since)}",), {"host": short_text(host), "since": iso(since)})


def digest(notices: Sequence[Notice], over: int = DIGEST_OVER) -> list[Notice]:
    """One person's notices of one pass, when more than ``over``, as one ``digest`` (the
    team channel's too); others pass as they are, in order."""
    by: dict[str | None, list[Notice]] = {}
    for n in notices:
        by.setdefault(n.user, []).append(n)
    out = []
    for user, mine in by.items():
        if len(mine) <= over:
            out.extend(mine)
            continue
        keys = "\n".join(n.key for n in mine)
        out.append(Notice("digest", user,
                          "digest:" + hashlib.sha256(keys.encode()).hexdigest()[:16],
                          f"{len(mine)} notices about your GPUs" if user is not None
                          else f"{len(mine)} notices about the team's hosts",
                          tuple(n.title for n in mine),
                          {"count": str(len(mine)),
                           "kinds": ",".join(sorted({n.kind for n in mine}))}))
    return out
