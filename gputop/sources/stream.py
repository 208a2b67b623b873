"""Streaming collection: two long-running ``nvidia-smi -lms`` loops per host.

A refresh then starts no process on the host: nvidia-smi initialises NVML once per stream
(seconds per GPU without persistence mode) instead of twice per refresh, and ``ps`` runs
only for pids not seen before (:class:`~gputop.sources.ssh.SshSource`).

Framing: the queried fields are numbers, uuids and driver-given names; nothing a remote
user chooses (no ``process_name``) is in either stream. ``timestamp`` starts every row and
``count`` says how many rows (GPUs) one GPU sample has, so a sample is complete when its
last row arrives. The apps stream prints nothing while no process runs: its rows are
grouped by timestamp, and the host's liveness is judged from the GPU stream only.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone

import asyncssh

from gputop.model import GpuInfo, HostError
from gputop.sources.nvidia_smi import (
    _LOST,
    APPS_QUERY,
    GPU_FIELDS,
    GPU_QUERY,
    AppRow,
    _split_lost,
    classify_failure,
    parse_apps_row,
    parse_gpu_rows,
)
from gputop.sources.protocol import LineReader, ParseError, new_nonce, start_pid, stream_script
from gputop.text import excerpt

#: An apps batch whose last row is younger than this may still be arriving.
SETTLE_S = 0.2

#: Most GPUs one host may report (a sample claiming more is not nvidia-smi talking).
MAX_GPUS = 1024


def stream_scripts(interval: float) -> tuple[str, str]:
    """The GPU and apps stream commands for ``interval`` seconds (``-lms``, >= 100 ms)."""
    ms = max(100, round(interval * 1000))
    fmt = "--format=csv,noheader,nounits"
    return (stream_script(f"nvidia-smi --query-gpu={GPU_QUERY} {fmt} -lms {ms}"),
            stream_script(f"nvidia-smi --query-compute-apps={APPS_QUERY} {fmt} -lms {ms}"))


class GpuSampler:
    """Lines of a ``--query-gpu=timestamp,count,...`` stream to complete samples.

    A lost GPU's line (on stderr, anywhere, even inside a row) counts as one of the
    sample's ``count`` rows. More rows than ``count``, a bad count or a malformed row is a
    ParseError: the stream is then not trusted any further.
    """

    def __init__(self) -> None:
        self._lines: list[str] = []

    @property
    def text(self) -> str:
        return "\n".join(self._lines)

    def feed(self, line: str) -> list[GpuInfo] | None:
        self._lines.append(line)
        data, lost = _split_lost(self.text)
        if not data:
            return None
        cells = data[0].split(", ")
        if len(cells) > len(GPU_FIELDS) or (len(data) > 1 and len(cells) != len(GPU_FIELDS)):
            raise ParseError(f"expected {len(GPU_FIELDS)} comma-separated fields, got "
                             f"{len(cells)}: {excerpt(data[0])}")
        if len(cells) < len(GPU_FIELDS):
            return None  # half a row (the rest after a lost GPU's line)
        count = cells[1].strip()
        if not count.isdigit() or not 1 <= int(count) <= MAX_GPUS:
            raise ParseError(f"bad GPU count in the stream: {excerpt(data[0])}")
        have = len(data) + len(lost)
        if have > int(count):
            raise ParseError(f"more rows than the {count} GPUs the sample announced")
        if have < int(count) or len(data[-1].split(", ")) < len(GPU_FIELDS):
            return None
        for row in data:
            if row.split(", ")[1].strip() != count:
                raise ParseError(f"GPU count changed within a sample: {excerpt(row)}")
        gpus = parse_gpu_rows(self.text)
        self._lines = []
        return gpus

    def flush(self) -> list[GpuInfo] | None:
        """At the end of the stream: what is left, if it is (only) lost GPUs' lines."""
        data, lost = _split_lost(self.text)
        if not lost or data:
            return None
        self._lines = []
        return parse_gpu_rows("\n".join(f"Unable to determine the device handle for GPU "
                                        f"{bus}: {why}" for bus, why in lost))


_TIMESTAMP = re.compile(r"\d{4}/\d{2}/\d{2} \d{2}:\d{2}:\d{2}(?:\.\d{1,6})?")


def parse_timestamp(value: str) -> float:
    """nvidia-smi's ``timestamp`` (``2026/07/14 08:12:53.500``) as seconds (host clock)."""
    v = value.strip()
    if not _TIMESTAMP.fullmatch(v):
        raise ParseError(f"bad timestamp in the stream: {excerpt(v)}")
    fmt = "%Y/%m/%d %H:%M:%S.%f" if "." in v else "%Y/%m/%d %H:%M:%S"
    try:
        return datetime.strptime(v, fmt).replace(tzinfo=timezone.utc).timestamp()
    except ValueError as exc:
        raise ParseError(f"bad timestamp in the stream: {excerpt(v)}") from exc


@dataclass
class AppsBatches:
    """Rows of a ``--query-compute-apps=timestamp,...`` stream, grouped into samples.

    Rows whose timestamps lie within half an interval of the batch's first belong to one
    loop iteration. The stream prints nothing while no process runs, so a batch older than
    1.5 intervals means "no processes now".
    """

    interval: float
    rows: list[AppRow] = field(default_factory=list)
    #: The batch before, while the newest may still be arriving (rows come one write each).
    previous: list[AppRow] = field(default_factory=list)
    stamp: float = 0.0
    at: float = 0.0
    seen: bool = False
    _carry: str = ""

    def feed(self, line: str, now: float) -> None:
        m = _LOST.search(line)
        if m:  # a lost GPU's line (stderr), maybe inside a row: keep the row's first half
            self._carry += line[: m.start()]
            return
        line, self._carry = self._carry + line, ""
        if not line.strip():
            return
        row = parse_apps_row(line)
        stamp = parse_timestamp(line.split(", ", 1)[0])
        if not self.rows or abs(stamp - self.stamp) > self.interval / 2:
            self.previous, self.rows, self.stamp = self.rows, [], stamp
        self.rows.append(row)
        self.at, self.seen = now, True

    def current(self, now: float) -> list[AppRow]:
        if not self.rows or now - self.at > 1.5 * self.interval + 0.25:
            return []
        if now - self.at < SETTLE_S:  # may be half-read: keep the last batch's others
            have = {r.pid for r in self.rows}
            return self.rows + [r for r in self.previous if r.pid not in have]
        return list(self.rows)


class _Stream:
    """One channel running one nvidia-smi loop, read by a task of its own."""

    def __init__(self, proc: asyncssh.SSHClientProcess[bytes], pid: int) -> None:
        self.proc = proc
        self.pid = pid
        self.task: asyncio.Task[None] | None = None


class HostStreams:
    """The GPU and apps streams of one host, on its SSH connection.

    ``seq`` counts complete GPU samples; ``event`` is set whenever anything changes (a
    sample, an error, the end of a stream), so a refresh waits without polling.
    """

    def __init__(self, conn: asyncssh.SSHClientConnection, interval: float,
                 max_output: int) -> None:
        self.conn = conn
        self.interval = interval
        self.max_output = max_output
        self.started_at = time.monotonic()
        self.first_at: float | None = None
        self.last_at = 0.0
        self.seq = 0
        self.gpus: list[GpuInfo] = []
        self.apps = AppsBatches(interval)
        self.error: HostError | None = None
        #: The stream ended (its rc): a dead stream is restarted, one that cannot stream
        #: (ended with a plain failure before any sample) makes the host fall back.
        self.ended: int | None = None
        self.event = asyncio.Event()
        self._streams: list[_Stream] = []
        #: Channels opened (for tests and the benchmark).
        self.channels = 0

    async def start(self) -> None:
        gpu_script, apps_script = stream_scripts(self.interval)
        # Time to first sample counts from here: the session's start-up is part of it.
        self.started_at = time.monotonic()
        gpu, apps = await asyncio.gather(self._open(gpu_script), self._open(apps_script))
        gpu.task = asyncio.create_task(self._read_gpu(gpu))
        apps.task = asyncio.create_task(self._read_apps(apps))

    async def _open(self, script: str) -> _Stream:
        proc = await self.conn.create_process(script, stderr=asyncssh.DEVNULL, encoding=None)
        self.channels += 1
        nonce = new_nonce()
        proc.stdin.write(f"{nonce}\n".encode())
        reader = LineReader(64 * 1024)  # a shell startup file's banner may come first
        while True:
            data = await proc.stdout.read(65536)
            if not data:
                proc.close()
                raise ParseError("the remote shell did not run the gputop stream")
            for line in reader.feed(data):
                pid = start_pid(line, nonce)
                if pid is not None:
                    stream = _Stream(proc, pid)
                    self._streams.append(stream)
                    return stream

    def _fail(self, err: HostError) -> None:
        if self.error is None:
            self.error = err
        self.event.set()

    async def _rest(self, stream: _Stream, text: str,
                    limit: int = 64 * 1024) -> tuple[str, int | None]:
        """After output that is not a sample: the rest of it (briefly, bounded) and the rc,
        so that a failure nvidia-smi explains is classified as such."""
        parts = [text]

        async def read() -> None:
            size = len(text)
            while size < limit:
                data = await stream.proc.stdout.read(65536)
                if not data:
                    await stream.proc.wait_closed()
                    return
                parts.append(data.decode("utf-8", "replace"))
                size += len(data)

        with contextlib.suppress(asyncio.TimeoutError, asyncssh.Error, OSError):
            await asyncio.wait_for(read(), 0.5)
        return "".join(parts)[:limit], stream.proc.exit_status

    async def _ended(self, stream: _Stream) -> int | None:
        with contextlib.suppress(asyncio.TimeoutError, asyncssh.Error, OSError):
            await asyncio.wait_for(stream.proc.wait_closed(), 2.0)
        return stream.proc.exit_status

    async def _read_gpu(self, stream: _Stream) -> None:
        sampler = GpuSampler()
        reader = LineReader(self.max_output)
        try:
            while True:
                data = await stream.proc.stdout.read(65536)
                if not data:
                    break
                for line in reader.feed(data):
                    gpus = sampler.feed(line)
                    if gpus is not None:
                        reader.restart()  # the limit is per sample
                        self._publish(gpus)
        except ParseError as exc:
            text, rc = await self._rest(stream, sampler.text + "\n")
            self._fail(classify_failure(text, rc) or HostError("parse", str(exc)))
            return
        except (asyncssh.Error, OSError) as exc:
            self._fail(HostError("ssh", f"nvidia-smi's stream broke: {excerpt(str(exc))}"))
            return
        rc = await self._ended(stream)
        text = sampler.text
        # After complete samples, an exit with nothing more to say (a lost GPU ends the
        # loop with 15 after the sample that shows it) is just the end: restart it.
        said = bool(text.strip()) or self.first_at is None
        failure = classify_failure(text, rc) if said else None
        if failure is not None:
            self._fail(failure)
            return
        try:
            rest = sampler.flush()
        except ParseError as exc:
            self._fail(HostError("parse", str(exc)))
            return
        if rest is not None:
            self._publish(rest)
        elif text.strip():
            self._fail(HostError("parse", f"nvidia-smi's stream ended mid-sample: "
                                          f"{excerpt(text)}"))
            return
        self.ended = -1 if rc is None else rc
        self.event.set()

    async def _read_apps(self, stream: _Stream) -> None:
        reader = LineReader(self.max_output)
        last = ""
        try:
            while True:
                data = await stream.proc.stdout.read(65536)
                if not data:
                    break
                lines = reader.feed(data)
                reader.restart()  # bounded per batch of rows as they come
                for line in lines:
                    last = line
                    self.apps.feed(line, time.monotonic())
                if lines:
                    self.event.set()
        except ParseError as exc:
            text, rc = await self._rest(stream, last + "\n")
            self._fail(classify_failure(text, rc) or HostError("parse", str(exc)))
            return
        except (asyncssh.Error, OSError) as exc:
            self._fail(HostError("ssh", f"nvidia-smi's apps stream broke: {excerpt(str(exc))}"))
            return
        rc = await self._ended(stream)
        # A failure (or a lost GPU) ends both loops: the GPU stream says what happened, so
        # give it a moment to say it. Either way the pair is restarted together.
        gpu_task = self._streams[0].task if self._streams else None
        if gpu_task is not None:
            await asyncio.wait({gpu_task}, timeout=1.0)
        if self.ended is None and self.error is None:
            self.ended = -1 if rc is None else rc
        self.event.set()

    def _publish(self, gpus: list[GpuInfo]) -> None:
        now = time.monotonic()
        if self.first_at is None:
            self.first_at = now
        self.last_at = now
        self.gpus = gpus
        self.seq += 1
        self.event.set()

    @property
    def first_sample_s(self) -> float | None:
        return None if self.first_at is None else self.first_at - self.started_at

    def close(self) -> None:
        """Stop reading and close the channels: the remote script kills nvidia-smi when
        its stdin closes (:func:`~gputop.sources.protocol.stream_script`)."""
        for s in self._streams:
            if s.task is not None:
                s.task.cancel()
            s.proc.close()
        self._streams = []

    async def kill(self) -> None:
        """A stalled stream: kill both loops' process groups on the host, then close."""
        pids = [s.pid for s in self._streams if s.pid > 1]
        self.close()
        if not pids:
            return
        groups = " ".join(f"-{int(p)}" for p in pids)
        with contextlib.suppress(Exception):
            await asyncio.wait_for(self.conn.run(f"kill -s KILL -- {groups}", check=False),
                                   timeout=1.5)
