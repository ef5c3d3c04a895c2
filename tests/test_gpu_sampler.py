"""The scripted GPU sampler, the XID catalogue, and NVML's absence on a machine without
a GPU. Real files in a temporary directory, no mocks; the real NVML on a GPU machine is
tests/test_gpu.py."""

from __future__ import annotations

import dataclasses
import json
import os
import threading
import types
from pathlib import Path
from typing import Any

import pynvml  # nvidia-ml-py imports without a driver; only nvmlInit needs one
import pytest

from supervisor.watchdog.gpu import (
    DeviceReading,
    FileSampler,
    GpuReading,
    NvmlLister,
    NvmlSampler,
)
from supervisor.watchdog.xid import XID_ACTIONS, describe, rule_for

FULL = {
    "temperature_c": 71, "slowdown_temperature_c": 89.0, "power_w": 650.5,
    "power_limit_w": 700, "utilization_ratio": 0.9, "memory_used_bytes": 7 << 30,
    "memory_total_bytes": 85520809984, "clock_event_reasons": 0x24, "thermal_throttled": True,
    "power_capped": True, "process_memory": {"4242": 1 << 30, "17": 0}, "xids": [94, 45],
    "errors": ["GPU 0 utilization: NVMLError_NotSupported: Not Supported"]}


def write_atomically(path: Path, doc: Any) -> None:
    """How tests drive the sampler: a reader sees the old file or the new one, never half."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(doc if isinstance(doc, str) else json.dumps(doc))
    os.replace(tmp, path)


@pytest.fixture
def gpu_file(tmp_path: Path) -> Path:
    return tmp_path / "gpu.json"


def test_file_sampler_round_trips_a_full_reading(gpu_file: Path):
    write_atomically(gpu_file, FULL)
    s = FileSampler(gpu_file)
    r = s.sample()
    assert r == GpuReading(
        temperature_c=71.0, slowdown_temperature_c=89.0, power_w=650.5, power_limit_w=700.0,
        utilization_ratio=0.9, memory_used_bytes=7 << 30, memory_total_bytes=85520809984,
        clock_event_reasons=0x24, thermal_throttled=True, power_capped=True,
        process_memory={4242: 1 << 30, 17: 0}, xids=(94, 45),
        errors=("GPU 0 utilization: NVMLError_NotSupported: Not Supported",))
    assert isinstance(r.temperature_c, float) and isinstance(r.power_limit_w, float)
    assert s.processes() == {4242: 1 << 30, 17: 0}
    # as_dict is what a test or a dump writes back: it reads back the same reading
    back = r.as_dict()
    back["process_memory"] = {str(k): v for k, v in back["process_memory"].items()}
    write_atomically(gpu_file, back)
    assert s.sample() == r


def test_process_memory_keys_are_parsed_to_int_pids(gpu_file: Path):
    write_atomically(gpu_file, {"process_memory": {"1": 5, "65536": 6 << 30}})
    procs = FileSampler(gpu_file).sample().process_memory
    assert procs == {1: 5, 65536: 6 << 30}
    assert procs is not None and all(type(k) is int for k in procs)


def test_absent_keys_are_unknown_not_zero(gpu_file: Path):
    write_atomically(gpu_file, {"temperature_c": 50})
    s = FileSampler(str(gpu_file))
    r = s.sample()
    assert r.temperature_c == 50.0
    assert r.slowdown_temperature_c is None and r.power_w is None and r.power_limit_w is None
    assert r.utilization_ratio is None and r.memory_used_bytes is None
    assert r.clock_event_reasons is None and r.thermal_throttled is None
    assert r.power_capped is None and r.process_memory is None
    assert r.errors == () and r.xids == ()
    assert s.processes() is None


def test_an_empty_object_and_explicit_nulls_are_all_unknown(gpu_file: Path):
    write_atomically(gpu_file, {})
    assert FileSampler(gpu_file).sample() == GpuReading()
    write_atomically(gpu_file, {"power_w": None, "process_memory": None, "xids": None})
    assert FileSampler(gpu_file).sample() == GpuReading()


def test_an_empty_process_list_is_known_and_empty(gpu_file: Path):
    write_atomically(gpu_file, {"process_memory": {}})
    assert FileSampler(gpu_file).processes() == {}


BAD = {
    "garbage": ("{not json", "not JSON"),
    "empty file": ("", "not JSON"),
    "half written": ('{"temperature_c": 5', "not JSON"),
    "not utf-8": (b"\xff\xfe{}", "not JSON"),
    "a list": ("[1, 2]", "expected a JSON object"),
    "a number": ("42", "expected a JSON object"),
    "unknown key": ('{"temp": 50}', "unknown key 'temp'"),
    "unknown key beside good ones": ('{"temperature_c": 50, "fan": 1}', "unknown key 'fan'"),
    "string for number": ('{"temperature_c": "hot"}', "temperature_c: expected a finite"),
    "bool for number": ('{"power_w": true}', "power_w: expected a finite number"),
    "NaN": ('{"temperature_c": NaN}', "temperature_c: expected a finite number"),
    "ratio over 1": ('{"utilization_ratio": 97}', "utilization_ratio: expected a ratio"),
    "float for int": ('{"memory_used_bytes": 1.5}', "memory_used_bytes: expected a non-neg"),
    "negative bytes": ('{"memory_total_bytes": -1}', "memory_total_bytes: expected a non-neg"),
    "string for bool": ('{"thermal_throttled": "yes"}', "thermal_throttled: expected true"),
    "int for bool": ('{"power_capped": 1}', "power_capped: expected true or false"),
    "bad pid": ('{"process_memory": {"abc": 5}}', "process_memory: expected"),
    "negative pid": ('{"process_memory": {"-3": 5}}', "process_memory: expected"),
    "string bytes": ('{"process_memory": {"12": "5"}}', "process_memory: expected"),
    "list for processes": ('{"process_memory": [12]}', "process_memory: expected"),
    "string xids": ('{"xids": "79"}', "xids: expected a list of XID codes"),
    "string in xids": ('{"xids": [79, "x"]}', "xids: expected a list of XID codes"),
    "errors not strings": ('{"errors": [1]}', "errors: expected a list of strings"),
}


@pytest.mark.parametrize("name", sorted(BAD))
def test_a_bad_file_gives_an_all_unknown_reading_naming_the_file_and_problem(
        gpu_file: Path, name: str):
    content, why = BAD[name]
    if isinstance(content, bytes):
        gpu_file.write_bytes(content)
    else:
        write_atomically(gpu_file, content)
    s = FileSampler(gpu_file)
    r = s.sample()
    assert r == GpuReading(errors=r.errors)  # every value unknown, no XIDs
    assert len(r.errors) == 1
    assert r.errors[0].startswith(f"{gpu_file}: ") and why in r.errors[0], r.errors[0]
    assert s.processes() is None


def test_a_file_that_disappears_and_comes_back(gpu_file: Path):
    s = FileSampler(gpu_file)
    write_atomically(gpu_file, {"temperature_c": 60, "process_memory": {"7": 100}})
    assert s.sample().temperature_c == 60.0
    gpu_file.unlink()
    gone = s.sample()
    assert gone == GpuReading(errors=gone.errors)
    assert gone.errors == (f"{gpu_file}: cannot read: No such file or directory",)
    assert s.processes() is None  # unknown, not "nothing holds the GPU"
    write_atomically(gpu_file, {"temperature_c": 61})
    assert s.sample() == GpuReading(temperature_c=61.0)


def test_a_directory_in_place_of_the_file_is_reported(gpu_file: Path):
    gpu_file.mkdir()
    r = FileSampler(gpu_file).sample()
    assert r.temperature_c is None and len(r.errors) == 1
    assert r.errors[0].startswith(f"{gpu_file}: cannot read")


def test_each_sample_rereads_the_file_so_tests_can_drive_throttling(gpu_file: Path):
    s = FileSampler(gpu_file)
    write_atomically(gpu_file, {"temperature_c": 70.0, "slowdown_temperature_c": 89.0,
                                "clock_event_reasons": 0x4, "thermal_throttled": False})
    assert (s.sample().temperature_c, s.sample().thermal_throttled) == (70.0, False)
    write_atomically(gpu_file, {"temperature_c": 90.0, "slowdown_temperature_c": 89.0,
                                "clock_event_reasons": 0x24, "thermal_throttled": True})
    r = s.sample()
    assert (r.temperature_c, r.clock_event_reasons, r.thermal_throttled) == (90.0, 0x24, True)
    write_atomically(gpu_file, {"xids": [79]})
    assert s.sample().xids == (79,)


def test_readers_never_see_a_half_written_file_when_writes_are_atomic(gpu_file: Path):
    write_atomically(gpu_file, {"temperature_c": 0.0})
    s = FileSampler(gpu_file)
    stop = threading.Event()

    def writer() -> None:
        t = 0
        while not stop.is_set():
            t = (t + 1) % 100
            write_atomically(gpu_file, {"temperature_c": float(t),
                                        "process_memory": {str(p): p for p in range(1, 50)}})

    th = threading.Thread(target=writer)
    th.start()
    try:
        readings = [s.sample() for _ in range(300)]
    finally:
        stop.set()
        th.join(10)
    assert all(r.errors == () and r.temperature_c is not None for r in readings)


# ---- the XID catalogue -----------------------------------------------------------------

CATALOGUE_NAMES = {
    13: "Graphics Engine Exception", 31: "GPU memory page fault",
    32: "Invalid or corrupted push buffer stream", 38: "Driver firmware error",
    43: "GPU stopped processing", 45: "Preemptive cleanup, due to previous errors",
    48: "Double Bit ECC Error", 61: "Internal micro-controller breakpoint/warning",
    62: "Internal micro-controller halt", 63: "GPU memory remapping event",
    64: "GPU memory remapping failure", 68: "NVDEC0 Exception",
    69: "Graphics Engine class error", 74: "NVLINK Error", 79: "GPU has fallen off the bus",
    92: "High single-bit ECC error rate", 94: "Contained memory error",
    95: "Uncontained memory error", 109: "Context Switch Timeout Error",
    119: "GSP RPC Timeout", 120: "GSP Error", 140: "ECC Unrecovered Error",
    154: "GPU Recovery Action Changed",
}


def test_xid_catalogue_names_the_codes_the_watchdog_must_know():
    for code, name in CATALOGUE_NAMES.items():
        x = describe(code)
        assert (x.code, x.name) == (code, name)
        assert x.remedy in XID_ACTIONS


@pytest.mark.parametrize(("code", "remedy"), [
    (13, "restart"), (31, "restart"), (32, "restart"), (68, "restart"), (69, "restart"),
    (94, "restart"),                     # RESTART_APP
    (46, "reset"), (62, "reset"), (64, "reset"), (95, "reset"), (109, "reset"),
    (119, "reset"), (120, "reset"), (140, "reset"),   # RESET_GPU
    (48, "reset"), (74, "reset"),         # workflows ending in a GPU reset
    (79, "reboot"),                       # RESTART_BM
    (38, "info"), (43, "info"), (63, "info"), (92, "info"),  # IGNORE
    (45, "info"),                         # the teardown XID, also after our own SIGKILL
    (154, "reset"),                       # its action text is not in NVML's event
])
def test_xid_remedies_follow_the_catalogues_immediate_action(code: int, remedy: str):
    assert describe(code).remedy == remedy


@pytest.mark.parametrize("code", [0, 1, 9999, 173, -5])
def test_an_unknown_xid_is_named_and_needs_a_reset(code: int):
    x = describe(code)
    assert (x.code, x.name, x.remedy) == (code, f"unknown XID {code}", "reset")


def test_each_remedy_has_its_one_rule():
    """The mapping the signal window counts by and a start's XID check acts on (one table,
    `xid.RULE_OF`): a restart clears it, a reset or reboot holds the engine down."""
    assert {r: rule_for(r) for r in XID_ACTIONS} == {
        "restart": "xid_restart", "reset": "xid_reset", "reboot": "xid_reset", "info": None}
    assert rule_for("something new") == "xid_reset"  # (as an unknown code: the safe side)


def test_xid_entries_are_frozen_values():
    x = describe(79)
    with pytest.raises(AttributeError):
        x.remedy = "restart"  # type: ignore[misc]
    assert describe(79) == x


# ---- NVML on a machine without a GPU ---------------------------------------------------

def test_nvml_without_a_gpu_says_why_and_never_raises():
    s = NvmlSampler([])
    why = s.init()
    if why is None:  # a GPU machine: tests/test_gpu.py covers the real readings
        s.close()
        pytest.skip("NVML works here; this test is for machines without a GPU")
    assert why.startswith("NVML")
    r = s.sample()
    assert r == GpuReading(errors=("NVML is not initialised",))
    assert s.processes() is None
    s.close()
    s.close()  # idempotent
    assert s.sample().errors == ("NVML is not initialised",)


def test_nvml_sampler_is_the_lifecycle_lister_too():
    assert NvmlLister is NvmlSampler
    lister = NvmlLister([0])
    if lister.init() is None:
        lister.close()
        pytest.skip("NVML works here")
    assert lister.processes() is None


def test_nvml_never_raises_when_used_without_init():
    s = NvmlSampler([0, 1])
    assert s.sample() == GpuReading(errors=("NVML is not initialised",))
    assert s.processes() is None
    s.close()


# ---- NvmlSampler's arithmetic, over a stand-in for the pynvml module ---------------------
# The stand-in answers with pynvml's own exception classes, so the error texts are NVML's.


def nvml_error(code: int) -> Exception:
    return pynvml.NVMLError(code)  # pynvml returns the subclass for the code


@dataclasses.dataclass
class FakeGpu:
    temperature: int = 60
    slowdown: int = 89
    power_mw: int = 650_000
    limit_mw: int = 700_000
    util_pct: int = 100
    used: int = 8 << 30
    total: int = 80 << 30
    reasons: int = 0x4
    compute: list[tuple[int, int | None]] = dataclasses.field(default_factory=list)
    graphics: list[tuple[int, int | None]] | None = dataclasses.field(default_factory=list)
    failing: set[str] = dataclasses.field(default_factory=set)  # answers NotSupported


class FakeNvml:
    """The names NvmlSampler uses, without the clock-reason constants (so the sampler's
    fallback to NVML's documented bit values is what runs)."""

    NVMLError = pynvml.NVMLError
    NVMLError_Timeout = pynvml.NVMLError_Timeout
    NVMLError_NotSupported = pynvml.NVMLError_NotSupported
    NVML_TEMPERATURE_GPU = pynvml.NVML_TEMPERATURE_GPU
    NVML_TEMPERATURE_THRESHOLD_SLOWDOWN = pynvml.NVML_TEMPERATURE_THRESHOLD_SLOWDOWN
    nvmlEventTypeXidCriticalError = pynvml.nvmlEventTypeXidCriticalError

    def __init__(self, *gpus: FakeGpu, registration_fails: bool = False) -> None:
        self.gpus = list(gpus)
        self.initialised = 0
        self.registration_fails = registration_fails
        self.pending_xids: list[int | tuple[int, int]] = []  # code, or (GPU index, code)
        self.event_sets_freed = 0
        self.waits: list[int] = []

    def nvmlInit(self) -> None:
        self.initialised += 1

    def nvmlShutdown(self) -> None:
        self.initialised -= 1

    def nvmlDeviceGetCount(self) -> int:
        return len(self.gpus)

    def nvmlDeviceGetHandleByIndex(self, i: int) -> FakeGpu:
        return self.gpus[i]

    @staticmethod
    def _answer(h: FakeGpu, what: str) -> Any:
        if what in h.failing:
            raise nvml_error(pynvml.NVML_ERROR_NOT_SUPPORTED)
        return getattr(h, what)

    def nvmlDeviceGetTemperature(self, h: FakeGpu, sensor: int) -> int:
        assert sensor == pynvml.NVML_TEMPERATURE_GPU
        return int(self._answer(h, "temperature"))

    def nvmlDeviceGetTemperatureThreshold(self, h: FakeGpu, which: int) -> int:
        assert which == pynvml.NVML_TEMPERATURE_THRESHOLD_SLOWDOWN
        return int(self._answer(h, "slowdown"))

    def nvmlDeviceGetPowerUsage(self, h: FakeGpu) -> int:
        return int(self._answer(h, "power_mw"))

    def nvmlDeviceGetEnforcedPowerLimit(self, h: FakeGpu) -> int:
        return int(self._answer(h, "limit_mw"))

    def nvmlDeviceGetUtilizationRates(self, h: FakeGpu) -> Any:
        return types.SimpleNamespace(gpu=self._answer(h, "util_pct"), memory=0)

    def nvmlDeviceGetMemoryInfo(self, h: FakeGpu) -> Any:
        used, total = self._answer(h, "used"), self._answer(h, "total")
        return types.SimpleNamespace(used=used, total=total, free=total - used)

    def nvmlDeviceGetCurrentClocksEventReasons(self, h: FakeGpu) -> int:
        return int(self._answer(h, "reasons"))

    def _procs(self, listed: list[tuple[int, int | None]] | None) -> list[Any]:
        if listed is None:
            raise nvml_error(pynvml.NVML_ERROR_NOT_SUPPORTED)
        return [types.SimpleNamespace(pid=p, usedGpuMemory=m) for p, m in listed]

    def nvmlDeviceGetComputeRunningProcesses(self, h: FakeGpu) -> list[Any]:
        self._answer(h, "compute")
        return self._procs(h.compute)

    def nvmlDeviceGetGraphicsRunningProcesses(self, h: FakeGpu) -> list[Any]:
        return self._procs(h.graphics)

    def nvmlEventSetCreate(self) -> str:
        return "event set"

    def nvmlDeviceRegisterEvents(self, h: FakeGpu, kinds: int, events: str) -> None:
        assert kinds == pynvml.nvmlEventTypeXidCriticalError and events == "event set"
        if self.registration_fails:
            raise nvml_error(pynvml.NVML_ERROR_NOT_SUPPORTED)

    def nvmlEventSetWait_v2(self, events: str, timeout_ms: int) -> Any:
        self.waits.append(timeout_ms)
        if not self.pending_xids:
            raise nvml_error(pynvml.NVML_ERROR_TIMEOUT)
        xid = self.pending_xids.pop(0)
        gpu, code = xid if isinstance(xid, tuple) else (0, xid)
        return types.SimpleNamespace(eventType=pynvml.nvmlEventTypeXidCriticalError,
                                     eventData=code, device=self.gpus[gpu])

    def nvmlDeviceGetIndex(self, h: FakeGpu) -> int:
        return next(i for i, g in enumerate(self.gpus) if g is h)

    def nvmlEventSetFree(self, events: str) -> None:
        self.event_sets_freed += 1


def started(nv: FakeNvml, indices: list[int] | None = None) -> NvmlSampler:
    s = NvmlSampler(indices or [], nvml=nv)
    assert s.init() is None
    return s


def test_nvml_readings_over_two_gpus_are_summed_maxed_and_ored():
    nv = FakeNvml(
        FakeGpu(temperature=61, slowdown=89, power_mw=690_500, reasons=0x4, util_pct=100,
                compute=[(4242, 6 << 30), (77, 1 << 30)]),
        FakeGpu(temperature=72, slowdown=87, power_mw=300_000, reasons=0x1, util_pct=50,
                used=2 << 30, compute=[(4242, 5 << 30)], graphics=[(77, 1 << 30)]))
    r = started(nv).sample()
    assert dataclasses.replace(r, devices=()) == GpuReading(
        temperature_c=72.0, slowdown_temperature_c=87.0, power_w=990.5, power_limit_w=1400.0,
        utilization_ratio=0.75, memory_used_bytes=10 << 30, memory_total_bytes=160 << 30,
        clock_event_reasons=0x5, thermal_throttled=False, power_capped=True,
        process_memory={4242: 11 << 30, 77: 2 << 30}, xids=(), errors=())
    # and each GPU's own readings, by NVML's index
    assert r.devices == (
        DeviceReading(index=0, temperature_c=61.0, slowdown_temperature_c=89.0,
                      power_w=690.5, power_limit_w=700.0, utilization_ratio=1.0,
                      memory_used_bytes=8 << 30, memory_total_bytes=80 << 30,
                      clock_event_reasons=0x4, thermal_throttled=False, power_capped=True,
                      process_memory={4242: 6 << 30, 77: 1 << 30}),
        DeviceReading(index=1, temperature_c=72.0, slowdown_temperature_c=87.0,
                      power_w=300.0, power_limit_w=700.0, utilization_ratio=0.5,
                      memory_used_bytes=2 << 30, memory_total_bytes=80 << 30,
                      clock_event_reasons=0x1, thermal_throttled=False, power_capped=False,
                      process_memory={4242: 5 << 30, 77: 1 << 30}))


def test_nvml_places_each_xid_on_its_gpu():
    nv = FakeNvml(FakeGpu(), FakeGpu(), FakeGpu(), FakeGpu())
    s = started(nv, [2, 3])
    nv.pending_xids = [(3, 79), (2, 48)]
    r = s.sample()
    assert r.xids == (79, 48)
    assert [d.xids for d in r.devices] == [(48,), (79,)]
    assert r.xids_by_gpu() == [(2, 48), (3, 79)]


def test_nvml_reads_only_the_engines_gpus():
    nv = FakeNvml(FakeGpu(temperature=90, compute=[(1, 1)]), FakeGpu(temperature=40))
    r = started(nv, [1]).sample()
    assert r.temperature_c == 40.0 and r.process_memory == {}


def test_a_failing_call_leaves_only_its_field_unknown_and_names_the_gpu():
    nv = FakeNvml(FakeGpu(temperature=95), FakeGpu(failing={"temperature", "limit_mw"}))
    r = started(nv).sample()
    # the hot GPU answered, the other did not: the maximum is unknown, not 95
    assert r.temperature_c is None and r.power_limit_w is None
    assert r.power_w == 1300.0 and r.slowdown_temperature_c == 89.0
    assert r.errors == ("GPU 1 temperature: NVMLError_NotSupported: Not Supported",
                        "GPU 1 power limit: NVMLError_NotSupported: Not Supported")


def test_unknown_clock_reasons_leave_both_throttle_flags_unknown():
    r = started(FakeNvml(FakeGpu(failing={"reasons"}))).sample()
    assert (r.clock_event_reasons, r.thermal_throttled, r.power_capped) == (None, None, None)
    assert r.temperature_c == 60.0


@pytest.mark.parametrize(("reasons", "thermal", "capped"), [
    (0x0, False, False), (0x1, False, False),   # none, GPU idle
    (0x4, False, True), (0x80, False, True),    # SW power cap, HW power brake
    (0x20, True, False), (0x40, True, False),   # SW thermal, HW thermal slowdown
    (0x8, False, False),                        # HW slowdown alone is neither
    (0x24, True, True),
])
def test_throttle_flags_come_from_nvmls_reason_bits(reasons: int, thermal: bool, capped: bool):
    r = started(FakeNvml(FakeGpu(reasons=reasons))).sample()
    assert (r.clock_event_reasons, r.thermal_throttled, r.power_capped) == (
        reasons, thermal, capped)


def test_xids_are_drained_without_blocking_once_each():
    nv = FakeNvml(FakeGpu())
    s = started(nv)
    assert s.sample().xids == ()
    nv.pending_xids += [79, 45]
    assert s.sample().xids == (79, 45)
    assert s.sample().xids == ()
    assert set(nv.waits) == {0}  # never a blocking wait
    nv.pending_xids += list(range(1, 101))  # a storm is read over several samples
    first, second = s.sample().xids, s.sample().xids
    assert len(first) == 64 and first + second == tuple(range(1, 101))


def test_failed_xid_registration_is_said_once_and_the_rest_still_reads():
    nv = FakeNvml(FakeGpu(), registration_fails=True)
    s = started(nv)
    assert s.xid_problem == "XID events unavailable: NVMLError_NotSupported: Not Supported"
    assert nv.event_sets_freed == 1  # the half-registered set is not leaked
    first, second = s.sample(), s.sample()
    assert first.errors == (s.xid_problem,) and first.temperature_c == 60.0
    assert second.errors == () and second.temperature_c == 60.0


def test_processes_without_graphics_support_come_from_the_compute_list():
    s = started(FakeNvml(FakeGpu(compute=[(10, 3 << 30), (11, None)], graphics=None)))
    # a pid whose memory NVML cannot attribute still holds the GPU
    assert s.processes() == {10: 3 << 30, 11: 0}
    assert s.sample().process_memory == {10: 3 << 30, 11: 0}


def test_processes_are_unknown_when_the_compute_list_fails():
    s = started(FakeNvml(FakeGpu(), FakeGpu(failing={"compute"})))
    assert s.processes() is None
    r = s.sample()
    assert r.process_memory is None and r.temperature_c == 60.0
    assert r.errors == ("GPU 1 processes: NVMLError_NotSupported: Not Supported",)


def test_a_gpu_index_nvml_does_not_see_is_refused_and_nvml_released():
    nv = FakeNvml(FakeGpu())
    s = NvmlSampler([0, 3], nvml=nv)
    assert s.init() == "engine.gpus names GPU 3, but NVML sees only 1"
    assert nv.initialised == 0
    assert s.sample().errors == ("NVML is not initialised",)
    empty = FakeNvml()
    assert NvmlSampler([], nvml=empty).init() == "NVML found no GPU"
    assert empty.initialised == 0


def test_close_frees_the_event_set_and_shuts_nvml_down_once():
    nv = FakeNvml(FakeGpu())
    s = started(nv)
    assert nv.initialised == 1
    s.close()
    s.close()
    assert (nv.initialised, nv.event_sets_freed) == (0, 1)
    assert s.sample().errors == ("NVML is not initialised",) and s.processes() is None


def test_sample_never_raises_whatever_the_library_does():
    class Broken(FakeNvml):
        gone = False  # the driver goes away after init

        def nvmlDeviceGetHandleByIndex(self, i: int) -> FakeGpu:
            if self.gone:
                raise RuntimeError("driver went away")
            return super().nvmlDeviceGetHandleByIndex(i)

        def nvmlEventSetWait_v2(self, events: str, timeout_ms: int) -> Any:
            raise OSError("event set gone")

    nv = Broken(FakeGpu())
    s = started(nv)
    nv.gone = True
    r = s.sample()
    assert r.temperature_c is None and r.process_memory is None and r.xids == ()
    assert r.errors == ("GPU 0 handle: RuntimeError: driver went away",
                        "GPU 0 processes: RuntimeError: driver went away",
                        "XID events: OSError: event set gone")
    assert s.processes() is None


def test_sample_and_processes_can_be_called_from_several_threads():
    s = started(FakeNvml(FakeGpu(compute=[(5, 1 << 30)]), FakeGpu()))
    results: list[Any] = []

    def work() -> None:
        for _ in range(200):
            results.append(s.sample().process_memory)
            results.append(s.processes())

    threads = [threading.Thread(target=work) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert len(results) == 1600 and all(r == {5: 1 << 30} for r in results)


# ---- a host's GPUs, scripted: each engine's sampler reads its own -------------------------

def eight_gpus(**hot: dict[str, Any]) -> dict[str, Any]:
    gpus = {str(i): {"temperature_c": 60.0 + i, "slowdown_temperature_c": 89.0,
                     "power_w": 300.0, "power_limit_w": 700.0,
                     "memory_used_bytes": 1 << 30, "memory_total_bytes": 80 << 30,
                     "clock_event_reasons": 0, "process_memory": {str(1000 + i): 1 << 30}}
            for i in range(8)}
    for key, values in hot.items():
        gpus[key.removeprefix("gpu")].update(values)
    return {"gpus": gpus}


def test_a_host_file_gives_each_engine_its_own_gpus(gpu_file: Path):
    write_atomically(gpu_file, eight_gpus(gpu5={"temperature_c": 92.0, "xids": [79]}))
    owner, other = FileSampler(gpu_file, [4, 5]), FileSampler(gpu_file, [6, 7])
    r = owner.sample()
    assert [d.index for d in r.devices] == [4, 5]
    assert r.temperature_c == 92.0 and r.power_w == 600.0 and r.xids == (79,)
    assert r.xids_by_gpu() == [(5, 79)]
    assert r.process_memory == {1004: 1 << 30, 1005: 1 << 30} and r.errors == ()
    assert r.thermal_throttled is False and r.power_capped is False  # from the reasons
    o = other.sample()
    assert o.temperature_c == 67.0 and o.xids == () and set(o.process_memory or {}) == {
        1006, 1007}
    # without indices: every GPU of the file
    assert len(FileSampler(gpu_file).sample().devices) == 8


def test_the_release_check_sees_a_pid_left_on_the_second_gpu_only(gpu_file: Path):
    doc = eight_gpus()
    doc["gpus"]["1"]["process_memory"] = {"4242": 6 << 30}
    write_atomically(gpu_file, doc)
    assert FileSampler(gpu_file, [0, 1]).processes() == {1000: 1 << 30, 4242: 6 << 30}
    assert 4242 not in (FileSampler(gpu_file, [0]).processes() or {})


def test_a_gpu_absent_from_the_host_file_is_unknown_and_named(gpu_file: Path):
    write_atomically(gpu_file, {"gpus": {"0": {"temperature_c": 50.0}}})
    r = FileSampler(gpu_file, [0, 3]).sample()
    assert r.temperature_c is None  # the hottest is unknown while GPU 3 is
    assert r.devices[0].temperature_c == 50.0 and r.devices[1].temperature_c is None
    assert r.errors == (f"GPU 3: not in {gpu_file}",)


@pytest.mark.parametrize(("doc", "error"), [
    ({"gpus": [1, 2]}, 'gpus: expected {"INDEX": {readings}}'),
    ({"gpus": {"x": {}}}, "gpus: 'x' is not a GPU index"),
    ({"gpus": {"0": 5}}, "gpus.0: expected an object of readings"),
    ({"gpus": {"0": {"errors": []}}}, "gpus.0: unknown key 'errors'"),
    ({"gpus": {"0": {"temperature_c": "hot"}}}, "gpus.0.temperature_c: expected a finite"),
    ({"gpus": {}, "temperature_c": 50}, "unknown key 'temperature_c' beside gpus"),
])
def test_a_bad_host_file_names_the_key(gpu_file: Path, doc: dict[str, Any], error: str):
    write_atomically(gpu_file, doc)
    r = FileSampler(gpu_file, [0]).sample()
    assert r.temperature_c is None and len(r.errors) == 1
    assert error in r.errors[0] and str(gpu_file) in r.errors[0]
