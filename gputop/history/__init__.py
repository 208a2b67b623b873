"""Recorded history: every host's GPUs, owners and reservations in an SQLite file, and the
waste report made from it (no Textual here: this is the data layer)."""

