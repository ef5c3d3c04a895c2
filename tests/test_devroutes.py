"""The probe of vLLM's development routes at each engine start (supervisor/watchdog/
devroutes.py), and what the daemon turns off, and says, when an engine lacks them: the
probe's verdicts through httpx.MockTransport; then the real daemon against fake engines
that serve none of them though VLLM_SERVER_DEV_MODE=1 (a front end without them, as vLLM
0.33's Rust one may be), or no /sleep (a sleeping standby kept awake, or refused). The
real engine's side is in tests/test_e2e_vllm.py (no dev mode) and test_e2e_ladder.py
(dev mode on: no sleep on CPU)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from supervisor.watchdog import devroutes
from supervisor.watchdog.devroutes import DevRoutes
from tests.harness import wait_for, write_config
from tests.test_proxy import proxy_config

DEV = {"VLLM_SERVER_DEV_MODE": "1"}
SLEEPY = ["--enable-sleep-mode"]


def probe(handler: Callable[[httpx.Request], httpx.Response]) -> DevRoutes:
    async def go() -> DevRoutes:
        async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as client:
            return await devroutes.probe(client, "http://engine", 1.0)

    return asyncio.run(go())


def vllm_like(served: set[str], asleep: bool = False) -> Callable[..., httpx.Response]:
    """A GET as vLLM's routers answer it: 405 on a POST-only route, 404 on none."""
    def handler(req: httpx.Request) -> httpx.Response:
        path = req.url.path
        assert req.method == "GET"  # (nothing else: no side effect)
        if path not in served:
            return httpx.Response(404, json={"detail": "Not Found"})
        if path == "/is_sleeping":
            return httpx.Response(200, json={"is_sleeping": asleep})
        if path == "/is_paused":
            return httpx.Response(200, json={"is_paused": False})
        return httpx.Response(405, json={"detail": "Method Not Allowed"})
    return handler


def test_a_get_refused_with_405_is_a_route_served_and_a_404_one_not_served():
    r = probe(vllm_like(set(devroutes.ROUTES), asleep=True))
    assert r.as_dict() == dict.fromkeys(devroutes.ROUTES, True) and r.asleep is True
    assert r.errors == {}
    r = probe(vllm_like({"/is_sleeping", "/reset_prefix_cache", "/is_paused"}))
    assert r.as_dict() == {"/reset_prefix_cache": True, "/sleep": False,
                           "/wake_up": False, "/is_sleeping": True, "/pause": False,
                           "/resume": False, "/is_paused": True}
    assert r.absent(devroutes.SLEEP_ROUTES) == ["/sleep", "/wake_up"]
    assert r.asleep is False


def test_no_answer_is_no_verdict_and_the_configuration_stands():
    def flaky(req: httpx.Request) -> httpx.Response:
        if req.url.path == "/sleep":
            raise httpx.ReadTimeout("timed out", request=req)
        if req.url.path == "/wake_up":
            return httpx.Response(500, text="boom")
        if req.url.path == "/is_sleeping":
            return httpx.Response(200, text="not json")
        raise httpx.ConnectError("refused", request=req)

    r = probe(flaky)
    assert r.as_dict() == {"/reset_prefix_cache": None, "/sleep": None, "/wake_up": None,
                           "/is_sleeping": True, "/pause": None, "/resume": None,
                           "/is_paused": None}
    assert r.errors["/sleep"] == "GET /sleep: no answer within 1 s"
    assert r.errors["/wake_up"] == "GET /wake_up: HTTP 500"
    assert r.errors["/reset_prefix_cache"].startswith("GET /reset_prefix_cache: ConnectError")
    # unknown: as configured (dev mode on: on; off: off, saying so)
    assert devroutes.prefix_reset_off(r, DEV) is None
    assert devroutes.sleep_off(r, SLEEPY, DEV) is None
    assert "VLLM_SERVER_DEV_MODE is not 1" in devroutes.prefix_reset_off(r, {})


def test_what_is_off_names_the_routes_not_served_and_why():
    none = DevRoutes(dict.fromkeys(devroutes.ROUTES, False))
    assert devroutes.off(none, SLEEPY, DEV) == {
        "prefix_reset": "the engine does not serve /reset_prefix_cache though "
                        "VLLM_SERVER_DEV_MODE=1 (a front end without vLLM's development "
                        "routes, such as VLLM_USE_RUST_FRONTEND=1's?)",
        "sleep": "the engine does not serve /sleep, /wake_up, /is_sleeping though "
                 "VLLM_SERVER_DEV_MODE=1 (a front end without vLLM's development routes, "
                 "such as VLLM_USE_RUST_FRONTEND=1's?)",
        "pause": "the engine does not serve /pause, /resume, /is_paused, "
                 "/reset_prefix_cache though VLLM_SERVER_DEV_MODE=1 (a front end without "
                 "vLLM's development routes, such as VLLM_USE_RUST_FRONTEND=1's?)"}
    assert devroutes.off(none, SLEEPY, {}) == {
        "prefix_reset": "the engine does not serve /reset_prefix_cache: "
                        "VLLM_SERVER_DEV_MODE is not 1",
        "sleep": "the engine does not serve /sleep, /wake_up, /is_sleeping: "
                 "VLLM_SERVER_DEV_MODE is not 1",
        "pause": "the engine does not serve /pause, /resume, /is_paused, "
                 "/reset_prefix_cache: VLLM_SERVER_DEV_MODE is not 1"}
    assert devroutes.missing_asked(none, SLEEPY, DEV) == [
        *devroutes.PREFIX_RESET_ROUTES, *devroutes.SLEEP_ROUTES]
    assert devroutes.missing_asked(none, [], DEV) == ["/reset_prefix_cache"]
    assert devroutes.missing_asked(none, SLEEPY, {}) == []  # (none was asked for)
    every = DevRoutes(dict.fromkeys(devroutes.ROUTES, True))
    # the CPU engine with dev mode on: every route, but no sleep (no flag: no sleep mode)
    assert devroutes.off(every, [], DEV) == {
        "sleep": "the engine was not started with --enable-sleep-mode"}
    assert devroutes.off(every, SLEEPY, DEV) == {}
    # not probed (None): the configuration's word, as before the probe
    assert devroutes.off(None, SLEEPY, DEV) == {}
    assert set(devroutes.off(None, SLEEPY, {})) == {"prefix_reset", "sleep", "pause"}


# ---- through the daemon, against fake engines ------------------------------------------

def metric(d: Any, name: str) -> dict[str, float]:
    text = httpx.get(f"{d.exporter_url}/metrics", timeout=5).text
    return {s.labels.get("capability", ""): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples
            if s.name == "vllm_supervisor_" + name}


def posts_to_dev_routes(tmp: Any) -> list[str]:
    asked = (tmp / "requests").read_text().splitlines()
    return [r for r in asked if r.startswith("POST")
            and r.split()[1].partition("?")[0] in devroutes.ROUTES]


@pytest.mark.component
def test_an_engine_without_the_dev_routes_has_its_remedies_off_from_its_start(
        daemon_factory, tmp_path):
    """VLLM_SERVER_DEV_MODE=1 and --enable-sleep-mode, but the engine serves none of the
    development routes: found at its start, not at first use. `status` says what is off
    and why, one warning and one audit entry say it, the exporter has it, the ladder
    skips both in-place rungs naming the probe's reason, `kv-reset` is refused, no sleep
    or reset is ever sent; a reload that brings the routes back is seen at the next
    start, probed anew."""
    cfg = proxy_config(tmp_path, *SLEEPY, "--dev-routes", "none")
    cfg["engine"]["env"].update(DEV)
    cfg["policy"] = {"dry_run": True, "min_action_gap_s": 0, "rules": {
        "prefix_collapse": {"when": "engine_uptime_s >= 0", "for_s": 0.5}}}
    d = daemon_factory(cfg)
    d.wait_state("RUNNING")
    st = wait_for(lambda: (s := d.status())["admission"]["held"] is None and s, 20,
                  "the gate to open")
    assert st["dev_routes"] == dict.fromkeys(devroutes.ROUTES, False)
    off = st["off"]
    assert set(off) == {"reset_prefix_cache", "kv_reset"}, off
    assert off["reset_prefix_cache"].startswith(
        "the engine does not serve /reset_prefix_cache though VLLM_SERVER_DEV_MODE=1")
    assert "/sleep, /wake_up, /is_sleeping" in off["kv_reset"]
    assert st["remedies"]["reset_prefix_cache"] is False and st["remedies"]["kv_reset"] is False
    assert "off        reset prefix cache: the engine does not serve" in d.ctl("status").stdout
    (entry,) = [e for e in d.events() if e["event"] == "dev_routes"]
    assert entry["pid"] == st["pid"] and entry["routes"] == st["dev_routes"]
    assert set(entry["off"]) == {"prefix_reset", "sleep", "pause"}
    (warning,) = [r for r in d.log_records()
                  if str(r.get("event", "")).startswith("the engine does not serve "
                                                        "development routes")]
    # (what the configuration asks for: dev mode's routes, sleep's with its flag; not
    # /pause, which only makes a KV reset cheaper where the vLLM has it)
    assert warning["level"] == "warning" and warning["missing"] == [
        *devroutes.PREFIX_RESET_ROUTES, *devroutes.SLEEP_ROUTES]
    assert metric(d, "engine_capability") == {"reset_prefix_cache": 0.0, "kv_reset": 0.0}
    # the ladder: both in-place rungs skipped, each with the probe's reason
    decision = wait_for(lambda: next((e for e in d.events() if e["event"] == "decision"),
                                     None), 20, "the rule's decision")
    assert decision["action"] == "restart" and decision["dry_run"] is True
    assert ("reset_prefix_cache: the engine does not serve /reset_prefix_cache though "
            "VLLM_SERVER_DEV_MODE=1") in decision["reason"]
    assert "kv_reset: the engine does not serve /sleep" in decision["reason"]
    r = d.ctl("kv-reset")
    assert r.returncode == 1 and "does not serve /sleep" in r.stderr
    assert "warmed_up" not in [e["event"] for e in d.events()]  # no warm-up tried
    assert posts_to_dev_routes(tmp_path) == []
    # the routes back (say, the Python front end again): the next start is probed anew
    cfg["engine"]["args"] = ["--dev-routes", "all"]
    cfg["policy"]["rules"]["prefix_collapse"] = {"enabled": False}
    write_config(d.config, cfg)
    assert d.ctl("reload").returncode == 0
    assert d.ctl("restart").returncode == 0
    st = wait_for(lambda: (s := d.status())["restarts"] == 1 and s["state"] == "RUNNING"
                  and s["remedies"]["kv_reset"] and s, 30, "the new engine, probed")
    assert st["off"] == {} and st["dev_routes"] == dict.fromkeys(devroutes.ROUTES, True)
    entries = [e for e in d.events() if e["event"] == "dev_routes"]
    assert len(entries) == 2 and entries[1]["off"] == {} and entries[1]["pid"] == st["pid"]
    assert metric(d, "engine_capability") == {"reset_prefix_cache": 1.0, "kv_reset": 1.0}
    wait_for(lambda: d.status()["admission"]["held"] is None, 30, "the gate to open")
    assert d.ctl("kv-reset", timeout=60).returncode == 0


def sleep_standby(tmp: Any, share: str) -> dict[str, Any]:
    """standby = "sleep" on an engine whose front end lacks /sleep and /wake_up."""
    cfg = proxy_config(tmp, *SLEEPY, "--gpu-memory-utilization", share,
                       "--dev-routes", "/is_sleeping,/reset_prefix_cache", keepalive_s=0.5)
    cfg["engine"].update(standby="sleep", env={**cfg["engine"]["env"], **DEV})
    return cfg


@pytest.mark.component
def test_a_standby_that_cannot_sleep_is_kept_awake_where_it_fits(daemon_factory, tmp_path):
    cfg = sleep_standby(tmp_path, "0.45")  # two fit side by side, awake
    d = daemon_factory(cfg)
    d.wait_state("RUNNING")
    st = wait_for(lambda: (s := d.status())["standby"]["state"] == "ready" and s, 30,
                  "the standby ready")
    sb = st["standby"]
    assert sb["asleep"] is False and sb["reason"].startswith(
        "kept awake: it cannot sleep: the engine does not serve /sleep, /wake_up though "
        "VLLM_SERVER_DEV_MODE=1")
    assert st["off"]["sleeping_standby"].endswith(": the standby is kept awake")
    assert set(st["off"]) == {"kv_reset", "sleeping_standby"}  # (the prefix reset is on)
    assert st["remedies"]["reset_prefix_cache"] is True
    assert metric(d, "engine_capability") == {
        "reset_prefix_cache": 1.0, "kv_reset": 0.0, "sleeping_standby": 0.0}
    ready = next(e for e in d.events() if e["event"] == "standby_ready")
    assert ready["asleep"] is False and ready["reason"] == sb["reason"]
    assert [e["event"] for e in d.events()].count("dev_routes") == 2  # each engine's start
    assert posts_to_dev_routes(tmp_path) == []  # no sleep tried, no warm-up
    # it takes over awake: no wake to send
    spare = sb["pid"]
    assert d.ctl("restart").returncode == 0
    st = wait_for(lambda: (s := d.status())["pid"] == spare and s["admission"]["held"] is None
                  and s, 30, "the awake standby serving")
    assert "standby_woken" not in [e["event"] for e in d.events()]


@pytest.mark.component
def test_a_standby_that_cannot_sleep_and_does_not_fit_awake_is_refused_not_retried(
        daemon_factory, tmp_path):
    """At 0.6 of the card a sleeping standby starts first; this one cannot sleep and an
    awake one does not fit: it is refused once (no backoff, no retry), the engine starts
    alone, `status` says why, `rearm` is refused, and a cold start does not start a
    standby first again while the engine's own probe says it cannot sleep."""
    cfg = sleep_standby(tmp_path, "0.6")
    d = daemon_factory(cfg)
    st = wait_for(lambda: (s := d.status())["state"] == "RUNNING"
                  and s["standby"]["state"] == "no_room" and s, 30, "no standby")
    refused = [e for e in d.events() if e["event"] == "standby_refused"]
    assert len(refused) == 1 and "does not serve /sleep, /wake_up" in refused[0]["why"]
    assert "standby_failed" not in [e["event"] for e in d.events()]
    assert st["standby"]["reason"].startswith("no sleeping standby: the engine cannot sleep")
    assert st["off"]["sleeping_standby"].endswith(
        ": no standby (an awake one does not fit beside the engine)")
    r = d.ctl("rearm")
    assert r.returncode == 1 and "an awake standby does not fit" in r.stderr
    first = st["pid"]
    assert d.ctl("restart").returncode == 0  # a cold start (no standby to swap to)
    st = wait_for(lambda: (s := d.status())["state"] == "RUNNING" and s["pid"] != first
                  and s["standby"]["state"] == "no_room" and s, 30, "the cold start")
    assert [e["event"] for e in d.events()].count("standby_refused") == 1
    assert any(r.get("event") == "no standby first: an engine so started cannot sleep"
               for r in d.log_records())
    # three engines started: the refused standby and the two serving ones
    assert len([e for e in d.events() if e["event"] == "dev_routes"]) == 3
    assert posts_to_dev_routes(tmp_path) == []
    assert json.loads(d.ctl("status", "--json").stdout)["standby"]["protected"] is False
