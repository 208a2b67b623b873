"""Query mode: one framed query per refresh on a kept exec channel.

The channel runs a constant POSIX shell loop (:data:`~gputop.sources.nvidia_smi.REMOTE_SCRIPT`);
per refresh one line is sent (a fresh nonce) and one framed block read back
(:mod:`gputop.sources.protocol`). Used with ``collection = "query"``, for one-shot
``--json``, and by a host that cannot stream.
"""

from __future__ import annotations

import asyncio
import contextlib

import asyncssh

from gputop.model import HostError
from gputop.sources.nvidia_smi import REMOTE_SCRIPT, MigParents, RemoteResult, parse_sections
from gputop.sources.protocol import (
    MAX_OUTPUT,
    FramingError,
    LineReader,
    Section,
    end_line,
    new_nonce,
    split_frame,
    start_pid,
)
from gputop.sources.stream_session import kill_group
from gputop.ssh.transport import ChannelClosed, HostLink
from gputop.text import excerpt


class QueryCollector:
    """A host's query loop: its channel, the refresh in flight, the kill of an abandoned one."""

    def __init__(self, link: HostLink, *, timeout: float) -> None:
        self._link = link
        self.timeout = timeout
        self.max_output = MAX_OUTPUT
        self._proc: asyncssh.SSHClientProcess[bytes] | None = None
        self._remote_pid: int | None = None
        #: A refresh is waiting for its answer / the kill of an abandoned one (for close()).
        self._in_flight = False
        self._killing: asyncio.Future[None] | None = None
        #: The last refresh's sections: parsed again if they name MIG uuids not yet known.
        self.sections: dict[str, Section] | None = None
        #: Exec channels opened, for tests and the benchmark.
        self.channels = 0

    async def query(self, mig: MigParents | None) -> RemoteResult:
        """One refresh, connecting first (the channel opened in the handshake slot) where
        the host has no connection; all within the host's ``timeout``."""
        opened = not self._link.connected()
        if opened:
            self.close_channel()
        spent = await self._link.open(self.open_channel) if opened else 0.0
        return await asyncio.wait_for(self.ask(mig, reopen=not opened),
                                      max(0.1, self.timeout - spent))

    async def ask(self, mig: MigParents | None, reopen: bool) -> RemoteResult:
        """One refresh on the kept connection; ``reopen``: once more on a new connection if
        the kept one (or its channel) died since the last refresh."""
        conn = self._link.conn
        assert conn is not None
        try:
            if self._proc is None:
                await self.open_channel(conn)
            return await self._refresh(mig)
        except (asyncssh.Error, BrokenPipeError, ChannelClosed):
            if not reopen:
                raise
            # The kept connection or channel died since the last refresh: reopen once, now.
            self.close_channel()
            self._link.drop()
            conn = await self._link.connect()
            await self.open_channel(conn)
            return await self._refresh(mig)

    async def open_channel(self, conn: asyncssh.SSHClientConnection) -> None:
        """Start the remote loop and read its start line (with a nonce of its own)."""
        # The script sends its own stderr to stdout, in order. What arrives on the channel's
        # stderr comes from the user's shell startup files: not ours.
        proc = await conn.create_process(REMOTE_SCRIPT, stderr=asyncssh.DEVNULL, encoding=None)
        self._proc = proc
        self.channels += 1
        nonce = new_nonce()
        proc.stdin.write(f"{nonce}\n".encode())
        # A shell startup file's banner may come first; 64 KiB of it is more than enough.
        reader = LineReader(64 * 1024)
        while True:
            data = await proc.stdout.read(65536)
            if not data:
                self.close_channel()
                raise ChannelClosed("the remote shell did not run the gputop script")
            for line in reader.feed(data):
                pid = start_pid(line, nonce)
                if pid is not None:
                    self._remote_pid = pid
                    return


    async def _refresh(self, mig: MigParents | None) -> RemoteResult:
        """One refresh: send a fresh nonce, read lines up to exactly its end line."""
        proc, conn = self._proc, self._link.conn
        assert proc is not None and conn is not None
        nonce = new_nonce()
        end = end_line(nonce)
        reader = LineReader(self.max_output)
        lines: list[str] = []
        try:
            self._in_flight = True
            proc.stdin.write(f"{nonce}\n".encode())
            done = False
            while not done:
                data = await proc.stdout.read(65536)
                if not data:
                    self.close_channel()
                    tail = " ".join(lines[-3:]) or reader.tail()
                    raise ChannelClosed(excerpt(tail) or "no output")
                for line in reader.feed(data):
                    if done:
                        raise FramingError("output after the end of the refresh")
                    if line == end:
                        done = True
                    else:
                        lines.append(line)
            if reader.pending:
                raise FramingError("output after the end of the refresh")
        except FramingError as exc:
            # Never read this channel again: whatever is still in flight is not trusted.
            await self._kill_remote(conn)
            return RemoteResult([], HostError("parse", str(exc)))
        except asyncio.CancelledError:
            # Timed out or shutting down: the refresh must not pile up on the remote host.
            # close() waits for this kill, should this task be cancelled again meanwhile.
            self._killing = asyncio.ensure_future(self._kill_remote(conn))
            await asyncio.shield(self._killing)
            raise
        finally:
            self._in_flight = False
        try:
            sections = split_frame(lines, nonce)
        except FramingError as exc:
            self.close_channel()  # the next refresh opens a new channel
            return RemoteResult([], HostError("parse", str(exc)))
        self.sections = sections
        return parse_sections(sections, mig)


    async def _kill_remote(self, conn: asyncssh.SSHClientConnection) -> None:
        """Kill the remote loop's whole process group and forget its channel."""
        pid = self._remote_pid
        self.close_channel()
        await kill_group(conn, pid)

    def close_channel(self) -> None:
        if self._proc is not None:
            self._proc.close()  # stdin EOF: the remote loop ends
        self._proc, self._remote_pid = None, None

    async def close(self) -> None:
        """End the remote loop. A refresh still in flight is killed on the host first
        (closing stdin would only end the loop after it), and a kill already under way is
        waited for: at shutdown nothing is left running there."""
        killing = self._killing
        conn = self._link.conn
        if (killing is None or killing.done()) and self._in_flight and self._link.connected():
            assert conn is not None
            killing = asyncio.ensure_future(self._kill_remote(conn))
        if killing is not None and not killing.done():
            with contextlib.suppress(Exception, asyncio.CancelledError):
                await asyncio.wait_for(asyncio.shield(killing), timeout=2.0)
        self.close_channel()
