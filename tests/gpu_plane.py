"""The front door over several processes before the real vLLM on the H100 (issue 38):
`vllm bench serve` at 256 streams direct to the engine, through the daemon's proxy over
N workers, and through the same front door in one process (`bench/plane_scale.py
_pool 1`, before the same engine), alternating, two runs each.

Not collected by pytest (no GPU in CI). On the GPU machine, after
`SHAPE=8b PROXY_WORKERS=4 python3 tests/gpu_vllm.py start none`:

    python3 tests/gpu_plane.py [CONCURRENCY [PROMPTS [RUNS]]]   # 256 1024 2

Prints `RESULT {json}` (and appends it to $WORK/results.jsonl, as tests/gpu_vllm.py does):
output tokens/s of each path and run, the ratios to direct, every request counted (failed
and short), and the CPU per output token of the daemon's processes (its own and its
workers') and of the one-process front door.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from tests.gpu_daemon import PROXY, ROOT, SUP_SITE, WORK, engine_addr, result, status, wait
from tests.gpu_load import bench


def front_procs(daemon_pid: int) -> list[psutil.Process]:
    """The daemon's process and its proxy workers (not its engines)."""
    d = psutil.Process(daemon_pid)
    return [d, *(p for p in d.children()
                 if "supervisor.plane.worker" in " ".join(p.cmdline()))]


def cpu_s(procs: list[psutil.Process]) -> float:
    total = 0.0
    for p in procs:
        try:
            t = p.cpu_times()
        except psutil.NoSuchProcess:
            continue
        total += t.user + t.system
    return total


def one_process_front(upstream: str) -> tuple[subprocess.Popen[bytes], str]:
    """The front door in one process before the engine: its address."""
    log = WORK / "one-process.log"
    p = subprocess.Popen([sys.executable, str(ROOT / "bench" / "plane_scale.py"), "_pool", "1",
                          f"http://{upstream}"], stdout=log.open("wb"),
                         stderr=subprocess.STDOUT, cwd=str(ROOT),
                         env={**os.environ, "PYTHONPATH": SUP_SITE}, start_new_session=True)
    port = wait(lambda: next((int(line.split()[1]) for line in log.read_text().splitlines()
                              if line.startswith("LISTENING ")), None), 60, "one process")
    return p, f"127.0.0.1:{port}"


def main(conc: int = 256, prompts: int = 1024, runs: int = 2) -> None:
    st = status()
    workers = front_procs(st["daemon_pid"])
    one, one_addr = one_process_front(engine_addr())
    one_ps = [psutil.Process(one.pid)]
    paths = {"direct": (engine_addr(), []), f"proxy-{len(workers) - 1}-workers":
             (PROXY, workers), "proxy-1-process": (one_addr, one_ps)}
    rows: dict[str, list[dict[str, Any]]] = {k: [] for k in paths}
    try:
        for i in range(runs):
            order = list(paths)[i % 3:] + list(paths)[:i % 3]
            for name in order:
                addr, procs = paths[name]
                c0, t0 = cpu_s(procs), time.monotonic()
                doc = bench(addr, conc, prompts, f"plane-{name}-{i}", detailed=True)
                c1, t1 = cpu_s(procs), time.monotonic()
                out = int(doc["total_output_tokens"])
                rows[name].append({
                    "output_tokens_per_s": round(float(doc["output_throughput"]), 1),
                    "completed": doc["completed"], "failed": prompts - doc["completed"],
                    "short": sum(1 for n in doc.get("output_lens", []) if n < 256),
                    "cpu_us_per_token": round((c1 - c0) / max(1, out) * 1e6, 2)
                    if procs else None,
                    "cpu_cores": round((c1 - c0) / (t1 - t0), 2) if procs else None,
                    "median_itl_ms": doc.get("median_itl_ms"),
                    "p99_itl_ms": doc.get("p99_itl_ms")})
                print(name, i, rows[name][-1], flush=True)
    finally:
        one.terminate()
        one.wait(15)
    direct = [r["output_tokens_per_s"] for r in rows["direct"]]
    ratios = {k: [round(r["output_tokens_per_s"] / d, 3) for r, d in zip(v, direct,
                                                                         strict=True)]
              for k, v in rows.items() if k != "direct"}
    result("plane", concurrency=conc, prompts=prompts, rows=rows, ratios=ratios)


if __name__ == "__main__":
    main(*(int(x) for x in sys.argv[1:4]))
