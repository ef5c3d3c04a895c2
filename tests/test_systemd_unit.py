"""The shipped unit file: `systemd-analyze verify` and the directives the design needs."""

from __future__ import annotations

import configparser
import shutil
import subprocess

import pytest

from tests.harness import ROOT

UNIT = ROOT / "systemd" / "vllm-supervisor.service"


def directives() -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    section = ""
    for raw in UNIT.read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        if line.startswith("["):
            section = line.strip("[]")
            continue
        key, _, value = line.partition("=")
        out.setdefault(f"{section}.{key}", []).append(value)
    return out


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="systemd-analyze missing")
def test_unit_passes_systemd_analyze_verify(tmp_path):
    # verify checks that ExecStart exists: point it at this checkout's installed script
    exe = ROOT / ".venv" / "bin" / "vllm-supervisor"
    assert exe.exists()
    unit = tmp_path / "vllm-supervisor.service"
    unit.write_text(UNIT.read_text().replace("/opt/vllm-supervisor/bin/vllm-supervisor", str(exe)))
    r = subprocess.run(["systemd-analyze", "verify", str(unit)], capture_output=True,
                       text=True, timeout=60)
    problems = [line for line in (r.stdout + r.stderr).splitlines()
                if "vllm-supervisor.service" in line]
    assert r.returncode == 0 and problems == [], r.stdout + r.stderr


def test_unit_has_the_directives_the_design_relies_on():
    d = directives()
    expect = {
        "Service.Type": "notify", "Service.NotifyAccess": "main",
        "Service.Restart": "on-failure", "Service.KillMode": "mixed",
        "Service.OOMPolicy": "continue", "Service.LimitNOFILE": "65536",
        "Service.RuntimeDirectory": "vllm-supervisor", "Service.User": "vllm",
        "Service.RestartPreventExitStatus": "78",
    }
    for key, value in expect.items():
        assert d.get(key) == [value], key
    assert "Service.PrivateDevices" not in d
    assert any("nvidia" in v for v in d["Service.DeviceAllow"])
    assert int(d["Unit.StartLimitBurst"][0]) > 0
    assert int(d["Service.WatchdogSec"][0]) > 0
    # TimeoutStopSec must outlast the default drain + grace + reaps + GPU release
    assert int(d["Service.TimeoutStopSec"][0]) > 30 + 10 + 2 * 10 + 60


def test_unit_parses_as_ini():
    cp = configparser.ConfigParser(strict=False, interpolation=None)
    cp.read_string(UNIT.read_text())
    assert cp.has_section("Service") and cp.has_section("Install")
