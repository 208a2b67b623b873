"""What runs on the store's host for :mod:`gputop.reservations.remote`: two constant POSIX
shell scripts (nothing from the config is interpolated: the path travels on stdin) and
what their error words mean.

The host needs a POSIX shell, ``cat``, ``cksum``, ``wc``, ``awk``, ``mv`` (with ``-T``:
GNU coreutils, busybox), ``ls``, ``rm``, ``rmdir``, ``mkdir``, ``sync``, ``sleep``, ``id``,
and ``flock`` from util-linux for writing.
"""

from __future__ import annotations

from gputop.reservations.records import MAX_FILE_BYTES
from gputop.reservations.store import SWEEP_MAX

#: Prefix of every marker line the scripts print (constant text).
MARK = "@@gputop-store"
_HEX = "case $n in *[!0-9a-f]*|'') exit 0 ;; esac"

#: The kept reader: the nonce and the path once, then one request per line, ``NONCE sum``
#: or ``NONCE read CRC SIZE`` (``- -``: nothing known); each answer is one marker line, and
#: for a changed file its bytes and an end marker.
READER_SCRIPT = (
    f"IFS= read -r n || exit 0; {_HEX}; IFS= read -r p || exit 0; "
    "case $p in /*) ;; *) exit 0 ;; esac; exec 2>/dev/null; set -f; umask 002; "
    f"M={MARK}; u=$(id -un) || u=-; "
    'printf "%s %s start %s %s\\n" "$M" "$n" "$$" "$u"; '
    'odd() { [ -e "$1" ] && [ ! -f "$1" ] && [ ! -L "$1" ]; }; '
    "while IFS= read -r q; do "
    "set -- $q; n=$1; "
    f"{_HEX}; "
    'if [ -L "$p" ]; then printf "%s %s err link\\n" "$M" "$n"; continue; fi; '
    'if [ ! -e "$p" ]; then printf "%s %s none\\n" "$M" "$n"; continue; fi; '
    'if [ ! -f "$p" ]; then printf "%s %s err notfile\\n" "$M" "$n"; continue; fi; '
    'if [ ! -r "$p" ]; then printf "%s %s err denied\\n" "$M" "$n"; continue; fi; '
    # Opened once (read-write where it may: a FIFO swapped in meanwhile is not waited on)
    # and checked through the fd; the sum and the bytes are then that one file's.
    'if [ -w "$p" ]; then command exec 8<>"$p"; else command exec 8<"$p"; fi || '
    '{ odd "$p" && e=notfile || e=changed; printf "%s %s err %s\\n" "$M" "$n" "$e"; '
    "continue; }; "
    '[ -f /dev/fd/8 ] || { exec 8<&-; printf "%s %s err notfile\\n" "$M" "$n"; '
    "continue; }; "
    's=$(cksum < /dev/fd/8) || { exec 8<&-; printf "%s %s err denied\\n" "$M" "$n"; '
    "continue; }; "
    'set -- $s; c=$1; z=$2; set -- $q; '
    'if [ "$2" = sum ]; then exec 8<&-; printf "%s %s sum %s %s\\n" "$M" "$n" "$c" "$z"; '
    "continue; fi; "
    'if [ "$3 $4" = "$c $z" ]; then exec 8<&-; printf "%s %s same\\n" "$M" "$n"; '
    "continue; fi; "
    f'if [ "$z" -gt {MAX_FILE_BYTES} ]; then exec 8<&-; '
    'printf "%s %s big %s\\n" "$M" "$n" "$z"; continue; fi; '
    'printf "%s %s data %s %s\\n" "$M" "$n" "$c" "$z"; cat /dev/fd/8; exec 8<&-; '
    'printf "\\n%s %s end\\n" "$M" "$n"; '
    "done"
)

#: One write: nonce, path, seconds to wait for the lock and the watchdog's hold on
#: stdin; then the current file (under the lock), then gputop's ``NONCE keep`` or
#: ``NONCE write SIZE``, the bytes as lines and ``MARK NONCE commit``.
#:
#: Every teammate can rename names in the shared directory, so the script trusts none
#: there: the lock file and the current file are each opened once, read-write where it
#: can (which never blocks on a FIFO), and checked to be plain files through their fds; the
#: new file is made in a fresh private directory of the writer's (0700, inside the shared
#: one: one filesystem), which the shell enters (``cd``: later names resolve in that very
#: directory, whatever is renamed meanwhile), and renamed from there (``mv -T``: never
#: into a directory planted at the path).
WRITER_SCRIPT = (
    f"IFS= read -r n || exit 0; {_HEX}; IFS= read -r p || exit 0; "
    "case $p in /*) ;; *) exit 0 ;; esac; "
    "IFS= read -r w || exit 0; case $w in *[!0-9]*|'') exit 0 ;; esac; "
    "IFS= read -r h || exit 0; case $h in *[!0-9]*|'') exit 0 ;; esac; "
    # SIGPIPE ignored: a client gone after its commit must not kill the script between
    # its last words and ending the watchdog.
    f"exec 2>/dev/null; set -f; trap '' PIPE; M={MARK}; LC_ALL=C; export LC_ALL; "
    'say() { printf "%s %s %s\\n" "$M" "$n" "$*"; }; '
    # Something at a name that is neither missing, a plain file nor a link.
    'odd() { [ -e "$1" ] && [ ! -f "$1" ] && [ ! -L "$1" ]; }; '
    # Whether "." is a directory only we can change names in: ours (the owner of the
    # file we just made in it) and writable by nobody else.
    # (One `ls`: "." sorts before the file's name, so its line comes first.)
    'mine() { set -- $(ls -dn . "$1"); '
    'case $1 in d????-??-*) [ "$3" = "${12}" ] ;; *) return 1 ;; esac; }; '
    "command -v flock >/dev/null || { say err noflock; exit 0; }; "
    'd=${p%/*}; b=${p##*/}; [ -n "$d" ] || d=/; umask 002; '
    "U=$(id -u) || U=-; case $U in *[!0-9]*|'') U=- ;; esac; "
    '[ -d "$d" ] || mkdir -p -- "$d" || { say err mkdir; exit 0; }; '
    'k="$p.flock"; F=gputop-new-file; i=0; '
    "while :; do "
    '[ -L "$k" ] && { say err locklink; exit 0; }; '
    'odd "$k" && { say err locknotfile; exit 0; }; '
    # `command`: a failed redirection on `exec` would end the shell.
    'command exec 9<>"$k" || { odd "$k" && say err locknotfile || say err lockdenied; '
    "exit 0; }; "
    '[ -f /dev/fd/9 ] || { say err locknotfile; exit 0; }; '
    'flock -x -w "$w" 9 || { say err busy; exit 0; }; '
    # The lock file could have been removed and made again while we waited: the lock
    # counts only on the file that is at the lock path now.
    '[ ! -L "$k" ] && [ /dev/fd/9 -ef "$k" ] && break; exec 9>&-; i=$((i + 1)); '
    '[ "$i" -lt 20 ] || { say err lockmoved; exit 0; }; '
    "done; "
    # The watchdog holds neither the lock nor the channel: when the hold runs out it kills
    # this whole process group (the session's), and the lock goes with it.
    "( exec 0</dev/null 1>/dev/null 9>&-; sleep \"$h\" & s=$!; "
    "trap 'kill $s; exit 0' TERM; wait $s; kill -KILL 0 ) & g=$!; "
    'end() { kill "$g"; exit 0; }; '
    'if [ -L "$p" ]; then say err link; end; fi; '
    'if [ -e "$p" ]; then '
    '[ -f "$p" ] || { say err notfile; end; }; [ -r "$p" ] || { say err denied; end; }; '
    'if [ -w "$p" ]; then command exec 8<>"$p"; else command exec 8<"$p"; fi || '
    '{ odd "$p" && say err notfile || say err changed; end; }; '
    '[ -f /dev/fd/8 ] || { say err notfile; end; }; '
    'set -- $(wc -c < /dev/fd/8); '
    f'[ "$1" -le {MAX_FILE_BYTES} ] || {{ say err big "$1"; end; }}; '
    'say data "$1"; cat /dev/fd/8; printf "\\n%s %s end\\n" "$M" "$n"; '
    "else say none; fi; "
    # Every live writer holds this lock while its temp file exists: any of ours left
    # belong to a killed one. Swept while gputop decides (never before the first marker):
    # only names with our uid, owned by us (builtin tests: nothing is forked for a
    # teammate's names, however many), at most SWEEP_MAX a write. A private directory is
    # emptied only if it is ours, of its one file.
    f'set +f; j={SWEEP_MAX}; for x in "$d/.$b.tmp.$U."*; do '
    '[ "$j" -gt 0 ] || break; [ ! -L "$x" ] && [ -O "$x" ] || continue; j=$((j - 1)); '
    'if [ -d "$x" ]; then '
    '( cd -P -- "$x" && [ -O . ] && mine . && rm -f -- "$F" ); rmdir -- "$x"; '
    'else rm -f -- "$x"; fi; done; set -f; '
    'IFS= read -r c || end; set -- $c; [ "$1" = "$n" ] || end; '
    'case $2 in keep) say done; end ;; write) ;; *) end ;; esac; '
    "z=$3; case $z in *[!0-9]*|'') end ;; esac; "
    'q="$d/.$b.tmp.$U.$$.$n"; mkdir -m 700 -- "$q" || { '
    # A name planted there first is a teammate's doing, not a permission problem.
    'if [ -e "$q" ] || [ -L "$q" ]; then say err tmpmoved; else say err tmpdenied; fi; end; }; '
    'drop() { rm -f -- "$F"; cd / && rmdir -- "$q"; end; }; '
    'cd -P -- "$q" || { say err tmpmoved; end; }; '
    '( set -C; : > "$F" ) || { say err tmpmoved; cd / && rmdir -- "$q"; end; }; '
    'mine "$F" || { say err tmpmoved; drop; }; '
    "awk -v e=\"$M $n commit\" '$0 == e { ok = 1; exit } { print } END { exit !ok }' "
    '> "$F" || drop; '
    'set -- $(wc -c < "$F"); [ "$1" = "$z" ] || { say err short; drop; }; '
    'sync -- "$F" || sync; '
    # Still the lock? Someone may have removed the lock file while gputop decided, and a
    # writer on the host then locked a new one: start again rather than write beside it.
    '[ /dev/fd/9 -ef "$k" ] || { say err moved; drop; }; '
    'mv -fT -- "$F" "$p" || { say err rename; drop; }; '
    'cd / && rmdir -- "$q"; sync -- "$d" || :; say done; end'
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
    "locknotfile": "the lock file {path}.flock on {host} is not a regular file (a FIFO, "
                   "socket or device?); gputop locks only a plain file there (it was left "
                   "untouched); nothing was written",
    "tmpmoved": "gputop's private directory for the new file on {host} was replaced while "
                "it wrote (someone renaming names in the shared directory?); nothing was "
                "written",
    "lockmoved": "the lock file kept being replaced while gputop waited for it; nothing "
                 "was written",
    "tmpdenied": "permission denied trying to write a file in the directory on {host}. Ask "
                 "the owner to make it group-writable (chmod g+w), or set [reservations] "
                 "path to a place you can write; nothing was written",
    "link": "is a symbolic link on {host}; gputop does not follow links for its files",
    "notfile": "not a regular file on {host}; gputop reads and writes only a plain file "
               "there (it was left untouched)",
    "changed": "was replaced while gputop opened it on {host} (it had been checked to be a "
               "plain file it may read); it was left untouched",
    "denied": "permission denied trying to read it on {host}. Ask the owner to make it "
              "group-readable for your team, or set [reservations] path elsewhere",
    "short": "the new file did not arrive whole on {host}; nothing was written",
    "rename": "cannot replace the file on {host}; nothing was written",
}
