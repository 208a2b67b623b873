"""Each person's own routes, kept in the shared reservations file under the identity the
store knows them by (``whoami``: the real uid here, the authenticated SSH account for a
remote store). The store itself refuses a write that touches anyone else's route
(``check_route_owners``), so nobody can redirect or silence another's notices.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from datetime import datetime

from gputop.notify.notice import Route
from gputop.notify_config import NotifyConfig
from gputop.reservations.ops import Invalid, whoami
from gputop.reservations.records import ROUTE_KINDS, RouteRecord, route_target_problem
from gputop.reservations.store import ReservationStore, StoreState


def set_route(store: ReservationStore, kind: str, target: str) -> RouteRecord:
    """Set the caller's route of ``kind`` (replacing their previous one of that kind)."""
    problem = route_target_problem(kind, target)
    if problem:
        raise Invalid(problem)
    user, _ = whoami(store)
    made: list[RouteRecord] = []

    def change(state: StoreState, now: datetime) -> StoreState:
        made[:] = [RouteRecord(user, kind, target, now)]
        keep = tuple(r for r in state.routes if (r.user, r.kind) != (user, kind))
        return replace(state, routes=(*keep, made[0]))

    store.update(change)
    return made[0]


def clear_routes(store: ReservationStore) -> int:
    """Remove every route of the caller (``notify me --off``); how many there were."""
    user, _ = whoami(store)
    gone: list[RouteRecord] = []

    def change(state: StoreState, now: datetime) -> StoreState:
        gone[:] = [r for r in state.routes if r.user == user]
        return replace(state, routes=tuple(r for r in state.routes if r.user != user))

    store.update(change)
    return len(gone)


def own_routes(state: StoreState, user: str) -> list[RouteRecord]:
    return [r for r in state.routes if r.user == user]


def routes_for(state: StoreState, user: str, config: NotifyConfig) -> list[Route]:
    """Where ``user``'s notices go: their routes; with none, mail at login@email_domain
    when the team configured one; else nowhere."""
    out = [Route("webhook" if r.kind == "webhook" else "ntfy" if r.kind == "ntfy"
                 else "email", r.target)
           for r in sorted(own_routes(state, user), key=lambda r: ROUTE_KINDS.index(r.kind))]
    if not out and config.email_domain and not route_target_problem(
            "email", f"{user}@{config.email_domain}"):
        out = [Route("email", f"{user}@{config.email_domain}")]
    return out


def store_routes(store: ReservationStore, config: NotifyConfig
                 ) -> Callable[[str], list[Route]]:
    """``routes_for`` over the store as it is when each notice is sent (a Notifier's
    ``routes_for``: it runs on the Notifier's thread, so a slow store delays no caller)."""
    return lambda user: routes_for(store.read(), user, config)
