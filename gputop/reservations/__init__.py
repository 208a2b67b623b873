"""Advisory GPU reservations in one shared file (no Textual here either)."""
