"""The remote side of a host's streaming channel, and the framing of what it sends back.

Remote output is hostile: any user on a GPU host chooses their jobs' command lines, which
``ps`` prints. So no byte a remote process controls may end a section or start a row:

- every refresh line the client sends carries a fresh random *nonce* (on the channel, never
  in a command line, so no process on the host can see it); every marker the script prints
  carries it, and a marker counts only as a whole line equal to what is expected;
- the sections come in a fixed order, each closed by its marker with the exit code; output
  after the end marker, a missing or misplaced marker is a framing error: that refresh is
  the host's ``parse`` error and the channel is reopened, never read from again;
- the size of one refresh is checked while it is read (:class:`LineReader`);
- in the streaming session (:func:`session_script`) every line is tagged by our own awk
  where it is produced (``g`` GPU loop, ``a`` apps loop, ``p`` ps), one line per write
  below the pipe's atomic size: a ps line stays a ``p`` line whatever it says.

Only the owners section decides who uses a GPU, and it holds no user text: the command
lines are a section of their own, read after it and parsed leniently.
"""

from __future__ import annotations

import re
import secrets
from dataclasses import dataclass

from gputop.ssh.transport import ParseError
from gputop.text import excerpt

#: Prefix of every marker line. Constant text: nothing from the config or from other hosts
#: is ever interpolated into the remote command.
MARK = "@@gputop"

#: The sections of one refresh, in the order the script prints them.
SECTIONS = ("gpu", "apps", "owners", "args")

#: Largest output accepted for one refresh (a host with thousands of processes stays far
#: below this; anything larger is not nvidia-smi talking). Enforced while reading.
MAX_OUTPUT = 4 * 1024 * 1024


class FramingError(ParseError):
    """The refresh's frame does not check out: its channel must not be read from again."""


#: ``ps`` for owners: a POSIX header this wide makes the user column 32 wide (the longest
#: Linux user name) instead of procps' 8, where ``first.lastname`` reads ``first.l+`` and a
#: holder is flagged on her own GPU. The header line it brings is skipped by the parser.
OWNER_HEADER = "USER" + "_" * 28
PS_OWNERS = f"LC_ALL=C ps -o pid= -o user={OWNER_HEADER} -o etime= -p"
#: ``ps`` for command lines, cut at 512 bytes each: in the C locale a column is a byte (under
#: UTF-8, 4096 columns of zero-width characters were 128 KiB per process, and 32 such jobs
#: pushed a refresh past the output limit: the host vanished from every board).
PS_ARGS = "LC_ALL=C COLUMNS=512 ps -o pid= -o args= -p"


def new_nonce() -> str:
    """128 random bits as hex: what a refresh line carries and its markers must repeat."""
    return secrets.token_hex(16)


def remote_script(gpu_query: str, apps_query: str) -> str:
    """The constant POSIX sh loop run once per channel (no awk, no python remotely).

    It reads a nonce line, says ``@@gputop NONCE start PID`` (sshd made it a process-group
    leader, so a hung refresh can be killed as a whole), then runs one refresh per line it
    reads, the line being that refresh's nonce. The two nvidia-smi queries run side by side
    (one in the background); the pids for ``ps`` are picked out with shell builtins (the
    apps rows are ``date time, uuid, pid, memory``). Each
    marker starts on a fresh line (``\\n`` first), so unterminated output cannot swallow it.
    Command lines are cut at 512 bytes: jobs with huge ones cannot fill the output limit.
    A refresh is collected and written at once: one SSH packet, not one per command.
    """
    refresh = (
        f"nvidia-smi {gpu_query} </dev/null & g=$!; "
        f"apps=$(nvidia-smi {apps_query} </dev/null 2>&1); arc=$?; "
        f'wait "$g"; printf "\\n{MARK} %s gpu %s\\n" "$n" "$?"; '
        f'printf "%s\\n{MARK} %s apps %s\\n" "$apps" "$n" "$arc"; '
        "pids=; while IFS=', ' read -r _d _t _u p _r; do case $p in ''|*[!0-9]*) ;; "
        '*) pids="$pids${pids:+,}$p" ;; esac; done <<EOF\n$apps\nEOF\n'
        f'if [ -n "$pids" ]; then {PS_OWNERS} "$pids" </dev/null; fi; '
        f'printf "\\n{MARK} %s owners %s\\n" "$n" "$?"; '
        f'if [ -n "$pids" ]; then {PS_ARGS} "$pids" </dev/null; fi; '
        f'printf "\\n{MARK} %s args %s" "$n" "$?"'
    )
    # A nonce line is 32 hex digits; anything else read on stdin ends the loop.
    check = "case $n in *[!0-9a-f]*|'') exit 0 ;; esac"
    return (f'IFS= read -r n || exit 0; {check}; printf "{MARK} %s start %s\\n" "$n" "$$"; '
            f'while IFS= read -r n; do {check}; r=$({{ {refresh}; }} 2>&1); '
            f'printf "%s\\n{MARK} %s end\\n" "$r" "$n"; done')


#: Tags our awk puts at the start of every line of a streaming session: a GPU row, an apps
#: row, a line of a ``ps`` answer. Every line is tagged by the producer's own awk, so no
#: byte a remote process prints can start a line with another producer's tag.
TAGS = ("g", "a", "p")

#: awk that tags each line it reads with ``TAG `` in one write of at most PIPE_BUF bytes (a
#: line is cut at 2000 bytes; ``ps`` command lines are cut at 512): lines written by the
#: three producers into one pipe never interleave.
_TAGGER = r'{printf "%s", "TAG " substr($0, 1, 2000) "\n"; fflush()}'

#: The apps loop's tagger also appends each row's process start time (``/proc/PID/stat``
#: field 22, read by awk itself: no process is started), so that a pid reused by another
#: process is never shown with the first one's owner (``-`` where it cannot be read). The
#: command name in that file is anyone's: the fields are counted after its last ``) ``.
_APPS_TAGGER = (
    r'function st(p,  f, s, l, a, n) { f = "/proc/" p "/stat"; s = ""; '
    r'while (n < 64 && (getline l < f) > 0) { s = s l "\n"; n++ } close(f); '
    r'if (s == "" || !sub(/.*\) /, "", s)) return "-"; split(s, a, " "); '
    r'return (a[20] ~ /^[0-9]+$/) ? a[20] : "-" } '
    r'{ r = $0; if (split(r, c, ", ") == 4 && c[3] ~ /^[0-9]+$/) r = r ", " st(c[3]); '
    r'printf "%s", "a " substr(r, 1, 2000) "\n"; fflush() }'
)

#: The relay: the one writer to the channel. It collects tagged lines and writes them out
#: at once (one SSH packet) when a GPU sample is complete (``count``, field 2 of each row,
#: says how many rows; a lost GPU's line counts as one), at a ``ps`` answer's marker and at
#: a loop's exit marker, at a GPU line that is no row (an error text: the client judges it)
#: and beyond 64 KiB. Until two GPU samples have gone out, apps rows go out as they come
#: (the first sample may wait for the first apps rows). A miscount only delays a flush to
#: the next sample or marker, never loses a line; an untagged line is dropped.
_RELAY = (
    r'{t = substr($0, 1, 2); if (t != "g " && t != "a " && t != "p ") next; '
    r'b = b $0 "\n"; f = substr($0, 3, 9) == "@@gputop "; '
    r'if (t == "g " && !f) { r = substr($0, 3); '
    r'l += gsub(/Unable to determine the device handle for GPU/, "", r); '
    r'if (split(r, c, ", ") >= NF_GPU) { if (c[1] != ts) { ts = c[1]; k = 0 } k++; '
    r'n = c[2] + 0 } else if (r == substr($0, 3)) f = 1; '
    r'if (n > 0 && k + l >= n) { f = 1; k = 0; l = 0; s++ } } '
    r'else if (t == "a " && s < 2) f = 1; '
    r'if (f || length(b) > 65536) { printf "%s", b; fflush(); b = "" } } '
    r'END { printf "%s", b }'
)


def session_script(gpu_command: str, apps_command: str, gpu_fields: int,
                   args_wait_s: int = 3) -> str:
    """One SSH session carrying a host's whole streaming collection, in one framed stdout.

    It reads a nonce line and answers ``@@gputop NONCE start PID`` (the session's process
    group, killed as a whole when a stream stalls), or ``@@gputop NONCE noawk`` where the
    host has no awk (the client then queries per refresh). Then it runs both nvidia-smi
    loops in the background, each through a tagger (``g``/``a``) and each closed by
    ``@@gputop NONCE exit RC``; and it answers ``NONCE PID,PID,...`` lines read on stdin
    with ``ps`` for those pids (tagged ``p``; sections ``owners`` and ``args`` framed as in
    :func:`remote_script`, with the request's own nonce). Everything goes through one
    relay awk, which writes about
    once per refresh. When stdin closes (gputop exits, the connection drops) or a request
    line is malformed, the whole process group is killed: an apps loop that prints nothing
    would never notice otherwise.

    mawk reads a pipe in blocks (a sample would wait for 4 KiB more) unless ``-W
    interactive``: probed once, used where it is accepted silently.
    """
    check = "case $n in *[!0-9a-f]*|'') exit 0 ;; esac"
    tag = {t: _TAGGER.replace("TAG", t) for t in TAGS} | {"a": _APPS_TAGGER}
    relay = _RELAY.replace("NF_GPU", str(int(gpu_fields)))
    probe = ("A=; if o=$(awk -W interactive 'BEGIN{}' </dev/null 2>&1) && [ -z \"$o\" ]; "
             "then A='awk -W interactive'; elif awk 'BEGIN{}' </dev/null >/dev/null 2>&1; "
             "then A=awk; fi")
    # Command lines are read with a deadline: reading one can hang (a job's argv pages
    # behind a FUSE mount it serves itself), and one such process must not keep its host
    # off the board. A ps killed at the deadline answers ``args 137``: owners still count,
    # its command lines are unknown (and not asked again for the same processes). The
    # watchdog's trap is set before its sleep starts (a TERM that comes first leaves none)
    # and reaps it (no zombie is left in the session).
    wait_s = max(1, int(args_wait_s))
    ask = (f'{{ {PS_OWNERS} "$p" </dev/null; printf "\\n{MARK} %s owners %s\\n" "$m" "$?"; '
           f'{PS_ARGS} "$p" </dev/null & a=$!; '
           f'( trap "kill \\$! 2>/dev/null; wait \\$!; exit 0" TERM; sleep {wait_s} & wait $!; '
           'kill -s KILL $a ) >/dev/null 2>&1 </dev/null & w=$!; '
           'wait $a; r=$?; kill $w 2>/dev/null; wait $w 2>/dev/null; '
           f'printf "\\n{MARK} %s args %s\\n{MARK} %s end\\n" "$m" "$r" "$m"; }} 2>&1')

    def loop(command: str, t: str) -> str:
        return (f'{{ {command} </dev/null 2>&1; printf "\\n{MARK} %s exit %s\\n" "$n" "$?"; }}'
                f" | LC_ALL=C $A '{tag[t]}' &")

    return (
        f"IFS= read -r n || exit 0; {check}; {probe}; "
        f'if [ -z "$A" ]; then printf "{MARK} %s noawk\\n" "$n"; exit 0; fi; '
        f'printf "{MARK} %s start %s\\n" "$n" "$$"; exec 3<&0; '
        f"{{ {loop(gpu_command, 'g')} {loop(apps_command, 'a')} "
        "while IFS=' ' read -r m p <&3; do "
        "case $m in *[!0-9a-f]*|'') break ;; esac; case $p in ''|*[!0-9,]*) break ;; esac; "
        f"{ask} | LC_ALL=C $A '{tag['p']}'; done; kill -s KILL 0; }} 2>/dev/null "
        f"| LC_ALL=C $A '{relay}'"
    )


#: The sections of one owners query (streaming collection: ``ps`` for new pids only).
OWNER_SECTIONS = ("owners", "args")


class OutputTooLarge(FramingError):
    """More output than one refresh may have: read no further."""


class LineReader:
    """Splits the channel's bytes into lines, counting every byte against ``limit``.

    The limit is enforced as bytes arrive, so a flood is cut off at ``limit`` rather than
    buffered first. Lines are decoded as UTF-8 with replacement (remote bytes are not
    trusted to be text).
    """

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.size = 0
        self._partial = b""

    def feed(self, data: bytes) -> list[str]:
        self.size += len(data)
        if self.size > self.limit:
            raise OutputTooLarge(f"output larger than {self.limit} bytes")
        if b"\n" not in data:
            self._partial += data
            return []
        # Decoded at once: a line break is never part of a UTF-8 sequence, so this reads
        # exactly as decoding each line would (replacing what is not UTF-8).
        head, _, self._partial = (self._partial + data).rpartition(b"\n")
        return head.decode("utf-8", "replace").split("\n")

    def restart(self) -> None:
        """Count from here on (a stream's limit is per sample): only the partial line left
        counts against the next."""
        self.size = len(self._partial)

    @property
    def pending(self) -> bool:
        """Bytes received that are not a complete line yet."""
        return bool(self._partial)

    def rest(self) -> bytes:
        """The partial line received so far (handed on to the next reader)."""
        return self._partial

    def tail(self) -> str:
        return excerpt(self._partial[-200:].decode("utf-8", "replace"))


_START = re.compile(r"(\d+)")


def start_pid(line: str, nonce: str) -> int | None:
    """The script's pid if ``line`` is exactly its start line for ``nonce``."""
    prefix = f"{MARK} {nonce} start "
    if not line.startswith(prefix):
        return None
    m = _START.fullmatch(line[len(prefix):])
    return int(m.group(1)) if m else None


def end_line(nonce: str) -> str:
    return f"{MARK} {nonce} end"


@dataclass(frozen=True)
class Section:
    text: str
    rc: int


_SECTION_MARK = re.compile(r"([a-z]+) (\d{1,3})")


def split_frame(lines: list[str], nonce: str,
                names: tuple[str, ...] = SECTIONS) -> dict[str, Section]:
    """One refresh's lines (up to, not including, its end line) as its sections (``names``).

    A line is a marker only if it starts with ``@@gputop NONCE``; every marker must be the
    next expected section with a numeric exit code. Anything else is a FramingError.
    """
    prefix = f"{MARK} {nonce} "
    sections: dict[str, Section] = {}
    buf: list[str] = []
    for line in lines:
        if not line.startswith(prefix):
            buf.append(line)
            continue
        m = _SECTION_MARK.fullmatch(line[len(prefix):])
        expected = names[len(sections)] if len(sections) < len(names) else None
        if m is None or m.group(1) != expected:
            raise FramingError(f"unexpected marker in the remote output: {excerpt(line)}")
        sections[m.group(1)] = Section("\n".join(buf), int(m.group(2)))
        buf = []
    if len(sections) != len(names):
        raise FramingError(
            f"incomplete output from the remote script ({len(sections)} of {len(names)} "
            f"sections): {excerpt(' '.join(buf))}")
    if any(line.strip() for line in buf):
        raise FramingError(f"output after the last section: {excerpt(' '.join(buf))}")
    return sections


def frame(nonce: str, **sections: tuple[str, int]) -> list[str]:
    """What the script prints for one refresh (without the end line), for tests and demos:
    ``frame(n, gpu=(text, rc), apps=..., owners=..., args=...)``."""
    out: list[str] = []
    for name in SECTIONS:
        text, rc = sections.get(name, ("", 0))
        out.extend(text.split("\n") if text else [])
        out.extend(["", f"{MARK} {nonce} {name} {rc}"])
    return out
