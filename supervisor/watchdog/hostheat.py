"""Heat that is not the GPU's: the host's CPU or SoC temperature (docs/watchdog.md).

On unified-memory machines (GB10 / DGX Spark) vLLM's busy-spin drives the SoC to 96 C
(vllm#51950) while NVML's GPU reading says little. psutil reads the kernel's hwmon and
thermal zones where the host exposes them (`sensors_temperatures`); the hottest CPU or
SoC sensor is the signal `host_temperature_c`, unknown where there is none (a VM, a
container without /sys/class/hwmon, macOS). Drives, NICs and batteries are not the
engine's heat and are left out. Read in a worker thread with each look at the engine's
tree; never raises.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import psutil

# hwmon / thermal-zone names of CPU and SoC sensors (Intel, AMD, Arm SoCs, Jetson/GB10)
_CPU = ("coretemp", "k10temp", "zenpower", "cpu", "soc", "tegra", "acpitz", "x86_pkg_temp",
        "thermal_zone", "package", "apple")
_NOT_CPU = ("nvme", "drivetemp", "iwlwifi", "ath", "battery", "bat", "mlx", "nic", "ssd")


def _is_cpu(name: str, label: str) -> bool:
    text = f"{name} {label}".lower()
    return any(k in text for k in _CPU) and not any(k in name.lower() for k in _NOT_CPU)


def hottest(read: Callable[[], Mapping[str, Sequence[Any]]] | None = None
            ) -> tuple[float | None, str | None]:
    """The hottest CPU/SoC sensor now, (celsius, "group/label"); (None, None) when the
    host exposes none."""
    try:
        groups = read() if read is not None else psutil.sensors_temperatures()
    except (AttributeError, OSError, RuntimeError, ValueError):
        return None, None  # (no sensors API on this platform, or unreadable)
    best: tuple[float | None, str | None] = (None, None)
    for name, entries in (groups or {}).items():
        for entry in entries:
            current = getattr(entry, "current", None)
            label = str(getattr(entry, "label", "") or "")
            if not isinstance(current, int | float) or isinstance(current, bool) \
                    or not -40 < current < 200 or not _is_cpu(name, label):
                continue
            if best[0] is None or current > best[0]:
                best = (float(current), f"{name}/{label}" if label else name)
    return best
