"""How long starts take, learned (supervisor/engine/startup/start_times.py): the expected length
is the median of the past starts of the same command line (its port aside), the time left
follows the phase the start is in, a version change is said to be cold, a broken file is
learned anew; and through the daemon and the fake engine: `status` shows the expected
length of a restart, and a request refused while the engine starts is told to come back
when it is expected (Retry-After), not after the configured constant."""

from __future__ import annotations

import json
from pathlib import Path

import httpx

from supervisor.engine.startup.start_times import KEEP, StartTimes
from tests.harness import wait_for
from tests.test_proxy import proxy_config, url

ARGV = ["vllm", "serve", "m", "--host", "127.0.0.1", "--port", "8100", "--dtype", "bf16"]
PHASES = [("loading the model", 5.0), ("capturing CUDA graphs", 40.0)]


def test_the_median_of_past_starts_and_what_is_left_from_the_phase_it_is_in(
        tmp_path: Path) -> None:
    times = StartTimes(tmp_path / "start-times.json")
    assert times.expect(ARGV, "0.26.0", 0.0, None, None) is None
    for total in (60.0, 50.0, 70.0):
        times.record(ARGV, "0.26.0", total, PHASES)
    other_port = [*ARGV[:6], "8101", *ARGV[7:]]
    e = times.expect(other_port, "0.26.0", 10.0, None, None)
    assert e is not None and e.total_s == 60.0 and e.left_s == 50.0 and not e.cold
    # 3 s into graph capture: the past starts had 20, 10 and 30 s left from there
    e = times.expect(ARGV, "0.26.0", 48.0, "capturing CUDA graphs", 3.0)
    assert e is not None and e.left_s == 17.0
    # another command line knows nothing; another version is a cold start
    assert times.expect([*ARGV, "--revision", "v2"], "0.26.0", 0.0, None, None) is None
    e = times.expect(ARGV, "0.33.0", 0.0, None, None)
    assert e is not None and e.cold
    # kept on disk, the last KEEP per command line
    for _ in range(KEEP + 5):
        times.record(ARGV, "0.26.0", 30.0, PHASES)
    again = StartTimes(tmp_path / "start-times.json")
    e = again.expect(ARGV, "0.26.0", 0.0, None, None)
    assert e is not None and e.starts == KEEP and e.total_s == 30.0


def test_a_broken_file_is_learned_anew(tmp_path: Path) -> None:
    path = tmp_path / "start-times.json"
    path.write_text("{not json")
    times = StartTimes(path)
    assert times.expect(ARGV, None, 0.0, None, None) is None
    times.record(ARGV, None, 12.0, [])
    assert json.loads(path.read_text())


def test_a_restart_shows_its_expected_length_and_a_refusal_says_when_to_come_back(
        daemon_factory, tmp_path):
    cfg = proxy_config(tmp_path, "--startup-delay", "4", hold_timeout_s=1.0,
                       retry_after_s=30)
    d = daemon_factory(cfg)
    d.wait_state("RUNNING", 30)
    first = d.status()
    assert (tmp_path / "start-times.json").exists()
    assert d.ctl("restart").returncode == 0
    start = wait_for(lambda: (d.status()["start"] or {}).get("expected_s") and
                     d.status()["start"], 30, "the restart's expected length")
    assert start["expected_s"] >= 4 and start["eta_s"] <= start["expected_s"]
    r = httpx.post(url(cfg), json={"model": "fake", "prompt": "hi", "max_tokens": 2},
                   timeout=30)
    assert r.status_code == 503  # held past the hold timeout while it starts
    retry = int(r.headers["Retry-After"])
    assert 1 <= retry <= 5, retry  # when it is expected, not the configured 30
    # the exporter's readiness probe says it too (a load balancer's next look)
    ready = httpx.get(d.exporter_url + "/readyz", timeout=10)
    if ready.status_code == 503:  # (unless the engine came up meanwhile)
        assert ready.text.startswith("not ready: STARTING, ready in about "), ready.text
        assert 1 <= int(ready.headers["Retry-After"]) <= 5
    d.wait_state("RUNNING", 30)
    assert d.status()["pid"] != first["pid"]
