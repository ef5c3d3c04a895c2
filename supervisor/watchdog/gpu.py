"""NVML: which processes hold GPU memory (the lifecycle), and the GPU readings the
watchdog samples (temperature and the card's own slowdown mark, power and its enforced
limit, utilisation, memory, clock-event reasons, per-process memory, XID events).

Behind two small protocols so that the daemon runs unchanged on a host without a GPU
(`NoGpu`, no sampler) and tests can script readings (`FileSampler`). Nothing here
raises into the daemon: no driver, no library or an NVML error means "unknown" (None),
with the failing call named in the reading's `errors`, and the next sample tries again.
A value is never 0 for "unknown", and a sum or extreme over several GPUs is unknown when
one GPU's part is (a partial sum would understate, a partial maximum could miss the hot
card). Every NVML call blocks: the daemon calls these from worker threads.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import importlib
import json
import math
import os
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, TypeVar

T = TypeVar("T")

# Clock-event reason bits, as NVML defines them (nvmlClocksEventReason*, formerly
# nvmlClocksThrottleReason*). NvmlSampler takes the values from the installed pynvml
# when it has them and falls back to these.
SW_POWER_CAP = 0x4
HW_SLOWDOWN = 0x8
SW_THERMAL_SLOWDOWN = 0x20
HW_THERMAL_SLOWDOWN = 0x40
HW_POWER_BRAKE_SLOWDOWN = 0x80

_XID_DRAIN_MAX = 64  # events read per sample: a storm is read over several samples


@dataclass(frozen=True)
class DeviceReading:
    """One GPU's readings, by NVML's index. None = unknown (never 0 for unknown)."""

    index: int
    temperature_c: float | None = None
    slowdown_temperature_c: float | None = None  # NVML's slowdown threshold of this card
    power_w: float | None = None
    power_limit_w: float | None = None  # enforced
    utilization_ratio: float | None = None  # 0..1
    memory_used_bytes: int | None = None
    memory_total_bytes: int | None = None
    clock_event_reasons: int | None = None  # the raw bitmask
    thermal_throttled: bool | None = None  # SW or HW thermal slowdown
    power_capped: bool | None = None  # SW power cap or HW power brake
    process_memory: dict[int, int] | None = None  # pid -> bytes on this GPU
    xids: tuple[int, ...] = ()  # XID codes seen on this GPU since the previous sample

    def margin_c(self, fallback_c: float) -> float | None:
        """Degrees below this card's own slowdown threshold (the fallback when unknown)."""
        if self.temperature_c is None:
            return None
        return (self.slowdown_temperature_c or fallback_c) - self.temperature_c


@dataclass(frozen=True)
class GpuReading:
    """One sample over the engine's GPUs. None = unknown (never 0 for unknown)."""

    temperature_c: float | None = None  # hottest of the engine's GPUs
    slowdown_temperature_c: float | None = None  # lowest NVML slowdown threshold among them
    power_w: float | None = None  # summed draw
    power_limit_w: float | None = None  # summed enforced power limit
    utilization_ratio: float | None = None  # mean GPU utilisation, 0..1
    memory_used_bytes: int | None = None  # summed
    memory_total_bytes: int | None = None
    clock_event_reasons: int | None = None  # OR of the raw bitmasks
    thermal_throttled: bool | None = None  # SW or HW thermal slowdown on any GPU
    power_capped: bool | None = None  # SW power cap or HW power brake on any GPU
    process_memory: dict[int, int] | None = None  # pid -> bytes, all processes on them
    xids: tuple[int, ...] = ()  # XID codes seen since the previous sample
    errors: tuple[str, ...] = ()  # what failed this time, e.g. "GPU 0 temperature: ..."
    # each GPU's own readings, in the engine's order (empty: only the summary is known,
    # as from a flat scripted file); the fields above summarise them
    devices: tuple[DeviceReading, ...] = ()

    def as_dict(self) -> dict[str, Any]:
        """As plain data; `devices` only when there are some (a flat scripted file reads
        the rest back)."""
        out = dataclasses.asdict(self)
        if not self.devices:
            del out["devices"]
        return out

    def xids_by_gpu(self) -> list[tuple[int | None, int]]:
        """(GPU index or None when unknown, XID code) for each XID of this sample."""
        if not self.devices:
            return [(None, code) for code in self.xids]
        out: list[tuple[int | None, int]] = [
            (d.index, code) for d in self.devices for code in d.xids]
        seen = [code for _, code in out]
        for code in self.xids:  # an event NVML could not place on one of the GPUs
            if code in seen:
                seen.remove(code)
            else:
                out.append((None, code))
        return out


def summarise(devices: Sequence[DeviceReading], *, process_memory: dict[int, int] | None,
              xids: Sequence[int] = (), errors: Sequence[str] = ()) -> GpuReading:
    """The engine's reading over its GPUs: the hottest temperature, the lowest slowdown
    threshold, summed power and memory, mean utilisation, OR-ed reasons; each unknown
    when one GPU's part is (a partial figure would understate or miss the hot card)."""
    temps = _all([d.temperature_c for d in devices])
    slowdowns = _all([d.slowdown_temperature_c for d in devices])
    power = _all([d.power_w for d in devices])
    limits = _all([d.power_limit_w for d in devices])
    utils = _all([d.utilization_ratio for d in devices])
    used = _all([d.memory_used_bytes for d in devices])
    total = _all([d.memory_total_bytes for d in devices])
    reasons = _all([d.clock_event_reasons for d in devices])
    mask = None
    if reasons is not None:
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
        thermal_throttled=_any([d.thermal_throttled for d in devices]),
        power_capped=_any([d.power_capped for d in devices]),
        process_memory=process_memory, xids=tuple(xids), errors=tuple(errors),
        devices=tuple(devices))


def _any(flags: Sequence[bool | None]) -> bool | None:
    """True when one GPU says so; unknown when none does and one is unknown."""
    if any(f is True for f in flags):
        return True
    return None if not flags or any(f is None for f in flags) else False


def _sum_processes(per_gpu: Sequence[dict[int, int] | None]) -> dict[int, int] | None:
    out: dict[int, int] = {}
    for procs in per_gpu:
        if procs is None:
            return None
        for pid, used in procs.items():
            out[pid] = out.get(pid, 0) + used
    return out


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


@dataclass(frozen=True)
class _GpuParts:
    """One GPU's raw answers; None where that call failed."""

    temperature: float | None = None
    slowdown: float | None = None
    power_mw: float | None = None
    limit_mw: float | None = None
    util_pct: float | None = None
    used: int | None = None
    total: int | None = None
    reasons: int | None = None


class NvmlSampler:
    """Real NVML through nvidia-ml-py: the GPU lister and the watchdog's sampler.

    `init()` before use and `close()` at the end; `sample()` and `processes()` may be
    called from different threads (one lock serialises the NVML calls)."""

    def __init__(self, indices: list[int], nvml: Any = None) -> None:
        """`indices`: the engine's GPUs (empty: every GPU NVML sees). `nvml`: the pynvml
        module (the default, imported at init) or a stand-in with its names, for tests."""
        self._nvml = nvml
        self._indices = list(indices)
        self._lock = threading.Lock()
        self._ok = False
        self._events: Any = None  # the XID event set, when registration worked
        self._thermal_mask = SW_THERMAL_SLOWDOWN | HW_THERMAL_SLOWDOWN
        self._power_mask = SW_POWER_CAP | HW_POWER_BRAKE_SLOWDOWN
        self.xid_problem: str | None = None  # why XID events are not read, if they are not
        self._xid_problem_told = False

    @property
    def indices(self) -> list[int]:
        """The GPUs sampled: the engine's `gpus`, or every GPU NVML sees once `init` ran."""
        return list(self._indices)

    def init(self) -> str | None:
        """Initialise NVML; returns why it is unavailable, or None when it works."""
        if self._ok:
            return None
        nv: Any = self._nvml
        try:
            if nv is None:
                nv = importlib.import_module("pynvml")
            nv.nvmlInit()
        except Exception as exc:  # no library, no driver, no device: all mean "no GPU"
            return f"NVML unavailable: {exc}"
        try:
            count = int(nv.nvmlDeviceGetCount())
        except Exception as exc:  # a driver that answers init but not the count
            _quiet(nv.nvmlShutdown)
            return f"NVML unavailable: {exc}"
        problem = None
        if count == 0:
            problem = "NVML found no GPU"
        elif not self._indices:
            self._indices = list(range(count))
        elif bad := [i for i in self._indices if not 0 <= i < count]:
            problem = f"engine.gpus names GPU {bad[0]}, but NVML sees only {count}"
        if problem is not None:
            _quiet(nv.nvmlShutdown)
            return problem
        self._nvml = nv
        self._thermal_mask = (_bit(nv, "SwThermalSlowdown", SW_THERMAL_SLOWDOWN)
                              | _bit(nv, "HwThermalSlowdown", HW_THERMAL_SLOWDOWN))
        self._power_mask = (_bit(nv, "SwPowerCap", SW_POWER_CAP)
                            | _bit(nv, "HwPowerBrakeSlowdown", HW_POWER_BRAKE_SLOWDOWN))
        self._register_xids(nv)
        self._ok = True
        return None

    def _register_xids(self, pynvml: Any) -> None:
        """One event set for XID critical errors on every engine GPU. XIDs are a bonus:
        when registration fails the other readings still work, and the first sample says
        so once."""
        events = None
        try:
            events = pynvml.nvmlEventSetCreate()
            for i in self._indices:
                pynvml.nvmlDeviceRegisterEvents(pynvml.nvmlDeviceGetHandleByIndex(i),
                                                pynvml.nvmlEventTypeXidCriticalError, events)
            self._events = events
        except Exception as exc:
            self.xid_problem = f"XID events unavailable: {type(exc).__name__}: {exc}"
            if events is not None:
                _quiet(lambda: pynvml.nvmlEventSetFree(events))

    def close(self) -> None:
        """Free the XID event set and shut NVML down; idempotent."""
        with self._lock:
            if not self._ok:
                return
            nv, events = self._nvml, self._events
            if events is not None:
                _quiet(lambda: nv.nvmlEventSetFree(events))
                self._events = None
            _quiet(nv.nvmlShutdown)
            self._ok = False

    def processes(self) -> dict[int, int] | None:
        """pid -> bytes over the engine's GPUs (compute and graphics); None if unknown."""
        with self._lock:
            if not self._ok:
                return None
            try:
                return self._processes(self._nvml)
            except Exception:  # unknown, never a guess: the take-down waits and retries
                return None

    def _processes(self, pynvml: Any) -> dict[int, int]:
        summed = _sum_processes([self._processes_on(pynvml, i) for i in self._indices])
        assert summed is not None  # (each GPU's list is known, or it raised)
        return summed

    def _processes_on(self, pynvml: Any, i: int) -> dict[int, int]:
        """pid -> bytes on GPU `i` (compute and graphics)."""
        handle = pynvml.nvmlDeviceGetHandleByIndex(i)
        on_gpu: dict[int, int] = {}
        for fn, optional in ((pynvml.nvmlDeviceGetComputeRunningProcesses, False),
                             (pynvml.nvmlDeviceGetGraphicsRunningProcesses, True)):
            try:
                procs = fn(handle)
            except pynvml.NVMLError_NotSupported:
                if not optional:
                    raise
                continue  # no graphics on a headless data-centre GPU
            for p in procs:
                # usedGpuMemory is None where NVML cannot attribute memory (MIG, some
                # containers): the pid still holds the GPU, so it stays listed, at 0.
                used = int(p.usedGpuMemory or 0)
                # a process in both lists is one process with one allocation
                on_gpu[int(p.pid)] = max(on_gpu.get(int(p.pid), 0), used)
        return on_gpu

    def sample(self) -> GpuReading:
        with self._lock:
            if not self._ok:
                return GpuReading(errors=("NVML is not initialised",))
            try:
                return self._sample(self._nvml)
            except Exception as exc:  # the contract is "never raises"; say what broke
                return GpuReading(errors=(f"sample: {type(exc).__name__}: {exc}",))

    def _sample(self, pynvml: Any) -> GpuReading:
        errors: list[str] = []
        if self.xid_problem is not None and not self._xid_problem_told:
            errors.append(self.xid_problem)
            self._xid_problem_told = True

        def call(what: str, fn: Callable[[], T]) -> T | None:
            try:
                return fn()
            except Exception as exc:  # one failing reading leaves only that one unknown
                errors.append(f"{what}: {type(exc).__name__}: {exc}")
                return None

        read = [(i, _read_gpu(pynvml, i, call), call(
            f"GPU {i} processes", functools.partial(self._processes_on, pynvml, i)))
            for i in self._indices]
        xids = self._drain_xids(pynvml, errors)
        devices = []
        for i, parts, procs in read:
            mask = parts.reasons
            devices.append(DeviceReading(
                index=i, temperature_c=parts.temperature, slowdown_temperature_c=parts.slowdown,
                power_w=None if parts.power_mw is None else parts.power_mw / 1000.0,
                power_limit_w=None if parts.limit_mw is None else parts.limit_mw / 1000.0,
                utilization_ratio=None if parts.util_pct is None else parts.util_pct / 100.0,
                memory_used_bytes=parts.used, memory_total_bytes=parts.total,
                clock_event_reasons=mask,
                thermal_throttled=None if mask is None else bool(mask & self._thermal_mask),
                power_capped=None if mask is None else bool(mask & self._power_mask),
                process_memory=procs, xids=tuple(code for gpu, code in xids if gpu == i)))
        return summarise(devices, process_memory=_sum_processes(
            [d.process_memory for d in devices]), xids=[code for _, code in xids],
            errors=errors)

    def _drain_xids(self, pynvml: Any, errors: list[str]) -> list[tuple[int | None, int]]:
        """Every XID event waiting in the set, without blocking (timeout 0), with the GPU
        it happened on (None when NVML cannot say)."""
        out: list[tuple[int | None, int]] = []
        if self._events is None:
            return out
        wait = getattr(pynvml, "nvmlEventSetWait_v2", None) or pynvml.nvmlEventSetWait
        for _ in range(_XID_DRAIN_MAX):
            try:
                data = wait(self._events, 0)
            except pynvml.NVMLError_Timeout:
                break  # drained
            except Exception as exc:
                errors.append(f"XID events: {type(exc).__name__}: {exc}")
                break
            if int(data.eventType) & int(pynvml.nvmlEventTypeXidCriticalError):
                out.append((self._gpu_of(pynvml, data), int(data.eventData)))
        return out

    def _gpu_of(self, pynvml: Any, data: Any) -> int | None:
        """The NVML index of the GPU an event came from, if NVML can tell."""
        device = getattr(data, "device", None)
        index_of = getattr(pynvml, "nvmlDeviceGetIndex", None)
        if device is None or index_of is None:
            return None
        try:
            index = int(index_of(device))
        except Exception:  # an event whose device NVML no longer knows: unplaced
            return None
        return index if index in self._indices else None


def _read_gpu(pynvml: Any, i: int, call: Callable[[str, Callable[[], Any]], Any]) -> _GpuParts:
    """GPU `i`'s answers, each None when its call failed (named in the errors)."""
    h = call(f"GPU {i} handle", lambda: pynvml.nvmlDeviceGetHandleByIndex(i))
    if h is None:
        return _GpuParts()
    mem = call(f"GPU {i} memory", lambda: pynvml.nvmlDeviceGetMemoryInfo(h))
    return _GpuParts(
        temperature=call(f"GPU {i} temperature", lambda: float(
            pynvml.nvmlDeviceGetTemperature(h, pynvml.NVML_TEMPERATURE_GPU))),
        slowdown=call(f"GPU {i} slowdown threshold", lambda: float(
            pynvml.nvmlDeviceGetTemperatureThreshold(
                h, pynvml.NVML_TEMPERATURE_THRESHOLD_SLOWDOWN))),
        power_mw=call(f"GPU {i} power", lambda: float(pynvml.nvmlDeviceGetPowerUsage(h))),
        limit_mw=call(f"GPU {i} power limit",
                      lambda: float(pynvml.nvmlDeviceGetEnforcedPowerLimit(h))),
        util_pct=call(f"GPU {i} utilization",
                      lambda: float(pynvml.nvmlDeviceGetUtilizationRates(h).gpu)),
        used=None if mem is None else int(mem.used),
        total=None if mem is None else int(mem.total),
        reasons=call(f"GPU {i} clock-event reasons", lambda: _reasons(pynvml, h)))


def _all(values: Sequence[T | None]) -> list[T] | None:
    """The values when every GPU answered, else None (unknown, not a partial figure)."""
    if not values or any(v is None for v in values):
        return None
    return [v for v in values if v is not None]


def _reasons(pynvml: Any, handle: Any) -> int:
    fn = getattr(pynvml, "nvmlDeviceGetCurrentClocksEventReasons", None) or \
        pynvml.nvmlDeviceGetCurrentClocksThrottleReasons
    return int(fn(handle))


def _bit(pynvml: Any, name: str, default: int) -> int:
    """A clock-event reason bit from pynvml: the current name, the older one, or NVML's
    documented value when this nvidia-ml-py has neither."""
    for prefix in ("nvmlClocksEventReason", "nvmlClocksThrottleReason"):
        value = getattr(pynvml, prefix + name, None)
        if isinstance(value, int):
            return value
    return default


def _quiet(fn: Callable[[], object]) -> None:
    # releasing NVML resources on the way out: a failure leaves nothing to tell
    with contextlib.suppress(Exception):
        fn()


NvmlLister = NvmlSampler  # the lifecycle's name for it


# ---- scripted readings -----------------------------------------------------------------

_FLOATS = ("temperature_c", "slowdown_temperature_c", "power_w", "power_limit_w",
           "utilization_ratio")
_INTS = ("memory_used_bytes", "memory_total_bytes", "clock_event_reasons")
_BOOLS = ("thermal_throttled", "power_capped")
_FIELDS = tuple(f.name for f in dataclasses.fields(GpuReading) if f.name != "devices")
_DEVICE_FIELDS = tuple(f.name for f in dataclasses.fields(DeviceReading) if f.name != "index")


class FileSampler:
    """Scripted readings: each sample re-reads a JSON file. Either one flat object whose
    keys are GpuReading's field names (the engine's summary), all optional (an absent key
    is unknown, None):

        {"temperature_c": 91.0, "slowdown_temperature_c": 89.0, "power_w": 650.5,
         "power_limit_w": 700.0, "utilization_ratio": 0.97,
         "memory_used_bytes": 7516192768, "memory_total_bytes": 85520809984,
         "clock_event_reasons": 36, "thermal_throttled": true, "power_capped": true,
         "process_memory": {"4242": 7012876288}, "xids": [79],
         "errors": ["GPU 0 power: NVMLError_NotSupported: Not Supported"]}

    or a host's GPUs, by NVML index, each with the same keys but `errors` (which stays at
    the top), the way NVML reads them one by one:

        {"gpus": {"0": {"temperature_c": 60.0, "process_memory": {"4242": 7012876288}},
                  "5": {"temperature_c": 91.0, "slowdown_temperature_c": 89.0,
                        "xids": [79]}}}

    Given `indices` (the engine's `gpus`), a sampler of the second form reads those GPUs
    alone and summarises them as NVML's sampler does (a GPU absent from the file is
    unknown); without, every GPU of the file. For machines without a GPU and for tests,
    which drive the watchdog by rewriting the file (atomically: write a temporary file,
    then os.replace). A missing, unreadable or malformed file, an unknown key or a value of
    the wrong type gives a reading with every value unknown and one error naming the file
    and the problem."""

    def __init__(self, path: str | os.PathLike[str], indices: Sequence[int] = ()) -> None:
        self.path = str(path)
        self.indices = list(indices)

    def _fail(self, why: str) -> GpuReading:
        return GpuReading(errors=(f"{self.path}: {why}",))

    def sample(self) -> GpuReading:
        try:
            doc = json.loads(Path(self.path).read_text(encoding="utf-8"))
        except OSError as exc:
            return self._fail(f"cannot read: {exc.strerror or exc}")
        except ValueError as exc:  # JSONDecodeError and UnicodeDecodeError both
            return self._fail(f"not JSON: {exc}")
        if not isinstance(doc, dict):
            return self._fail("expected a JSON object of GPU readings")
        if "gpus" in doc:
            return self._sample_gpus(doc)
        values: dict[str, Any] = {}
        for key, raw in doc.items():
            if key not in _FIELDS:
                return self._fail(f"unknown key {key!r} (known: {', '.join(_FIELDS)}, gpus)")
            try:
                values[key] = _coerce(key, raw)
            except (TypeError, ValueError) as exc:
                return self._fail(f"{key}: {exc}")
        return GpuReading(**values)

    def _sample_gpus(self, doc: dict[str, Any]) -> GpuReading:
        gpus, errors = doc["gpus"], doc.get("errors")
        if extra := sorted(set(doc) - {"gpus", "errors"}):
            return self._fail(f"unknown key {extra[0]!r} beside gpus (known: gpus, errors)")
        if not isinstance(gpus, dict):
            return self._fail('gpus: expected {"INDEX": {readings}}')
        try:
            notes = list(_coerce("errors", errors))
        except TypeError as exc:
            return self._fail(f"errors: {exc}")
        by_index: dict[int, DeviceReading] = {}
        for key, raw in gpus.items():
            if not (isinstance(key, str) and key.isascii() and key.isdigit()):
                return self._fail(f"gpus: {key!r} is not a GPU index")
            if not isinstance(raw, dict):
                return self._fail(f"gpus.{key}: expected an object of readings")
            values: dict[str, Any] = {}
            for field, value in raw.items():
                if field not in _DEVICE_FIELDS:
                    return self._fail(f"gpus.{key}: unknown key {field!r} "
                                      f"(known: {', '.join(_DEVICE_FIELDS)})")
                try:
                    values[field] = _coerce(field, value)
                except (TypeError, ValueError) as exc:
                    return self._fail(f"gpus.{key}.{field}: {exc}")
            mask = values.get("clock_event_reasons")
            if mask is not None:  # the flags follow the reasons, as NVML's sampler does
                values.setdefault("thermal_throttled",
                                  bool(mask & (SW_THERMAL_SLOWDOWN | HW_THERMAL_SLOWDOWN)))
                values.setdefault("power_capped",
                                  bool(mask & (SW_POWER_CAP | HW_POWER_BRAKE_SLOWDOWN)))
            by_index[int(key)] = DeviceReading(index=int(key), **values)
        indices = self.indices or sorted(by_index)
        for i in indices:
            if i not in by_index:
                notes.append(f"GPU {i}: not in {self.path}")
        devices = [by_index.get(i, DeviceReading(index=i)) for i in indices]
        return summarise(devices, process_memory=_sum_processes(
            [d.process_memory for d in devices]),
            xids=[code for d in devices for code in d.xids], errors=notes)

    def processes(self) -> dict[int, int] | None:
        return self.sample().process_memory


def _coerce(key: str, raw: Any) -> Any:
    if raw is None:
        return () if key in ("xids", "errors") else None
    if key in _FLOATS:
        if isinstance(raw, bool) or not isinstance(raw, int | float) or not math.isfinite(raw):
            raise TypeError(f"expected a finite number, got {raw!r}")
        if key == "utilization_ratio" and not 0.0 <= raw <= 1.0:
            raise ValueError(f"expected a ratio between 0 and 1, got {raw!r}")
        return float(raw)
    if key in _INTS:
        if isinstance(raw, bool) or not isinstance(raw, int) or raw < 0:
            raise TypeError(f"expected a non-negative integer, got {raw!r}")
        return raw
    if key in _BOOLS:
        if not isinstance(raw, bool):
            raise TypeError(f"expected true or false, got {raw!r}")
        return raw
    if key == "process_memory":
        if not isinstance(raw, dict):
            raise TypeError(f'expected {{"pid": bytes}}, got {raw!r}')
        out = {}
        for pid, used in raw.items():
            if not (pid.isascii() and pid.isdigit() and int(pid) > 0) or isinstance(
                    used, bool) or not isinstance(used, int) or used < 0:
                raise ValueError(f'expected {{"pid": bytes}}, got {pid!r}: {used!r}')
            out[int(pid)] = used
        return out
    if key == "xids":
        if not isinstance(raw, list) or not all(
                isinstance(x, int) and not isinstance(x, bool) and x > 0 for x in raw):
            raise TypeError(f"expected a list of XID codes, got {raw!r}")
        return tuple(raw)
    if key == "errors":
        if not isinstance(raw, list) or not all(isinstance(x, str) for x in raw):
            raise TypeError(f"expected a list of strings, got {raw!r}")
        return tuple(raw)
    raise ValueError("not a reading")  # pragma: no cover - _FIELDS covers every key
