"""The NVML source's mapping.

TEST DOUBLE, said plainly: this machine has no NVIDIA GPU or driver, so real NVML cannot run
here. A stand-in module with pynvml's function names, return shapes and exception classes
replaces ``pynvml`` for these tests only; the /proc reading of process owners is real.
"""

from __future__ import annotations

import os
import pwd
import subprocess
import types
from dataclasses import dataclass

from gputop.sources.nvml import NvmlSource


class NVMLError(Exception):
    pass


class NVMLError_NotSupported(NVMLError):
    pass


class NVMLError_GpuIsLost(NVMLError):
    pass


class NVMLError_DriverNotLoaded(NVMLError):
    pass


class NVMLError_LibraryNotFound(NVMLError):
    pass


@dataclass
class Util:
    gpu: int
    memory: int


@dataclass
class Mem:
    total: int
    used: int
    free: int


@dataclass
class Pci:
    busId: str


@dataclass
class Proc:
    pid: int
    usedGpuMemory: int | None


def fake_nvml(pid: int, *, init_error: Exception | None = None) -> types.ModuleType:
    m = types.ModuleType("pynvml_standin")
    m.NVMLError = NVMLError  # type: ignore[attr-defined]
    m.NVMLError_DriverNotLoaded = NVMLError_DriverNotLoaded  # type: ignore[attr-defined]
    m.NVMLError_LibraryNotFound = NVMLError_LibraryNotFound  # type: ignore[attr-defined]
    m.NVML_TEMPERATURE_GPU = 0  # type: ignore[attr-defined]

    def init() -> None:
        m.inits += 1  # type: ignore[attr-defined]
        if init_error:
            raise init_error

    m.inits = 0  # type: ignore[attr-defined]

    def handle(i: int) -> int:
        if i == 2:
            raise NVMLError_GpuIsLost("GPU is lost")
        return i

    def not_supported(h: int) -> int:
        raise NVMLError_NotSupported("Not Supported")

    m.nvmlInit = init  # type: ignore[attr-defined]
    m.nvmlShutdown = lambda: setattr(m, "inits", -1)  # type: ignore[attr-defined]
    m.nvmlDeviceGetPersistenceMode = lambda h: 0 if h == 1 else 1  # type: ignore[attr-defined]
    m.nvmlDeviceGetCount = lambda: 3  # type: ignore[attr-defined]
    m.nvmlSystemGetDriverVersion = lambda: "550.90.07"  # type: ignore[attr-defined]
    m.nvmlDeviceGetHandleByIndex = handle  # type: ignore[attr-defined]
    m.nvmlDeviceGetName = lambda h: b"NVIDIA H100 80GB HBM3"  # type: ignore[attr-defined]
    m.nvmlDeviceGetUUID = lambda h: f"GPU-{h}"  # type: ignore[attr-defined]
    m.nvmlDeviceGetPciInfo = lambda h: Pci(f"00000000:0{h}:00.0")  # type: ignore[attr-defined]
    m.nvmlDeviceGetUtilizationRates = lambda h: Util(87, 40)  # type: ignore[attr-defined]
    m.nvmlDeviceGetMemoryInfo = lambda h: Mem(81559 << 20, 19818 << 20, 0)  # type: ignore[attr-defined]
    m.nvmlDeviceGetTemperature = lambda h, s: 59  # type: ignore[attr-defined]
    m.nvmlDeviceGetPowerUsage = lambda h: 631950  # type: ignore[attr-defined]
    m.nvmlDeviceGetEnforcedPowerLimit = lambda h: 700000  # type: ignore[attr-defined]
    m.nvmlDeviceGetFanSpeed = not_supported  # type: ignore[attr-defined]
    m.nvmlDeviceGetPerformanceState = lambda h: 0  # type: ignore[attr-defined]
    m.nvmlDeviceGetMigMode = lambda h: (1, 1) if h == 1 else (0, 0)  # type: ignore[attr-defined]
    m.nvmlDeviceGetComputeRunningProcesses = (  # type: ignore[attr-defined]
        lambda h: [Proc(pid, 2 << 30)] if h == 0 else [Proc(999999, None)])
    return m


async def test_mapping_with_real_proc_owner() -> None:
    sleeper = subprocess.Popen(["sleep", "60"])
    try:
        src = NvmlSource("local", timeout=5, nvml=fake_nvml(sleeper.pid))
        gpus, err = await src.query()
    finally:
        sleeper.kill()
        sleeper.wait()
    assert err is None
    g0, g1, lost = gpus
    assert (g0.index, g0.uuid, g0.name, g0.bus_id) == (0, "GPU-0", "NVIDIA H100 80GB HBM3",
                                                        "00000000:00:00.0")
    assert (g0.utilization_percent, g0.memory_utilization_percent) == (87, 40)
    assert (g0.memory_used_mib, g0.memory_total_mib, g0.temperature_c) == (19818, 81559, 59)
    assert (g0.power_draw_w, g0.power_limit_w, g0.fan_percent) == (631.95, 700.0, None)
    assert (g0.pstate, g0.mig_mode, g0.driver_version) == ("P0", "Disabled", "550.90.07")
    assert g1.mig_mode == "Enabled"
    (p,) = g0.processes
    assert p.pid == sleeper.pid and p.gpu_memory_mib == 2048
    assert p.user == pwd.getpwuid(os.geteuid()).pw_name
    assert p.command == "sleep 60" and p.elapsed_s is not None and p.elapsed_s >= 0
    (gone,) = g1.processes
    assert (gone.pid, gone.user, gone.gpu_memory_mib) == (999999, None, None)
    assert lost.lost and lost.index == 2 and "lost" in (lost.lost_reason or "")


async def test_driver_not_loaded_is_classified() -> None:
    src = NvmlSource("local", timeout=5,
                     nvml=fake_nvml(1, init_error=NVMLError_DriverNotLoaded("Driver Not Loaded")))
    gpus, err = await src.query()
    assert gpus == [] and err is not None and err.kind == "driver"


async def test_library_missing_is_classified() -> None:
    src = NvmlSource("local", timeout=5,
                     nvml=fake_nvml(1, init_error=NVMLError_LibraryNotFound("no libnvidia-ml")))
    _, err = await src.query()
    assert err is not None and err.kind == "no-nvml"


async def test_real_pynvml_on_a_machine_without_gpu() -> None:
    """Not a double: the real pynvml here finds no driver, and that is a host error."""
    gpus, err = await NvmlSource("local", timeout=10).query()
    if err is None:  # a machine with a GPU: then there are GPUs
        assert gpus
    else:
        assert err.kind in ("no-nvml", "driver")


async def test_one_nvml_session_for_the_life_of_the_source() -> None:
    """NVML is initialised once, not per refresh (each init costs seconds per GPU without
    persistence mode), and shut down once, at close. A test double: no GPU here."""
    nv = fake_nvml(os.getpid())
    src = NvmlSource("local", timeout=5, nvml=nv)
    for _ in range(5):
        gpus, err = await src.query()
        assert err is None
    assert nv.inits == 1  # type: ignore[attr-defined]
    assert [g.persistence_mode for g in gpus] == ["Enabled", "Disabled", None]
    await src.close()
    assert nv.inits == -1  # type: ignore[attr-defined]
