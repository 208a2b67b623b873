"""Read the local machine's GPUs in-process through NVML (``pynvml``, imported lazily).

No subprocess, no SSH: the local host costs a few NVML calls per refresh, on one NVML
session initialised once for the life of the process (``nvmlInit`` is what costs seconds
per GPU without persistence mode; it is repeated only after NVML itself failed). Process owners,
command lines and ages come from ``/proc``, as ``ps`` would report them.
"""

from __future__ import annotations

import asyncio
import os
import pwd
from collections.abc import Callable
from dataclasses import replace
from types import ModuleType
from typing import Any, Literal, TypeVar

from gputop.model import GpuInfo, HostError, MigInstance, ProcessInfo
from gputop.text import clean, excerpt

T = TypeVar("T")
MIB = 1024 * 1024


def _load_pynvml() -> ModuleType:
    import pynvml

    return pynvml  # type: ignore[no-any-return]


class NvmlSource:
    """The local machine. ``nvml`` may be given for tests (no GPU here), else pynvml."""

    kind: Literal["nvml"] = "nvml"
    #: Not a stream, nothing odd to report, no backoff to forget (see ``Source``).
    warnings: tuple[str, ...] = ()
    first_sample_s: float | None = None
    paced = False

    def __init__(self, name: str, *, timeout: float, nvml: ModuleType | None = None,
                 proc_root: str = "/proc") -> None:
        self.name = name
        self.timeout = timeout
        self._nvml = nvml
        self._initialised = False
        self._proc = proc_root
        self.connects = 0

    def reset(self) -> None:
        """Nothing to forget: every query tries the host anew."""

    async def query(self) -> tuple[list[GpuInfo], HostError | None]:
        try:
            return await asyncio.wait_for(asyncio.to_thread(self._read), self.timeout)
        except (asyncio.TimeoutError, TimeoutError):
            return [], HostError("timeout", "NVML did not answer in time")

    # -- blocking part (runs in a worker thread) --------------------------------------------

    def _read(self) -> tuple[list[GpuInfo], HostError | None]:
        try:
            nv = self._nvml or _load_pynvml()
            self._nvml = nv
        except ImportError:
            return [], HostError("no-nvml", "pynvml (nvidia-ml-py) is not installed")
        try:
            if not self._initialised:
                nv.nvmlInit()
                self._initialised = True
            count = nv.nvmlDeviceGetCount()
            driver = self._opt(lambda: _s(nv.nvmlSystemGetDriverVersion()))
        except nv.NVMLError as exc:
            self._initialised = False
            return [], self._classify(nv, exc)
        if count == 0:
            return [], HostError("no-devices", "No devices were found")
        return [self._gpu(nv, i, driver) for i in range(count)], None

    def _classify(self, nv: Any, exc: Exception) -> HostError:
        text = excerpt(str(exc))
        if isinstance(exc, getattr(nv, "NVMLError_LibraryNotFound", ())):
            # (pynvml's own text is "NVML Shared Library Not Found": said once, with why)
            return HostError("no-nvml", "NVML library not found (no NVIDIA driver on "
                             "this machine?)")
        if isinstance(exc, getattr(nv, "NVMLError_DriverNotLoaded", ())):
            return HostError("driver", f"NVIDIA driver is not loaded: {text}")
        return HostError("driver", f"NVML: {text}")

    def _opt(self, fn: Callable[[], T]) -> T | None:
        """Value of one NVML call, or None if this GPU/driver cannot report it."""
        nv = self._nvml
        assert nv is not None
        try:
            return fn()
        except nv.NVMLError:
            return None

    def _gpu(self, nv: Any, index: int, driver: str | None) -> GpuInfo:
        try:
            h = nv.nvmlDeviceGetHandleByIndex(index)
        except nv.NVMLError as exc:
            return GpuInfo(index=index, lost=True, lost_reason=excerpt(str(exc)))
        util = self._opt(lambda: nv.nvmlDeviceGetUtilizationRates(h))
        mem = self._opt(lambda: nv.nvmlDeviceGetMemoryInfo(h))
        power = self._opt(lambda: nv.nvmlDeviceGetPowerUsage(h))
        limit = self._opt(lambda: nv.nvmlDeviceGetEnforcedPowerLimit(h))
        pstate = self._opt(lambda: nv.nvmlDeviceGetPerformanceState(h))
        mig = self._opt(lambda: nv.nvmlDeviceGetMigMode(h))
        pci = self._opt(lambda: nv.nvmlDeviceGetPciInfo(h))
        procs = self._opt(lambda: nv.nvmlDeviceGetComputeRunningProcesses(h)) or []
        instances = self._instances(nv, h) if mig is not None and mig[0] else ()
        placed = {p.pid: (i.gpu_instance_id, i.compute_instance_id)
                  for i in instances for p in i.processes}
        processes = tuple(self._process(p, placed.get(p.pid)) for p in procs)
        if instances:  # the instances' processes with owners, as the GPU's list has them
            by_pid = {p.pid: p for p in processes}
            instances = tuple(replace(i, processes=tuple(by_pid.get(p.pid, p)
                                                         for p in i.processes))
                              for i in instances)
        persistence = self._opt(lambda: nv.nvmlDeviceGetPersistenceMode(h))
        return GpuInfo(
            index=index,
            uuid=self._opt(lambda: _s(nv.nvmlDeviceGetUUID(h))),
            name=self._opt(lambda: _s(nv.nvmlDeviceGetName(h))),
            bus_id=_s(pci.busId) if pci is not None else None,
            utilization_percent=util.gpu if util is not None else None,
            memory_utilization_percent=util.memory if util is not None else None,
            memory_used_mib=mem.used // MIB if mem is not None else None,
            memory_total_mib=mem.total // MIB if mem is not None else None,
            temperature_c=self._opt(
                lambda: nv.nvmlDeviceGetTemperature(h, nv.NVML_TEMPERATURE_GPU)),
            power_draw_w=power / 1000.0 if power is not None else None,
            power_limit_w=limit / 1000.0 if limit is not None else None,
            fan_percent=self._opt(lambda: nv.nvmlDeviceGetFanSpeed(h)),
            pstate=f"P{pstate}" if pstate is not None and 0 <= pstate <= 15 else None,
            mig_mode=("Enabled" if mig[0] else "Disabled") if mig is not None else None,
            persistence_mode=(("Enabled" if persistence else "Disabled")
                              if persistence is not None else None),
            driver_version=driver,
            processes=processes,
            instances=instances,
        )

    def _instances(self, nv: Any, h: Any) -> tuple[MigInstance, ...]:
        """A MIG-enabled GPU's instances: one NVML MIG device handle each (empty slots
        raise NotFound). Utilisation stays None: NVML reports none per MIG device."""
        out: list[MigInstance] = []
        if not hasattr(nv, "nvmlDeviceGetMigDeviceHandleByIndex"):  # pynvml before MIG
            return ()
        count = self._opt(lambda: nv.nvmlDeviceGetMaxMigDeviceCount(h)) or 0
        for slot in range(min(int(count), 64)):
            inst = self._mig_device(nv, h, slot)
            if inst is not None:
                out.append(inst)
        return tuple(out)

    def _mig_device(self, nv: Any, h: Any, slot: int) -> MigInstance | None:
        mh = self._opt(lambda: nv.nvmlDeviceGetMigDeviceHandleByIndex(h, slot))
        if mh is None:
            return None
        mem = self._opt(lambda: nv.nvmlDeviceGetMemoryInfo(mh))
        name = self._opt(lambda: _s(nv.nvmlDeviceGetName(mh))) or ""
        procs = self._opt(lambda: nv.nvmlDeviceGetComputeRunningProcesses(mh)) or []
        gi = self._opt(lambda: int(nv.nvmlDeviceGetGpuInstanceId(mh)))
        ci = self._opt(lambda: int(nv.nvmlDeviceGetComputeInstanceId(mh)))
        return MigInstance(
            gpu_instance_id=gi, compute_instance_id=ci, device_index=slot,
            uuid=self._opt(lambda: _s(nv.nvmlDeviceGetUUID(mh))),
            # A MIG device's name is its GPU's and its profile: "... MIG 3g.40gb".
            profile=name.rpartition("MIG ")[2] or None if "MIG " in name else None,
            memory_used_mib=mem.used // MIB if mem is not None else None,
            memory_total_mib=mem.total // MIB if mem is not None else None,
            processes=tuple(self._process(p, (gi, ci)) for p in procs))

    def _process(self, p: Any, where: tuple[int | None, int | None] | None = None
                 ) -> ProcessInfo:
        used = getattr(p, "usedGpuMemory", None)
        user, command, elapsed = _proc_details(self._proc, p.pid)
        # Newer NVML structs say the instance themselves; 0xFFFFFFFF means "not MIG".
        gi, ci = where or (getattr(p, "gpuInstanceId", None), getattr(p, "computeInstanceId", None))
        return ProcessInfo(
            pid=p.pid,
            user=user,
            command=command,
            gpu_memory_mib=used // MIB if isinstance(used, int) else None,
            elapsed_s=elapsed,
            gpu_instance_id=gi if isinstance(gi, int) and 0 <= gi < 0xFFFF else None,
            compute_instance_id=ci if isinstance(ci, int) and 0 <= ci < 0xFFFF else None,
        )

    async def close(self) -> None:
        if self._initialised and self._nvml is not None:
            try:
                self._nvml.nvmlShutdown()
            except self._nvml.NVMLError:
                pass
            self._initialised = False


def _s(v: bytes | str) -> str:
    """A string NVML reported, cleaned as every string from a host is (gputop.text.clean)."""
    return clean(v.decode("utf-8", "replace") if isinstance(v, bytes) else v)


def _proc_details(root: str, pid: int) -> tuple[str | None, str | None, int | None]:
    """Owner, command line and age of a local process, as ``ps`` would show them."""
    base = f"{root}/{int(pid)}"
    try:
        uid = os.stat(base).st_uid
        try:
            user: str | None = pwd.getpwuid(uid).pw_name
        except KeyError:
            user = str(uid)
        with open(f"{base}/cmdline", "rb") as f:
            raw = f.read().replace(b"\0", b" ").decode("utf-8", "replace")
            command = clean(raw).strip() or None
        with open(f"{base}/stat", "rb") as f:
            stat = f.read().decode("ascii", "replace")
        start_ticks = int(stat.rsplit(")", 1)[1].split()[19])
        with open(f"{root}/uptime") as f:
            uptime = float(f.read().split()[0])
        elapsed = max(0, int(uptime - start_ticks / os.sysconf("SC_CLK_TCK")))
    except (OSError, ValueError, IndexError):
        return None, None, None
    return user, command, elapsed

