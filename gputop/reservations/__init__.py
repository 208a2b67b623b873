"""Advisory GPU reservations in one shared file (no Textual here either)."""

from gputop.reservations.ops import Invalid, Refused, Target, release, reserve
from gputop.reservations.store import Reservation, Store, StoreError, StoreState

__all__ = ["Invalid", "Refused", "Reservation", "Store", "StoreError", "StoreState", "Target",
           "release", "reserve"]
