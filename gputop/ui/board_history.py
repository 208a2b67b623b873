"""The board's short history for the sparklines: per host, one sample per answer.

A sample is the host's GPUs' keys (the list the model keeps: one object while they do not
change) and three tuples: utilisation, memory used and memory total, by position. An
answer is then one append per host, not two per GPU: at 200 hosts x 8 GPUs the appends to
3,200 series were most of what an answer cost the board's model, and only the selected
GPU's series is ever read (the detail pane).
"""

from __future__ import annotations

from collections import deque

from gputop.model import HostSnapshot

HISTORY = 120  # samples kept per host (one per refresh), so per GPU for the sparklines

#: (its GPUs' keys, utilisation %, memory used MiB, memory total MiB): a gap when the
#: numbers are None (the host did not answer).
Numbers = tuple[int | None, ...] | None
Sample = tuple[list[str], Numbers, Numbers, Numbers]


class BoardHistory:
    """Every host's last HISTORY samples."""

    def __init__(self) -> None:
        self._hosts: dict[str, deque[Sample]] = {}

    def add(self, snap: HostSnapshot, keys: list[str]) -> None:
        """A host's answer (``keys``: its GPUs' keys, in order)."""
        samples = self._hosts.get(snap.name)
        if samples is None:
            samples = self._hosts[snap.name] = deque(maxlen=HISTORY)
        gpus = snap.gpus
        totals = tuple([g.memory_total_mib for g in gpus])
        if samples:
            last = samples[-1][3]
            if last == totals:  # (nearly always: one tuple shared, not one per answer)
                totals = last
        samples.append((keys, tuple([g.utilization_percent for g in gpus]),
                        tuple([g.memory_used_mib for g in gpus]), totals))

    def gap(self, host: str, keys: list[str]) -> None:
        """The host did not answer: a gap in each of its GPUs' series (``keys``)."""
        samples = self._hosts.get(host)
        if samples is not None:
            samples.append((keys, None, None, None))

    def series(self, key: str, host: str) -> tuple[list[float | None], list[float | None]]:
        """A GPU's utilisation and memory-used percentages, oldest first; ``None`` is a
        gap (unknown, or the host did not answer), never 0. Samples from before the GPU
        was listed are not in it."""
        util: list[float | None] = []
        mem: list[float | None] = []
        keys: list[str] | None = None
        at = -1
        for sample in self._hosts.get(host, ()):
            if sample[0] is not keys:
                keys = sample[0]
                at = keys.index(key) if key in keys else -1
            if at < 0:
                continue
            utils, used, totals = sample[1], sample[2], sample[3]
            if utils is None or used is None or totals is None or at >= len(utils):
                util.append(None)
                mem.append(None)
                continue
            u, m, t = utils[at], used[at], totals[at]
            util.append(None if u is None else float(u))
            mem.append(100.0 * m / t if m is not None and t else None)
        return util, mem
