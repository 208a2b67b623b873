"""The board and the shared reservations file: reading it (re-read when it changes, on a
worker thread, or over SSH), and the keys that write it: ``r`` reserve (a whole GPU or a
share of one), ``u`` release, ``Q`` the queue. :class:`StoreActions` owns the store and
what was last read of it; the app owns one, keeps the key bindings (Textual dispatches
them to the app) and delegates to it.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Callable, Sequence
from datetime import datetime

from rich.text import Text
from textual.app import App
from textual.worker import Worker

from gputop.config.load import Config
from gputop.poller import Poller
from gputop.reservations.filelock import StoreError
from gputop.reservations.ops import Invalid, Refused, Target, release, size_text
from gputop.reservations.shares import mig_mode, reserve_share, room_mib
from gputop.reservations.state import StoreState
from gputop.reservations.store import ReservationStore
from gputop.text import clean, excerpt
from gputop.ui.board_model import BoardModel
from gputop.ui.board_rows import (
    GpuRow,
    HostRow,
    gpu_keys,
    host_of,
    short_model,
    split_instance,
    split_share,
)
from gputop.ui.cells import time_left
from gputop.ui.feed import BoardSource
from gputop.ui.screens import ConfirmScreen, ReserveRequest, ReserveScreen


class StoreActions:
    """What the board does with the shared file: read it (``reload``, and on the app's
    timer ``reload_if_changed``), show what it read (``state``, ``problem``, via the
    model), and write it from the ``r``/``u``/``Q`` keys (``reserve``, ``release``,
    ``queue``). Dialogs, toasts and workers are the app's."""

    def __init__(self, app: App[int], store: ReservationStore, model: BoardModel, *,
                 config: Config, clock: Callable[[], datetime], me: str, me_given: bool,
                 selected: Callable[[], GpuRow | HostRow | None],
                 redraw: Callable[[], None], changed: Callable[[], None],
                 given_hosts: Sequence[str] | None = None) -> None:
        self.app = app
        self.store = store
        self.model = model
        self.config = config
        self.clock = clock
        #: Who "me" is; for a store over SSH, the account its host authenticated (learnt
        #: with its first answer) unless ``me_given`` (``--user``).
        self.me = me
        self._me_given = me_given
        self._selected = selected
        self._redraw = redraw  # draw now (after our own write)
        self._changed = changed  # something to draw with the next tick
        #: The hosts of sources the board was given (the demo): the queue waits on those
        #: as the board shows them, never polling hosts of the same names itself.
        self._given_hosts = given_hosts
        #: The reservations as last read, and why the file could not be read (or None).
        self.state: StoreState | None = None
        self.problem: str | None = None
        self._store_sig: object = None
        self._store_reading = False
        self._waiting: Worker[None] | None = None

    # -- reading the file ----------------------------------------------------------------

    def _store_stat(self) -> object:
        return self.store.signature()

    def reload(self) -> None:
        """Re-read the shared file now (after our own write, or when asked)."""
        if self.store.remote:
            self._read_remote_store()
            return
        sig = self._store_stat()
        try:
            result: StoreState | StoreError = self.store.read()
        except StoreError as exc:
            result = exc
        self._apply_store(sig, result)

    def reload_if_changed(self) -> None:
        """Every interval: when the file changed (a teammate reserved something), read it
        on a worker thread. A large or hostile file (up to 4 MiB, 10,000 records) costs
        that thread a tenth of a second, never the screen; an unchanged file, broken or not,
        is not read again."""
        if self.store.remote:
            self._read_remote_store()
            return
        sig = self._store_stat()
        if sig == self._store_sig or self._store_reading:
            return
        self._store_reading = True

        def read() -> None:
            try:
                result: StoreState | StoreError = self.store.read()
            except StoreError as exc:
                result = exc
            self.app.call_from_thread(self._apply_store, sig, result)

        self.app.run_worker(read, thread=True, group="store", exit_on_error=False)

    def _read_remote_store(self) -> None:
        """A store over SSH, always on a worker thread: one short round trip when the file
        did not change (its checksum), the file only when it did; a host that is down
        costs that thread its timeout, never the screen."""
        if self._store_reading:
            return
        self._store_reading = True

        def read() -> None:
            me = None
            try:
                result: StoreState | StoreError = self.store.read()
                me = self.store.whoami()[0]
            except StoreError as exc:
                result = exc
            self.app.call_from_thread(self._apply_remote_store, result, me)

        self.app.run_worker(read, thread=True, group="store", exit_on_error=False)

    def _apply_remote_store(self, result: StoreState | StoreError, me: str | None) -> None:
        if me is not None and not self._me_given and me != self.me:
            self.me = self.model.me = me
            self.model.state_version += 1  # every row's "is it mine" may change
            self._changed()
        if result is self.state and self.problem is None:
            self._store_reading = False  # unchanged: nothing to redo
            return
        self._apply_store(None, result)

    def _apply_store(self, sig: object,
                     result: StoreState | StoreError) -> None:
        self._store_reading = False
        self._store_sig = sig
        if isinstance(result, StoreError):
            if str(result) != self.problem:  # stays in the summary bar until fixed
                self.problem = str(result)
                self.app.notify(str(result), title="reservations", severity="error",
                            markup=False, timeout=6)
                self._changed()
            return
        if self.problem is not None:
            self.problem = None
        self.state = result
        self.model.set_state(result)
        self._changed()

    # -- the queue -----------------------------------------------------------------------

    def queue(self) -> None:
        from gputop.ui.screens import QueueScreen

        waiting = self.state.waiting(self.clock()) if self.state is not None else []
        self.app.push_screen(QueueScreen(waiting, self.clock(), self.me), self._join_queue)

    def _join_queue(self, count: int | None) -> None:
        if count is None:
            return
        if self._waiting is not None and not self._waiting.is_finished:
            self.app.notify("you are already waiting in the queue", severity="warning")
            return
        self._waiting = self.app.run_worker(self._wait(count), name="_wait", group="queue",
                                            exclusive=True)

    async def _wait(self, count: int) -> None:
        """Wait in the queue like ``free --wait``; quitting the board leaves the queue."""
        from gputop.jobs.wait import WaitedTooLong, wait_for_gpus
        from gputop.reservations.queue import DEFAULT_LEASE_S, Request

        def say(msg: str) -> None:
            self.app.notify(msg, title="queue", markup=False, timeout=6)
            self._store_sig = None

        poller = None
        if self._given_hosts is not None:  # the demo (or given sources): what the board shows,
            poller = Poller(self.config.with_defaults(collection="query"), [
                BoardSource(name, self.model.snapshots.get) for name in self._given_hosts])
        try:  # (else the waiter's own queries: a GPU is free the moment its job ends)
            got = await wait_for_gpus(self.config, self.store, Request(count), note="",
                                      seconds=self.config.reservations.default_s,
                                      lease_s=DEFAULT_LEASE_S, max_wait=None, say=say,
                                      poller=poller)
        except (Invalid, Refused, StoreError, WaitedTooLong) as exc:
            self.app.notify(str(exc), severity="error", markup=False, timeout=6)
            return
        finally:
            if poller is not None:
                await poller.aclose()
        self.app.bell()
        self._store_changed("granted: " + ", ".join(f"{clean(r.host)}:{r.gpu}" for r in got))

    # -- reserve and release -------------------------------------------------------------

    def reserve(self) -> None:
        """Reserve the selected GPU: refuse at once if someone else holds it, ask first if
        someone else runs on it, and check again on submit that it is still that GPU."""
        row = self._selected()
        if not isinstance(row, GpuRow) or row.gpu.index is None:
            self.app.notify("select a GPU row to reserve", severity="warning")
            return
        if row.shares or row.share is not None:  # a shared GPU: `r` offers a share of it
            self._ask_share(row)
            return
        holder = row.reservation
        if holder is not None and holder.user != self.me:
            note = f" ({clean(holder.note)})" if holder.note else ""
            self.app.notify(f"{row.label} is reserved by {clean(holder.user)} for "
                        f"{time_left(holder.expires, self.clock())} more{note}",
                        severity="warning", markup=False, timeout=6)
            return
        key, label = row.key, row.label
        about = f"{short_model(row.gpu.name)}  {clean(row.gpu.uuid) or 'no uuid'}"

        def done(req: ReserveRequest | None) -> None:
            if req is not None:
                self._reserve_checked(key, label, req)

        shareable = row.instance is None and not mig_mode(row.gpu) and holder is None

        def ask() -> None:
            self.app.push_screen(ReserveScreen(label, self.config.reservations.default_s,
                                           self.config.reservations.max_s, about,
                                           "optional" if shareable else None), done)

        from gputop.jobs.remote import login_on

        host = next((h for h in self.config.hosts if h.name == row.host), None)
        mine = {self.me} | ({login_on(self.config, host)} if host is not None else set())
        others = [p for p in row.gpu.processes if clean(p.user) not in mine]
        if not others:
            ask()
            return
        who = ", ".join(sorted({clean(p.user) or "?" for p in others}))
        q = Text()
        q.append(f"{label} is in use by {who}:\n", style="bold")
        for p in others[:5]:
            q.append(f"  {p.pid} {clean(p.user) or '?'}  {excerpt(p.command or '', 50)}\n")
        if len(others) > 5:
            q.append(f"  … and {len(others) - 5} more\n")
        q.append("\nReserve it anyway? Your reservation will not stop their jobs.")
        self.app.push_screen(ConfirmScreen(q, "Reserve anyway"),
                         lambda yes: ask() if yes else None)

    def _ask_share(self, row: GpuRow) -> None:
        """`r` on a shared GPU (or one of its shares): a share of it, or yours resized."""
        g = row.gpu
        gpu_row = self.model.find(split_share(row.key)[0])
        shares = row.shares or (gpu_row.shares if isinstance(gpu_row, GpuRow) else ())
        rest = "?" if g.memory_total_mib is None else size_text(
            room_mib(g.memory_total_mib, shares, but=self.me))
        key, label = split_share(row.key)[0], f"{clean(row.host)}:{g.index}"
        about = f"{short_model(g.name)}  {clean(g.uuid) or 'no uuid'}"

        def done(req: ReserveRequest | None) -> None:
            if req is not None:
                self._reserve_checked(key, label, req)

        self.app.push_screen(ReserveScreen(label, self.config.reservations.default_s,
                                       self.config.reservations.max_s, about, "required",
                                       rest), done)

    def _reserve_checked(self, key: str, label: str, req: ReserveRequest) -> None:
        """The dialog was open a while: reserve only if the latest data still shows the GPU
        the user chose, at the same index, on a host that answers."""
        host = host_of(key)
        gpu_key, gi = split_instance(key)  # gi: a MIG instance row's GPU instance id
        snap = self.model.snapshots.get(host)
        gpu = None if snap is None or not snap.ok else next(
            (g for g, k in zip(snap.gpus, gpu_keys(host, snap.gpus)) if k == gpu_key), None)
        now_label = None if gpu is None else (
            f"{clean(host)}:{gpu.index}" + ("" if gi is None else f"/{gi}"))
        if snap is None or not snap.ok:
            problem = f"{clean(host)} is down now"
        elif gpu is None or gpu.index is None or (
                gi is not None and gi not in {i.gpu_instance_id for i in gpu.instances}):
            problem = f"{label} is gone from {clean(host)}"
        elif now_label != label:
            problem = f"{label} is now {now_label} (renumbered)"
        elif req.share_mib is not None and gpu.memory_total_mib is None:
            problem = f"{label} does not report its memory"
        else:
            self.app.run_worker(self._reserve(Target(host, gpu.index, gpu.uuid, gi), req,
                                              gpu.memory_total_mib),
                                name="_reserve", group="store")
            return
        self.app.notify(f"not reserved: {problem}", severity="error", markup=False, timeout=6)

    async def _reserve(self, target: Target, req: ReserveRequest,
                       total_mib: int | None = None) -> None:
        from gputop.jobs.remote import answered_logins
        from gputop.reservations.ops import reserve_outcomes
        from gputop.reservations.queue import queue_claim
        from gputop.reservations.terms import Terms

        logins = answered_logins(self.config, self.model.snapshots)
        terms = Terms(req.seconds, self.config.reservations.max_s, req.note, user=self.me,
                      login=logins, share_mib=req.share_mib)
        try:
            if req.share_mib is not None:
                # The queue's order rule for shares, as for `gputop reserve --share`.
                from gputop.reservations.queue import share_claim

                claim = share_claim([h.name for h in self.config.hosts],
                                    [h for _, h in self.model.snapshots.items()],
                                    req.share_mib, self.me, target)
                # The login asked here, as the board knows it now.
                await asyncio.to_thread(
                    reserve_share, self.store, target, total_mib or 0,
                    dataclasses.replace(terms, login={target.host: logins(target.host)}.get),
                    check=claim)
            else:
                # The queue's order rule, as for `gputop reserve`: a GPU whose taking for
                # this long could delay a waiter is theirs (refused, naming them).
                check = queue_claim([target], dict(self.model.snapshots),
                                    [h.name for h in self.config.hosts], self.me,
                                    seconds=req.seconds)
                await asyncio.to_thread(reserve_outcomes, self.store, [target], terms,
                                        check=check)
        except Refused as exc:
            self.app.notify(f"refused: {exc}", severity="error", markup=False, timeout=6)
            return
        except (Invalid, StoreError) as exc:
            self.app.notify(str(exc), severity="error", markup=False, timeout=6)
            return
        self._store_changed(f"reserved {clean(target.label)}" + (
            "" if req.share_mib is None else f" (a {size_text(req.share_mib)} share)"))

    def release(self) -> None:
        row = self._selected()
        if isinstance(row, GpuRow) and row.gpu.index is not None and (
                row.shares or row.share is not None):  # a shared GPU: your share of it
            shares = row.shares or ((row.share,) if row.share else ())
            if not any(r.user == self.me for r in shares) and (
                    row.share is None or row.share.user != self.me):
                self.app.notify("you hold no share of the selected GPU", severity="warning")
                return
            self.app.run_worker(self._release(Target(row.host, row.gpu.index)),
                                name="_release", group="store")
            return
        if not isinstance(row, GpuRow) or row.reservation is None:
            self.app.notify("no reservation on the selected GPU", severity="warning")
            return
        if row.reservation.user != self.me:
            self.app.notify(f"reserved by {clean(row.reservation.user)}, not you; use "
                        "`gputop release --force` to take it back", severity="warning",
                        markup=False)
            return
        target = Target(row.host, row.reservation.gpu, instance=row.reservation.instance)
        self.app.run_worker(self._release(target), name="_release", group="store")

    async def _release(self, target: Target) -> None:
        try:
            await asyncio.to_thread(release, self.store, [target], user=self.me)
        except (Refused, StoreError) as exc:
            self.app.notify(str(exc), severity="error", markup=False, timeout=6)
            return
        self._store_changed(f"released {clean(target.label)}")

    def _store_changed(self, message: str) -> None:
        """We wrote the shared file: show it now rather than at the next re-read."""
        self.app.notify(message, markup=False)
        self._store_sig = None
        self.reload()
        self._redraw()
