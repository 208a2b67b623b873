"""Turn what ``nvidia-smi`` prints into model records, and classify how it fails.

The framing of the remote script's output (markers, nonce, sections) is
:mod:`gputop.sources.protocol`; this module parses the sections' rows.

Everything here is pure (text in, records out) so the whole real-output corpus can be fed
through it in tests. nvidia-smi reports a value it cannot read as ``[N/A]``,
``[Not Supported]``, ``[Unknown Error]``, ``N/A``, ``ERR!``, an empty cell, or (newer drivers)
``[Requested functionality has been deprecated]``: all of these become ``None``.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from operator import getitem
from typing import Any

from gputop.model import GpuInfo, HostError, ProcessInfo
from gputop.sources.protocol import (
    OWNER_HEADER,
    Section,
    remote_script,
    split_frame,
)
from gputop.ssh.transport import ParseError
from gputop.text import clean, excerpt

# (nvidia-smi field, GpuInfo attribute, converter)
Converter = Callable[[str | None], Any]


def _clean(value: str | None) -> str | None:
    """A cell's text, or ``None`` for every "could not read" sentinel nvidia-smi uses."""
    if value is None:
        return None
    v = value.strip()
    if not v or v in {"N/A", "ERR!", "Not Found", "Unknown", "Unknown Error"}:
        return None
    if v.startswith("[") and v.endswith("]"):
        return None
    return v


def to_str(value: str | None) -> str | None:
    """Text a host reported, cleaned of control characters once, here, where records are
    built: the board, ``--json`` and every other reader get the same safe string."""
    v = _clean(value)
    return (clean(v) or None) if v is not None else None


_NUM = re.compile(r"^[-+]?\d+(?:\.\d+)?")


def to_float(value: str | None) -> float | None:
    """Leading number of a cell ("631.95 W" -> 631.95); None for sentinels or junk."""
    if value is None:
        return None
    try:  # the common case (``nounits``): a bare number, converted without a regex
        f = float(value)
    except ValueError:
        v = _clean(value)
        m = _NUM.match(v) if v is not None else None
        return float(m.group()) if m else None
    return f if math.isfinite(f) else None  # "nan"/"inf" are not readings


def to_int(value: str | None) -> int | None:
    f = to_float(value)
    return None if f is None else round(f)


def to_index(value: str | None) -> int | None:
    """A device index: plain digits, 0-65535 ("-5" or "1e20" is no index, not a GPU)."""
    v = value.strip() if value is not None else ""
    return int(v) if v.isdigit() and len(v) <= 5 and int(v) <= 65535 else None


def _skip(value: str | None) -> None:
    return None


GPU_FIELDS: tuple[tuple[str, str, Converter], ...] = (
    # timestamp first: in a stream (``-lms``) it marks where a row starts; count: how many
    # rows (GPUs) one sample has, so a sample is complete without waiting for the next.
    ("timestamp", "", _skip),
    ("count", "", _skip),
    ("index", "index", to_index),
    ("uuid", "uuid", to_str),
    ("name", "name", to_str),
    ("pci.bus_id", "bus_id", to_str),
    ("utilization.gpu", "utilization_percent", to_int),
    ("utilization.memory", "memory_utilization_percent", to_int),
    ("memory.used", "memory_used_mib", to_int),
    ("memory.total", "memory_total_mib", to_int),
    ("temperature.gpu", "temperature_c", to_int),
    ("power.draw", "power_draw_w", to_float),
    ("power.limit", "power_limit_w", to_float),
    ("fan.speed", "fan_percent", to_int),
    ("pstate", "pstate", to_str),
    ("mig.mode.current", "mig_mode", to_str),
    ("driver_version", "driver_version", to_str),
    ("persistence_mode", "persistence_mode", to_str),
)
GPU_QUERY = ",".join(f for f, _, _ in GPU_FIELDS)
# No process_name: it is text a user chooses (a newline in it would start a row). The
# command line comes from ``ps``, in a section of its own.
APPS_FIELDS = ("timestamp", "gpu_uuid", "pid", "used_memory")
APPS_QUERY = ",".join(APPS_FIELDS)

REMOTE_SCRIPT = remote_script(
    f"--query-gpu={GPU_QUERY} --format=csv,noheader,nounits",
    f"--query-compute-apps={APPS_QUERY} --format=csv,noheader,nounits",
)

_LOST = re.compile(
    r"Unable to determine the device handle for GPU\s*"
    r"([0-9A-Fa-f]+:[0-9A-Fa-f]+:[0-9A-Fa-f]+\.[0-9A-Fa-f]+)\s*:\s*(.*)$"
)


def _split_lost(text: str) -> tuple[list[str], list[tuple[str, str]]]:
    """Data lines and (bus id, reason) of lost GPUs, wherever nvidia-smi's stderr put them.

    stderr shares the pipe with stdout, so the lost line may come first, between rows, last,
    or (stdout being block-buffered) even inside a row: the row's two halves are joined.
    """
    data: list[str] = []
    lost: list[tuple[str, str]] = []
    carry = ""
    for line in text.splitlines():
        m = _LOST.search(line)
        if m:
            lost.append((m.group(1), clean(m.group(2)).strip()))
            carry += line[: m.start()]
            continue
        line, carry = carry + line, ""
        if line.strip():
            data.append(line)
    if carry.strip():
        data.append(carry)
    return data, lost


#: Converted cells by converter: most of a GPU's cells repeat from one sample to the next
#: (its name, uuid, limits, often its load), and the converters are pure functions of the
#: text. Bounded: a memo is emptied when it fills.
_MEMOS: dict[Converter, dict[str, Any]] = {}
_MEMO_SIZE = 4096
_MISSING = object()


def _memo(conv: Converter) -> dict[str, Any]:
    memo = _MEMOS.get(conv)
    if memo is None:
        memo = _MEMOS[conv] = {}
    return memo


def parse_gpu_rows(
    text: str, fields: Sequence[tuple[str, str, Converter]] = GPU_FIELDS
) -> list[GpuInfo]:
    """Rows of ``--query-gpu=<fields> --format=csv,noheader,nounits``.

    A field whose attribute is ``""`` is expected in the output but not kept.

    A GPU the driver lost is reported as a line of its own; it becomes a ``lost`` GpuInfo
    identified by its bus id, and the other GPUs are parsed normally.
    """
    rows, lost = _split_lost(text)
    gpus: list[GpuInfo] = []
    kept = [(attr, conv, _memo(conv)) for _, attr, conv in fields]
    for line in rows:
        cells = line.split(", ")
        if len(cells) != len(fields):
            raise ParseError(
                f"expected {len(fields)} comma-separated fields, got {len(cells)}: {excerpt(line)}"
            )
        if fields is GPU_FIELDS:
            gpus.append(gpu_from_cells(cells))
            continue
        values: dict[str, Any] = {}
        for (attr, conv, memo), cell in zip(kept, cells):
            if not attr:
                continue
            v = memo.get(cell, _MISSING)
            if v is _MISSING:
                v = conv(cell)
                if len(memo) >= _MEMO_SIZE:
                    memo.clear()
                memo[cell] = v
            values[attr] = v
        gpus.append(GpuInfo(**values))
    gpus.extend(GpuInfo(index=None, bus_id=clean(bus), lost=True, lost_reason=reason or None)
                for bus, reason in lost)
    return gpus


#: GPU_FIELDS' kept cells are GpuInfo's first fields, in order: a row is built positionally.
_ROW_START = 2
_ROW_CONVERTERS = tuple(conv for _, attr, conv in GPU_FIELDS[_ROW_START:])
_ROW_MEMOS = tuple(_memo(conv) for conv in _ROW_CONVERTERS)  # (emptied, never replaced)
assert all(attr for _, attr, _ in GPU_FIELDS[_ROW_START:])
assert [a for _, a, _ in GPU_FIELDS[_ROW_START:]] == [
    f.name for f in dataclasses.fields(GpuInfo)][:len(GPU_FIELDS) - _ROW_START]


def gpu_from_cells(cells: Sequence[str]) -> GpuInfo:
    """One GPU_FIELDS row, already split into its cells (the caller checked their count).
    (The hot path of every refresh: each cell's value is memoised by its text, and only a
    cell not seen before is converted.)"""
    row = cells[_ROW_START:]
    try:  # (every cell seen before: the lookups run in C)
        return GpuInfo.from_row(list(map(getitem, _ROW_MEMOS, row)))
    except KeyError:
        pass
    values = [memo.get(cell, _MISSING) for memo, cell in zip(_ROW_MEMOS, row)]
    for i, (conv, memo, cell) in enumerate(zip(_ROW_CONVERTERS, _ROW_MEMOS, row)):
        if values[i] is _MISSING:
            v = values[i] = conv(cell)
            if len(memo) >= _MEMO_SIZE:
                memo.clear()
            memo[cell] = v
    return GpuInfo.from_row(values)


@dataclass(frozen=True)
class AppRow:
    gpu_uuid: str | None
    pid: int
    used_memory_mib: int | None
    #: The process's start time (``/proc/PID/stat`` field 22, clock ticks since boot), as
    #: the streaming session appends it: a pid with another start is another process.
    start: str | None = None


def parse_apps_rows(text: str) -> list[AppRow]:
    """Rows of ``--query-compute-apps=gpu_uuid,pid,used_memory``; lost-GPU lines skipped."""
    rows: list[AppRow] = []
    for line in _split_lost(text)[0]:
        rows.append(parse_apps_row(line))
    return rows


def parse_apps_row(line: str) -> AppRow:
    """One ``timestamp, gpu_uuid, pid, used_memory`` row, strictly."""
    cells = line.split(", ")
    pid = to_int(cells[2]) if len(cells) == len(APPS_FIELDS) else None
    if pid is None or not cells[2].strip().isdigit():
        raise ParseError(f"unexpected process row: {excerpt(line)}")
    return AppRow(to_str(cells[1]), pid, to_int(cells[3]))


def failed_apps_rows(text: str) -> tuple[list[AppRow], list[str]]:
    """The process rows of a query that failed, and its other lines (the failure's words):
    lost-GPU lines are skipped and a row cut by one is joined, as in :func:`parse_apps_rows`."""
    rows: list[AppRow] = []
    words: list[str] = []
    for line in _split_lost(text)[0]:
        try:
            rows.append(parse_apps_row(line))
        except ParseError:
            words.append(line)
    return rows, words


#: The separators of the remote script's ``IFS=', ' read``: a comma with the spaces around
#: it, or a run of spaces (POSIX field splitting; a tab is no separator there).
_SCRIPT_IFS = re.compile(r" *, *| +")


def script_pids(text: str) -> list[int]:
    """The pids the remote script asked ``ps`` about for this apps output: the fourth field
    of each line (``while IFS=', ' read -r _d _t _u p _r``) where it is ASCII digits. The
    owners section answers exactly these, whatever else the output held."""
    pids: list[int] = []
    for line in text.split("\n"):  # read's lines: "\n" only (not str.splitlines' \r etc.)
        fields = _SCRIPT_IFS.split(line.strip(" "), 4)
        p = fields[3] if len(fields) > 3 else ""
        if p.isascii() and p.isdigit():
            pids.append(int(p))
    return pids


def parse_etime(value: str) -> int | None:
    """POSIX ``ps -o etime`` (``[[dd-]hh:]mm:ss``) to seconds."""
    m = re.fullmatch(r"(?:(\d+)-)?(?:(\d+):)?(\d+):(\d+)", value.strip())
    if not m:
        return None
    days, hours, mins, secs = (int(g) if g else 0 for g in m.groups())
    return ((days * 24 + hours) * 60 + mins) * 60 + secs


@dataclass(frozen=True)
class Owner:
    pid: int
    user: str
    elapsed_s: int | None


def parse_owner_rows(text: str, asked: Iterable[int]) -> dict[int, Owner]:
    """``ps -o pid= -o user= -o etime= -p PIDS``: who runs each GPU process.

    This section holds no text a user chooses, so it is read strictly: every row is a pid
    that was asked for, once, with a user and an elapsed time; anything else is an error.
    """
    wanted = set(asked)
    out: dict[int, Owner] = {}
    for line in text.splitlines():
        if not line.strip() or line.strip() == OWNER_HEADER:  # the widening header
            continue
        parts = line.split()
        pid = int(parts[0]) if len(parts) == 3 and parts[0].isdigit() else None
        if pid is None or pid not in wanted:
            raise ParseError(f"unexpected ps row: {excerpt(line)}")
        owner = Owner(pid, clean(parts[1]), parse_etime(parts[2]))
        if out.setdefault(pid, owner) != owner:  # a process on two GPUs is asked for twice
            raise ParseError(f"ps gave two owners for pid {pid}")
    return out


def parse_args_rows(text: str, asked: Iterable[int]) -> dict[int, str]:
    """``ps -o pid= -o args= -p PIDS``: command lines, for display only.

    Users choose this text, so it is read leniently: a row starts with a pid asked for and
    not yet seen; any other line continues the row before it. A pid that appears twice has
    no trustworthy command line and is left out.
    """
    wanted = set(asked)
    out: dict[int, list[str]] = {}
    twice: set[int] = set()
    current: list[str] | None = None
    for line in text.splitlines():
        head, _, rest = line.strip().partition(" ")
        pid = int(head) if head.isdigit() else None
        if pid is not None and pid in wanted:
            if pid in out:
                twice.add(pid)
            current = out[pid] = [rest.strip()]
        elif current is not None and line.strip():
            current.append(line.strip())
    return {pid: clean(" ".join(parts)) for pid, parts in out.items() if pid not in twice}


#: MIG uuid -> (parent GPU uuid, GPU instance id, compute instance id).
MigParents = Mapping[str, tuple[str, int | None, int | None]]


def attach_processes(
    gpus: Iterable[GpuInfo], apps: Iterable[AppRow], owners: dict[int, Owner],
    args: dict[int, str] | None = None, mig: MigParents | None = None,
) -> list[GpuInfo]:
    """Hang each compute process on its GPU (by UUID), with owner, command line and age.

    A process reported under a MIG device's uuid (some drivers) goes to its parent GPU,
    on its instance, where ``mig`` (the host's MIG inventory) knows that uuid."""
    args = args or {}
    mig = mig or {}
    # A pid listed again on one GPU (nvidia-smi's loop printing two iterations as one
    # batch) is the same process: its newer row replaces the older, never adds to it.
    by_uuid: dict[str | None, dict[tuple[int, int | None, int | None], ProcessInfo]] = {}
    for a in apps:
        o = owners.get(a.pid)
        parent, gi, ci = mig.get(a.gpu_uuid or "", (a.gpu_uuid, None, None))
        by_uuid.setdefault(parent, {})[(a.pid, gi, ci)] = (
            ProcessInfo(
                pid=a.pid,
                user=o.user if o else None,
                command=args.get(a.pid) or None,
                gpu_memory_mib=a.used_memory_mib,
                elapsed_s=o.elapsed_s if o else None,
                gpu_instance_id=gi,
                compute_instance_id=ci,
            )
        )
    gpus = list(gpus)
    # UUIDs are unique on real hardware; masked captures repeat one, so attach once only.
    claimed: set[str | None] = set()
    result = []
    for g in gpus:
        if g.uuid in by_uuid and g.uuid not in claimed and not g.lost:
            claimed.add(g.uuid)
            g = g.with_processes(tuple(by_uuid[g.uuid].values()))
        result.append(g)
    return result


# --- failures -----------------------------------------------------------------------------

_DRIVER_TEXTS = (
    "couldn't communicate with the NVIDIA driver",
    "Failed to initialize NVML",
    "Driver/library version mismatch",
    "NVIDIA driver is not loaded",
)


def _message_lines(text: str) -> str:
    """The lines of a failed call that say something: data rows and lost-GPU lines are
    left out, so a message leads with its meaning, not with the data printed before it."""
    data, _ = _split_lost(text)
    said = [ln for ln in data if len(ln.split(", ")) not in (len(GPU_FIELDS), len(APPS_FIELDS))]
    return " ".join(said or data)


def classify_failure(output: str, rc: int | None) -> HostError | None:
    """The host-level error a failed nvidia-smi call means, or None if it did not fail."""
    text = output.strip()
    if rc == 127 or re.search(r"nvidia-smi: (command )?not found", text):
        return HostError("no-nvidia-smi", "nvidia-smi was not found on the remote PATH")
    for needle in _DRIVER_TEXTS:
        at = text.find(needle)
        if at >= 0:
            line_start = text.rfind("\n", 0, at) + 1
            return HostError("driver", excerpt(text[line_start:]))
    if "No devices were found" in text:
        return HostError("no-devices", "No devices were found")
    if rc not in (0, None) and not _split_lost(text)[1]:
        said = _message_lines(text)
        return HostError("error", f"nvidia-smi failed (exit {rc})"
                         + (f": {excerpt(said)}" if said else ""))
    return None


# --- the remote script's output -----------------------------------------------------------


@dataclass(frozen=True)
class RemoteResult:
    """One refresh, parsed: the GPUs or the host's error, and warnings about the data."""

    gpus: list[GpuInfo]
    error: HostError | None = None
    warnings: tuple[str, ...] = ()
    #: MIG uuids processes were reported under that the MIG inventory did not know.
    unknown_mig: frozenset[str] = frozenset()


def index_warnings(gpus: Iterable[GpuInfo]) -> list[str]:
    """A GPU index listed twice (both GPUs are shown)."""
    gpus = list(gpus)
    indexes = [g.index for g in gpus if g.index is not None]
    if len(set(indexes)) == len(indexes):  # (every sample of every host: the usual case)
        return []
    seen: dict[int, int] = {}
    for g in gpus:
        if g.index is not None:
            seen[g.index] = seen.get(g.index, 0) + 1
    return [f"nvidia-smi listed GPU index {i} {n} times" for i, n in seen.items() if n > 1]


def parse_sections(sections: dict[str, Section], mig: MigParents | None = None) -> RemoteResult:
    """GPUs with their processes from one refresh's sections, or the host error."""
    gpu, apps_s = sections["gpu"], sections["apps"]
    try:
        failure = classify_failure(gpu.text, gpu.rc)
        if failure:
            return RemoteResult([], failure)
        gpus = parse_gpu_rows(gpu.text)
        if not gpus:
            return RemoteResult([], HostError("parse", "nvidia-smi listed no GPUs"))
        warnings = index_warnings(gpus)
        apps_failure = classify_failure(apps_s.text, apps_s.rc)
        if apps_failure is None and apps_s.rc == 0:
            apps = parse_apps_rows(apps_s.text)
            asked = [a.pid for a in apps]
        else:
            # A failed query (exit 15: a GPU lost) may still list the other GPUs' processes,
            # and the script asked ps about them: keep the rows, as a stream's apps loop does.
            apps, words = failed_apps_rows(apps_s.text)
            asked = script_pids(apps_s.text)
            if not apps and apps_failure is not None:
                warnings.append(f"processes unknown: {apps_failure.message}")
            elif words or (apps_failure is not None and not any(g.lost for g in gpus)):
                # (A lost GPU alone says why the query failed.)
                why = apps_failure.message if apps_failure is not None else \
                    f"nvidia-smi failed (exit {apps_s.rc}): {excerpt(' '.join(words))}"
                warnings.append(f"processes may be missing: {why}")
        pids = [a.pid for a in apps]
        owners = parse_owner_rows(sections["owners"].text, asked)
        args = parse_args_rows(sections["args"].text, pids)
        unknown_mig = frozenset(a.gpu_uuid for a in apps if a.gpu_uuid
                                and a.gpu_uuid.startswith("MIG-") and a.gpu_uuid not in (mig or {}))
        return RemoteResult(attach_processes(gpus, apps, owners, args, mig), None,
                            tuple(warnings), unknown_mig)
    except ParseError as exc:
        return RemoteResult([], HostError("parse", str(exc)))


def parse_remote_output(lines: list[str], nonce: str) -> RemoteResult:
    """One refresh's lines (without its end line), framed with ``nonce``."""
    try:
        sections = split_frame(lines, nonce)
    except ParseError as exc:
        return RemoteResult([], HostError("parse", str(exc)))
    return parse_sections(sections)


# --- header-aware parsing (any --query-* CSV with a header, e.g. the fixture corpus) ------

_UNIT = re.compile(r"^(?P<name>[^\[]+?)\s*(?:\[(?P<unit>[^\]]*)\])?$")


def parse_query_csv(text: str) -> list[dict[str, str | None]]:
    """``--format=csv`` (with header, with or without units) to records keyed by field.

    Units named in the header are stripped from values; sentinels become ``None``.
    """
    lines = [ln for ln in text.splitlines() if ln.strip()]
    if not lines:
        return []
    header = [h.strip() for h in lines[0].split(",")]
    names: list[str] = []
    for h in header:
        m = _UNIT.match(h)
        names.append(m.group("name") if m else h)
    records = []
    for line in lines[1:]:
        cells = line.split(", ", len(names) - 1)
        if len(cells) != len(names):
            raise ParseError(f"row has {len(cells)} cells for {len(names)} columns")
        records.append({n: _clean(c) for n, c in zip(names, cells)})
    return records


_ALIASES = {"gpu_name": "name", "gpu_bus_id": "pci.bus_id", "gpu_uuid": "uuid"}


def gpus_from_records(records: Iterable[dict[str, str | None]]) -> list[GpuInfo]:
    """Map header-keyed records onto GpuInfo; fields a capture lacks stay ``None``."""
    gpus = []
    for rec in records:
        rec = {_ALIASES.get(k, k): v for k, v in rec.items()}
        values = {attr: conv(rec.get(f)) for f, attr, conv in GPU_FIELDS if attr}
        gpus.append(GpuInfo(**values))
    return gpus
