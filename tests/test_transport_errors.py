"""How what the socket layer and the SSH set-up raise is said: classified, in their own words
(a local file that cannot be read is named, never taken for the network)."""

from __future__ import annotations

import json
import os
import socket
from pathlib import Path

import pytest

from gputop.ssh.transport import KeyLoadError, classify_exception, resolve_options
from tests.support.as_user import need_test_users, run_as, shared_tmp, user_home
from tests.support.fleet import Fleet


def test_a_name_that_does_not_resolve_says_so_without_errno_numbers() -> None:
    """Not "name resolution failed: [Errno -2] Name or service not known"."""
    real = None
    try:
        socket.getaddrinfo("no-such-host.invalid", 22)
    except socket.gaierror as exc:
        real = exc
    assert real is not None  # (.invalid never resolves: RFC 2606)
    err = classify_exception(real)
    assert err.kind == "unreachable"
    assert err.message.startswith("name resolution failed: ") and "[Errno" not in err.message
    assert err.message == f"name resolution failed: {real.strerror}"
    # One with no words of its own still says something.
    assert classify_exception(socket.gaierror()).message == "name resolution failed: gaierror"


def test_an_unreadable_identity_file_is_an_auth_error_naming_it(small_fleet: Fleet) -> None:
    """Not "unreachable: [Errno 13] Permission denied": the host was never asked; the key
    named in ~/.ssh/config is what cannot be read (mode 000, owned by someone else)."""
    need_test_users()
    with shared_tmp() as root:
        home = user_home(small_fleet, root, "gtbob")
        key = home / ".ssh" / "id_ed25519"
        os.chown(key, 0, 0)
        key.chmod(0)
        cfg = root / "hosts.toml"
        cfg.write_text(small_fleet.write_config(["alpha"], timeout=5.0).read_text())
        env = {"HOME": str(home), "PATH": os.environ["PATH"], "USER": "gtbob",
               "LOGNAME": "gtbob"}
        proc = run_as("gtbob", ["--config", str(cfg), "--json"], env, root)
        (host,) = json.loads(proc.stdout)["hosts"]
        assert host["error"] == {"kind": "auth",
                                 "message": f"cannot read {key}: Permission denied"}


def test_a_key_asyncssh_cannot_load_is_named(tmp_path: Path) -> None:
    """asyncssh's own error ("Invalid private key") names no file: the config's is found."""
    (tmp_path / "bad").write_text("not a key\n")
    (tmp_path / "config").write_text(f"Host x\n  HostName 127.0.0.1\n  IdentityFile "
                                     f"{tmp_path / 'bad'}\n")
    with pytest.raises(KeyLoadError) as caught:
        resolve_options("x", ssh_config=[tmp_path / "config"])
    err = classify_exception(caught.value)
    assert err.kind == "auth"
    assert err.message.startswith(f"cannot load the key {tmp_path / 'bad'} "), err
