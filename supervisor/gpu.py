"""NVML, as far as the lifecycle needs it: which processes hold memory on the GPUs.

Behind a small protocol so that the daemon runs unchanged on a host without a GPU
(`NoGpu`) and tests can script readings. The real lister never raises: no driver, no
library or an NVML error means "unknown", reported as None, and the daemon goes on.
The watchdog's sampler (temperature, power, clock-event reasons) builds on this module.
"""

from __future__ import annotations

import threading
from typing import Protocol


class GpuProcessLister(Protocol):
    def processes(self) -> dict[int, int] | None:
        """pid -> bytes of GPU memory, over the engine's GPUs; None if unknown."""


class NoGpu:
    def processes(self) -> dict[int, int] | None:
        return None


class NvmlLister:
    """Real NVML through nvidia-ml-py. Blocking: call it from a worker thread."""

    def __init__(self, indices: list[int]) -> None:
        self._indices = indices
        self._lock = threading.Lock()
        self._ok = False

    def init(self) -> str | None:
        """Initialise NVML; returns why it is unavailable, or None when it works."""
        try:
            import pynvml

            pynvml.nvmlInit()
            count = pynvml.nvmlDeviceGetCount()
        except Exception as exc:  # no library, no driver, no device: all mean "no GPU"
            return f"NVML unavailable: {exc}"
        if count == 0:
            return "NVML found no GPU"
        if not self._indices:
            self._indices = list(range(count))
        bad = [i for i in self._indices if i >= count]
        if bad:
            return f"engine.gpus names GPU {bad[0]}, but NVML sees only {count}"
        self._ok = True
        return None

    def processes(self) -> dict[int, int] | None:
        if not self._ok:
            return None
        import pynvml

        out: dict[int, int] = {}
        with self._lock:
            try:
                for i in self._indices:
                    handle = pynvml.nvmlDeviceGetHandleByIndex(i)
                    for fn in (pynvml.nvmlDeviceGetComputeRunningProcesses,
                               pynvml.nvmlDeviceGetGraphicsRunningProcesses):
                        for p in fn(handle):
                            used = p.usedGpuMemory or 0
                            out[p.pid] = out.get(p.pid, 0) + int(used)
            except pynvml.NVMLError:
                return None
        return out
