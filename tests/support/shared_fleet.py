"""The shared session fleet's hosts (one of every fault) and the set-up any fleet needs."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.support.fleet import GpuProcess, Host, sshd_available

HOSTILE = "[bold red]x[/] \x1b]0;pwned\x07"

# The dozen hosts of the "done when" fleet: healthy ones and one of every fault.
FAULTS = {
    "unreachable": "unreachable",
    "banner": "timeout",
    "hang": "timeout",
    "auth": "auth",
    "hostkey-changed": "host-key",
    "hostkey-unknown": "host-key",
    "no-smi": "no-nvidia-smi",
    "driver": "driver",
    "nvml-mismatch": "driver",
    "no-devices": "no-devices",
    "parse": "parse",
}


def fleet_hosts() -> list[Host]:
    return [
        Host("gpu-h100", "127.0.0.2", gpus=("h100", "h100"), processes=[
            GpuProcess("gtalice", "python train.py --epochs 90", gpu=0, mem_mib=19000),
            GpuProcess("gtbob", HOSTILE, gpu=1, mem_mib=77),
        ]),
        Host("gpu-mixed", "127.0.0.3", gpus=("h100-mig", "l40s", "rtx2080", "rtx2080-win")),
        Host("gpu-lost", "127.0.0.4", scenario="lost", gpus=("l40s",)),
        Host("unreachable", "127.0.0.5", scenario="unreachable"),
        Host("banner", "127.0.0.6", scenario="banner-timeout"),
        Host("hang", "127.0.0.7", scenario="hang"),
        Host("auth", "127.0.0.8", scenario="auth"),
        Host("hostkey-changed", "127.0.0.9", scenario="host-key-changed"),
        Host("hostkey-unknown", "127.0.0.10", scenario="host-key-unknown"),
        Host("no-smi", "127.0.0.11", scenario="no-nvidia-smi"),
        Host("driver", "127.0.0.12", scenario="driver"),
        Host("nvml-mismatch", "127.0.0.13", scenario="nvml-mismatch"),
        Host("no-devices", "127.0.0.14", scenario="no-devices"),
        Host("parse", "127.0.0.15", scenario="parse"),
    ]


def need_sshd() -> None:
    reason = sshd_available()
    if reason:
        pytest.skip(reason)


def world_readable(p: Path) -> Path:
    # sshd (and the test users' processes) must be able to reach the fleet's files.
    for parent in [p, *p.parents]:
        if str(parent) in ("/", "/tmp"):
            break
        os.chmod(parent, os.stat(parent).st_mode | 0o755)
    return p
