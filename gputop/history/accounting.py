"""What one GPU sample counts for: the report's rules, in one place.

A sample stands for ``dt`` seconds of one GPU (the time since its host's previous sample).
Per GPU it is *no data* (host down, GPU lost) or data; data is exactly one of *busy*
(load above ~0 %, or processes whose load the GPU cannot report), *held idle* (load at ~0 %
while someone holds it: a process with memory on it, or a reservation) or *idle*.

Per user: *used* is time with a process of theirs on the GPU. A GPU shared by several users
is split equally between them (each of ``k`` users gets ``dt / k``), so per-user used time
adds up to the GPU's used time. *Reserved* is the holder's reservation time; *reserved
idle* the part of it with no process of the holder on the GPU (a process whose owner is
unknown might be theirs, so it is not counted idle). *Unreserved* is use of a GPU the user
did not reserve (nobody's, or someone else's). *Held idle* is their share of time holding
memory at ~0 % load. Mean utilisation while used weighs each share by its time.

A MIG GPU with known instances is split into *parts*: each instance counts for its fraction
of the GPU (``mig_fraction``: its compute slices out of the GPU's 7, or 4 on an A30) with
its own users, utilisation and holder (the instance's reservation, else the whole GPU's);
the slices no instance uses are one more part with nobody on it. The parts add up to the
GPU: the GPU's time is counted once, and the fleet never counts a GPU and its instances.

A GPU held in memory *shares* (``gputop reserve --share``, history schema 4) carries its
shares: each holder is *reserved* for the share's fraction of the GPU's memory (a 30G
share of an 80 GB GPU: 0.37 of the time), and *reserved idle* for that fraction while no
process of theirs runs on it; both are also counted apart as *shared* and *shared idle*,
so the report tells shares from whole reservations. A share holder's own use of the GPU is
not *unreserved*; anyone else's is. Memory that no share holds is nobody's reservation.
"""

from __future__ import annotations

import re
from typing import Any

from gputop.reservations.flags import IDLE_UTIL_PERCENT

# Indices into the per-GPU and per-user sums (db.GPU_METRICS, db.USER_METRICS).
DATA, NODATA, BUSY, IDLE, HELD_IDLE, UTIL_SUM, UTIL_SECS = range(7)
USED, RESERVED, RESERVED_IDLE, UNRESERVED, U_HELD_IDLE, U_UTIL_SUM, U_UTIL_SECS = range(7)
#: The part of RESERVED (RESERVED_IDLE) that came from memory shares (history schema 4).
SHARED, SHARED_IDLE = 7, 8
#: How many per-user sums there are (db.USER_METRICS).
N_USER = 9
#: The user id recorded for a process whose owner nobody could tell.
UNKNOWN_USER = "?"

#: [gpu, util|None, mem|None, [user ids], holder|None, nodata 0/1, (parts)]; parts, on a
#: MIG GPU with instances (history schema 2): [[GI id, fraction, util|None, [user ids],
#: holder|None], ...], whose fractions add up to at most 1; shares (8th item, parts then
#: null; history schema 4): [[holder user id, fraction of the GPU's memory], ...].
Entry = list[object]

#: A MIG profile: ``3g.40gb``, ``1g.10gb+me``, ``1g.20gb``, ``1c.3g.40gb`` (a compute
#: instance of one slice inside a 3-slice GPU instance).
_PROFILE = re.compile(r"(?:(\d{1,2})c\.)?(\d{1,2})g\.\d{1,4}gb(?:[+-][a-z0-9]{1,8})*")
#: Compute slices of a whole GPU: 7 on A100, H100, H200, B200 (and GH200/GB200), 4 on A30.
_SLICES_A30 = re.compile(r"\bA30\b")


def gpu_slices(gpu_name: str | None) -> int:
    return 4 if gpu_name and _SLICES_A30.search(gpu_name) else 7


def mig_fraction(profile: str | None, gpu_name: str | None, memory_mib: int | None,
                 gpu_memory_mib: int | None) -> float | None:
    """The fraction of its GPU a MIG instance stands for: its compute slices (the ``3`` of
    ``3g.40gb``, the ``1`` of ``1c.3g.40gb``) out of the GPU's. Compute, not memory: a
    ``3g.40gb`` holds half an 80 GB GPU's memory but 3/7 of its SMs, and NVIDIA sizes the
    profiles (and clouds price them) by slices. A profile we cannot read falls back to the
    instance's share of the memory; None if neither is known."""
    m = _PROFILE.fullmatch(profile or "")
    if m:
        slices, total = int(m.group(1) or m.group(2)), gpu_slices(gpu_name)
        if 0 < slices <= total:
            return slices / total
    if memory_mib and gpu_memory_mib and 0 < memory_mib <= gpu_memory_mib:
        return memory_mib / gpu_memory_mib
    return None


def account(dt: float, entry: Entry, unknown_uid: int | None,
            gpu_sums: list[float], user_sums: dict[int, list[float]]) -> None:
    """Add one GPU sample of ``dt`` seconds to ``gpu_sums`` and ``user_sums`` (in place)."""
    parts = entry[6] if len(entry) > 6 else None
    if parts and not entry[5]:
        assert isinstance(parts, list)
        rest = 1.0
        for _gi, frac, util, users, holder in parts:
            rest -= frac
            _account(dt * frac, util, users, holder, 0, unknown_uid, gpu_sums, user_sums)
        if rest > 1e-9:  # slices no instance uses: nobody's, held by the GPU's holder
            _account(dt * rest, None, [], entry[4], 0, unknown_uid, gpu_sums, user_sums)
        return
    shares = entry[7] if len(entry) > 7 else None
    _account(dt, entry[1], entry[3], entry[4], entry[5], unknown_uid, gpu_sums, user_sums,
             shares if isinstance(shares, list) else None)


def _account(dt: float, util: object, users: object, holder: object, nodata: object,
             unknown_uid: int | None, gpu_sums: list[float],
             user_sums: dict[int, list[float]], shares: list[Any] | None = None) -> None:
    assert isinstance(users, list)
    if holder is not None:
        assert isinstance(holder, int)
        h = user_sums.setdefault(holder, [0.0] * N_USER)
        h[RESERVED] += dt
        if not nodata and holder not in users and unknown_uid not in users:
            h[RESERVED_IDLE] += dt
    sharers: set[int] = set()
    for uid, frac in shares or ():
        sharers.add(uid)
        h = user_sums.setdefault(uid, [0.0] * N_USER)
        h[RESERVED] += dt * frac
        h[SHARED] += dt * frac
        if not nodata and uid not in users and unknown_uid not in users:
            h[RESERVED_IDLE] += dt * frac
            h[SHARED_IDLE] += dt * frac
    if nodata:
        gpu_sums[NODATA] += dt
        return
    gpu_sums[DATA] += dt
    known = isinstance(util, int)
    low = known and util <= IDLE_UTIL_PERCENT  # type: ignore[operator]
    if known:
        gpu_sums[UTIL_SUM] += util * dt  # type: ignore[operator]
        gpu_sums[UTIL_SECS] += dt
    if (known and not low) or (not known and users):
        gpu_sums[BUSY] += dt
    elif users or holder is not None or sharers:
        gpu_sums[HELD_IDLE] += dt
    else:
        gpu_sums[IDLE] += dt
    if not users:
        return
    share = dt / len(users)
    for uid in users:
        assert isinstance(uid, int)
        u = user_sums.setdefault(uid, [0.0] * N_USER)
        u[USED] += share
        if uid != holder and uid not in sharers:
            u[UNRESERVED] += share
        if low:
            u[U_HELD_IDLE] += share
        if known:
            u[U_UTIL_SUM] += util * share  # type: ignore[operator]
            u[U_UTIL_SECS] += share
