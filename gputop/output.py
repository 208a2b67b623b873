"""The headless writer: one JSON document per snapshot, one per line in ``--watch``.

``ensure_ascii`` keeps every non-ASCII or control character of remote text as a ``\\u``
escape, so a hostile process name cannot reach the reader's terminal through ``--json``.

``WatchDocuments`` builds each ``--watch`` line without serialising again a GPU whose data
and annotation did not change since the last line: its JSON text is kept and reused. The
line is byte for byte what ``dumps(annotate(...))`` gives (a test compares them).
"""

from __future__ import annotations

import json
from typing import IO, Any

from gputop.model import SCHEMA_VERSION, FleetSnapshot, GpuInfo, iso
from gputop.reservations.flags import (
    Annotation,
    IdleTracker,
    annotated_gpu,
    gpu_annotation,
    instance_index,
    reservation_index,
)
from gputop.reservations.store import StoreState


def dumps(document: Any, *, pretty: bool = False) -> str:
    return json.dumps(document, ensure_ascii=True, indent=2 if pretty else None,
                      separators=None if pretty else (",", ":"))


def write_document(document: dict[str, Any], stream: IO[str], *, pretty: bool = False) -> None:
    write_line(dumps(document, pretty=pretty), stream)


def write_line(text: str, stream: IO[str]) -> None:
    stream.write(text + "\n")
    stream.flush()


class WatchDocuments:
    """The compact ``--json`` document of each refresh, as text, reusing per GPU the JSON
    of the last refresh when the GPU's data and annotation are equal (compared by value:
    a host answers with new objects every refresh). A GPU's power draw changes often, so
    a busy GPU is serialised again most refreshes; an idle or steady one is not."""

    def __init__(self) -> None:
        self._gpus: dict[tuple[str, int], tuple[GpuInfo, Annotation, str]] = {}
        self.reused = self.serialised = 0  # counted for the benchmarks

    def text(self, snapshot: FleetSnapshot, state: StoreState | None,
             tracker: IdleTracker | None = None, extra: dict[str, Any] | None = None) -> str:
        now = snapshot.time
        held = reservation_index(state, now)
        inst_held = instance_index(state, now)
        kept: dict[tuple[str, int], tuple[GpuInfo, Annotation, str]] = {}
        hosts = []
        for host in snapshot.hosts:
            gpus = []
            for pos, g in enumerate(host.gpus):
                ann = gpu_annotation(host.name, g, held, inst_held, tracker, now)
                key = (host.name, pos)
                last = self._gpus.get(key)
                if last is not None and (last[0] is g or last[0] == g) and last[1] == ann:
                    kept[key] = last
                    gpus.append(last[2])
                    self.reused += 1
                    continue
                text = dumps(annotated_gpu(g, ann))
                kept[key] = (g, ann, text)
                gpus.append(text)
                self.serialised += 1
            head = dumps(host.head_dict())
            hosts.append(f'{head[:-1]},"gpus":[{",".join(gpus)}]}}')
        self._gpus = kept  # hosts and GPUs that are gone are forgotten
        doc = dumps({"version": SCHEMA_VERSION, "time": iso(snapshot.time)})
        tail = dumps(extra)[1:-1] if extra else ""
        return f'{doc[:-1]},"hosts":[{",".join(hosts)}]' + (f",{tail}" if tail else "") + "}"
