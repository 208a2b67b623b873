"""The stream parsers: where a sample ends, and what nothing remote may do to that."""

from __future__ import annotations

import pytest

from gputop.sources.nvidia_smi import APPS_QUERY, GPU_QUERY
from gputop.sources.protocol import LineReader, OutputTooLarge
from gputop.sources.stream_parse import AppsBatches, GpuSampler, parse_timestamp
from gputop.sources.stream_session import session_command
from gputop.ssh.transport import ParseError
from tests.support.fleet import CAPTURES, DATA, ROW_QUERY, project_capture

TS = "2026/07/14 08:12:53.500"  # as the real h100 captures print it
LOST = (DATA / "errors/device-handle-gpu-is-lost.txt").read_text().strip()


def row(index: int, count: int, ts: str = TS) -> str:
    cells = project_capture(CAPTURES["l40s"], ROW_QUERY).strip().split(", ")
    cells[0], cells[1], cells[2] = str(count), str(index), f"GPU-{index}"
    return ", ".join([ts, *cells])


def feed_all(sampler: GpuSampler, lines: list[str]) -> list[list[int | None]]:
    out = []
    for ln in lines:
        gpus = sampler.feed(ln)
        if gpus is not None:
            out.append([g.index for g in gpus])
    return out


def test_a_sample_ends_at_its_count_not_at_the_next_sample() -> None:
    s = GpuSampler()
    assert s.feed(row(0, 3)) is None and s.feed(row(1, 3)) is None
    gpus = s.feed(row(2, 3))
    assert gpus is not None and [g.index for g in gpus] == [0, 1, 2]
    assert feed_all(s, [row(0, 3), row(1, 3), row(2, 3)] * 2) == [[0, 1, 2]] * 2


@pytest.mark.parametrize("where", ["first", "middle", "last", "inside a row"])
def test_a_lost_gpu_line_anywhere_counts_as_one_of_the_rows(where: str) -> None:
    a, b = row(0, 3), row(2, 3)
    if where == "first":
        lines = [LOST, a, b]
    elif where == "middle":
        lines = [a, LOST, b]
    elif where == "last":
        lines = [a, b, LOST]
    else:  # stdout block-buffered, stderr not: the lost line lands inside a row
        cut = len(b) // 2
        lines = [a, b[:cut] + LOST, b[cut:]]
    s = GpuSampler()
    got = [g for ln in lines if (g := s.feed(ln)) is not None]
    assert len(got) == 1
    assert [(g.index, g.lost) for g in got[0]] == [(0, False), (2, False), (None, True)]
    assert s.text == ""


def test_only_lost_gpus_left_at_the_end_of_the_stream_are_a_sample() -> None:
    s = GpuSampler()
    assert s.feed(LOST) is None
    rest = s.flush()
    assert rest is not None and rest[0].lost


@pytest.mark.parametrize("lines", [
    [LOST, LOST, row(0, 1)],  # more rows (lost GPUs) than the count
    [row(0, 2), row(1, 3)],  # the count changes within a sample
    [row(0, 0)],  # no GPUs
    [row(0, 99999)],  # absurd
    [row(0, 2) + ", extra"],  # an extra field
    ["| NVIDIA-SMI 550.127.05 |", "+-----+"],  # the table, not the query
])
def test_malformed_streams_are_parse_errors(lines: list[str]) -> None:
    s = GpuSampler()
    with pytest.raises(ParseError):
        for ln in lines:
            s.feed(ln)


def test_no_field_a_remote_user_controls_is_streamed() -> None:
    """A user's process name could hold a newline and start a row: it is never asked for."""
    script = session_command(2.0)
    assert "process_name" not in APPS_QUERY and "process_name" not in script
    assert GPU_QUERY.startswith("timestamp,count,") and APPS_QUERY.startswith("timestamp,")
    assert script.count("-lms 2000 ") == 2
    assert session_command(0.01).count("-lms 100 ") == 2  # never a busier loop than 100 ms


def test_the_output_limit_is_per_sample() -> None:
    reader = LineReader(1000)
    for _ in range(50):  # 50 samples of 600 bytes: far over 1000 in all, fine per sample
        reader.feed(b"x" * 599 + b"\n")
        reader.restart()
    with pytest.raises(OutputTooLarge):  # one endless line is cut off as it arrives
        for _ in range(3):
            reader.feed(b"y" * 400)


def test_apps_rows_group_by_timestamp_and_match_the_gpu_sample_by_host_clock() -> None:
    b = AppsBatches(interval=2.0)
    t0 = parse_timestamp(TS)
    assert b.for_sample(t0) == [] and not b.seen
    b.feed(f"{TS}, GPU-0, 11327, 2566")
    b.feed("2026/07/14 08:12:53.512, GPU-1, 11328, 1542")
    assert b.seen and [r.pid for r in b.for_sample(t0)] == [11327, 11328]
    # The next iteration, taken 40 ms after the next GPU sample: it belongs to that one
    # (it came in the same packet), the sample before keeps its own batch.
    b.feed("2026/07/14 08:12:55.540, GPU-0, 11327, 2600")
    assert [(r.pid, r.used_memory_mib) for r in b.for_sample(t0)] == [
        (11327, 2566), (11328, 1542)]
    # The newest batch may still be arriving: 11328, in the batch before, is kept for now.
    assert [(r.pid, r.used_memory_mib) for r in b.for_sample(t0 + 2)] == [
        (11327, 2600), (11328, 1542)]
    # The loop printed nothing since: a sample an interval later reads that batch as whole,
    # and no processes once 1.5 intervals have passed.
    assert [r.pid for r in b.for_sample(t0 + 4)] == [11327]
    assert b.for_sample(t0 + 5.6) == []
    b.feed(LOST)  # a lost GPU's line is no row
    with pytest.raises(ParseError):
        b.feed("GPU-0, 11327, 2566")  # no timestamp
    with pytest.raises(ParseError):
        b.feed(f"{TS}, GPU-0, python, 2566")


def test_a_batch_cut_by_the_relay_never_drops_a_process_for_a_sample() -> None:
    """The relay writes at the end of a GPU sample; the apps loop's rows of that moment may
    straddle it (CI: one of eight jobs shown for a sample). Cut first, in the middle, last:
    every process of the batch before stays until a later batch shows this one whole."""
    b = AppsBatches(interval=1.0)
    t0 = parse_timestamp(TS)
    pids = [101, 102, 103, 104]
    for p in pids:
        b.feed(f"2026/07/14 08:12:53.500, GPU-0, {p}, 10")
    for cut in range(len(pids) + 1):  # the newest batch so far: its first `cut` rows
        c = AppsBatches(interval=1.0)
        for p in pids:
            c.feed(f"2026/07/14 08:12:53.500, GPU-0, {p}, 10")
        for p in pids[:cut]:
            c.feed(f"2026/07/14 08:12:54.520, GPU-0, {p}, 20")
        got = {r.pid: r.used_memory_mib for r in c.for_sample(t0 + 1)}
        assert sorted(got) == pids, cut
        assert all(got[p] == 20 for p in pids[:cut]), cut  # the newer rows where they came
    # 104 ended: the batch at t0+1 is known whole once t0+2's began; it is gone from both.
    for p in pids[:3]:
        b.feed(f"2026/07/14 08:12:54.520, GPU-0, {p}, 20")
    b.feed("2026/07/14 08:12:55.510, GPU-0, 101, 30")
    assert [r.pid for r in b.for_sample(t0 + 1)] == [101, 102, 103]
    assert [r.pid for r in b.for_sample(t0 + 2)] == [101, 102, 103]


def test_a_pid_seen_again_in_a_batch_replaces_its_row() -> None:
    """Two loop iterations printed within half an interval (a slow one, then a quick one)
    or a flood of one row: the process is one row, the newest, never one per line."""
    b = AppsBatches(interval=2.0)
    t0 = parse_timestamp(TS)
    for i in range(400):
        b.feed(f"2026/07/14 08:12:53.{500 + i % 400:03d}, GPU-0, 11327, {2000 + i}")
    b.feed("2026/07/14 08:12:53.900, GPU-1, 11327, 10")  # the same pid on another GPU
    assert [(r.gpu_uuid, r.pid, r.used_memory_mib) for r in b.for_sample(t0)] == [
        ("GPU-0", 11327, 2399), ("GPU-1", 11327, 10)]


def test_timestamps_are_checked() -> None:
    assert parse_timestamp(TS) - parse_timestamp("2026/07/14 08:12:52.500") == pytest.approx(1)
    for bad in ("2026-07-14 08:12:53", "now", "2026/13/14 08:12:53.500"):
        with pytest.raises(ParseError):
            parse_timestamp(bad)


def test_owner_cache_is_keyed_by_pid_and_start_time() -> None:
    """ps is asked once per process (pid and start time): a process missing from a sample
    or two (a late apps batch on a loaded host) keeps its owner; one gone for longer than
    OWNER_MEMORY intervals, or a pid reused by another process (another start time, even
    in the very next sample), is asked again; without a start time only a pid present in
    every sample keeps its owner. The ps round trip is a stand-in here (the rule is the
    cache's; tests/test_stream_fleet.py runs the real ps over real SSH)."""
    import asyncio

    from gputop.config.tables import HostConfig
    from gputop.sources.nvidia_smi import AppRow, Owner
    from gputop.sources.ssh import SshSource
    from gputop.sources.stream_collector import OWNER_MEMORY
    from gputop.ssh.transport import JumpPool

    async def scenario(steps: list[tuple[float, str | None]]) -> list[list[int]]:
        src = SshSource(HostConfig(name="h"), timeout=3.0, interval=1.0, ssh_config=None,
                        handshakes=asyncio.Semaphore(1), jumps=JumpPool(None))
        asked: list[list[int]] = []

        async def ask_ps(_st: object, pids: list[int]) -> tuple[dict[int, Owner], dict[int, str]]:
            asked.append(pids)
            return {p: Owner(p, "gtalice", 5) for p in pids}, {p: "train.py" for p in pids}

        src.streams._ask_ps = ask_ps  # type: ignore[method-assign]
        for now, start in steps:
            apps = [] if start == "gone" else [AppRow("GPU-1", 42, 100, start)]
            owners, _ = await src.streams._owners_of(None, apps, now)  # type: ignore[arg-type]
            assert (42 in owners) == bool(apps)
        return asked

    late = [(0.0, "100"), (1.0, "gone"), (2.0, "gone"), (3.0, "100")]
    assert asyncio.run(scenario(late)) == [[42]]  # late batches: asked once
    gone = [*late, (4.0, "gone"), (4.0 + OWNER_MEMORY + 0.5, "101")]
    assert asyncio.run(scenario(gone)) == [[42], [42]]
    back = [*late, (4.0, "gone"), (4.0 + OWNER_MEMORY + 0.5, "100")]  # the same process
    assert asyncio.run(scenario(back)) == [[42]]
    reused = [(0.0, "100"), (1.0, "100"), (2.0, "777"), (3.0, "777")]  # same pid, new process
    assert asyncio.run(scenario(reused)) == [[42], [42]]
    unknown = [(0.0, None), (1.0, None), (2.0, "gone"), (3.0, None)]
    assert asyncio.run(scenario(unknown)) == [[42], [42]]


def test_session_apps_rows_carry_the_start_time() -> None:
    from gputop.sources.stream_parse import parse_session_apps_row

    row = parse_session_apps_row("2026/11/30 10:00:00.000, GPU-1, 42, 100, 1553884")
    assert (row.pid, row.used_memory_mib, row.start) == (42, 100, "1553884")
    assert parse_session_apps_row("2026/11/30 10:00:00.000, GPU-1, 42, 100, -").start is None
    assert parse_session_apps_row("2026/11/30 10:00:00.000, GPU-1, 42, 100").start is None
    with pytest.raises(ParseError):
        parse_session_apps_row("2026/11/30 10:00:00.000, GPU-1, 42, 100, x1")
