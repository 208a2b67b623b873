"""Read a remote host's GPUs over one persistent SSH connection (asyncssh).

Per host: one connection, kept open (:mod:`gputop.ssh.transport`), and one of two
collection modes on it. Streaming (the default, :mod:`gputop.sources.stream_collector`): one exec
channel whose session runs both ``nvidia-smi -lms`` loops and answers ``ps`` for new pids
on its stdin; a refresh reads the next sample and starts nothing on the host. Per-refresh
query (``collection = "query"``, one-shot ``--json``, or a host that cannot stream, for
good; :mod:`gputop.sources.query`): one framed query per refresh on a kept channel.

:class:`SshSource` picks the mode, falls back from streaming to queries, turns failures
into the host's classified error and backoff, and adds the MIG inventory (read rarely, on
a short-lived channel of its own).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Literal

import asyncssh

from gputop.config.tables import HostConfig
from gputop.model import GpuInfo, HostError
from gputop.sources import mig
from gputop.sources.nvidia_smi import RemoteResult, parse_sections
from gputop.sources.protocol import MARK, FramingError, LineReader, new_nonce, start_pid
from gputop.sources.query import QueryCollector
from gputop.sources.stream_collector import CannotStream, StreamCollector
from gputop.sources.stream_session import kill_group
from gputop.ssh.transport import ChannelClosed, HostLink, JumpPool, classify_exception
from gputop.text import excerpt

#: The MIG inventory (``nvidia-smi -L`` and ``-q -x``, see :mod:`gputop.sources.mig`) is
#: read again after this long, and sooner (at most every MIG_RETRY_S) when a refresh shows
#: what it does not know: a new MIG GPU, a new or gone process on one, an unknown MIG uuid.
MIG_REFRESH_S = 300.0
MIG_RETRY_S = 15.0
#: Largest inventory accepted: ``-q -x`` is about 30-120 KiB per GPU.
MIG_MAX_OUTPUT = 8 * 1024 * 1024
#: Run on its own channel, rarely: a nonce line in (never in the command line), the script's
#: pid (to kill its process group on a timeout), then the two outputs, each closed by a
#: marker with that nonce and its exit code. Nothing from the config is interpolated.
MIG_SCRIPT = (
    "IFS= read -r n || exit 0; case $n in *[!0-9a-f]*|'') exit 0 ;; esac; "
    f'printf "{MARK} %s start %s\\n" "$n" "$$"; '
    "nvidia-smi -L </dev/null 2>/dev/null; "
    f'printf "\\n{MARK} %s list %s\\n" "$n" "$?"; '
    "nvidia-smi -q -x </dev/null 2>/dev/null; "
    f'printf "\\n{MARK} %s xml %s\\n" "$n" "$?"'
)


def _query_keepalive(interval: float) -> float:
    return max(30.0, interval * 5)


class SshSource:
    """One remote host: a persistent connection and one collection mode on it, one refresh
    in flight at most."""

    kind: Literal["ssh"] = "ssh"

    def __init__(
        self,
        host: HostConfig,
        *,
        timeout: float,
        interval: float,
        ssh_config: Sequence[Path] | None,
        handshakes: asyncio.Semaphore,
        jumps: JumpPool,
        first_sample_timeout: float = 60.0,
        collection: str = "stream",
    ) -> None:
        self.host = host
        self.name = host.name
        self.timeout = timeout
        self.interval = interval
        #: Streaming (one session per host: two nvidia-smi loops and ps) or one framed
        #: query per refresh; a host that cannot stream falls back to the query for good.
        self.streaming = collection == "stream"
        #: Why this host fell back to a query per refresh (shown among its warnings).
        self._fallback_note: str | None = None
        # Keepalives only for the query per refresh: a stream's samples flow every interval
        # and a silent one is a stall, killed and restarted at its limit. (asyncssh moves
        # its keepalive timer on every packet received: a timer armed and cancelled per
        # host per refresh, for nothing.)
        self.link = HostLink(host, timeout=timeout, interval=interval, ssh_config=ssh_config,
                             handshakes=handshakes, jumps=jumps,
                             keepalive_s=0.0 if self.streaming else _query_keepalive(interval))
        self.queries = QueryCollector(self.link, timeout=timeout)
        self.streams = StreamCollector(self.link, timeout=timeout, interval=interval,
                                       first_sample_timeout=first_sample_timeout)
        #: What the last refresh found odd in data it still shows (e.g. a GPU index twice).
        self.warnings: tuple[str, ...] = ()
        self._mig: mig.Inventory | None = None
        self._mig_at = -1e18  # monotonic time of the last inventory read
        self._mig_pids: frozenset[tuple[str | None, int]] = frozenset()
        #: MIG inventories read (each on a short-lived channel of its own), for tests.
        self.mig_reads = 0

    # -- what the poller, tests and the benchmark read -------------------------------------

    @property
    def connects(self) -> int:
        """SSH connections opened."""
        return self.link.connects

    @property
    def channels(self) -> int:
        """Exec channels opened for collecting (the MIG reads are counted apart)."""
        return self.queries.channels + self.streams.channels

    @property
    def stream_starts(self) -> int:
        """Streaming sessions started (one channel each)."""
        return self.streams.starts

    @property
    def paced(self) -> bool:
        """The last answer was a new stream sample: the poller asks again at once."""
        return self.streams.paced

    @property
    def first_sample_s(self) -> float | None:
        """Probe cost: seconds the last stream took to its first sample."""
        return self.streams.first_sample_s

    def reset(self) -> None:
        """Forget the backoff: the next query tries (connects) at once."""
        self.link.reset()

    # -- one refresh -----------------------------------------------------------------------

    async def query(self) -> tuple[list[GpuInfo], HostError | None]:
        """This host's GPUs, or its classified error. Never raises (but CancelledError)."""
        self.streams.paced = False
        waiting = self.link.waiting()
        if waiting is not None:
            return [], waiting
        try:
            if self.streaming:
                try:
                    result = await self.streams.query()
                except CannotStream as exc:
                    result = await self._fall_back(str(exc))
            else:
                result = await self.queries.query(self._mig.parents if self._mig else None)
        except Exception as exc:  # every failure is this host's alone
            err = self.link.classify(exc)
            if err.kind != "timeout" or not self.link.connected():
                self._drop()
            self.link.backoff(err)
            self.warnings = ()
            return [], err
        self.link.succeeded()
        gpus, mig_warnings = await self._with_mig(result)
        note = (self._fallback_note,) if self._fallback_note else ()
        self.warnings = result.warnings + mig_warnings + note
        return gpus, result.error

    async def _fall_back(self, why: str) -> RemoteResult:
        """Collect with a query per refresh from now on (a host that cannot stream)."""
        self.streaming = False
        self._fallback_note = f"{why}: collecting with a query per refresh"
        # Connected to stream, without keepalive: from now on as a query's.
        self.link.keep_alive(_query_keepalive(self.interval))
        self.streams.stop()
        self.queries.close_channel()
        self.warnings = ()
        return await asyncio.wait_for(
            self.queries.ask(self._mig.parents if self._mig else None, reopen=False),
            self.timeout)

    def _drop(self) -> None:
        self.queries.close_channel()
        self.streams.stop()
        self.link.drop()

    async def close(self) -> None:
        """End the remote loops and the connection: what is in flight on the host is
        killed first (see the collectors' ``close``), nothing is left running there."""
        await self.queries.close()
        await self.streams.close()
        await self.link.close()

    # -- MIG inventory (rare: its own channel, on the kept connection) ------------------------

    async def _with_mig(self, result: RemoteResult) -> tuple[list[GpuInfo], tuple[str, ...]]:
        """The refresh's GPUs with their MIG instances, reading the inventory again when it
        is old or the refresh shows what it does not know. Never raises: an inventory that
        cannot be read is a warning, and the GPUs are shown without instances."""
        gpus = result.gpus
        migs = [g for g in gpus if mig.is_mig(g)]
        if not migs:
            self._mig = None
            return gpus, ()
        pids = frozenset((g.uuid, p.pid) for g in migs for p in g.processes)
        now = time.monotonic()
        due = (now - self._mig_at >= MIG_REFRESH_S
               or (now - self._mig_at >= MIG_RETRY_S
                   and (pids != self._mig_pids
                        or mig.unknown(gpus, self._mig, result.unknown_mig))))
        warnings: list[str] = []
        if due and self.link.conn is not None:
            self._mig_at = now
            try:
                inventory = await asyncio.wait_for(self._read_mig(self.link.conn), self.timeout)
            except Exception as exc:  # the GPUs are still shown, without instances
                warnings.append(f"MIG inventory not read: {classify_exception(exc).message}")
            else:
                self._mig, self._mig_pids = inventory, pids
                sections = self.queries.sections
                if result.unknown_mig and sections is not None:
                    # Processes reported under MIG uuids just learnt: place them now.
                    again = parse_sections(sections, inventory.parents)
                    gpus = again.gpus if again.error is None else gpus
        if self._mig is None:
            return gpus, tuple(warnings)
        return mig.attach(gpus, self._mig), tuple(warnings) + self._mig.warnings

    async def _read_mig(self, conn: asyncssh.SSHClientConnection) -> mig.Inventory:
        """Run :data:`MIG_SCRIPT` once; its output is bounded while it is read."""
        proc = await conn.create_process(MIG_SCRIPT, stderr=asyncssh.DEVNULL, encoding=None)
        self.mig_reads += 1  # its own count: ``channels`` counts the refresh channel
        nonce = new_nonce()
        reader = LineReader(MIG_MAX_OUTPUT)
        pid: int | None = None
        parts: dict[str, tuple[str, int]] = {}
        buf: list[str] = []
        prefix = f"{MARK} {nonce} "
        try:
            proc.stdin.write(f"{nonce}\n".encode())
            while len(parts) < 2:
                data = await proc.stdout.read(65536)
                if not data:
                    raise ChannelClosed("the MIG inventory script ended early")
                for line in reader.feed(data):
                    if pid is None:
                        pid = start_pid(line, nonce)
                        continue
                    if not line.startswith(prefix):
                        buf.append(line)
                        continue
                    name, _, rc = line[len(prefix):].partition(" ")
                    expected = ("list", "xml")[len(parts)] if len(parts) < 2 else None
                    if name != expected or not rc.isdigit():
                        raise FramingError(f"unexpected marker in the MIG inventory: "
                                           f"{excerpt(line)}")
                    parts[name] = ("\n".join(buf), int(rc))
                    buf = []
        except BaseException:
            if pid and pid > 1:
                await asyncio.shield(kill_group(conn, pid))
            raise
        finally:
            proc.close()
        listed, xml = parts["list"], parts["xml"]
        return mig.build_inventory(listed[0] if listed[1] == 0 else None,
                                   xml[0] if xml[1] == 0 else None)

