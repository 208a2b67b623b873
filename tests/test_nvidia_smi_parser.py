"""The parser against real nvidia-smi output (tests/data, copied from the shared corpus)."""

from __future__ import annotations

from pathlib import Path

import pytest

from gputop.model import GpuInfo, HostError
from gputop.sources.nvidia_smi import (
    APPS_QUERY,
    GPU_FIELDS,
    GPU_QUERY,
    REMOTE_SCRIPT,
    classify_failure,
    gpus_from_records,
    parse_apps_rows,
    parse_args_rows,
    parse_etime,
    parse_gpu_rows,
    parse_owner_rows,
    parse_query_csv,
    parse_remote_output,
    to_float,
    to_int,
)
from gputop.sources.protocol import MARK, frame
from gputop.ssh.transport import ParseError
from tests.support.fleet import CAPTURES, project_capture

DATA = Path(__file__).parent / "data" / "nvidia-smi"
CORPUS = Path(__file__).resolve().parents[2] / "shared" / "fixtures" / "nvidia-smi"


#: A real nvidia-smi timestamp (h100 compute-apps capture): the first field of every row.
TS = "2026/07/14 08:12:53.500"
NONCE = "0123456789abcdef" * 2


def remote(gpu: str, gpu_rc: int = 0, apps: str = "", owners: str = "", args: str = "",
           apps_rc: int = 0) -> tuple[list[GpuInfo], HostError | None]:
    """What the parser makes of one refresh with these sections (framed as the script does)."""
    r = parse_remote_output(frame(NONCE, gpu=(gpu, gpu_rc), apps=(apps, apps_rc),
                                  owners=(owners, 0), args=(args, 0)), NONCE)
    return r.gpus, r.error


@pytest.mark.parametrize("cell", [
    "[N/A]", "[Not Supported]", "[Unknown Error]", "[Requested functionality has been deprecated]",
    "[Function Not Found]", "N/A", "", "   ", "ERR!", "[Insufficient Permissions]",
])
def test_sentinels_are_none_never_zero(cell: str) -> None:
    assert to_int(cell) is None and to_float(cell) is None


def test_numbers_with_and_without_units() -> None:
    assert to_int("81559 MiB") == 81559 and to_int("100 %") == 100
    assert to_float("631.95 W") == 631.95 and to_float("0x0000") == 0.0
    assert to_int("P0") is None


@pytest.mark.parametrize("capture", sorted(CAPTURES))
def test_field_mapping_on_every_all_fields_capture(capture: str) -> None:
    """Projected to our query (as nvidia-smi prints csv,noheader,nounits) == header-mapped."""
    path = CAPTURES[capture]
    (by_header,) = gpus_from_records(parse_query_csv(path.read_text()))
    (positional,) = parse_gpu_rows(project_capture(path, GPU_QUERY))
    assert positional == by_header
    assert positional.memory_total_mib and positional.memory_total_mib > 0
    assert positional.name and positional.name.startswith("NVIDIA ")


def test_known_values_h100() -> None:
    (g,) = parse_gpu_rows(project_capture(CAPTURES["h100"], GPU_QUERY))
    assert (g.index, g.uuid, g.bus_id) == (0, "GPU-00000000-0000-0000-0000-000000000000",
                                          "00000000:00:09.0")
    assert (g.utilization_percent, g.memory_utilization_percent) == (100, 11)
    assert (g.memory_used_mib, g.memory_total_mib, g.temperature_c) == (19818, 81559, 59)
    assert (g.power_draw_w, g.power_limit_w, g.fan_percent) == (631.95, 700.0, None)
    assert (g.pstate, g.mig_mode, g.driver_version) == ("P0", "Disabled", "590.48.01")


def test_mig_capture_has_no_utilisation() -> None:
    (g,) = parse_gpu_rows(project_capture(CAPTURES["h100-mig"], GPU_QUERY))
    assert g.mig_mode == "Enabled"
    assert g.utilization_percent is None and g.memory_utilization_percent is None


def test_noheader_nounits_real_rows() -> None:
    # The exact field list of these captures (SOURCES.md), "" = not kept.
    fields = (("memory.total", "memory_total_mib", to_int), ("memory.free", "", to_int),
              ("memory.used", "memory_used_mib", to_int),
              ("temperature.gpu", "temperature_c", to_int), ("fan.speed", "fan_percent", to_int),
              ("utilization.gpu", "utilization_percent", to_int),
              ("utilization.memory", "memory_utilization_percent", to_int))
    for name in ("geforce-2gb-noheader-nounits-fan-na-newer-driver.csv",
                 "geforce-2gb-noheader-nounits-fan-not-supported-older-driver.csv"):
        (g,) = parse_gpu_rows((DATA / "csv" / name).read_text(), fields)
        assert (g.memory_total_mib, g.memory_used_mib, g.temperature_c) == (2004, 0, 44)
        assert g.fan_percent is None and g.utilization_percent == 0


def test_header_aliases_and_nounits_header_units() -> None:
    (g,) = gpus_from_records(parse_query_csv(
        (DATA / "csv/geforce-rtx-2060-driver-460.91.03-query-gpu-aliases.csv").read_text()))
    assert (g.name, g.bus_id, g.memory_used_mib, g.utilization_percent) == (
        "GeForce RTX 2060", "00000000:09:00.0", 682, 20)
    (p100,) = gpus_from_records(parse_query_csv(
        (DATA / "csv/tesla-p100-pcie-16gb-driver-510.47.03-query-gpu-nounits.csv").read_text()))
    assert (p100.fan_percent, p100.power_draw_w, p100.pstate) == (None, 28.16, "P0")
    two = gpus_from_records(parse_query_csv(
        (DATA / "csv/geforce-gtx-1080ti-and-gtx-1060-6gb-mixed-query-gpu.csv").read_text()))
    assert [g.name for g in two] == ["GeForce GTX 1080 Ti", "GeForce GTX 1060 6GB"]
    assert [g.memory_total_mib for g in two] == [11175, 6078]


def test_compute_apps_rows_real_captures() -> None:
    text = (DATA / "csv/rtx-2080-super-windows-driver-591.86-query-compute-apps-load.csv"
            ).read_text()
    recs = parse_query_csv(text)
    assert len(recs) == 12
    assert any(r["process_name"] and " " in r["process_name"] for r in recs)  # Windows paths
    assert all(r["used_gpu_memory"] is None for r in recs)
    rows = parse_apps_rows(f"{TS}, GPU-1, 11327, 2566\n{TS}, GPU-1, 7, [N/A]\n")
    assert rows[0].pid == 11327 and rows[0].used_memory_mib == 2566
    assert rows[1].used_memory_mib is None


def test_ps_rows_and_etime() -> None:
    assert parse_etime("05:21") == 321
    assert parse_etime("01:00:00") == 3600
    assert parse_etime("2-03:04:05") == 2 * 86400 + 3 * 3600 + 4 * 60 + 5
    assert parse_etime("junk") is None
    owners = parse_owner_rows(" 123 alice     1-00:00:00\n\n 9 1001 00:01\n", [123, 9])
    assert owners[123].user == "alice" and owners[123].elapsed_s == 86400
    assert owners[9].user == "1001"
    args = parse_args_rows(" 123 python train.py --lr 0.1\n 9 /bin/x\n", [123, 9])
    assert args == {123: "python train.py --lr 0.1", 9: "/bin/x"}


@pytest.mark.parametrize(("name", "rc", "kind"), [
    ("driver-communication-failure.txt", 9, "driver"),
    ("nvml-driver-library-version-mismatch.txt", 18, "driver"),
    ("nvml-driver-library-version-mismatch-with-nvml-library-version.txt", 18, "driver"),
    ("nvml-unknown-error-in-container.txt", 255, "driver"),
    ("no-devices-were-found.txt", 6, "no-devices"),
    ("cli-option-missing-value-windows-driver-591.86-exit-255.txt", 255, "error"),
])
def test_real_error_texts_are_classified(name: str, rc: int, kind: str) -> None:
    err = classify_failure((DATA / "errors" / name).read_text(), rc)
    assert err is not None and err.kind == kind
    assert "\n" not in err.message


def test_command_not_found_forms() -> None:
    for text, rc in (("sh: 1: nvidia-smi: not found", 127),
                     ("bash: nvidia-smi: command not found", 127), ("", 127)):
        err = classify_failure(text, rc)
        assert err is not None and err.kind == "no-nvidia-smi"


@pytest.mark.parametrize("name", [
    "device-handle-gpu-is-lost.txt",
    "device-handle-unknown-error-busid-no-space.txt",
    "device-handle-unknown-error-busid-with-space.txt",
])
def test_lost_gpu_beside_a_healthy_one(name: str) -> None:
    healthy = project_capture(CAPTURES["l40s"], GPU_QUERY)
    text = healthy + (DATA / "errors" / name).read_text()
    gpus, err = remote(text, 15)
    assert err is None
    assert [g.lost for g in gpus] == [False, True]
    assert gpus[1].bus_id and gpus[1].lost_reason


def test_processes_attach_to_their_gpu_with_owner() -> None:
    rows = project_capture(CAPTURES["h100"], GPU_QUERY)
    gpus, err = remote(
        rows, apps=f"{TS}, GPU-00000000-0000-0000-0000-000000000000, 11327, 2566",
        owners="11327 alice 10:00", args="11327 /root/tools/memhog --size 2G")
    assert err is None
    (p,) = gpus[0].processes
    assert (p.pid, p.user, p.gpu_memory_mib, p.elapsed_s) == (11327, "alice", 2566, 600)
    assert p.command == "/root/tools/memhog --size 2G"
    assert gpus[0].users == ("alice",)


def test_process_without_ps_row_is_shown_without_owner() -> None:
    rows = project_capture(CAPTURES["h100"], GPU_QUERY)
    gpus, _ = remote(rows, apps=f"{TS}, GPU-00000000-0000-0000-0000-000000000000, 5, [N/A]")
    (p,) = gpus[0].processes
    assert (p.pid, p.user, p.command, p.gpu_memory_mib) == (5, None, None, None)


@pytest.mark.parametrize("text", [
    "", "garbage", f"only one section\n{MARK} {NONCE} gpu 0",
    "\n".join(frame(NONCE, gpu=("1, 2, 3", 0))),
    "\n".join(frame(NONCE)),
    "\n".join(frame(NONCE)).replace(" owners ", " args "),  # out of order
    "\n".join(frame(NONCE)).replace(f" {NONCE} owners", f" {'f' * 32} owners"),  # old nonce
    "\n".join(frame(NONCE)) + "\nafter the last section",
])
def test_malformed_remote_output_is_a_parse_error(text: str) -> None:
    r = parse_remote_output(text.split("\n"), NONCE)
    assert r.gpus == [] and isinstance(r.error, HostError) and r.error.kind == "parse"


def test_parse_error_excerpt_is_sanitised() -> None:
    with pytest.raises(ParseError) as exc:
        parse_gpu_rows("\x1b]0;owned\x07[bold]" + "x" * 500)
    msg = str(exc.value)
    assert "\x1b" not in msg and "\x07" not in msg and len(msg) < 250


def _corpus_files() -> list[Path]:
    base = CORPUS if CORPUS.is_dir() else DATA
    return sorted(p for p in base.rglob("*") if p.is_file() and p.name != "SOURCES.md")


@pytest.mark.parametrize("path", _corpus_files(), ids=lambda p: p.name)
def test_whole_corpus_never_crashes_the_parser(path: Path) -> None:
    """Every real output, fed back as if a host had answered with it: data or a classified
    error, never an exception."""
    text = path.read_text(errors="replace")
    for rc in (0, 255):
        gpus, err = remote(text, rc)
        assert bool(gpus) != (err is not None)  # data or an error, exactly one
        if err is not None:
            assert err.kind in ("parse", "driver", "no-devices", "no-nvidia-smi", "error")
    if path.suffix == ".csv" and not text[:1].isdigit() and "," in text.split("\n", 1)[0]:
        gpus_from_records(parse_query_csv(text))


def test_remote_script_is_constant_posix_sh() -> None:
    import shutil
    import subprocess

    assert GPU_QUERY in REMOTE_SCRIPT and APPS_QUERY in REMOTE_SCRIPT
    sh = shutil.which("dash") or shutil.which("sh")
    assert sh
    r = subprocess.run([sh, "-n", "-c", REMOTE_SCRIPT], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr


def test_not_a_number_is_not_a_reading() -> None:
    assert to_float("nan") is None and to_float("inf") is None and to_int("-inf") is None
    assert to_float(" 42.5 ") == 42.5 and to_int("7") == 7


@pytest.mark.parametrize("cell", ["-5", "1e20", "65536", "3.0", " ", "0x1", "99999999999"])
def test_an_index_that_is_no_device_index_is_unknown(cell: str) -> None:
    """A (hostile or broken) nvidia-smi's index that no device can have is not trusted."""
    sample = {"index": cell, "uuid": "GPU-1", "name": "NVIDIA H100"}
    row = ", ".join(sample.get(f, "1") for f, _, _ in GPU_FIELDS)
    (g,) = parse_gpu_rows(row)
    assert g.index is None and g.name is not None
