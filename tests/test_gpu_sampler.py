"""The scripted GPU sampler, the XID catalogue, and NVML's absence on a machine without
a GPU. Real files, no mocks; the real NVML on a GPU machine is tests/test_gpu.py."""

from __future__ import annotations

import json
from pathlib import Path

from supervisor.gpu import FileSampler, GpuReading, NvmlSampler
from supervisor.xid import describe


def test_file_sampler_round_trips_a_full_reading(tmp_path: Path):
    f = tmp_path / "gpu.json"
    f.write_text(json.dumps({
        "temperature_c": 71, "slowdown_temperature_c": 89.0, "power_w": 650.5,
        "power_limit_w": 700, "utilization_ratio": 0.9, "memory_used_bytes": 123,
        "memory_total_bytes": 456, "clock_event_reasons": 4, "thermal_throttled": False,
        "power_capped": True, "process_memory": {"4242": 1 << 30}, "xids": [94]}))
    s = FileSampler(str(f))
    r = s.sample()
    assert r == GpuReading(temperature_c=71.0, slowdown_temperature_c=89.0, power_w=650.5,
                           power_limit_w=700.0, utilization_ratio=0.9, memory_used_bytes=123,
                           memory_total_bytes=456, clock_event_reasons=4,
                           thermal_throttled=False, power_capped=True,
                           process_memory={4242: 1 << 30}, xids=(94,))
    assert s.processes() == {4242: 1 << 30}


def test_absent_keys_are_unknown(tmp_path: Path):
    f = tmp_path / "gpu.json"
    f.write_text('{"temperature_c": 50}')
    r = FileSampler(str(f)).sample()
    assert r.temperature_c == 50.0 and r.power_w is None and r.process_memory is None
    assert r.errors == () and r.xids == ()


def test_bad_files_give_an_unknown_reading_naming_the_problem(tmp_path: Path):
    f = tmp_path / "gpu.json"
    cases = {
        "missing": (None, "cannot read"),
        "garbage": ("{not json", "not JSON"),
        "list": ("[1, 2]", "expected a JSON object"),
        "unknown key": ('{"temp": 50}', "unknown key 'temp'"),
        "wrong type": ('{"temperature_c": "hot"}', "temperature_c: expected a number"),
        "bool for number": ('{"power_w": true}', "power_w: expected a number"),
        "bad pid": ('{"process_memory": {"abc": 5}}', "process_memory"),
        "bad xids": ('{"xids": "79"}', "xids: expected a list"),
    }
    for name, (text, why) in cases.items():
        if text is None:
            f.unlink(missing_ok=True)
        else:
            f.write_text(text)
        r = FileSampler(str(f)).sample()
        assert r.temperature_c is None and r.power_w is None, name
        assert len(r.errors) == 1 and why in r.errors[0] and str(f) in r.errors[0], name


def test_xid_catalogue_names_and_remedies():
    assert describe(79).name == "GPU has fallen off the bus" and describe(79).remedy == "reboot"
    assert describe(48).remedy == "reset" and describe(95).remedy == "reset"
    assert describe(94).remedy == "restart" and describe(13).remedy == "restart"
    assert describe(45).remedy == "info"
    unknown = describe(9999)
    assert unknown.name == "unknown XID 9999" and unknown.remedy == "reset"


def test_nvml_without_a_gpu_says_why_and_never_raises():
    s = NvmlSampler([])
    why = s.init()
    if why is None:  # on a GPU machine this test has nothing to prove
        s.close()
        return
    assert "NVML" in why
    r = s.sample()
    assert r.temperature_c is None and r.errors == ("NVML is not initialised",)
    assert s.processes() is None
    s.close()
