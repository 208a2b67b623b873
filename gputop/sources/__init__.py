"""Where host snapshots come from: SSH + nvidia-smi, local NVML, or the built-in demo."""

from __future__ import annotations

from typing import Literal, Protocol

from gputop.errors import EXIT_HUB, GputopError
from gputop.model import GpuInfo, HostError

#: Why a hub could not be read (see gputop.hubclient.client).
HubErrorKind = Literal["unreachable", "timeout", "auth", "parse", "error"]


class Source(Protocol):
    """One host, as the poller drives it: every source implements all of this (a plain
    source answers with the defaults: no warnings, no stream, nothing to reset), so the
    poller reads each member directly. ``query`` never raises for the host's own
    failures: it returns them.
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

    @property
    def warnings(self) -> tuple[str, ...]:
        """What the last query found odd in data it still returned (onto the snapshot)."""
        ...

    @property
    def first_sample_s(self) -> float | None:
        """Seconds its stream took to the first sample (onto the snapshot); None: none."""
        ...

    @property
    def paced(self) -> bool:
        """The last query waited for the host's own next sample: ask again, no sleep."""
        ...

    def reset(self) -> None:
        """Forget any backoff: the next query tries at once (the board's ``c``)."""
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
