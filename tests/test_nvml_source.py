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
        # Said once, with the likely why (pynvml's text says "Not Found" too).
        assert err.kind != "no-nvml" or err.message == (
            "NVML library not found (no NVIDIA driver on this machine?)"), err.message


class NVMLError_NotFound(NVMLError):
    pass


def fake_mig_nvml(pid: int) -> types.ModuleType:
    """GPU 1 in MIG mode, split as the real H100 capture is (device 0: GI 2 3g.40gb, device
    1: GI 9 1g.10gb; further slots empty), ``pid`` running on device 1. Same test double."""
    m = fake_nvml(pid)
    layout = {0: (2, "3g.40gb", 40448, 11091), 1: (9, "1g.10gb", 9984, 9)}

    def mig_handle(h: int, slot: int) -> tuple[int, int]:
        if h != 1 or slot not in layout:
            raise NVMLError_NotFound("Not Found")
        return (h, slot)

    def procs(h: object) -> list[Proc]:
        if h == (1, 1) or h == 1:
            return [Proc(pid, 900 << 20)]
        return [] if isinstance(h, tuple) else [Proc(pid, 2 << 30)]

    def name(h: object) -> bytes:
        if isinstance(h, tuple):
            return f"NVIDIA H100 80GB HBM3 MIG {layout[h[1]][1]}".encode()
        return b"NVIDIA H100 80GB HBM3"

    def mem(h: object) -> Mem:
        if isinstance(h, tuple):
            _, _, total, used = layout[h[1]]
            return Mem(total << 20, used << 20, (total - used) << 20)
        return Mem(81559 << 20, 11125 << 20, 0)

    m.NVMLError_NotFound = NVMLError_NotFound  # type: ignore[attr-defined]
    m.nvmlDeviceGetMaxMigDeviceCount = lambda h: 7  # type: ignore[attr-defined]
    m.nvmlDeviceGetMigDeviceHandleByIndex = mig_handle  # type: ignore[attr-defined]
    m.nvmlDeviceGetGpuInstanceId = lambda h: layout[h[1]][0]  # type: ignore[attr-defined]
    m.nvmlDeviceGetComputeInstanceId = lambda h: 0  # type: ignore[attr-defined]
    m.nvmlDeviceGetUUID = (  # type: ignore[attr-defined]
        lambda h: f"MIG-{h[0]}-{h[1]}" if isinstance(h, tuple) else f"GPU-{h}")
    m.nvmlDeviceGetName = name  # type: ignore[attr-defined]
    m.nvmlDeviceGetMemoryInfo = mem  # type: ignore[attr-defined]
    m.nvmlDeviceGetComputeRunningProcesses = procs  # type: ignore[attr-defined]
    return m


async def test_mig_instances_through_nvml() -> None:
    sleeper = subprocess.Popen(["sleep", "60"])
    try:
        gpus, err = await NvmlSource("local", timeout=5, nvml=fake_mig_nvml(sleeper.pid)).query()
    finally:
        sleeper.kill()
        sleeper.wait()
    assert err is None
    g0, g1, _lost = gpus
    assert g0.instances == ()
    a, b = g1.instances
    assert (a.gpu_instance_id, a.compute_instance_id, a.profile, a.uuid) == (
        2, 0, "3g.40gb", "MIG-1-0")
    assert (a.memory_used_mib, a.memory_total_mib, a.processes) == (11091, 40448, ())
    assert (b.gpu_instance_id, b.profile, b.memory_total_mib) == (9, "1g.10gb", 9984)
    assert a.utilization_percent is None and b.utilization_percent is None  # never 0
    (p,) = b.processes
    assert p.pid == sleeper.pid and p.user == pwd.getpwuid(os.geteuid()).pw_name
    assert (p.gpu_instance_id, p.compute_instance_id) == (9, 0)
    (gp,) = g1.processes  # the GPU's own list says the instance too
    assert (gp.pid, gp.gpu_instance_id) == (sleeper.pid, 9)


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
