"""A test fleet of real OpenSSH ``sshd`` processes on loopback.

Each host is an ``sshd`` on its own 127.0.x.y address with its own generated host key. The
client side is a generated ``HOME`` with ``~/.ssh/config``, ``known_hosts`` and a key. Each
host's sessions get a stand-in ``nvidia-smi`` first on PATH (sshd's ``SetEnv``) that replays
real captures from ``tests/data/nvidia-smi`` (projected onto the fields gputop asks for, the
way ``--format=csv,noheader,nounits`` prints them) and real failure texts and exit codes.
GPU processes are real processes owned by real test users, so the remote ``ps`` tells the
truth about them.

Used by the tests (``conftest.py``'s fixtures) and by the benchmark (``bench/``).
"""

from __future__ import annotations

import contextlib
import os
import pwd
import re
import shlex
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

from gputop.sources.nvidia_smi import APPS_QUERY, GPU_QUERY

DATA = Path(__file__).resolve().parents[1] / "data" / "nvidia-smi"
SSHD = shutil.which("sshd") or "/usr/sbin/sshd"
TEST_USERS = ("gtalice", "gtbob")

GPU_ARGS = f"--query-gpu={GPU_QUERY} --format=csv,noheader,nounits"
#: The fields after the timestamp, which the stand-in prints itself, as it prints the row.
ROW_QUERY = GPU_QUERY.split(",", 1)[1]
ROW_FIELDS = ROW_QUERY.split(",")
APPS_ARGS = f"--query-compute-apps={APPS_QUERY} --format=csv,noheader,nounits"

STANDIN = r"""#!/bin/bash
# Stand-in nvidia-smi for the gputop test fleet: replays recorded output for this host.
# Like the real one it loops with -l SEC / --loop=SEC / -lms MS / --loop-ms=MS: a start-up
# delay once, then one sample per interval; a failing sample (a lost GPU: exit 15) ends it.
# Each start is logged; the loop itself starts no process (bash builtins only).
d={smi_dir}
printf '%s\n' "nvidia-smi $*" >> {log}
loop= prev= rest=
for a in "$@"; do
  case $prev in
    -l) loop=$a; prev=; continue ;;
    -lms) loop=$((a / 1000)).$(printf '%03d' $((a % 1000))); prev=; continue ;;
  esac
  case $a in
    -l|-lms) prev=$a ;;
    --loop=*) loop=${{a#--loop=}} ;;
    --loop-ms=*) a=${{a#--loop-ms=}}; loop=$((a / 1000)).$(printf '%03d' $((a % 1000))) ;;
    *) rest="$rest${{rest:+ }}$a" ;;
  esac
done
cd -P "$d" || exit 1
exec 3<>{fifo}  # nobody writes to it: `read -t` on it is a sleep without a process
if [ -f "./delay" ]; then read -r delay < "./delay"; read -r -t "$delay" -u 3 _; fi
case "$1" in
  --query-gpu=*) k=gpu ;;
  --query-compute-apps=*) k=apps ;;
  -L) k=list ;;
  -q) k=xml ;;
  *) k=default ;;
esac
if [ -f "./$k.args" ]; then
  read -r want < "./$k.args"
  if [ "$rest" != "$want" ]; then
    echo "Field in \"$1\" is not a valid field to query."
    echo "Please run 'nvidia-smi --help-query-${{k}}' for help."
    exit 2
  fi
fi
if [ -n "$loop" ] && [ -f "./noloop" ]; then
  echo "Invalid combination of input arguments. Please run 'nvidia-smi -h' for help."
  exit 2
fi
# One sample: numbered chunks in order: *.err to stderr, *.rows prefixed with the
# timestamp, the rest as they are (a lost GPU's line comes on stderr, wherever nvidia-smi
# happens to print it).
# stdout is block-buffered into a pipe and flushed once per sample, as the real one's: one
# write per stdout chunk; stderr (a lost GPU's line) is not buffered.
sample() {{
  cd -P "$d" || exit 1  # the scenario now: set_scenario swaps the directory at once
  # One reading of the clock for both halves: bash's -1 is time(), the kernel's coarse
  # seconds, which lag EPOCHREALTIME by up to a tick (a sample a few ms after a second
  # began was stamped a whole second early, and its processes went to the wrong sample).
  now=$EPOCHREALTIME
  printf -v ts '%(%Y/%m/%d %H:%M:%S)T' "${{now%.*}}"
  ms=${{now#*.}}; ts="$ts.${{ms:0:3}}"
  for f in "./$k".[0-9]*; do
    [ -f "$f" ] || continue
    out=
    case $f in
      *.rows) while IFS= read -r line; do out="$out$ts, $line"$'\n'; done < "$f"
              printf '%s' "$out" ;;
      *.err) IFS= read -r -d '' t < "$f"; printf '%s' "$t" >&2 ;;
      *) IFS= read -r -d '' t < "$f"; printf '%s' "$t" ;;
    esac
  done
  read -r rc < "./$k.rc"
}}
sample
[ -n "$loop" ] || exit "$rc"
while [ "$rc" = 0 ]; do
  read -r -t "$loop" -u 3 _
  sample
done
exit "$rc"
"""


def sshd_available() -> str | None:
    """None if the fleet can run here, else the reason it cannot."""
    if not Path(SSHD).exists():
        return f"OpenSSH sshd not found at {SSHD} (apt-get install openssh-server)"
    if not shutil.which("ssh-keygen"):
        return "ssh-keygen not found (apt-get install openssh-client)"
    return None


def is_root() -> bool:
    return os.geteuid() == 0


def ensure_test_users() -> list[str]:
    """Create the test users if we may (root); return the ones that exist."""
    users = []
    for u in TEST_USERS:
        try:
            pwd.getpwnam(u)
        except KeyError:
            if not is_root():
                continue
            r = subprocess.run(["useradd", "-M", "-s", "/usr/sbin/nologin", u],
                               capture_output=True)
            # 9: another test process (a parallel worker) made it first
            if r.returncode not in (0, 9):
                raise RuntimeError(f"useradd {u}: {r.stderr.decode(errors='replace')}") from None
        users.append(u)
    return users


#: Users that log in over SSH (they have a shell, unlike TEST_USERS, whose accounts only
#: own processes), all in one team group, as a team sharing a reservations file would be.
LOGIN_USERS = ("gtcarol", "gtdave", "gterin", "gtfrank")
TEAM_GROUP = "gtteam"


def ensure_login_users(names: Iterable[str] = LOGIN_USERS) -> list[str]:
    """Create the SSH login users (and their team group) if we may (root); return the
    ones that exist and can log in."""
    import grp

    if is_root():
        try:
            grp.getgrnam(TEAM_GROUP)
        except KeyError:
            subprocess.run(["groupadd", TEAM_GROUP], capture_output=True)
    users = []
    for u in names:
        try:
            pwd.getpwnam(u)
        except KeyError:
            if not is_root():
                continue
            # Password "*": no password, yet not "locked" ("!"), which sshd refuses even
            # for key logins.
            subprocess.run(["useradd", "-M", "-s", "/bin/sh", "-G", TEAM_GROUP, "-p", "*", u],
                           capture_output=True)
        try:
            if pwd.getpwnam(u).pw_shell.endswith("nologin"):
                continue
        except KeyError:
            continue
        if is_root() and _locked_password(u):  # made by an older helper: unlock it
            subprocess.run(["usermod", "-p", "*", u], capture_output=True)
        users.append(u)
    return users


def _locked_password(user: str) -> bool:
    try:
        lines = Path("/etc/shadow").read_text().splitlines()
    except OSError:
        return False
    return any(ln.startswith(f"{user}:!") for ln in lines)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# --- what a host replays ------------------------------------------------------------------


def project_capture(capture: Path, fields: str) -> str:
    """A ``--format=csv`` capture (header with units) as ``csv,noheader,nounits`` rows."""
    lines = [ln for ln in capture.read_text().splitlines() if ln.strip()]
    header = [h.strip() for h in lines[0].split(", ")]
    names = [h.split(" [")[0] for h in header]
    units = [h.split(" [")[1].rstrip("]") if " [" in h else "" for h in header]
    out = []
    for row in lines[1:]:
        cells = row.split(", ")
        picked = []
        for f in fields.split(","):
            i = names.index(f)
            v = cells[i]
            if units[i] and v.endswith(" " + units[i]):
                v = v[: -len(units[i]) - 1]
            picked.append(v)
        out.append(", ".join(picked))
    return "\n".join(out) + "\n"


CAPTURES = {
    "h100": DATA / "csv/h100-80gb-hbm3-driver-590.48.01-query-gpu-all-fields-load.csv",
    "h100-mig": DATA / "csv/h100-80gb-hbm3-mig-driver-590.48.01-query-gpu-all-fields-load.csv",
    "l40s": DATA / "csv/l40s-driver-595.80-query-gpu-all-fields-idle.csv",
    "rtx2080": DATA / "csv/rtx-2080-super-linux-driver-610.57.04-query-gpu-all-fields-idle.csv",
    "rtx2080-win": DATA / "csv/rtx-2080-super-windows-driver-591.86-query-gpu-all-fields-load.csv",
}
ERRORS = {
    # scenario: (file, exit code). Codes per nvidia-smi(1): 6 query unsuccessful,
    # 9 driver not loaded, 18 NVML driver/library version mismatch.
    "driver": ("errors/driver-communication-failure.txt", 9),
    "no-devices": ("errors/no-devices-were-found.txt", 6),
    "nvml-mismatch": ("errors/nvml-driver-library-version-mismatch-with-nvml-library-version.txt",
                      18),
}


@dataclass
class GpuProcess:
    user: str | None  # None: the fleet's own user
    argv0: str  # what ps shows as the command line
    gpu: int = 0
    mem_mib: int = 1024
    #: Arguments after argv0: then the process is `sleep` (the last one must be its time).
    args: tuple[str, ...] = ()
    #: On a MIG GPU: (GPU instance id, compute instance id) that `-q -x` reports for it.
    mig: tuple[int, int] | None = None
    popen: subprocess.Popen[bytes] | None = None

    @property
    def pid(self) -> int:
        assert self.popen is not None
        return self.popen.pid


LOST_TEXT = "errors/device-handle-unknown-error-busid-no-space.txt"
#: Where a lost GPU's line comes (on stderr), per scenario; "lost" is the original: stdout, last.
LOST_AT = {"lost-first": 0, "lost-middle": 1, "lost-last": -1}
#: The same lost GPU, with a compute-apps query that fails too (exit 15, as every query of
#: an nvidia-smi that lost a GPU) while it lists the other GPUs' processes, and names no
#: lost GPU in its own output.
LOST_APPS_AT = {"lost-apps-first": 0, "lost-apps-middle": 1, "lost-apps-last": -1}
HOSTILE_GPU_NAME = "NVIDIA \x1b]0;pwned\x07H100\x1b[2J \u202eevil"


def gpu_uuid(name: str, i: int) -> str:
    """The UUID the stand-in gives GPU ``i`` of host ``name`` (distinct per host)."""
    return f"GPU-{name[:8]:0>8}-0000-4000-8000-{i:012d}"


def app_uuid(h: Host, p: GpuProcess, gis: list[int]) -> str:
    """The uuid --query-compute-apps reports a process under."""
    if h.apps_by_mig and p.mig and h.gpus[p.gpu] == "h100-mig":
        return mig_uuid(h.name, p.gpu, gis.index(p.mig[0]))
    return gpu_uuid(h.name, p.gpu)


def mig_uuid(name: str, i: int, dev: int) -> str:
    """The MIG uuid the stand-in gives MIG device ``dev`` of GPU ``i`` of host ``name``."""
    return f"MIG-{name[:8]:0>8}-{i:04d}-5000-8000-{dev:012d}"


# --- MIG: what `nvidia-smi -L` and `nvidia-smi -q -x` print for the fleet's GPUs ----------

MIG_LIST = DATA / "table/list-L-h100-80gb-hbm3-mig-mixed-profiles-driver-590.48.01.txt"
MIG_TABLE = DATA / "table/h100-80gb-hbm3-mig-driver-590.48.01-load-mig-devices.txt"
MIG_XML = DATA / "xml/a100-sxm4-80gb-mig-driver-535.54.03.xml"


def mig_layout() -> list[tuple[str, int, int, int, int]]:
    """The real H100's MIG devices: (profile, GI, CI, used MiB, total MiB) in device order,
    profiles from its ``-L`` capture, ids and memory from its table capture."""
    profiles = [ln.split()[1] for ln in MIG_LIST.read_text().splitlines()
                if ln.startswith("  MIG ")]
    rows = []
    lines = MIG_TABLE.read_text().splitlines()
    for ln in lines:
        cells = ln.strip("|").split("|")
        ids = cells[0].split() if len(cells) == 4 else []
        if len(ids) == 4 and all(x.isdigit() for x in ids) and "MiB" in cells[1]:
            used, total = (int(x.strip().removesuffix("MiB")) for x in cells[1].split("/"))
            rows.append((int(ids[1]), int(ids[2]), int(ids[3]), used, total))
    rows.sort(key=lambda r: r[2])
    return [(profiles[dev], gi, ci, used, total) for gi, ci, dev, used, total in rows]


def list_output(h: Host) -> str:
    """``nvidia-smi -L`` for this host: its GPUs' lines, and the H100's MIG lines under each
    MIG GPU, as the real capture prints them (uuids replaced)."""
    layout = mig_layout()
    out = []
    for i, g in enumerate(h.gpus):
        name = project_capture(CAPTURES[g], "name").strip()
        out.append(f"GPU {i}: {name} (UUID: {gpu_uuid(h.name, i)})")
        if g == "h100-mig":
            out += [f"  MIG {prof:<11} Device {dev:>2}: (UUID: {mig_uuid(h.name, i, dev)})"
                    for dev, (prof, *_rest) in enumerate(layout)]
    return "\n".join(out) + "\n"


def xml_output(h: Host) -> str:
    """``nvidia-smi -q -x`` for this host: the real A100 document's structure (one ``<gpu>``
    element per GPU), with the H100 capture's MIG devices on MIG GPUs and, per process, its
    ``<process_info>`` with the process's argv0 as ``<process_name>``, unescaped (a user
    chooses it)."""
    text = MIG_XML.read_text()
    lines = text.splitlines()
    start = next(i for i, ln in enumerate(lines) if ln.startswith("    <gpu "))
    end = next(i for i, ln in enumerate(lines) if ln == "    </gpu>")
    head = [ln.replace("<attached_gpus>4<", f"<attached_gpus>{len(h.gpus)}<")
            for ln in lines[:start]]
    gpu = lines[start:end + 1]
    mig_at = (gpu.index("        <mig_devices>"), gpu.index("        </mig_devices>"))
    dev_tpl = gpu[mig_at[0] + 1:gpu.index("            </mig_device>") + 1]
    out = list(head)
    for i, g in enumerate(h.gpus):
        devs: list[str] = []
        if g == "h100-mig":
            for dev, (_prof, gi, ci, used, total) in enumerate(mig_layout()):
                fb = False
                for ln in dev_tpl:
                    ln = re.sub(r"<index>\d+<", f"<index>{dev}<", ln)
                    ln = re.sub(r"<gpu_instance_id>\d+<", f"<gpu_instance_id>{gi}<", ln)
                    ln = re.sub(r"<compute_instance_id>\d+<", f"<compute_instance_id>{ci}<", ln)
                    if "<fb_memory_usage>" in ln:
                        fb = True
                    if "<bar1_memory_usage>" in ln:
                        fb = False
                    if fb and "<total>" in ln:
                        ln = re.sub(r"\d+ MiB", f"{total} MiB", ln)
                    if fb and "<used>" in ln:
                        ln = re.sub(r"\d+ MiB", f"{used} MiB", ln)
                    devs.append(ln)
        procs = []
        for p in h.processes:
            if p.popen is None or p.gpu != i:
                continue
            gi, ci = (str(p.mig[0]), str(p.mig[1])) if p.mig and g == "h100-mig" \
                else ("N/A", "N/A")
            procs += ["            <process_info>",
                      f"                <gpu_instance_id>{gi}</gpu_instance_id>",
                      f"                <compute_instance_id>{ci}</compute_instance_id>",
                      f"                <pid>{p.pid}</pid>",
                      "                <type>C</type>",
                      f"                <process_name>{p.argv0}</process_name>",
                      f"                <used_memory>{p.mem_mib} MiB</used_memory>",
                      "            </process_info>"]
        for ln in gpu[:mig_at[0]]:
            ln = ln.replace("<current_mig>Enabled<", "<current_mig>"
                            + ("Enabled" if g == "h100-mig" else "Disabled") + "<")
            ln = re.sub(r"<uuid>[^<]*<", f"<uuid>{gpu_uuid(h.name, i)}<", ln)
            out.append(ln)
        out += (["        <mig_devices>", *devs, "        </mig_devices>"] if devs
                else ["        <mig_devices>None</mig_devices>"])
        for ln in gpu[mig_at[1] + 1:]:
            ln = re.sub(r"<uuid>[^<]*<", f"<uuid>{gpu_uuid(h.name, i)}<", ln)
            if ln.strip() == "<processes />":
                out += ["        <processes>", *procs, "        </processes>"]
                continue
            out.append(ln)
    out.append("</nvidia_smi_log>")
    return "\n".join(out) + "\n"


@dataclass
class Host:
    name: str
    address: str
    scenario: str = "ok"  # ok lost parse hang no-nvidia-smi driver no-devices nvml-mismatch
    #                       auth host-key-changed host-key-unknown unreachable banner-timeout
    #                       lost-first lost-middle lost-last dup-index huge hostile-names
    #                       lost-apps-first lost-apps-middle lost-apps-last
    #                       drop (TCP SYNs dropped: a full listen queue)
    gpus: tuple[str, ...] = ("h100",)
    processes: list[GpuProcess] = field(default_factory=list)
    behind: str | None = None  # name of the bastion host it is reached through
    delay: float = 0.0  # seconds each stand-in nvidia-smi call takes
    #: --query-compute-apps names a MIG process's MIG device uuid (some drivers), not its GPU's
    apps_by_mig: bool = False
    #: GPU names that replace the captures' (no comma: nvidia-smi's CSV has none there).
    gpu_names: tuple[str, ...] = ()
    port: int = 0
    proc: subprocess.Popen[bytes] | None = None

    @property
    def runs_sshd(self) -> bool:
        return self.scenario not in ("unreachable", "banner-timeout", "drop")


class Fleet:
    def __init__(self, root: Path, hosts: Iterable[Host], port: int | None = None) -> None:
        self.root = root
        self.hosts = {h.name: h for h in hosts}
        self.port = port or free_port()
        self.home = root / "home"
        self.ssh = self.home / ".ssh"
        self._listeners: list[socket.socket] = []
        self.users = ensure_test_users()

    # -- setup -----------------------------------------------------------------------------

    def start(self) -> Fleet:
        self.ssh.mkdir(parents=True, exist_ok=True)
        os.chmod(self.home, 0o755)
        self.ssh.chmod(0o700)
        key = self.ssh / "id_ed25519"
        _keygen(key)
        other = self.root / "stranger_key"
        _keygen(other)
        (self.root / "authorized_keys").write_text((key.with_suffix(".pub")).read_text())
        (self.root / "stranger_authorized_keys").write_text(other.with_suffix(".pub").read_text())
        if is_root():
            Path("/run/sshd").mkdir(mode=0o755, exist_ok=True)
        self._start_processes()
        known, config = [], []
        for h in self.hosts.values():
            h.port = self.port
            hdir = self.root / h.name
            if h.scenario == "banner-timeout":
                s = socket.socket()
                s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                s.bind((h.address, h.port))
                s.listen(64)  # accepted by the kernel, never answered
                self._listeners.append(s)
            elif h.scenario == "drop":
                # A listen queue of one, filled: the kernel drops every further SYN, as a
                # firewall that drops packets would (no iptables needed).
                s = socket.socket()
                s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                s.bind((h.address, h.port))
                s.listen(0)
                filler = socket.create_connection((h.address, h.port), timeout=2)
                self._listeners += [s, filler]
            elif h.runs_sshd:
                self._write_host(h, hdir)
                pub = (hdir / "ssh_host_ed25519_key.pub").read_text().split()
                if h.scenario == "host-key-changed":
                    _keygen(hdir / "impostor_key")
                    pub = (hdir / "impostor_key.pub").read_text().split()
                if h.scenario != "host-key-unknown":
                    known.append(f"[{h.address}]:{h.port} {pub[0]} {pub[1]}")
            config.append(f"Host {h.name}\n  HostName {h.address}\n  Port {h.port}\n"
                          f"  User {pwd.getpwuid(os.geteuid()).pw_name}\n"
                          f"  IdentityFile {key}\n  IdentitiesOnly yes\n"
                          # OpenSSH's client finds ~ through passwd, not $HOME: be explicit.
                          f"  UserKnownHostsFile {self.ssh / 'known_hosts'}\n"
                          + (f"  ProxyJump {h.behind}\n" if h.behind else ""))
        (self.ssh / "known_hosts").write_text("\n".join(known) + "\n")
        (self.ssh / "config").write_text("\n".join(config))
        for h in self.hosts.values():
            if h.runs_sshd:
                self._start_sshd(h)
        for h in self.hosts.values():
            if h.runs_sshd:
                _wait_port(h.address, h.port)
        return self

    def _start_processes(self) -> None:
        for h in self.hosts.values():
            for p in h.processes:
                self.start_process(p)

    def start_process(self, p: GpuProcess) -> None:
        """Start one GPU process (a real process of its user). A test adding a job to a
        running host appends it to the host's processes and calls ``set_scenario``."""
        user = p.user if p.user in self.users else None
        # `cat` on a pipe nobody writes to: waits forever, and its command line is
        # exactly argv0, to the last byte (`sleep N` would add " N").
        cmd = ["bash", "-c", f"exec -a {shlex.quote(p.argv0)} cat"]
        if p.args:
            cmd = ["bash", "-c", 'exec -a "$0" sleep "$@"', p.argv0, *p.args]
        p.popen = subprocess.Popen(
            cmd,
            user=user, start_new_session=True, cwd="/",
            stdin=subprocess.PIPE, stdout=subprocess.DEVNULL,
        )

    def _write_host(self, h: Host, hdir: Path) -> None:
        smi = hdir / "smi"
        bindir = hdir / "bin"
        bindir.mkdir(parents=True, exist_ok=True)
        log = shlex.quote(str(hdir / "calls.log"))
        _keygen(hdir / "ssh_host_ed25519_key")
        if h.scenario != "no-nvidia-smi":
            standin = bindir / "nvidia-smi"
            log = shlex.quote(str(hdir / "calls.log"))
            fifo = hdir / "never"
            if not fifo.exists():
                os.mkfifo(fifo, 0o666)
            standin.write_text(STANDIN.format(smi_dir=shlex.quote(str(smi)), log=log,
                                              fifo=shlex.quote(str(fifo))))
            standin.chmod(0o755)
        # ps is the real one, logged: a test can count the processes gputop starts.
        ps = bindir / "ps"
        ps.write_text(f"#!/bin/sh\nprintf 'ps %s\\n' \"$*\" >> {log}\nexec /bin/ps \"$@\"\n")
        ps.chmod(0o755)
        self.set_scenario(h, h.scenario)
        auth = "stranger_authorized_keys" if h.scenario == "auth" else "authorized_keys"
        (hdir / "sshd_config").write_text(
            f"ListenAddress {h.address}:{h.port}\n"
            f"HostKey {hdir / 'ssh_host_ed25519_key'}\n"
            f"PidFile {hdir / 'sshd.pid'}\n"
            f"AuthorizedKeysFile {self.root / auth}\n"
            "StrictModes no\nPasswordAuthentication no\nKbdInteractiveAuthentication no\n"
            "UsePAM no\nPermitRootLogin prohibit-password\nLogLevel INFO\n"
            "AllowTcpForwarding yes\n"
            # The sessions run the connecting user's ~/.bashrc (bash does for sshd). Where
            # that runs `pyenv init` (this machine's root), each session rehashed (slow), and
            # one killed with its session left pyenv's lock behind: every later session
            # waited 60 s. A negative timeout skips the rehash.
            f"SetEnv PATH={bindir}:/usr/local/bin:/usr/bin:/bin PYENV_REHASH_TIMEOUT=-1\n"
        )

    def set_scenario(self, h: Host, scenario: str, delay: float | None = None) -> None:
        """(Re)write what the host's stand-in nvidia-smi replays; takes effect at once."""
        hdir = self.root / h.name
        h.scenario = scenario
        if delay is not None:
            h.delay = delay
        files: dict[str, str] = {}
        if scenario in ERRORS:
            name, rc = ERRORS[scenario]
            text = (DATA / name).read_text()
            files.update({"gpu.0.out": text, "gpu.rc": str(rc), "apps.0.out": text,
                          "apps.rc": str(rc)})
        elif scenario == "parse":
            # A wrapper that ignores its arguments and prints the default table.
            table = (DATA / "table/a10-driver-550.127.05-no-processes.txt").read_text()
            files.update({"default.0.out": table, "default.rc": "0"})
            for k in ("gpu", "apps"):
                files[f"{k}.0.out"], files[f"{k}.rc"] = table, "0"
        elif scenario == "huge":
            # Far more than any nvidia-smi prints: 5 MiB of one letter, in lines.
            files.update({"gpu.0.out": ("A" * 1023 + "\n") * 5 * 1024, "gpu.rc": "0",
                          "apps.0.out": "", "apps.rc": "0"})
        else:
            rows: list[str] = []
            lost_gpus = 1 if scenario == "lost" or scenario in LOST_AT \
                or scenario in LOST_APPS_AT or scenario == "hostile-names" else 0
            for i, g in enumerate(h.gpus):
                # The stand-in prints the timestamp in front of each row as it prints it.
                cells = project_capture(CAPTURES[g], ROW_QUERY).rstrip("\n").split(", ")
                cells[ROW_FIELDS.index("count")] = str(len(h.gpus) + lost_gpus)
                cells[ROW_FIELDS.index("index")] = "0" if scenario == "dup-index" else str(i)
                cells[ROW_FIELDS.index("uuid")] = gpu_uuid(h.name, i)  # distinct UUID
                if scenario == "hostile-names":
                    cells[ROW_FIELDS.index("name")] = HOSTILE_GPU_NAME
                elif i < len(h.gpu_names) and h.gpu_names[i]:
                    cells[ROW_FIELDS.index("name")] = h.gpu_names[i]
                rows.append(", ".join(cells) + "\n")
            # process_name only where gputop still asks for it (as nvidia-smi would): it is
            # argv[0], whatever its owner put there, newlines included.
            named = "process_name" in APPS_QUERY
            gis = [gi for _p, gi, _c, _u, _t in mig_layout()]
            apps = [
                f"{app_uuid(h, p, gis)}, {p.pid}, {p.mem_mib}"
                + (f", {p.argv0}" if named else "") + "\n"
                for p in h.processes if p.popen is not None and p.gpu < len(rows)
            ]
            rc = "0"
            gpu_chunks: list[tuple[str, str]] = [("rows", "".join(rows))]
            apps_chunks: list[tuple[str, str]] = [("rows", "".join(apps))]
            lost = (DATA / LOST_TEXT).read_text()
            if scenario == "hostile-names":
                lost = lost.replace("Unknown Error", "Unknown \x1b[31mError\x1b[0m")
            if scenario == "lost":
                gpu_chunks = [("rows", "".join(rows)), ("out", lost)]
                rc = "15"
            elif scenario in LOST_APPS_AT:
                at = LOST_APPS_AT[scenario]
                at = len(rows) if at < 0 else min(at, len(rows))
                gpu_chunks = [("rows", "".join(rows[:at])), ("err", lost),
                              ("rows", "".join(rows[at:]))]
                rc = "15"
            elif scenario in LOST_AT or scenario == "hostile-names":
                at = LOST_AT.get(scenario, -1)
                at = len(rows) if at < 0 else min(at, len(rows))
                gpu_chunks = [("rows", "".join(rows[:at])), ("err", lost),
                              ("rows", "".join(rows[at:]))]
                apps_chunks = [("rows", "".join(apps[:1])), ("err", lost),
                               ("rows", "".join(apps[1:]))]
                rc = "15"
            for k, chunks in (("gpu", gpu_chunks), ("apps", apps_chunks)):
                for n, (stream, text) in enumerate(chunks):
                    files[f"{k}.{n}.{stream}"] = text
            files.update({"gpu.rc": rc, "apps.rc": rc if scenario != "lost" else "0",
                          "gpu.args": GPU_ARGS, "apps.args": APPS_ARGS,
                          "list.0.out": list_output(h), "list.rc": "0",
                          "xml.0.out": xml_output(h), "xml.rc": "0", "xml.args": "-q -x"})
        if scenario == "hang":
            files["delay"] = "86400"
        elif h.delay:
            files["delay"] = f"{h.delay:g}"
        # A new directory, then the `smi` link swapped to it in one rename: a looping
        # stand-in reads one scenario per sample, never half of one. The one before stays
        # for a sample still being read.
        n = 1 + max((int(p.name[4:]) for p in hdir.glob("smi.[0-9]*")), default=0)
        new = hdir / f"smi.{n}"
        new.mkdir(parents=True)
        for name, text in files.items():
            (new / name).write_text(text)
        for extra in ("noloop",):  # test switches that outlive a scenario
            if (hdir / "smi" / extra).exists():
                (new / extra).write_text("")
        tmp = hdir / "smi.link"
        tmp.unlink(missing_ok=True)
        tmp.symlink_to(new.name)
        os.replace(tmp, hdir / "smi")
        for old in hdir.glob("smi.[0-9]*"):
            if int(old.name[4:]) < n - 1:
                shutil.rmtree(old, ignore_errors=True)

    def _start_sshd(self, h: Host) -> None:
        hdir = self.root / h.name
        h.proc = subprocess.Popen(
            [SSHD, "-D", "-e", "-f", str(hdir / "sshd_config")],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
            stderr=open(hdir / "sshd.log", "wb"),  # noqa: SIM115
        )

    # -- use ------------------------------------------------------------------------------

    def env(self) -> dict[str, str]:
        """Environment for a gputop process that should see this fleet's ~/.ssh."""
        env = dict(os.environ)
        env["HOME"] = str(self.home)
        env.pop("SSH_AUTH_SOCK", None)
        env.pop("GPUTOP_CONFIG", None)
        return env

    def write_config(self, names: Iterable[str] | None = None, *, timeout: float = 3.0,
                     interval: float = 1.0, extra: str = "",
                     first_sample_timeout: float | None = None, wait_all: bool = True
                     ) -> Path:
        """A hosts.toml for these hosts. The first sample may take ``timeout`` unless told
        otherwise: a hung stand-in is then a timeout in the tests' short time. One-shots
        wait for every host (``wait_all``) unless told otherwise: on a loaded machine a
        healthy host's first connection can take longer than the first-answer deadline,
        which tests/test_first_answer.py tests."""
        path = self.root / "hosts.toml"
        names = list(names) if names is not None else list(self.hosts)
        first = timeout if first_sample_timeout is None else first_sample_timeout
        body = (f"[defaults]\ntimeout = {timeout}\ninterval = {interval}\n"
                f"first_sample_timeout = {first}\n"
                + ("wait_all = true\n" if wait_all else "") + f"{extra}\n")
        body += f"[reservations]\npath = \"{self.root / 'reservations.json'}\"\n\n"
        body += "".join(f'[[hosts]]\nname = "{n}"\n\n' for n in names)
        path.write_text(body)
        return path

    def calls(self, h: Host) -> list[str]:
        """Every nvidia-smi and ps the host ran so far (its stand-ins log each start)."""
        log = self.root / h.name / "calls.log"
        return log.read_text().splitlines() if log.exists() else []

    def remote_processes(self, h: Host) -> list[str]:
        """Processes still running the host's stand-in (a hung query must not pile up)."""
        needle = str(self.root / h.name / "bin" / "nvidia-smi")
        out = subprocess.run(["ps", "-ww", "-eo", "pid=,args="], capture_output=True,
                             text=True).stdout
        return [ln for ln in out.splitlines() if needle in ln]

    def stop_sshd(self, h: Host) -> None:
        """The host goes down: its sshd and every session it serves."""
        if h.proc is not None:
            out = subprocess.run(["ps", "-eo", "pid=,ppid="], capture_output=True, text=True)
            for ln in out.stdout.splitlines():
                pid, ppid = (int(x) for x in ln.split())
                if ppid == h.proc.pid:
                    with contextlib.suppress(ProcessLookupError):  # (it ended since ps)
                        os.kill(pid, signal.SIGKILL)
            h.proc.terminate()
            h.proc.wait(5)
            h.proc = None

    def restart_sshd(self, h: Host) -> None:
        self._start_sshd(h)
        _wait_port(h.address, h.port)

    def stop(self) -> None:
        for h in self.hosts.values():
            self.stop_sshd(h)
            for p in h.processes:
                if p.popen is not None:
                    p.popen.kill()
                    p.popen.wait(5)
                    if p.popen.stdin is not None:
                        p.popen.stdin.close()
        for s in self._listeners:
            s.close()
        # Anything a remote session left (it should not: a test whose gputop was killed
        # leaves its loop and a hung stand-in's `sleep`): kill the session's whole process
        # group, found by this fleet's path in its command line or PATH (sshd sets it).
        mine = os.getpgrp()
        for pid in _pids_mentioning(str(self.root)):
            try:
                pgid = os.getpgid(pid)
                if pgid != mine:
                    os.killpg(pgid, signal.SIGKILL)
                else:
                    os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def _pids_mentioning(text: str) -> list[int]:
    found = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit() or int(d.name) == os.getpid():
            continue
        try:
            blob = (d / "cmdline").read_bytes() + b"\0" + (d / "environ").read_bytes()
        except OSError:
            continue
        if text.encode() in blob:
            found.append(int(d.name))
    return found


def _keygen(path: Path) -> None:
    if path.exists():
        return
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", "gputop-test",
                    "-f", str(path)], check=True, capture_output=True)


def _wait_port(address: str, port: int, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            with socket.create_connection((address, port), timeout=1):
                return
        except OSError:
            if time.monotonic() > deadline:
                raise RuntimeError(f"sshd on {address}:{port} did not start") from None
            time.sleep(0.02)
