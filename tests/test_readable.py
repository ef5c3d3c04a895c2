"""What an operator reads: the console log drops empty fields (the JSON lines keep them),
and the readable status prints sizes and durations in human units."""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator

import pytest
import structlog

from supervisor.control.cli import format_signal, format_status
from supervisor.ops.logs import RequestLog, configure_logging, set_level
from tests.harness import fake_engine_config, wait_for


@pytest.fixture
def restore_logging() -> Iterator[None]:
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    yield
    root.handlers[:] = handlers
    root.setLevel(level)
    structlog.reset_defaults()


@pytest.mark.usefixtures("restore_logging")
def test_the_console_drops_empty_fields_and_json_keeps_them(capsys) -> None:
    configure_logging("info", "console")
    structlog.get_logger("t").info("engine line", proc=None, where="", pid=42)
    out = capsys.readouterr().out
    assert "engine line" in out and "pid" in out and "42" in out
    assert "proc" not in out and "where" not in out and "None" not in out
    configure_logging("info", "json")
    structlog.get_logger("t").info("engine line", proc=None, where="", pid=42)
    line = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert line["proc"] is None and line["where"] == "" and line["pid"] == 42


@pytest.mark.usefixtures("restore_logging")
@pytest.mark.parametrize("fmt", ["json", "console"])
def test_a_logged_traceback_names_the_error_and_never_a_frames_locals(capsys, fmt) -> None:
    def parse(body: bytes) -> object:
        prompt = body.decode()  # (a client's words: never in a log)
        return json.loads(prompt)

    configure_logging("info", fmt)
    try:
        secret = "-".join(("PROMPT", "SECRET"))  # (not on any line a traceback shows)
        parse(b'{"prompt": "%s", "x": [' % secret.encode() + b"[" * 100_000)
    except RecursionError:
        structlog.get_logger("t").exception("proxy handler failed")
    out = capsys.readouterr().out
    assert "RecursionError" in out and "proxy handler failed" in out
    assert "PROMPT-SECRET" not in out


@pytest.mark.usefixtures("restore_logging")
def test_the_access_line_is_the_line_structlog_writes_and_follows_the_level(capsys) -> None:
    """The proxy's access line skips the standard library's record and formatter: the
    same bytes, the same level, and a test's capture_logs still sees it."""
    fields = {"method": "POST", "path": "/v1/completions", "status": 200, "peer": None,
              "duration_s": 0.0012, "model": "m\u00e9\"", "tokens": 3}
    configure_logging("info", "json")
    structlog.contextvars.bind_contextvars(engine="e1")
    try:
        structlog.get_logger("supervisor.proxy").info("request", **fields)
        RequestLog("supervisor.proxy").info("request", **fields)
    finally:
        structlog.contextvars.clear_contextvars()
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 2
    ts = [json.loads(line)["timestamp"] for line in lines]
    assert lines[0].replace(ts[0], "T") == lines[1].replace(ts[1], "T")
    assert json.loads(lines[1])["engine"] == "e1"
    set_level("warning")
    RequestLog("supervisor.proxy").info("request", **fields)
    assert capsys.readouterr().out == ""
    set_level("info")
    with structlog.testing.capture_logs() as logs:
        RequestLog("supervisor.proxy").info("request", tokens=1)
    assert logs == [{"event": "request", "tokens": 1, "log_level": "info"}]
    assert capsys.readouterr().out == ""
    configure_logging("info", "console")
    RequestLog("supervisor.proxy").info("request", tokens=1)
    out = capsys.readouterr().out
    assert "request" in out and "tokens" in out and not out.startswith("{")


@pytest.mark.parametrize(("name", "value", "shown"), [
    ("engine_rss_bytes", 3.08571e9, "2.9 GiB"),
    ("engine_rss_growth_bytes_per_h", 5 * 2**20, "5.0 MiB/h"),
    ("engine_gpu_memory_bytes", 512, "512 B"),
    ("canary_latency_s", 0.0423, "42 ms"),
    ("metrics_age_s", 2.5, "2.5 s"),
    ("engine_uptime_s", 3725.0, "1h02m05s"),
    ("gpu_temperature_c", 71.4, "71 C"),
    ("gpu_power_w", 412.7, "413 W"),
    ("engine_cpu_percent", 97.25, "97.2 %"),
    ("kv_cache_usage", 0.873456, "87.3 %"),
    ("spec_decode_acceptance_rate", 0.41, "41.0 %"),
    ("requests_running", 3, "3"),
    ("generation_tokens_per_s", 118.4, "118.4 tokens/s"),  # (a rate, not a time)
    ("preemption_rate", 0.25, "0.25 preemptions/s"),
    ("ttft_p99", 0.0195, "20 ms"),
    ("gpu_thermal_throttled", 1.0, "yes"),
    ("prefix_cache_hit_rate_ratio", 0.5, "0.50 x its baseline"),
    ("kv_blocks_held", 12, "12 blocks"),
    ("kv_tier_store_refusals_per_s", 2.5, "2.5 stores refused/s"),  # (not a time)
    ("kv_tier_loaded_bytes_per_s", 3 * 2**30, "3.0 GiB/s"),
])
def test_signals_print_in_human_units(name: str, value: float, shown: str) -> None:
    assert format_signal(name, value) == shown


def test_status_prints_human_units_and_leaves_unknown_signals_out() -> None:
    text = format_status({
        "state": "RUNNING", "state_for_s": 75, "reason": "healthy", "pid": 10,
        "engine": {"processes": 3, "host": "127.0.0.1", "port": 8100}, "uptime_s": 75,
        "restarts": 0, "throttle_level": 0,
        "signals": {"engine_rss_bytes": 3.08571e9, "gpu_temperature_c": None},
        "daemon_pid": 9, "daemon_uptime_s": 80})
    assert "signal     engine_rss_bytes = 2.9 GiB" in text
    assert "e+09" not in text and "gpu_temperature_c" not in text


def test_status_says_where_the_standby_stands_and_why_it_is_not_ready() -> None:
    base = {"state": "RUNNING", "reason": "healthy", "pid": 10, "restarts": 1,
            "engine": {"processes": 3, "host": "127.0.0.1", "port": 8100}}
    ready = format_status({**base, "standby": {"mode": "awake", "state": "ready", "pid": 11,
                                               "port": 8101, "for_s": 42.4, "reason": None}})
    assert "standby    ready (pid 11, port 8101) for 42 s" in ready
    waiting = format_status({**base, "standby": {
        "mode": "awake", "state": "waiting", "pid": None, "port": None, "for_s": 3,
        "reason": "could not be started: port in use"}})
    assert "standby    waiting for 3 s: could not be started: port in use" in waiting
    asleep = format_status({**base, "standby": {
        "mode": "sleep", "state": "ready", "pid": 11, "port": 8101, "for_s": 65,
        "reason": None, "asleep": True, "rss_bytes": 18 * 2**30}})
    assert "standby    ready, asleep (pid 11, port 8101) for 65 s, 18.0 GiB host memory" \
        in asleep
    early = format_status({**base, "standby": {
        "mode": "snapshot", "state": "ready", "pid": 11, "port": 8101, "for_s": 65,
        "reason": None, "asleep": True, "early_wake": True}})
    assert "standby    ready, asleep (its weights wake early) (pid 11, port 8101) for 65 s" \
        in early
    on_card = format_status({**base, "standby": {
        "mode": "snapshot", "state": "ready", "pid": 11, "port": 8101, "for_s": 65,
        "reason": None, "asleep": True, "weights": "gpu", "early_wake": None}})
    assert "standby    ready, asleep (its weights on the GPU) (pid 11, port 8101)" in on_card
    assert "host backup" not in on_card
    kept = format_status({**base, "standby": {
        "mode": "snapshot", "state": "ready", "pid": 11, "port": 8101, "for_s": 65,
        "reason": None, "asleep": True, "weights": "gpu", "early_wake": None,
        "host_cache": "kept: POST /collective_rpc: HTTP 404: Not Found"}})
    assert ("\n           its weights' host backup kept (POST /collective_rpc: HTTP 404: "
            "Not Found): its death gives the card back later") in kept
    host = format_status({**base, "standby": {
        "mode": "snapshot", "state": "ready", "pid": 11, "port": 8101, "for_s": 65,
        "reason": None, "asleep": True, "weights": "host", "early_wake": True,
        "weights_off": "the card leaves 15.50 GiB free; they need 15.51 GiB and 1 GiB more"}})
    assert "(its weights wake early)" in host
    assert ("\n           its weights stay on the host: the card leaves 15.50 GiB free; "
            "they need 15.51 GiB and 1 GiB more") in host
    # a thin standby: what it carries of streams after a failover, against the engine
    thin = format_status({**base, "engine": {**base["engine"], "kv_tokens": 255_744},
                          "standby": {"mode": "sleep", "state": "ready", "pid": 11,
                                      "port": 8101, "for_s": 65, "reason": None,
                                      "asleep": True, "kv_tokens": 50_048}})
    assert "standby    ready, asleep (pid 11, port 8101) for 65 s, 50,048 KV tokens " \
        "(20% of the engine's)" in thin
    assert "standby" not in format_status({**base, "standby": {"state": "none"}})


def test_status_says_where_the_compile_cache_is_and_its_size() -> None:
    base = {"state": "RUNNING", "reason": "healthy", "pid": 10, "restarts": 0,
            "engine": {"processes": 3, "host": "127.0.0.1", "port": 8100}}
    text = format_status({**base, "compile_cache": {
        "dir": "/var/lib/vllm-supervisor/vllm-cache/default/0.26.0",
        "vllm_version": "0.26.0", "bytes": 3 * 2**20 + 2**19}})
    assert ("cache      /var/lib/vllm-supervisor/vllm-cache/default/0.26.0 (vLLM 0.26.0, "
            "3.5 MiB)") in text
    unknown = format_status({**base, "compile_cache": {"dir": "/c/unknown",
                                                       "vllm_version": None, "bytes": None}})
    assert "cache      /c/unknown (vLLM unknown, size not yet measured)" in unknown
    assert "cache " not in format_status(base)


def test_status_says_how_full_the_kv_tier_is_and_what_vllm_refused() -> None:
    base = {"state": "RUNNING", "reason": "healthy", "pid": 10, "restarts": 0,
            "engine": {"processes": 3, "host": "127.0.0.1", "port": 8100}}
    tier = {"folder": "/dev/shm/kv", "max_bytes": 24 * 2**30, "chunk_tokens": 256,
            "files": 4096, "bytes": 12 * 2**30, "error": None, "warning": None,
            "removed_files_total": 0, "removed_bytes_total": 0, "store_refusals_total": 0}
    assert "kv tier    /dev/shm/kv: 12.0 GiB of 24.0 GiB (4,096 files)\n" in format_status(
        {**base, "kv_tier": tier})
    busy = format_status({**base, "kv_tier": {
        **tier, "removed_bytes_total": 5 * 2**30, "store_refusals_total": 3075,
        "warning": "the KV tier may take 40.0 GiB of host memory"}})
    assert ("kv tier    /dev/shm/kv: 12.0 GiB of 24.0 GiB (4,096 files), 5.0 GiB removed to "
            "keep it there; 3,075 stores refused (its CPU part full: raise "
            "engine.kv_tier_cpu_gib)\n           warning: the KV tier may take 40.0 GiB of "
            "host memory") in busy
    unseen = format_status({**base, "kv_tier": {**tier, "files": None, "bytes": None}})
    assert "kv tier    /dev/shm/kv: not yet looked at" in unseen
    assert "kv tier" not in format_status(base)


def test_status_says_where_vllm_writes_its_own_stack_dumps() -> None:
    base = {"state": "RUNNING", "reason": "healthy", "pid": 10, "restarts": 0,
            "engine": {"processes": 3, "host": "127.0.0.1", "port": 8100}}
    text = format_status({**base, "stack_dumps": {
        "dir": "/var/lib/vllm-supervisor/stack-dumps/default/20261201T100000Z-bay0-gen1",
        "owner": "daemon", "timeout_s": 4, "check_interval_s": 1}})
    assert ("dumps      /var/lib/vllm-supervisor/stack-dumps/default/20261201T100000Z-bay0-"
            "gen1 (vLLM's own, after 4 s stalled; the daemon)") in text
    theirs = format_status({**base, "stack_dumps": {"dir": None, "owner": "operator",
                                                    "timeout_s": 300}})
    assert "dumps      off (your --watchdog-config)" in theirs
    assert "dumps " not in format_status(base)


def test_every_signal_but_a_count_prints_with_its_unit() -> None:
    """A new signal must say its unit in `status` (or be declared a plain count here)."""
    from supervisor.watchdog.signal_list import SIGNAL_NAMES

    counts = {"requests_waiting", "requests_running", "canary_failures",
              "scrape_failures_total", "gpu_xid_reset_errors", "gpu_xid_restart_errors",
              "sleep_ops_in_flight"}
    bare = [n for n in SIGNAL_NAMES if format_signal(n, 0.5) == "0.5" and n not in counts]
    assert not bare, bare


def test_a_start_reads_well_phases_in_status_routes_in_one_line_no_empty_fields(
        daemon_factory, tmp_path) -> None:
    """While the engine starts, `status` says what it is doing as vLLM reports it and for
    how long; vLLM's route table becomes one line; engine lines carry no empty fields;
    a later start says how long the last one took."""
    d = daemon_factory(fake_engine_config(tmp_path, "--startup-delay", "3"))
    st = wait_for(lambda: (s := d.status())["state"] == "STARTING" and s.get("start")
                  and s["start"]["phase"] and s, 10, "a start phase")
    assert st["start"]["phase"] == "loading the model" and st["start"]["last_start_s"] is None
    assert "starting   loading the model for " in d.ctl("status").stdout
    d.wait_state("RUNNING", 20)
    assert d.status()["start"] is None
    recs = d.log_records()
    engine = [r for r in recs if r.get("source") == "engine"]
    assert engine and not [r for r in engine if None in (r.get("proc"), r.get("where"))
                           and ("proc" in r or "where" in r)]
    routes = [r for r in recs if r.get("event") == "engine routes"]
    assert len(routes) == 1 and routes[0]["count"] == 5
    assert routes[0]["paths"].split() == ["/health", "/metrics", "/v1/models",
                                          "/v1/completions", "/v1/chat/completions"]
    assert all(r["level"] == "debug" for r in engine if r["event"].startswith("Route: "))
    phases = [r["phase"] for r in recs if r.get("event") == "engine start phase"]
    assert phases == ["loading the model", "sizing the KV cache", "starting the API server"]
    assert d.ctl("restart").returncode == 0
    st = wait_for(lambda: (s := d.status()).get("start") and s, 10, "the second start")
    assert st["start"]["last_start_s"] >= 3
    assert "the last start took" in d.ctl("status").stdout
