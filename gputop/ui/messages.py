"""Messages from the data feed to the board."""

from __future__ import annotations

from textual.message import Message

from gputop.model import HostSnapshot


class HostUpdated(Message):
    """A host answered. A newer one for the same host replaces one still queued, so a
    busy board never works through outdated snapshots."""

    def __init__(self, snapshot: HostSnapshot) -> None:
        super().__init__()
        self.snapshot = snapshot

    def can_replace(self, message: Message) -> bool:
        return isinstance(message, HostUpdated) and message.snapshot.name == self.snapshot.name
