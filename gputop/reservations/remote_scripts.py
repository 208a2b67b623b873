"""What runs on the store's host for :mod:`gputop.reservations.remote`: two constant POSIX
shell scripts (nothing from the config is interpolated: the path travels on stdin) and
what their error words mean.

The host needs a POSIX shell, ``cat``, ``cksum``, ``wc``, ``awk``, ``mv``, ``rm``,
``mkdir``, ``sync``, ``sleep``, ``id``, and ``flock`` from util-linux for writing.
"""

from __future__ import annotations

from gputop.reservations.store import MAX_FILE_BYTES

#: Prefix of every marker line the scripts print (constant text).
MARK = "@@gputop-store"
_HEX = "case $n in *[!0-9a-f]*|'') exit 0 ;; esac"

#: The kept reader: the nonce and the path once, then one request per line, ``NONCE sum``
#: or ``NONCE read CRC SIZE`` (``- -``: nothing known); each answer is one marker line, and
#: for a changed file its bytes and an end marker.
READER_SCRIPT = (
    f"IFS= read -r n || exit 0; {_HEX}; IFS= read -r p || exit 0; "
    "case $p in /*) ;; *) exit 0 ;; esac; exec 2>/dev/null; set -f; "
    f"M={MARK}; u=$(id -un) || u=-; "
    'printf "%s %s start %s %s\\n" "$M" "$n" "$$" "$u"; '
    "while IFS= read -r q; do "
    "set -- $q; n=$1; "
    f"{_HEX}; "
    'if [ -L "$p" ]; then printf "%s %s err link\\n" "$M" "$n"; continue; fi; '
    'if [ ! -e "$p" ]; then printf "%s %s none\\n" "$M" "$n"; continue; fi; '
    'if [ ! -f "$p" ]; then printf "%s %s err notfile\\n" "$M" "$n"; continue; fi; '
    'if [ ! -r "$p" ]; then printf "%s %s err denied\\n" "$M" "$n"; continue; fi; '
    's=$(cksum < "$p") || { printf "%s %s err denied\\n" "$M" "$n"; continue; }; '
    'set -- $s; c=$1; z=$2; set -- $q; '
    'if [ "$2" = sum ]; then printf "%s %s sum %s %s\\n" "$M" "$n" "$c" "$z"; continue; fi; '
    'if [ "$3 $4" = "$c $z" ]; then printf "%s %s same\\n" "$M" "$n"; continue; fi; '
    f'if [ "$z" -gt {MAX_FILE_BYTES} ]; then printf "%s %s big %s\\n" "$M" "$n" "$z"; '
    "continue; fi; "
    'printf "%s %s data %s %s\\n" "$M" "$n" "$c" "$z"; cat "$p"; '
    'printf "\\n%s %s end\\n" "$M" "$n"; '
    "done"
)

#: One write: nonce, path, seconds to wait for the lock and the watchdog's hold on
#: stdin; then the current file (under the lock), then gputop's ``NONCE keep`` or
#: ``NONCE write SIZE``, the bytes as lines and ``MARK NONCE commit``.
WRITER_SCRIPT = (
    f"IFS= read -r n || exit 0; {_HEX}; IFS= read -r p || exit 0; "
    "case $p in /*) ;; *) exit 0 ;; esac; "
    "IFS= read -r w || exit 0; case $w in *[!0-9]*|'') exit 0 ;; esac; "
    "IFS= read -r h || exit 0; case $h in *[!0-9]*|'') exit 0 ;; esac; "
    # SIGPIPE ignored: a client gone after its commit must not kill the script between
    # its last words and ending the watchdog.
    f"exec 2>/dev/null; set -f; trap '' PIPE; M={MARK}; "
    'say() { printf "%s %s %s\\n" "$M" "$n" "$*"; }; '
    "command -v flock >/dev/null || { say err noflock; exit 0; }; "
    'd=${p%/*}; b=${p##*/}; [ -n "$d" ] || d=/; umask 002; '
    '[ -d "$d" ] || mkdir -p -- "$d" || { say err mkdir; exit 0; }; '
    'k="$p.flock"; i=0; '
    "while :; do "
    '[ -L "$k" ] && { say err locklink; exit 0; }; '
    # (A failed redirection on `exec` would end the shell: `true` tries it first.)
    'true >>"$k" || { say err lockdenied; exit 0; }; exec 9>>"$k"; '
    'flock -x -w "$w" 9 || { say err busy; exit 0; }; '
    # The lock file could have been removed and made again while we waited: the lock
    # counts only on the file that is at the lock path now.
    '[ /dev/fd/9 -ef "$k" ] && break; exec 9>&-; i=$((i + 1)); '
    '[ "$i" -lt 20 ] || { say err lockmoved; exit 0; }; '
    "done; "
    # The watchdog holds neither the lock nor the channel: when the hold runs out it kills
    # this whole process group (the session's), and the lock goes with it.
    "( exec 0</dev/null 1>/dev/null 9>&-; sleep \"$h\" & s=$!; "
    "trap 'kill $s; exit 0' TERM; wait $s; kill -KILL 0 ) & g=$!; "
    'end() { kill "$g"; exit 0; }; '
    # Every live writer holds this lock while its temp file exists: any left belong to a
    # killed one.
    'set +f; rm -f -- "$d/.$b.tmp."*; set -f; '
    'if [ -L "$p" ]; then say err link; end; fi; '
    'if [ -e "$p" ]; then '
    '[ -f "$p" ] || { say err notfile; end; }; [ -r "$p" ] || { say err denied; end; }; '
    'set -- $(wc -c < "$p"); '
    f'[ "$1" -le {MAX_FILE_BYTES} ] || {{ say err big "$1"; end; }}; '
    'say data "$1"; cat "$p"; printf "\\n%s %s end\\n" "$M" "$n"; '
    "else say none; fi; "
    'IFS= read -r c || end; set -- $c; [ "$1" = "$n" ] || end; '
    'case $2 in keep) say done; end ;; write) ;; *) end ;; esac; '
    "z=$3; case $z in *[!0-9]*|'') end ;; esac; "
    't="$d/.$b.tmp.$$.$n"; ( set -C; : > "$t" ) || { say err tmpdenied; end; }; '
    "awk -v e=\"$M $n commit\" '$0 == e { ok = 1; exit } { print } END { exit !ok }' "
    '> "$t" || { rm -f -- "$t"; end; }; '
    'set -- $(wc -c < "$t"); [ "$1" = "$z" ] || { rm -f -- "$t"; say err short; end; }; '
    'sync -- "$t" || sync; '
    # Still the lock? Someone may have removed the lock file while gputop decided, and a
    # writer on the host then locked a new one: start again rather than write beside it.
    '[ /dev/fd/9 -ef "$k" ] || { rm -f -- "$t"; say err moved; end; }; '
    'mv -f -- "$t" "$p" || { rm -f -- "$t"; say err rename; end; }; '
    'sync -- "$d" || :; say done; end'
)

#: What the scripts' ``err`` words mean, for one line naming host and path.
ERRORS = {
    "noflock": "cannot write: `flock` (util-linux) is not installed on {host}; gputop locks "
               "the file with it there (install util-linux, or keep the file on a host "
               "that has it); nothing was written",
    "busy": "still locked by another writer after {wait}",
    "mkdir": "cannot create the directory on {host} (permission denied?); set "
             "[reservations] path to a place you can write; nothing was written",
    "lockdenied": "permission denied trying to open the lock file {path}.flock on {host}. "
                  "Ask the owner to make the directory and its files group-writable "
                  "(chmod g+w) for your team's group, or set [reservations] path to a "
                  "place you can write; nothing was written",
    "locklink": "the lock file {path}.flock on {host} is a symbolic link; gputop does not "
                "follow links for its files; nothing was written",
    "lockmoved": "the lock file kept being replaced while gputop waited for it; nothing "
                 "was written",
    "tmpdenied": "permission denied trying to write a file in the directory on {host}. Ask "
                 "the owner to make it group-writable (chmod g+w), or set [reservations] "
                 "path to a place you can write; nothing was written",
    "link": "is a symbolic link on {host}; gputop does not follow links for its files",
    "notfile": "not a regular file on {host}; gputop reads and writes only a plain file "
               "there (it was left untouched)",
    "denied": "permission denied trying to read it on {host}. Ask the owner to make it "
              "group-readable for your team, or set [reservations] path elsewhere",
    "short": "the new file did not arrive whole on {host}; nothing was written",
    "rename": "cannot replace the file on {host}; nothing was written",
}
