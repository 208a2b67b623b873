"""Recorded history: every host's GPUs, owners and reservations in an SQLite file, and the
waste report made from it (no Textual here: this is the data layer)."""

from gputop.history.db import SCHEMA_VERSION, HistoryDB, HistoryError

__all__ = ["SCHEMA_VERSION", "HistoryDB", "HistoryError"]
