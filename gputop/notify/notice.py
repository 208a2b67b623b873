"""What one notification is, and where it may go: the contract between the part that
decides what to tell (``events``) and the parts that say it (``channels``, ``delivery``).

Every text in a notice is plain text that may hold hostile bytes from hosts or teammates
(process names, notes, GPU names): each channel escapes it for its own format and bounds
its length; nothing here is markup.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Literal, Protocol

#: What happened. ``granted``: your queued GPUs were granted; ``expiring``: your reservation
#: ends in N minutes; ``ended``: it ended (expired, its job ended, released by someone with
#: --force); ``idle``: flag idle-reservation past idle_grace; ``unreserved-use``: someone
#: runs on a reserved GPU (to holder and user); ``over-share``: a share holder uses more
#: than the share; ``host-down`` / ``host-up``: team channel only, after a grace; ``digest``:
#: several notices for one person at once; ``test``: ``gputop notify test``.
NoticeKind = Literal["granted", "expiring", "ended", "idle", "unreserved-use", "over-share",
                     "host-down", "host-up", "digest", "test"]

#: Where a notice may go: a person's own route, or the team channel's format.
RouteKind = Literal["email", "ntfy", "webhook", "slack", "mattermost", "teams", "json"]


@dataclass(frozen=True)
class Notice:
    kind: NoticeKind
    #: The person it is for (their login); None: the team channel.
    user: str | None
    #: One notice per occurrence: a repeat of the same key is suppressed (e.g.
    #: ``expiring:RESERVATION_ID``, ``idle:RESERVATION_ID:SINCE``).
    key: str
    #: One line, plain text (a mail subject, a chat message's first line).
    title: str
    #: Details, plain text, one per line (the command to use the GPUs, who released it).
    lines: tuple[str, ...] = ()
    #: The same facts as data for JSON formats (host, gpu, until, by, ...), plain strings.
    fields: Mapping[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class Route:
    """One place a notice goes: ``target`` is an address, a URL, or an ntfy topic URL."""

    kind: RouteKind
    target: str


class Notifier(Protocol):
    """What the deciding side hands notices to: ``submit`` never blocks and never raises
    (a slow or failing endpoint delays nothing: delivery is bounded and retried apart)."""

    def submit(self, notice: Notice) -> None: ...
