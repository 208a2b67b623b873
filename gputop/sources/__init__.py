"""Where host snapshots come from: SSH + nvidia-smi, local NVML, or the built-in demo."""

from __future__ import annotations

from typing import Literal, Protocol

from gputop.errors import EXIT_HUB, GputopError
from gputop.model import GpuInfo, HostError

#: Why a hub could not be read (see gputop.sources.hub).
HubErrorKind = Literal["unreachable", "timeout", "auth", "parse", "error"]


class Source(Protocol):
    """One host. ``query`` never raises for the host's own failures: it returns them.

    A source may also have ``warnings: tuple[str, ...]``, what its last query found odd in
    data it still returned, and ``first_sample_s`` (its stream's time to first sample); the
    poller copies both onto the host snapshot. One whose ``paced`` is true after a query
    waited for its host's own next sample, so the poller asks again without sleeping.
    """

    name: str
    @property
    def kind(self) -> Literal["ssh", "nvml", "demo"]:
        """Where the data comes from, as the snapshot reports it."""
        ...
    @property
    def connects(self) -> int:
        """Connections this source opened so far (SSH); lets tests and the bench prove reuse."""
        ...

    async def query(self) -> tuple[list[GpuInfo], HostError | None]: ...

    async def close(self) -> None: ...


class HubError(GputopError):
    """The hub could not be read: ``kind`` (also its ``reason``) classifies why. Exit 4."""

    exit_code = EXIT_HUB

    def __init__(self, url: str, kind: HubErrorKind, message: str) -> None:
        super().__init__(f"hub {url}: {kind}: {message}", reason=kind)
        self.url, self.kind, self.message = url, kind, message

    def host_error(self) -> HostError:
        return HostError(self.kind, f"hub {self.url}: {self.message}")
