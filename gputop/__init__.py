"""gputop: one live board of every GPU on your team's servers, with advisory reservations."""

__version__ = "0.1.0"
