"""Turn what ``nvidia-smi`` prints into model records, and classify how it fails.

Everything here is pure (text in, records out) so the whole real-output corpus can be fed
through it in tests. nvidia-smi reports a value it cannot read as ``[N/A]``,
``[Not Supported]``, ``[Unknown Error]``, ``N/A``, ``ERR!``, an empty cell, or (newer drivers)
``[Requested functionality has been deprecated]``: all of these become ``None``.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, replace
from typing import Any

from gputop.model import GpuInfo, HostError, ProcessInfo
from gputop.text import excerpt

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


def to_str(value: str | None) -> str | None:
    return _clean(value)


GPU_FIELDS: tuple[tuple[str, str, Converter], ...] = (
    ("index", "index", to_int),
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
)
GPU_QUERY = ",".join(f for f, _, _ in GPU_FIELDS)
# process_name last: it is the only cell that may itself contain ", ".
APPS_FIELDS = ("gpu_uuid", "pid", "used_memory", "process_name")
APPS_QUERY = ",".join(APPS_FIELDS)

#: Section markers in the remote script's output. Constant text: nothing from the config or
#: from other hosts is ever interpolated into the remote command.
MARK = "@@gputop"
END = f"{MARK} end"

# One refresh. The two nvidia-smi queries run side by side (the GPU query in the
# background), so a refresh costs the host one nvidia-smi latency, not two; the pids for
# `ps` are picked out with shell builtins (no awk, no extra process).
REFRESH = (
    f"nvidia-smi --query-gpu={GPU_QUERY} --format=csv,noheader,nounits </dev/null & g=$!; "
    f"apps=$(nvidia-smi --query-compute-apps={APPS_QUERY} --format=csv,noheader,nounits "
    "</dev/null 2>&1); "
    f'arc=$?; wait "$g"; echo "{MARK} rc $?"; '
    f'printf "%s\\n" "$apps"; echo "{MARK} rc $arc"; '
    "pids=; while IFS=', ' read -r _u p _r; do case $p in ''|*[!0-9]*) ;; "
    '*) pids="$pids${pids:+,}$p" ;; esac; done <<EOF\n$apps\nEOF\n'
    'if [ -n "$pids" ]; then ps -o pid= -o user= -o etime= -o args= -p "$pids" </dev/null; fi; '
    f'echo "{MARK} rc $?"; echo "{END}"'
)

# The remote side of one host's streaming channel, opened once per connection: it says its
# pid (sshd made it a process-group leader, so a hung refresh can be killed as a whole), then
# runs one refresh per line the client sends, and exits when the channel closes. A refresh
# therefore costs no new SSH session, no new shell and no polling sleep on the host.
REMOTE_SCRIPT = f'echo "{MARK} start $$"; while read -r _; do {{ {REFRESH}; }} 2>&1; done'



class ParseError(ValueError):
    """Output that is not what was asked for; message carries a sanitised excerpt."""


_LOST = re.compile(
    r"Unable to determine the device handle for GPU\s*"
    r"([0-9A-Fa-f]+:[0-9A-Fa-f]+:[0-9A-Fa-f]+\.[0-9A-Fa-f]+)\s*:\s*(.*)$"
)


def parse_gpu_rows(
    text: str, fields: Sequence[tuple[str, str, Converter]] = GPU_FIELDS
) -> list[GpuInfo]:
    """Rows of ``--query-gpu=<fields> --format=csv,noheader,nounits``.

    A field whose attribute is ``""`` is expected in the output but not kept.

    A GPU the driver lost is reported as a line of its own; it becomes a ``lost`` GpuInfo
    identified by its bus id, and the other GPUs are parsed normally.
    """
    gpus: list[GpuInfo] = []
    for line in text.splitlines():
        if not line.strip():
            continue
        lost = _LOST.search(line)
        if lost:
            gpus.append(
                GpuInfo(index=None, bus_id=lost.group(1), lost=True, lost_reason=lost.group(2))
            )
            continue
        cells = line.split(", ")
        if len(cells) != len(fields):
            raise ParseError(
                f"expected {len(fields)} comma-separated fields, got {len(cells)}: {excerpt(line)}"
            )
        values = {attr: conv(cell) for (_, attr, conv), cell in zip(fields, cells) if attr}
        gpus.append(GpuInfo(**values))
    return gpus


@dataclass(frozen=True)
class AppRow:
    gpu_uuid: str | None
    pid: int
    used_memory_mib: int | None
    process_name: str | None


def parse_apps_rows(text: str) -> list[AppRow]:
    """Rows of ``--query-compute-apps=gpu_uuid,pid,used_memory,process_name``."""
    rows: list[AppRow] = []
    for line in text.splitlines():
        if not line.strip():
            continue
        cells = line.split(", ", len(APPS_FIELDS) - 1)
        pid = to_int(cells[1]) if len(cells) == len(APPS_FIELDS) else None
        if pid is None:
            raise ParseError(f"unexpected process row: {excerpt(line)}")
        rows.append(AppRow(to_str(cells[0]), pid, to_int(cells[2]), to_str(cells[3])))
    return rows


def parse_etime(value: str) -> int | None:
    """POSIX ``ps -o etime`` (``[[dd-]hh:]mm:ss``) to seconds."""
    m = re.fullmatch(r"(?:(\d+)-)?(?:(\d+):)?(\d+):(\d+)", value.strip())
    if not m:
        return None
    days, hours, mins, secs = (int(g) if g else 0 for g in m.groups())
    return ((days * 24 + hours) * 60 + mins) * 60 + secs


@dataclass(frozen=True)
class PsRow:
    pid: int
    user: str
    elapsed_s: int | None
    args: str


def parse_ps_rows(text: str) -> dict[int, PsRow]:
    """``ps -o pid= -o user= -o etime= -o args=``; lines that do not fit are skipped."""
    out: dict[int, PsRow] = {}
    for line in text.splitlines():
        parts = line.split(None, 3)
        if len(parts) < 3 or not parts[0].isdigit():
            continue
        args = parts[3] if len(parts) == 4 else ""
        out[int(parts[0])] = PsRow(int(parts[0]), parts[1], parse_etime(parts[2]), args)
    return out


def attach_processes(
    gpus: Iterable[GpuInfo], apps: Iterable[AppRow], ps: dict[int, PsRow]
) -> list[GpuInfo]:
    """Hang each compute process on its GPU (by UUID), enriched with owner/cmdline/age."""
    by_uuid: dict[str | None, list[ProcessInfo]] = {}
    for a in apps:
        p = ps.get(a.pid)
        by_uuid.setdefault(a.gpu_uuid, []).append(
            ProcessInfo(
                pid=a.pid,
                user=p.user if p else None,
                command=(p.args or a.process_name) if p else a.process_name,
                gpu_memory_mib=a.used_memory_mib,
                elapsed_s=p.elapsed_s if p else None,
            )
        )
    gpus = list(gpus)
    # UUIDs are unique on real hardware; masked captures repeat one, so attach once only.
    claimed: set[str | None] = set()
    result = []
    for g in gpus:
        if g.uuid in by_uuid and g.uuid not in claimed and not g.lost:
            claimed.add(g.uuid)
            g = replace(g, processes=tuple(by_uuid[g.uuid]))
        result.append(g)
    return result


# --- failures -----------------------------------------------------------------------------

_DRIVER_TEXTS = (
    "couldn't communicate with the NVIDIA driver",
    "Failed to initialize NVML",
    "Driver/library version mismatch",
    "NVIDIA driver is not loaded",
)


def classify_failure(output: str, rc: int | None) -> HostError | None:
    """The host-level error a failed nvidia-smi call means, or None if it did not fail."""
    text = output.strip()
    if rc == 127 or re.search(r"nvidia-smi: (command )?not found", text):
        return HostError("no-nvidia-smi", "nvidia-smi was not found on the remote PATH")
    for needle in _DRIVER_TEXTS:
        if needle in text:
            return HostError("driver", excerpt(text))
    if "No devices were found" in text:
        return HostError("no-devices", "No devices were found")
    if rc not in (0, None) and not _LOST.search(text):
        return HostError("error", f"nvidia-smi exited with {rc}: {excerpt(text)}")
    return None


# --- the remote script's output -----------------------------------------------------------


def split_sections(text: str) -> list[tuple[str, int | None]]:
    """Split one refresh's output into (section text, exit code) pairs."""
    lines = text.splitlines()
    if lines and lines[0].startswith(f"{MARK} start"):
        lines = lines[1:]
    if lines and lines[-1] == END:
        lines = lines[:-1]
    sections: list[tuple[str, int | None]] = []
    buf: list[str] = []
    for line in lines:
        if line.startswith(f"{MARK} rc "):
            rc_text = line[len(MARK) + 4 :].strip()
            sections.append(("\n".join(buf), int(rc_text) if rc_text.isdigit() else None))
            buf = []
        else:
            buf.append(line)
    if len(sections) != 3:
        raise ParseError(f"incomplete output from the remote script: {excerpt(text)}")
    return sections


def parse_remote_output(text: str) -> tuple[list[GpuInfo], HostError | None]:
    """GPUs with their processes from one refresh's output, or the host error."""
    try:
        (gpu_text, gpu_rc), (apps_text, apps_rc), (ps_text, _) = split_sections(text)
        failure = classify_failure(gpu_text, gpu_rc)
        if failure:
            return [], failure
        gpus = parse_gpu_rows(gpu_text)
        if not gpus:
            return [], HostError("parse", "nvidia-smi listed no GPUs")
        apps = [] if classify_failure(apps_text, apps_rc) else parse_apps_rows(apps_text)
        return attach_processes(gpus, apps, parse_ps_rows(ps_text)), None
    except ParseError as exc:
        return [], HostError("parse", str(exc))


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
        values = {attr: conv(rec.get(f)) for f, attr, conv in GPU_FIELDS}
        gpus.append(GpuInfo(**values))
    return gpus
