"""The host's CPU/SoC heat (supervisor/watchdog/hostheat.py) from psutil's sensor
groups as a real host reports them (entries shaped as psutil's `shwtemp`): the hottest CPU or
SoC sensor, drives and NICs left out, nothing on a host without sensors; and the
signal `host_temperature_c` it feeds."""

from __future__ import annotations

from typing import NamedTuple

from supervisor.watchdog import hostheat
from supervisor.watchdog.signals import SignalWindow, WindowConfig


class shwtemp(NamedTuple):  # (psutil's own entry: its fields, as psutil has them)
    label: str
    current: float
    high: float | None
    critical: float | None


def t(label: str, current: float) -> shwtemp:
    return shwtemp(label, current, None, None)


def test_the_hottest_cpu_or_soc_sensor_and_not_a_drive() -> None:
    intel = {"coretemp": [t("Package id 0", 71.0), t("Core 0", 69.0)],
             "nvme": [t("Composite", 83.0)], "iwlwifi_1": [t("", 90.0)]}
    assert hostheat.hottest(lambda: intel) == (71.0, "coretemp/Package id 0")
    # a GB10-like SoC: thermal zones, one of them near its throttle point
    soc = {"soc_thermal": [t("", 96.2)], "cpu_thermal": [t("", 88.0)]}
    assert hostheat.hottest(lambda: soc) == (96.2, "soc_thermal")
    assert hostheat.hottest(lambda: {"k10temp": [t("Tctl", 250.0)]}) == (None, None)


def test_a_host_without_sensors_is_unknown_never_an_error() -> None:
    assert hostheat.hottest(lambda: {}) == (None, None)

    def missing() -> dict[str, list[shwtemp]]:
        raise AttributeError("sensors_temperatures")  # (psutil on macOS or Windows)
    assert hostheat.hottest(missing) == (None, None)
    # the real call on this machine: a number or unknown, never a raise
    got, _ = hostheat.hottest()
    assert got is None or isinstance(got, float)


def test_the_signal_follows_the_last_look() -> None:
    w = SignalWindow(WindowConfig())
    w.add_tree(1.0, 1 << 30, 50.0, 93.5)
    s = w.compute(2.0, metrics_age_s=1.0, staleness_s=0.0, scrape_failures_total=0,
                  engine_uptime_s=10.0)
    assert s["host_temperature_c"] == 93.5
    w.add_tree(3.0, 1 << 30, 50.0, None)
    s = w.compute(4.0, metrics_age_s=1.0, staleness_s=0.0, scrape_failures_total=0,
                  engine_uptime_s=12.0)
    assert s["host_temperature_c"] is None
