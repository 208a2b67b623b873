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
"""

from __future__ import annotations

from gputop.reservations.flags import IDLE_UTIL_PERCENT

# Indices into the per-GPU and per-user sums (db.GPU_METRICS, db.USER_METRICS).
DATA, NODATA, BUSY, IDLE, HELD_IDLE, UTIL_SUM, UTIL_SECS = range(7)
USED, RESERVED, RESERVED_IDLE, UNRESERVED, U_HELD_IDLE, U_UTIL_SUM, U_UTIL_SECS = range(7)
#: The user id recorded for a process whose owner nobody could tell.
UNKNOWN_USER = "?"

Entry = list[object]  # [gpu, util|None, mem|None, [user ids], holder|None, nodata 0/1]


def account(dt: float, entry: Entry, unknown_uid: int | None,
            gpu_sums: list[float], user_sums: dict[int, list[float]]) -> None:
    """Add one GPU sample of ``dt`` seconds to ``gpu_sums`` and ``user_sums`` (in place)."""
    util, users, holder, nodata = entry[1], entry[3], entry[4], entry[5]
    assert isinstance(users, list)
    if holder is not None:
        assert isinstance(holder, int)
        h = user_sums.setdefault(holder, [0.0] * 7)
        h[RESERVED] += dt
        if not nodata and holder not in users and unknown_uid not in users:
            h[RESERVED_IDLE] += dt
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
    elif users or holder is not None:
        gpu_sums[HELD_IDLE] += dt
    else:
        gpu_sums[IDLE] += dt
    if not users:
        return
    share = dt / len(users)
    for uid in users:
        assert isinstance(uid, int)
        u = user_sums.setdefault(uid, [0.0] * 7)
        u[USED] += share
        if uid != holder:
            u[UNRESERVED] += share
        if low:
            u[U_HELD_IDLE] += share
        if known:
            u[U_UTIL_SUM] += util * share  # type: ignore[operator]
            u[U_UTIL_SECS] += share
