"""The framing of the remote script's output and the parser's hard cases, without SSH.

The remote script itself is run here too, by a real POSIX shell (dash where installed)
with a stand-in nvidia-smi, and read through the same framing the SSH source uses.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from gputop.sources.nvidia_smi import (
    GPU_QUERY,
    REMOTE_SCRIPT,
    classify_failure,
    parse_args_rows,
    parse_gpu_rows,
    parse_owner_rows,
    parse_remote_output,
    script_pids,
    to_str,
)
from gputop.sources.protocol import (
    MARK,
    FramingError,
    LineReader,
    OutputTooLarge,
    end_line,
    frame,
    split_frame,
    start_pid,
)
from gputop.ssh.transport import ParseError
from tests.support.fleet import CAPTURES, project_capture

NONCE = "a" * 32
DATA = Path(__file__).parent / "data" / "nvidia-smi"
LOST = (DATA / "errors/device-handle-gpu-is-lost.txt").read_text().strip()
ROW = project_capture(CAPTURES["l40s"], GPU_QUERY).strip()


def row(index: int, uuid: str) -> str:
    cells = ROW.split(", ")
    cells[2], cells[3] = str(index), uuid  # after timestamp, count
    return ", ".join(cells)


def test_line_reader_enforces_the_limit_as_bytes_arrive() -> None:
    r = LineReader(100)
    assert r.feed(b"x" * 60) == []  # no newline yet: nothing is a line, but it is counted
    with pytest.raises(OutputTooLarge, match="output larger than 100 bytes"):
        r.feed(b"x" * 41)
    r = LineReader(100)
    assert r.feed(b"ab\ncd") == ["ab"] and r.pending
    assert r.feed(b"e\n\xff\n") == ["cde", "\ufffd"] and not r.pending


def test_a_marker_counts_only_as_a_whole_line_with_this_refresh_nonce() -> None:
    lines = frame(NONCE, gpu=(ROW, 0))
    # what a user could print: the marker text inside a line, or with another nonce
    hostile = [f"x {MARK} {NONCE} apps 0", f"{MARK} {'b' * 32} apps 0", f"{MARK} end",
               f" {MARK} {NONCE} apps 0"]
    lines[3:3] = hostile  # inside the apps section
    sections = split_frame(lines, NONCE)
    assert sections["apps"].text.split("\n")[: len(hostile)] == hostile
    assert sections["gpu"].text.strip() == ROW


@pytest.mark.parametrize("lines", [
    frame(NONCE)[:-1],  # the last marker missing
    [*frame(NONCE)[:2], f"{MARK} {NONCE} gpu 0", *frame(NONCE)[2:]],  # a section twice
    [f"{MARK} {NONCE} gpu x", *frame(NONCE)[2:]],  # not an exit code
    [f"{MARK} {NONCE} gpu 0 extra", *frame(NONCE)[2:]],
])
def test_frames_that_do_not_check_out(lines: list[str]) -> None:
    with pytest.raises(FramingError):
        split_frame(lines, NONCE)


def test_start_and_end_lines_are_exact() -> None:
    assert start_pid(f"{MARK} {NONCE} start 123", NONCE) == 123
    for line in (f"{MARK} {NONCE} start 123 ", f"{MARK} {NONCE} start", f"{MARK} start 1",
                 f"x{MARK} {NONCE} start 1", f"{MARK} {'b' * 32} start 1"):
        assert start_pid(line, NONCE) is None
    assert end_line(NONCE) == f"{MARK} {NONCE} end"


@pytest.mark.parametrize("where", ["first", "middle", "last", "inside a row"])
def test_lost_gpu_line_anywhere(where: str) -> None:
    rows = [row(i, f"GPU-{i}").replace("00000000:01:00.0", f"00000000:0{i + 1}:00.0")
            for i in (0, 2)]
    if where == "first":
        text = "\n".join([LOST, *rows])
    elif where == "middle":
        text = "\n".join([rows[0], LOST, rows[1]])
    elif where == "last":
        text = "\n".join([*rows, LOST])
    else:  # stdout block-buffered, stderr not: the lost line lands inside a row
        cut = len(rows[1]) // 2
        text = "\n".join([rows[0], rows[1][:cut] + LOST, rows[1][cut:]])
    r = parse_remote_output(frame(NONCE, gpu=(text, 15), apps=(LOST, 15)), NONCE)
    assert r.error is None, r.error
    assert [(g.bus_id, g.lost) for g in r.gpus] == [
        ("00000000:01:00.0", False), ("00000000:03:00.0", False), ("0000:02:00.0", True)]
    assert r.gpus[2].lost_reason == "GPU is lost. Reboot the system to recover this GPU"
    assert r.warnings == ()


def test_host_messages_lead_with_their_meaning() -> None:
    err = classify_failure(f"{ROW}\n{ROW}\nSomething unexpected happened", 15)
    assert err is not None and err.kind == "error"
    assert err.message == "nvidia-smi failed (exit 15): Something unexpected happened"
    err = classify_failure(f"{ROW}\nFailed to initialize NVML: Unknown Error", 255)
    assert err is not None and err.kind == "driver"
    assert err.message == "Failed to initialize NVML: Unknown Error"
    err = classify_failure(ROW, 3)
    assert err is not None and err.message.startswith("nvidia-smi failed (exit 3): ")


def test_owner_rows_are_strict_args_rows_lenient() -> None:
    with pytest.raises(ParseError):
        parse_owner_rows("1 root 00:01\n", [42])  # a pid nobody asked about
    with pytest.raises(ParseError):
        parse_owner_rows("42 alice 00:01\n42 bob 00:01\n", [42])
    # a process using two GPUs is asked for twice; a ps that repeats it is not an attack
    assert parse_owner_rows("42 alice 00:01\n42 alice 00:01\n", [42, 42])[42].user == "alice"
    with pytest.raises(ParseError):
        parse_owner_rows("42 alice 00:01 python x.py\n", [42])
    # command lines: a continuation joins its row; a pid seen twice has no command at all
    args = parse_args_rows("42 python a.py\n--lr 1\n99 not asked\n7 x\n7 forged\n", [42, 7])
    assert args == {42: "python a.py --lr 1 99 not asked"}


def test_strings_are_cleaned_where_records_are_built() -> None:
    assert to_str("NVIDIA \x1b[31mH100\x1b[0m\u202e") == "NVIDIA H100"
    assert to_str("\x1b[0m") is None
    (g,) = parse_gpu_rows(ROW.replace("NVIDIA L40S", "NVIDIA \x1b]0;t\x07L40S"))
    assert g.name == "NVIDIA L40S"


def test_the_script_runs_in_a_posix_shell_and_frames_its_output(tmp_path: Path) -> None:
    """dash runs the real script with a stand-in nvidia-smi and the real ps; a second
    refresh with another nonce is framed by that nonce only."""
    sh = shutil.which("dash") or shutil.which("sh")
    assert sh
    (tmp_path / "nvidia-smi").write_text(  # pid 1 runs on both GPUs
        "#!/bin/sh\ncase $1 in --query-gpu=*) printf '%s\\n%s\\n' \"$ROW\" \"$ROW2\" ;; "
        "*) printf '2026/07/14 08:12:53.500, GPU-x, 1, 5\\n"
        "2026/07/14 08:12:53.500, GPU-y, 1, 7\\n' ;; esac\n")
    (tmp_path / "nvidia-smi").chmod(0o755)
    nonces = ["1" * 32, "2" * 32, "3" * 32]
    r = subprocess.run([sh, "-c", REMOTE_SCRIPT], input="\n".join(nonces) + "\n",
                       capture_output=True, text=True, timeout=30,
                       env={"PATH": f"{tmp_path}:/usr/bin:/bin", "ROW": row(0, "GPU-x"),
                            "ROW2": row(1, "GPU-y")})
    lines = r.stdout.split("\n")
    assert start_pid(lines[0], nonces[0])
    first = lines[1: lines.index(end_line(nonces[1]))]
    result = parse_remote_output(first, nonces[1])
    assert result.error is None, result.error
    assert [[(p.pid, p.gpu_memory_mib) for p in g.processes] for g in result.gpus] == [
        [(1, 5)], [(1, 7)]]
    assert result.gpus[0].processes[0].user and result.gpus[0].processes[0].command
    second = lines[lines.index(end_line(nonces[1])) + 1: lines.index(end_line(nonces[2]))]
    assert parse_remote_output(second, nonces[2]).error is None
    assert parse_remote_output(second, nonces[1]).error is not None  # the wrong nonce


#: Lines a failed compute-apps query might print besides its rows, as the remote script's
#: ``IFS=', ' read`` splits them: some give it a pid for ps, some look as if they did.
ODD_APPS_LINES = [
    "GPU 0000:07:00.0, pid 1, Unknown Error",  # the 4th field is a pid to the script
    ", ,1 ,2, x",  # empty fields: commas with and without spaces
    "  a   b  c   3   ",
    "a\tb c 4 5",  # a tab separates nothing there
    "a b c \uff14",  # a fullwidth digit is no pid
    "a,b,c,,6",
    "a b c 7\r",
    LOST,
]


@pytest.mark.parametrize("shell", ["dash", "bash"])
@pytest.mark.parametrize("at", ["first", "middle", "last"])
def test_a_failed_apps_query_keeps_its_rows_and_the_owners_ps_gave(
        tmp_path: Path, shell: str, at: str) -> None:
    """Issue 19: an apps query that exits 15 (a GPU lost) but lists the other GPUs'
    processes. The real script, run by a real shell, asks ps about every pid it picks out
    of that output, odd lines included; the parser reads the rows and accepts exactly the
    owners the script asked for (not a ``parse: unexpected ps row`` for the host)."""
    sh = shutil.which(shell)
    if sh is None:
        pytest.skip(f"{shell} is not installed")
    rows = ["2026/07/14 08:12:53.500, GPU-x, 100, 5", "2026/07/14 08:12:53.500, GPU-y, 200, 7"]
    apps = {"first": [*ODD_APPS_LINES, *rows], "middle": [rows[0], *ODD_APPS_LINES, rows[1]],
            "last": [*rows, *ODD_APPS_LINES]}[at]
    (tmp_path / "gpu.txt").write_text(f"{row(0, 'GPU-x')}\n{row(1, 'GPU-y')}\n{LOST}\n")
    (tmp_path / "apps.txt").write_text("\n".join(apps) + "\n")
    (tmp_path / "nvidia-smi").write_text(
        f"#!/bin/sh\ncd {tmp_path}\ncase $1 in --query-gpu=*) cat gpu.txt ;; "
        "*) cat apps.txt ;; esac\nexit 15\n")
    # ps answers every pid it is asked about (as for live processes) and logs the list.
    (tmp_path / "ps").write_text(
        f"#!/bin/sh\nfor a; do last=$a; done\necho \"$last\" >> {tmp_path}/asked\n"
        "case \"$*\" in *args=*) f=args ;; *) f=owner ;; esac\n"
        "IFS=,; for p in $last; do if [ $f = args ]; then echo \"$p python job.py\"; "
        "else echo \"$p root 00:01\"; fi; done\n")
    for name in ("nvidia-smi", "ps"):
        (tmp_path / name).chmod(0o755)
    nonces = ["1" * 32, "2" * 32]
    r = subprocess.run([sh, "-c", REMOTE_SCRIPT], input="\n".join(nonces) + "\n",
                       capture_output=True, text=True, timeout=30,
                       env={"PATH": f"{tmp_path}:/usr/bin:/bin"})
    lines = r.stdout.split("\n")
    result = parse_remote_output(lines[1: lines.index(end_line(nonces[1]))], nonces[1])
    assert result.error is None, result.error
    assert [g.lost for g in result.gpus] == [False, False, True]
    assert [[(p.pid, p.user) for p in g.processes] for g in result.gpus] == [
        [(100, "root")], [(200, "root")], []]
    # The lost GPU says why the query failed; the lines that are neither rows nor a lost
    # GPU's are shown as what they are.
    (warning,) = result.warnings
    assert warning.startswith("processes may be missing: nvidia-smi failed (exit 15): GPU "
                              "0000:07:00.0, pid 1, Unknown Error , ,1 ,2, x"), warning
    asked = (tmp_path / "asked").read_text().split()
    assert asked[0] == asked[1]  # owners, then command lines, for the same pids
    assert sorted(map(int, asked[0].split(","))) == sorted(script_pids("\n".join(apps)))


def test_a_failed_apps_query_without_a_lost_gpu_is_a_warning() -> None:
    """Rows of a failed query nothing explains are shown, with a warning that the list may
    be incomplete; with no rows, the processes are unknown (the host still shows)."""
    apps = "2026/07/14 08:12:53.500, GPU-x, 100, 5\nSomething unexpected happened"
    lines = frame(NONCE, gpu=(row(0, "GPU-x"), 0), apps=(apps, 15),
                  owners=("100 root 00:01", 0))
    r = parse_remote_output(lines, NONCE)
    assert r.error is None, r.error
    assert [p.pid for p in r.gpus[0].processes] == [100]
    assert r.warnings == ("processes may be missing: nvidia-smi failed (exit 15): "
                          "Something unexpected happened",)
    r = parse_remote_output(frame(NONCE, gpu=(row(0, "GPU-x"), 0),
                                  apps=("Something unexpected happened", 15)), NONCE)
    assert r.error is None and r.gpus[0].processes == ()
    assert r.warnings == ("processes unknown: nvidia-smi failed (exit 15): "
                          "Something unexpected happened",)
