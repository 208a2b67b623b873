"""The streaming session's remote side, run locally under /bin/sh (no sshd needed): the
relay holds a GPU sample until its last row, so a host writes once per refresh, and
closing stdin ends everything. A fake ``nvidia-smi`` script on PATH stands in for the GPU
(rows from a real capture); the fleet tests run the same script over real OpenSSH."""

from __future__ import annotations

import os
import select
import subprocess
import time
from pathlib import Path

from gputop.sources.stream_session import session_command
from tests.test_stream_parse import row

NONCE = "0123456789abcdef0123456789abcdef"


def fake_smi(tmp_path: Path) -> Path:
    body = [row(i, 2).split(", ", 1)[1] for i in range(2)]
    script = tmp_path / "nvidia-smi"
    script.write_text(
        "#!/bin/sh\n"
        'ts() { date "+%Y/%m/%d %H:%M:%S.000"; }\n'
        'case "$1" in\n'
        "--query-gpu=*) while :; do t=$(ts)\n"
        f'  printf "%s, %s\\n" "$t" "{body[0]}"; sleep 0.3\n'  # a sample in two writes
        f'  printf "%s, %s\\n" "$t" "{body[1]}"; sleep 0.2; done ;;\n'
        '*) while :; do printf "%s, GPU-0, 4242, 100\\n" "$(ts)"; sleep 0.5; done ;;\n'
        "esac\n")
    script.chmod(0o755)
    return tmp_path


def test_the_relay_writes_a_gpu_sample_once_and_stdin_eof_ends_the_session(
    tmp_path: Path,
) -> None:
    env = {**os.environ, "PATH": f"{fake_smi(tmp_path)}:{os.environ['PATH']}"}
    p = subprocess.Popen(["/bin/sh", "-c", session_command(0.5)], stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE, env=env, start_new_session=True)
    assert p.stdin is not None and p.stdout is not None
    chunks: list[bytes] = []
    try:
        p.stdin.write(f"{NONCE}\n".encode())
        p.stdin.flush()
        end = time.monotonic() + 3.3
        while time.monotonic() < end:
            ready, _, _ = select.select([p.stdout], [], [], 0.1)
            if ready:
                chunks.append(os.read(p.stdout.fileno(), 65536))
        first, *rest = b"".join(chunks).decode().split("\n", 1)
        assert first.startswith(f"@@gputop {NONCE} start ")
        assert all(ln[:2] in ("g ", "a ") for ln in rest[0].splitlines()), rest
    finally:
        p.stdin.close()  # EOF: the session kills its whole process group
        p.wait(5)
    # After the first two samples (written as they come), one write per sample: both
    # rows at once, though the stand-in wrote them 0.3 s apart; apps rows ride along.
    late: list[str] = []
    done = 0  # complete samples written so far: apps rows go out as they come till two
    for c in (c.decode() for c in chunks):
        if done >= 2 and "g " in c:
            late.append(c)
        done += sum(ln.startswith("g ") and ln.split(", ")[2] == "1" for ln in c.splitlines())
    assert len(late) >= 3, chunks
    for c in late:
        rows = [ln for ln in c.splitlines() if ln.startswith("g ")]
        assert len(rows) == 2 and rows[0].split(", ")[2] == "0", c
        assert rows[1].split(", ")[2] == "1", c
        assert not c.startswith("a ") or "\ng " in c  # no write of apps rows alone
    time.sleep(0.3)
    out = subprocess.run(["ps", "-o", "pid=,stat=", "-g", str(p.pid)], capture_output=True,
                         text=True).stdout
    alive = [ln for ln in out.splitlines() if not ln.split()[1].startswith("Z")]
    assert alive == [], out


def test_apps_rows_carry_each_process_start_time_read_by_awk(tmp_path: Path) -> None:
    """The apps tagger appends /proc/PID/stat's start time (field 22) to each row, counting
    fields after the command name's last ``) ``: a process named ``x) R 1`` + newline +
    ``2 3`` cannot shift them; a pid with no /proc entry gets ``-``."""
    hostile = tmp_path / "x) R 1\n2 3"
    hostile.write_bytes(Path("/bin/sleep").read_bytes())
    hostile.chmod(0o755)
    job = subprocess.Popen([str(hostile), "30"])
    time.sleep(0.1)
    stat = Path(f"/proc/{job.pid}/stat").read_text()
    assert ") R 1\n2 3) " in stat  # the kernel shows the hostile name as it is
    start = stat.rsplit(") ", 1)[1].split()[19]
    missing = int(Path("/proc/sys/kernel/pid_max").read_text()) + 7
    smi = tmp_path / "bin"
    smi.mkdir()
    (smi / "nvidia-smi").write_text(
        "#!/bin/sh\n"
        'ts() { date "+%Y/%m/%d %H:%M:%S.000"; }\n'
        'case "$1" in\n'
        f'--query-gpu=*) while :; do printf "%s, %s\\n" "$(ts)" "{row(0, 1).split(", ", 1)[1]}"; '
        "sleep 0.2; done ;;\n"
        f'*) while :; do printf "%s, GPU-0, {job.pid}, 100\\n%s, GPU-0, {missing}, 5\\n" '
        '"$(ts)" "$(ts)"; sleep 0.2; done ;;\n'
        "esac\n")
    (smi / "nvidia-smi").chmod(0o755)
    env = {**os.environ, "PATH": f"{smi}:{os.environ['PATH']}"}
    p = subprocess.Popen(["/bin/sh", "-c", session_command(0.2)], stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE, env=env, start_new_session=True)
    assert p.stdin is not None and p.stdout is not None
    out = b""
    try:
        p.stdin.write(f"{NONCE}\n".encode())
        p.stdin.flush()
        end = time.monotonic() + 5
        while out.count(b"\na ") < 4 and time.monotonic() < end:
            ready, _, _ = select.select([p.stdout], [], [], 0.1)
            if ready:
                out += os.read(p.stdout.fileno(), 65536)
    finally:
        p.stdin.close()
        p.wait(5)
        job.kill()
        job.wait()
    rows = [ln[2:] for ln in out.decode().splitlines() if ln.startswith("a ")]
    assert rows, out
    for r in rows:
        cells = r.split(", ")
        assert len(cells) == 5, r
        if cells[2] == str(missing):
            assert cells[4] == "-", r
        else:
            assert cells[2] == str(job.pid) and cells[4] == start, r
