"""Advisory GPU reservations in one shared file (no Textual here either)."""

from gputop.reservations.ops import (
    Invalid,
    Outcome,
    Refused,
    Target,
    release,
    reserve,
    reserve_outcomes,
    whoami,
)
from gputop.reservations.store import (
    Reservation,
    ReservationStore,
    Store,
    StoreError,
    StoreState,
)

__all__ = ["Invalid", "Outcome", "Refused", "Reservation", "ReservationStore", "Store",
           "StoreError", "StoreState", "Target", "release", "reserve", "reserve_outcomes", "whoami"]
