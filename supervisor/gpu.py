"""NVML: which processes hold GPU memory (the lifecycle), and the GPU readings the
watchdog samples (temperature and the card's own slowdown mark, power and its enforced
limit, utilisation, memory, clock-event reasons, per-process memory, XID events).

Behind two small protocols so that the daemon runs unchanged on a host without a GPU
(`NoGpu`, no sampler) and tests can script readings (`FileSampler`). Nothing here
raises into the daemon: no driver, no library or an NVML error means "unknown" (None),
with the failing call named in the reading's `errors`, and the next sample tries again.
Every NVML call blocks: the daemon calls these from worker threads.
"""

from __future__ import annotations

import dataclasses
import json
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, TypeVar

T = TypeVar("T")

# clock-event reason bits (nvmlClocksEventReason*; the same values as the older
# nvmlClocksThrottleReason* names)
SW_POWER_CAP = 0x4
HW_SLOWDOWN = 0x8
SW_THERMAL_SLOWDOWN = 0x20
HW_THERMAL_SLOWDOWN = 0x40
HW_POWER_BRAKE_SLOWDOWN = 0x80


@dataclass(frozen=True)
class GpuReading:
    """One sample over the engine's GPUs. None = unknown (never 0 for unknown)."""

    temperature_c: float | None = None  # hottest of the engine's GPUs
    slowdown_temperature_c: float | None = None  # lowest NVML slowdown threshold among them
    power_w: float | None = None  # summed draw
    power_limit_w: float | None = None  # summed enforced limit
    utilization_ratio: float | None = None  # mean, 0..1
    memory_used_bytes: int | None = None  # summed
    memory_total_bytes: int | None = None
    clock_event_reasons: int | None = None  # OR of the raw bitmasks
    thermal_throttled: bool | None = None  # SW or HW thermal slowdown on any GPU
    power_capped: bool | None = None  # SW power cap or HW power brake on any GPU
    process_memory: dict[int, int] | None = None  # pid -> bytes, all processes on them
    xids: tuple[int, ...] = ()  # XID codes seen since the previous sample
    errors: tuple[str, ...] = ()  # what failed this time

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


class GpuProcessLister(Protocol):
    def processes(self) -> dict[int, int] | None:
        """pid -> bytes of GPU memory, over the engine's GPUs; None if unknown."""


class GpuSampler(Protocol):
    def sample(self) -> GpuReading:
        """Blocking (call it from a worker thread). Never raises."""

    def processes(self) -> dict[int, int] | None: ...


class NoGpu:
    def processes(self) -> dict[int, int] | None:
        return None


class NvmlSampler:
    """Real NVML through nvidia-ml-py: the GPU lister and the watchdog's sampler."""

    def __init__(self, indices: list[int]) -> None:
        self._indices = indices
        self._lock = threading.Lock()
        self._ok = False
        self._events: Any = None  # the XID event set, when registration worked
        self.xid_problem: str | None = None

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
        try:
            events = pynvml.nvmlEventSetCreate()
            for i in self._indices:
                pynvml.nvmlDeviceRegisterEvents(pynvml.nvmlDeviceGetHandleByIndex(i),
                                                pynvml.nvmlEventTypeXidCriticalError, events)
            self._events = events
        except Exception as exc:  # XIDs are a bonus: the rest of the readings still work
            self.xid_problem = f"XID events unavailable: {exc}"
        return None

    def close(self) -> None:
        if not self._ok:
            return
        import pynvml

        with self._lock:
            try:
                if self._events is not None:
                    pynvml.nvmlEventSetFree(self._events)
                pynvml.nvmlShutdown()
            except Exception:  # shutting down: nothing left to tell
                pass
            self._ok = False

    def processes(self) -> dict[int, int] | None:
        if not self._ok:
            return None
        import pynvml

        with self._lock:
            try:
                return self._processes(pynvml)
            except pynvml.NVMLError:
                return None

    def _processes(self, pynvml: Any) -> dict[int, int]:
        out: dict[int, int] = {}
        for i in self._indices:
            handle = pynvml.nvmlDeviceGetHandleByIndex(i)
            for fn in (pynvml.nvmlDeviceGetComputeRunningProcesses,
                       pynvml.nvmlDeviceGetGraphicsRunningProcesses):
                for p in fn(handle):
                    used = p.usedGpuMemory or 0
                    out[p.pid] = out.get(p.pid, 0) + int(used)
        return out

    def sample(self) -> GpuReading:
        if not self._ok:
            return GpuReading(errors=("NVML is not initialised",))
        import pynvml

        errors: list[str] = []

        def call(what: str, fn: Callable[[], T]) -> T | None:
            try:
                return fn()
            except Exception as exc:  # one failing reading leaves only that one unknown
                errors.append(f"{what}: {type(exc).__name__}: {exc}")
                return None

        temps: list[float] = []
        slowdowns: list[float] = []
        power: list[float] = []
        limits: list[float] = []
        utils: list[float] = []
        used: list[int] = []
        total: list[int] = []
        reasons: list[int] = []
        with self._lock:
            for i in self._indices:
                t, sl, p, lim, u, m, r = _read_gpu(pynvml, i, call)
                for values, v, scale in ((temps, t, 1.0), (slowdowns, sl, 1.0),
                                         (power, p, 1e-3), (limits, lim, 1e-3),
                                         (utils, u, 1e-2)):
                    if v is not None:
                        values.append(float(v) * scale)
                if m is not None:
                    used.append(int(m.used))
                    total.append(int(m.total))
                if r is not None:
                    reasons.append(int(r))
            procs = call("processes", lambda: self._processes(pynvml))
            xids = self._drain_xids(pynvml, errors)
        mask = None
        if reasons:
            mask = 0
            for r in reasons:
                mask |= r
        return GpuReading(
            temperature_c=max(temps) if temps else None,
            slowdown_temperature_c=min(slowdowns) if slowdowns else None,
            power_w=sum(power) if power else None,
            power_limit_w=sum(limits) if limits else None,
            utilization_ratio=sum(utils) / len(utils) if utils else None,
            memory_used_bytes=sum(used) if used else None,
            memory_total_bytes=sum(total) if total else None,
            clock_event_reasons=mask,
            thermal_throttled=(None if mask is None else
                               bool(mask & (SW_THERMAL_SLOWDOWN | HW_THERMAL_SLOWDOWN))),
            power_capped=(None if mask is None else
                          bool(mask & (SW_POWER_CAP | HW_POWER_BRAKE_SLOWDOWN))),
            process_memory=procs, xids=tuple(xids), errors=tuple(errors))

    def _drain_xids(self, pynvml: Any, errors: list[str]) -> list[int]:
        """Every XID event waiting in the set, without blocking (timeout 0)."""
        out: list[int] = []
        if self._events is None:
            return out
        for _ in range(64):  # bounded: a storm of events is read over several samples
            try:
                data = pynvml.nvmlEventSetWait_v2(self._events, 0)
            except pynvml.NVMLError as exc:
                if getattr(exc, "value", None) != pynvml.NVML_ERROR_TIMEOUT:
                    errors.append(f"XID events: {exc}")
                break
            if data.eventType == pynvml.nvmlEventTypeXidCriticalError:
                out.append(int(data.eventData))
        return out


def _read_gpu(pynvml: Any, i: int, call: Callable[[str, Callable[[], Any]], Any]) -> tuple[
        Any, Any, Any, Any, Any, Any, Any]:
    """temperature, slowdown mark, power (mW), limit (mW), utilisation (%), memory info
    and clock-event reasons of GPU `i`; each None when its call failed."""
    h = call(f"GPU {i} handle", lambda: pynvml.nvmlDeviceGetHandleByIndex(i))
    if h is None:
        return None, None, None, None, None, None, None
    return (
        call("temperature", lambda: pynvml.nvmlDeviceGetTemperature(
            h, pynvml.NVML_TEMPERATURE_GPU)),
        call("slowdown threshold", lambda: pynvml.nvmlDeviceGetTemperatureThreshold(
            h, pynvml.NVML_TEMPERATURE_THRESHOLD_SLOWDOWN)),
        call("power", lambda: pynvml.nvmlDeviceGetPowerUsage(h)),
        call("power limit", lambda: pynvml.nvmlDeviceGetEnforcedPowerLimit(h)),
        call("utilization", lambda: pynvml.nvmlDeviceGetUtilizationRates(h).gpu),
        call("memory", lambda: pynvml.nvmlDeviceGetMemoryInfo(h)),
        call("clock-event reasons", lambda: _reasons(pynvml, h)))


def _reasons(pynvml: Any, handle: Any) -> int:
    fn = getattr(pynvml, "nvmlDeviceGetCurrentClocksEventReasons", None) or \
        pynvml.nvmlDeviceGetCurrentClocksThrottleReasons
    return int(fn(handle))


NvmlLister = NvmlSampler  # the lifecycle's name for it


@dataclass
class FileSampler:
    """Scripted readings: each sample re-reads a JSON object whose keys are GpuReading's
    fields (`process_memory` as {"pid": bytes}; `xids` as a list). For machines without
    a GPU and for tests, which drive the watchdog by rewriting the file (atomically).
    A missing or bad file gives a reading with every value unknown and the reason."""

    path: str
    _fields: dict[str, dataclasses.Field[Any]] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self._fields = {f.name: f for f in dataclasses.fields(GpuReading)
                        if f.name != "errors"}

    def _fail(self, why: str) -> GpuReading:
        return GpuReading(errors=(f"{self.path}: {why}",))

    def sample(self) -> GpuReading:
        try:
            doc = json.loads(Path(self.path).read_text())
        except OSError as exc:
            return self._fail(f"cannot read: {exc.strerror or exc}")
        except ValueError as exc:
            return self._fail(f"not JSON: {exc}")
        if not isinstance(doc, dict):
            return self._fail("expected a JSON object of GPU readings")
        values: dict[str, Any] = {}
        for key, raw in doc.items():
            if key not in self._fields:
                return self._fail(f"unknown key {key!r} (known: {', '.join(self._fields)})")
            try:
                values[key] = _coerce(key, raw)
            except (TypeError, ValueError) as exc:
                return self._fail(f"{key}: {exc}")
        return GpuReading(**values)

    def processes(self) -> dict[int, int] | None:
        return self.sample().process_memory


_FLOATS = ("temperature_c", "slowdown_temperature_c", "power_w", "power_limit_w",
           "utilization_ratio")
_INTS = ("memory_used_bytes", "memory_total_bytes", "clock_event_reasons")
_BOOLS = ("thermal_throttled", "power_capped")


def _coerce(key: str, raw: Any) -> Any:
    if raw is None:
        return None
    if key in _FLOATS:
        if isinstance(raw, bool) or not isinstance(raw, int | float):
            raise TypeError(f"expected a number, got {raw!r}")
        return float(raw)
    if key in _INTS:
        if isinstance(raw, bool) or not isinstance(raw, int):
            raise TypeError(f"expected an integer, got {raw!r}")
        return raw
    if key in _BOOLS:
        if not isinstance(raw, bool):
            raise TypeError(f"expected true or false, got {raw!r}")
        return raw
    if key == "process_memory":
        if not isinstance(raw, dict):
            raise TypeError(f"expected {{\"pid\": bytes}}, got {raw!r}")
        out = {}
        for pid, used in raw.items():
            if not str(pid).isdigit() or isinstance(used, bool) or not isinstance(used, int):
                raise ValueError(f"expected {{\"pid\": bytes}}, got {pid!r}: {used!r}")
            out[int(pid)] = used
        return out
    if key == "xids":
        if not isinstance(raw, list) or not all(
                isinstance(x, int) and not isinstance(x, bool) for x in raw):
            raise TypeError(f"expected a list of XID codes, got {raw!r}")
        return tuple(raw)
    raise ValueError("not a reading")
