"""The one-shot table: hostile strings stay inert, columns stay aligned and within the
width, whichever line (first, middle, last) carries the hostile value."""

from __future__ import annotations

import re
from datetime import datetime, timezone

import pytest

from gputop.cli.table import cell_width, render
from gputop.model import FleetSnapshot, GpuInfo, HostError, HostSnapshot, ProcessInfo
from gputop.reservations.state import StoreState
from gputop.reservations.terms import Target, Terms, new_reservation

NOW = datetime(2026, 1, 1, 12, tzinfo=timezone.utc)
HOSTILE = "\x1b]0;pwned\x07\x1b[2J\x1b[31mred\u202eevil\x9b1m\r\nnext"
WIDE = "显卡显卡显卡显卡"  # two cells per character
SGR = re.compile(r"\x1b\[[0-9;]*m")


def gpu(i: int, *, name: str = "NVIDIA H100 80GB HBM3", user: str = "alice") -> GpuInfo:
    return GpuInfo(index=i, uuid=f"GPU-{i}", name=name, utilization_percent=50,
                   memory_used_mib=1024, memory_total_mib=81559,
                   processes=(ProcessInfo(pid=10 + i, user=user, command=HOSTILE),))


def fleet(bad_at: int) -> tuple[FleetSnapshot, StoreState]:
    gpus = [gpu(i) for i in range(3)]
    gpus[bad_at] = gpu(bad_at, name=HOSTILE + WIDE, user=HOSTILE)
    hosts = (
        HostSnapshot("gpu-01", time=NOW, gpus=tuple(gpus), last_ok=NOW),
        HostSnapshot("down", time=NOW, error=HostError("ssh", HOSTILE), last_ok=None),
    )
    state = StoreState(reservations=(
        new_reservation(
            Target("gpu-01", bad_at), Terms(3600, note=HOSTILE, user=HOSTILE, machine="m"), NOW),))
    return FleetSnapshot(hosts=hosts, time=NOW), state


@pytest.mark.parametrize("bad_at", [0, 1, 2])
@pytest.mark.parametrize("width", [None, 120, 60])
def test_hostile_strings_stay_inert_and_columns_aligned(bad_at: int, width: int | None) -> None:
    snap, state = fleet(bad_at)
    text = render(snap, state, width=width, now=NOW)
    lines = text.splitlines()
    assert len(lines) == 1 + 3 + 1 + 1  # header, one line per GPU, the failed host, summary
    for ch in ("\x1b", "\x07", "\x9b", "\u202e", "\r"):
        assert ch not in text
    if width is not None:
        assert max(cell_width(ln) for ln in lines) <= width, lines
    # The MEMORY column ends at the same cell on every GPU line, hostile or not.
    ends = {cell_width(ln[: ln.index("/80G") + 4]) for ln in lines[1:4]}
    assert len(ends) == 1, lines
    assert lines[-2].startswith("down") and "ssh:" in lines[-2]
    assert "never answered" in lines[-2] or width is not None


def test_colour_is_only_sgr_and_only_when_asked() -> None:
    snap, state = fleet(1)
    plain = render(snap, state, now=NOW)
    coloured = render(snap, state, color=True, now=NOW)
    assert "\x1b" not in plain
    assert "\x1b[" in coloured
    assert "\x1b" not in SGR.sub("", coloured)
    assert [ln.rstrip() for ln in SGR.sub("", coloured).splitlines()] == plain.splitlines()


def test_reservation_and_flags_are_shown() -> None:
    snap, _ = fleet(0)
    state = StoreState(reservations=(
        new_reservation(Target("gpu-01", 2), Terms(7200, user="bob", machine="m"), NOW),))
    lines = render(snap, state, now=NOW).splitlines()
    assert "RESERVED" in lines[0] and "FLAGS" in lines[0]
    assert "bob 2h00m" in lines[3] and "unreserved-use" in lines[3]
    assert lines[1].split()[:2] == ["gpu-01", "0"]


def test_unknown_values_are_not_zero() -> None:
    g = GpuInfo(index=0, name=None, utilization_percent=None, memory_used_mib=None,
                memory_total_mib=None)
    snap = FleetSnapshot(hosts=(HostSnapshot("h", time=NOW, gpus=(g,)),), time=NOW)
    line = render(snap, None, now=NOW).splitlines()[1]
    assert line.split()[:5] == ["h", "0", "?", "?", "?"]


def test_a_failed_hosts_name_is_never_cut() -> None:
    """Error rows are named in full even when every GPU row has a short host name."""
    snap = FleetSnapshot(hosts=(
        HostSnapshot("h", time=NOW, gpus=(gpu(0),), last_ok=NOW),
        HostSnapshot("gpu-long-name-17", time=NOW, error=HostError("timeout", "no answer")),
        HostSnapshot("localhost", time=NOW, error=HostError("no-nvml", "NVML not found")),
    ), time=NOW)
    lines = render(snap, None, now=NOW).splitlines()
    assert lines[2].startswith("gpu-long-name-17  timeout: no answer"), lines
    assert lines[3].startswith("localhost") and "…" not in lines[3], lines


def test_a_failed_hosts_reason_has_one_pair_of_brackets() -> None:
    """Not "connection refused (waiting to retry) (never answered)"."""
    snap = FleetSnapshot(hosts=(
        HostSnapshot("a", time=NOW, error=HostError("unreachable",
                                                     "connection refused (waiting to retry)")),
        HostSnapshot("b", time=NOW, error=HostError("timeout", "no answer")),
    ), time=NOW)
    lines = render(snap, None, now=NOW).splitlines()
    assert lines[1].split(None, 1)[1] == (
        "unreachable: connection refused (waiting to retry; never answered)")
    assert lines[2].split(None, 1)[1] == "timeout: no answer (never answered)"


def test_idle_reservation_is_flagged_after_the_grace_period() -> None:
    """As in --json and on the board: a reservation whose holder ran nothing for the grace
    period is flagged in the one-shot table too."""
    from datetime import timedelta

    from gputop.reservations.flags import IdleTracker

    made = NOW - timedelta(hours=1)
    idle = GpuInfo(index=0, uuid="GPU-0", name="L40S", utilization_percent=0,
                   memory_used_mib=0, memory_total_mib=46068)
    snap = FleetSnapshot(hosts=(HostSnapshot("h", time=NOW, gpus=(idle,), last_ok=NOW),),
                         time=NOW)
    state = StoreState(reservations=(new_reservation(
        Target("h", 0), Terms(7200, user="bob", machine="m"), made),))
    tracker = IdleTracker(1800, grace_s=900)
    tracker.observe(snap.hosts[0])
    line = render(snap, state, tracker=tracker, now=NOW).splitlines()[1]
    assert "idle-reservation" in line, line
