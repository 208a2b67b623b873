"""The report for people (a table and a text chart), for spreadsheets (CSV) and as a plot.

Host, user and GPU names come from other machines: the text form cleans them, the CSV
form defuses cells a spreadsheet would run as a formula.
"""

from __future__ import annotations

import csv
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, TextIO

from gputop.errors import UsageError
from gputop.history.names import MAX_NAMED, OTHER_NAMES
from gputop.text import clean

_BLOCKS = " ▁▂▃▄▅▆▇█"
BY_COLUMNS = {
    "user": ("user", "used_hours", "reserved_hours", "reserved_idle_hours", "shared_hours",
             "shared_idle_hours", "unreserved_hours", "held_idle_hours",
             "mean_utilization_used"),
    "host": ("host", "gpus", "gpu_hours", "busy_hours", "idle_hours", "held_idle_hours",
             "no_data_hours", "mean_utilization", "used_hours", "reserved_hours",
             "reserved_idle_hours", "unknown_gpus_hours"),
    "gpu": ("host", "index", "name", "uuid", "gpu_hours", "busy_hours", "idle_hours",
            "held_idle_hours", "no_data_hours", "mean_utilization", "used_hours",
            "reserved_hours", "reserved_idle_hours"),
}
_HEADERS = {"user": "USER", "host": "HOST", "gpus": "GPUS", "index": "GPU", "name": "MODEL",
            "uuid": "UUID", "used_hours": "USED", "reserved_hours": "RESERVED",
            "reserved_idle_hours": "RES. IDLE", "unreserved_hours": "UNRESERVED",
            "shared_hours": "OF IT SHARED", "shared_idle_hours": "SHARED IDLE",
            "held_idle_hours": "HELD IDLE", "mean_utilization_used": "UTIL WHEN USED",
            "gpu_hours": "GPU-H", "busy_hours": "BUSY", "idle_hours": "IDLE",
            "no_data_hours": "NO DATA", "mean_utilization": "MEAN UTIL"}
#: In CSV and JSON only; the text form says it in a line under the table.
_TEXT_SKIP = {"unknown_gpus_hours"}


def sparkline(values: list[float | None]) -> str:
    """0-100 % as block characters; a gap (no data) is a blank, never a 0 % bar."""
    out = []
    for v in values:
        if v is None:
            out.append(" ")
        else:
            out.append(_BLOCKS[1 + min(7, max(0, int(v / 100 * 8 - 1e-9)))] if v > 0 else "▁")
    return "".join(out)


def _cell(key: str, v: Any) -> str:
    if v is None:
        return "?" if key == "gpus" else "-"
    if key.startswith("mean_utilization"):
        return f"{v:.0f} %"
    if isinstance(v, float):
        return _num(v)
    return clean(str(v))[:40]


def _num(v: float) -> str:
    return f"{v:.2f}" if abs(v) < 10 else f"{v:.1f}" if abs(v) < 1000 else f"{v:.0f}"


def _local(iso: str) -> str:
    t = datetime.fromisoformat(iso.replace("Z", "+00:00"))
    return t.astimezone().strftime("%Y-%m-%d %H:%M")


def _pct(v: float | None) -> str:
    return "-" if v is None else f"{v:.0f} %"


def _span_words(seconds: float) -> str:
    m = round(seconds / 60)
    if m < 1:
        return f"{round(seconds)}s"
    return f"{m // 1440}d{m % 1440 // 60}h" if m >= 1440 else (
        f"{m // 60}h{m % 60:02d}m" if m >= 60 else f"{m}m")


def _since(a: str, b: str) -> float:
    return (datetime.fromisoformat(b.replace("Z", "+00:00"))
            - datetime.fromisoformat(a.replace("Z", "+00:00"))).total_seconds()


def _header(doc: dict[str, Any], out: TextIO) -> None:
    """The span the numbers are for: what was recorded of the range asked, and the gaps in
    it (no recorder running), so a short or broken record never reads as the whole range."""
    rec = doc.get("recorded")
    gaps = rec["gaps"] if rec else []
    if not rec or (not gaps and (rec["from"], rec["to"]) == (doc["from"], doc["to"])):
        print(f"GPU-hours from {_local(doc['from'])} to {_local(doc['to'])} (local time)",
              file=out)
    else:
        missed = sum(_since(g["from"], g["to"]) for g in gaps)
        print(f"GPU-hours from {_local(rec['from'])} to {_local(rec['to'])} (local time): "
              f"recorded {_span_words(_since(rec['from'], rec['to']) - missed)} of the "
              f"{_span_words(_since(doc['from'], doc['to']))} asked (from "
              f"{_local(doc['from'])} to {_local(doc['to'])})", file=out)
    for g in gaps[:MAX_GAPS]:
        print(f"not recorded from {_local(g['from'])} to {_local(g['to'])} "
              f"({_span_words(_since(g['from'], g['to']))}): no recorder was running", file=out)
    if len(gaps) > MAX_GAPS:
        more = sum(_since(g["from"], g["to"]) for g in gaps[MAX_GAPS:])
        print(f"and {len(gaps) - MAX_GAPS} more gaps ({_span_words(more)} in all; --json "
              "lists them)", file=out)


#: Gaps named in the text form (--json has them all).
MAX_GAPS = 5


def write_text(doc: dict[str, Any], by: str, out: TextIO) -> None:
    hl = doc["headline"]
    _header(doc, out)
    print(f"of {_num(hl['gpu_hours'])} GPU-hours, {_pct(hl['busy_percent'])} busy, "
          f"{_pct(hl['idle_percent'])} idle, {_pct(hl['held_idle_percent'])} held idle "
          f"({_num(hl['no_data_hours'])} GPU-hours with no data while recording)", file=out)
    if hl.get("hosts_with_unknown_gpus"):
        print(f"and {hl['hosts_with_unknown_gpus']} host(s) down before any of their GPUs "
              f"was seen: {_num(hl['unknown_gpus_hours'])} host-hours with no data, not "
              "counted as GPU-hours (how many GPUs is unknown)", file=out)
    if not doc["hosts"] and not doc["users"]:
        print("nothing recorded in this range", file=out)
        return
    tables = {"user": ["user", "host"], "host": ["host"], "gpu": ["gpu"]}[by]
    for which in tables:
        rows = doc[which + "s"]
        cols = tuple(c for c in BY_COLUMNS[which] if c not in _TEXT_SKIP)
        table = [[_HEADERS[c] for c in cols]] + [[_cell(c, r.get(c)) for c in cols]
                                                  for r in rows]
        if which == "host":
            table[0].append("UTILISATION OVER TIME")
            for row, r in zip(table[1:], rows):
                row.append(sparkline(doc["series"]["hosts"].get(r["host"], [])))
            table.append(["fleet"] + [""] * (len(cols) - 1)
                         + [sparkline(doc["series"]["fleet"])])
        widths = [max(len(row[i]) for row in table) for i in range(len(table[0]))]
        print(file=out)
        # Words (names, uuids, the chart) start at their column; numbers end at theirs.
        left = [i == 0 or i >= len(cols) or cols[i] in _WORDS for i in range(len(widths))]
        for row in table:
            cells = [c.ljust(w) if lj else c.rjust(w) for c, w, lj in zip(row, widths, left)]
            print("  ".join(cells).rstrip(), file=out)
        if which == "host":
            for r in rows:
                if r.get("unknown_gpus_hours"):
                    print(f"  {clean(r['host'])[:40]}: down {_num(r['unknown_gpus_hours'])} h "
                          "before any of its GPUs was seen (GPUs unknown, not in GPU-hours)",
                          file=out)
        if which == "user" and any(r["user"] == OTHER_NAMES for r in rows):
            print(f"  {OTHER_NAMES}: names seen for a single refresh, names over the limit "
                  f"on new names, and names past the {MAX_NAMED} busiest of a GPU in a "
                  "minute, hour or day (see docs/history.md)", file=out)
    print(f"\nchart: one column per {_step_words(doc['series']['step_s'])}, blank = no data",
          file=out)


#: Columns of words, not numbers.
_WORDS = frozenset(("host", "user", "name", "uuid", "gpu"))


def _step_words(step: int) -> str:
    for unit, s in (("day", 86400), ("h", 3600), ("min", 60)):
        if step >= s and step % s == 0:
            return f"{step // s} {unit}" if unit != "day" else f"{step // s} day(s)"
    return f"{step} s"


def _defuse(v: Any) -> Any:
    if isinstance(v, float):
        return round(v, 6)  # hours to 4 ms; not 100.00000000000001
    if not isinstance(v, str):
        return v
    v = clean(v)
    return "'" + v if v[:1] in ("=", "+", "-", "@") else v


def write_csv(doc: dict[str, Any], by: str, out: TextIO) -> None:
    cols = BY_COLUMNS[by]
    w = csv.writer(out, lineterminator="\n")
    w.writerow(cols)
    for r in doc[by + "s"]:
        w.writerow([_defuse(r.get(c)) if r.get(c) is not None else "" for c in cols])


def write_plot(doc: dict[str, Any], path: Path) -> None:
    """Utilisation over time per host, and GPU-hours per user. Needs matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        # Not `pip install 'gputop[plot]'`: gputop is installed from a checkout, and that
        # name on an index may be someone else's package.
        raise UsageError("--plot needs matplotlib in gputop's own environment: pipx inject "
                         "gputop matplotlib, or pip install '.[plot]' in the checkout "
                         "(uv tool install '.[plot]')") from None
    start = datetime.fromisoformat(doc["series"]["start"].replace("Z", "+00:00"))
    step = doc["series"]["step_s"]
    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(11, 8))
    from datetime import timedelta

    for name, values in [*doc["series"]["hosts"].items(), ("fleet", doc["series"]["fleet"])]:
        xs = [(start + timedelta(seconds=step * i)).astimezone(timezone.utc)
              for i in range(len(values))]
        ys = [float("nan") if v is None else v for v in values]
        # a marker too: a value between two gaps draws no line, and would not show
        ax1.plot(xs, ys, label=clean(name)[:30], linewidth=2.5 if name == "fleet" else 1,
                 marker="o", markersize=2)
    ax1.set_ylabel("utilisation %")
    ax1.set_ylim(0, 100)
    ax1.set_title("utilisation over time (gaps: no data)")
    if len(doc["series"]["hosts"]) <= 12:
        ax1.legend(fontsize="small")
    users = doc["users"][:30]
    names = [clean(u["user"])[:20] for u in users]
    keys = ("used_hours", "reserved_hours", "reserved_idle_hours", "held_idle_hours")
    width = 0.2
    for i, k in enumerate(keys):
        ax2.bar([x + (i - 1.5) * width for x in range(len(users))], [u[k] for u in users],
                width, label=k.replace("_hours", "").replace("_", " "))
    ax2.set_xticks(range(len(users)), names, rotation=30, ha="right")
    ax2.set_ylabel("GPU-hours")
    ax2.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def fleet_text(hour: dict[str, Any], day: dict[str, Any], width: int = 24) -> str:
    """The board's fleet view: per host, the last hour's and day's mean load and how the
    day's GPU-hours split, with the day's load as a text chart (blank: no data)."""
    hl = day["headline"]
    lines = [f"last 24 h: of {_num(hl['gpu_hours'])} GPU-hours, {_pct(hl['busy_percent'])} "
             f"busy, {_pct(hl['idle_percent'])} idle, {_pct(hl['held_idle_percent'])} held "
             f"idle; {_num(hl['no_data_hours'])} GPU-hours with no data", ""]
    hour_util = {h["host"]: h["mean_utilization"] for h in hour["hosts"]}
    rows = [["HOST", "HOUR", "DAY", "BUSY", "IDLE", "HELD IDLE", "NO DATA", "LAST 24 H"]]
    for h in day["hosts"]:
        data = h["gpu_hours"] - h["no_data_hours"]

        def share(x: float, data: float = data) -> str:
            return "-" if data <= 0 else f"{100 * x / data:.0f} %"

        series = day["series"]["hosts"].get(h["host"], [])
        step = max(1, len(series) // width) if series else 1
        chart = [None if not (part := [v for v in series[i:i + step] if v is not None])
                 else sum(part) / len(part) for i in range(0, len(series), step)]
        rows.append([clean(h["host"])[:24], _pct(hour_util.get(h["host"])),
                     _pct(h["mean_utilization"]), share(h["busy_hours"]),
                     share(h["idle_hours"]), share(h["held_idle_hours"]),
                     f"{_num(h['no_data_hours'])} h" if h.get("gpus") is not None else
                     f"{_num(h.get('unknown_gpus_hours', 0.0))} h, GPUs ?", sparkline(chart)])
    if len(rows) == 1:
        return "\n".join([*lines, "nothing recorded in the last 24 hours"])
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for r in rows:
        lines.append("  ".join([r[0].ljust(widths[0])]
                               + [c.rjust(w) for c, w in zip(r[1:-1], widths[1:-1])]
                               + [r[-1]]).rstrip())
    return "\n".join(lines)
