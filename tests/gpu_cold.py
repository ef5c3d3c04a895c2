"""A cold machine's first minutes under load, on a lent GPU (issue 48, point 4).

Not collected by pytest (no GPU in CI). On a fresh GPU machine (nothing compiled: no
torch inductor, Triton, FlashInfer or vLLM cache), after the stage calls of
docs/gpu-validation.md:

    SHAPE=8b python3 tests/gpu_cold.py [MINUTES [CONCURRENCY]]   # 10 128

starts the daemon as `tests/gpu_vllm.py start` does (the 8B shape, torch.compile and CUDA
graphs, the sleeping standby first), and the moment its status says RUNNING, vLLM's own
`vllm bench serve` through the proxy at CONCURRENCY streams, run after run for MINUTES.
The engine's first requests wait at the proxy for its proof (the warm-up of every client
path, the canary, the golden check). Every policy decision in that time is a false one:
target 0. Reported (`RESULT {json}`, appended to $WORK/results.jsonl): the caches found
before the start, the time to RUNNING, each proof's warm-up (each path's seconds), each
run's requests completed and failed and the streams shorter than asked, the largest
`engine_stalled_s` and canary failures seen (status every 2 s), the decisions and restarts.
Run it in the background (setsid) and poll: it outlasts a 10-minute call.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from tests.gpu_daemon import PROXY, WORK, events, result, status, wait
from tests.gpu_load import bench
from tests.gpu_start import phase_start

OUT_TOKENS = 256  # bench()'s --random-output-len
CACHES = ("/tmp/torchinductor_root", "~/.triton", "~/.cache/flashinfer", "~/.cache/vllm",
          "~/.cache/torch", "~/.nv/ComputeCache")


def found_caches() -> dict[str, int]:
    """Each cache folder that already exists, and its files (a fresh machine: none)."""
    out = {}
    for c in CACHES:
        p = Path(os.path.expanduser(c))
        if p.exists():
            out[c] = sum(1 for _ in p.rglob("*"))
    return out


class Watch:
    """status every 2 s: the largest engine_stalled_s and canary failures, the states."""

    def __init__(self) -> None:
        self.stalled = 0.0
        self.canary_failures = 0.0
        self.states: list[str] = []
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self.stop.wait(2.0):
            try:
                st = status()
            except Exception:
                continue
            sig = st.get("signals") or {}
            self.stalled = max(self.stalled, sig.get("engine_stalled_s") or 0.0)
            self.canary_failures = max(self.canary_failures, sig.get("canary_failures") or 0)
            if not self.states or self.states[-1] != st["state"]:
                self.states.append(st["state"])


def run_summary(doc: dict[str, Any], prompts: int) -> dict[str, Any]:
    lens = doc.get("output_lens") or []
    return {"completed": doc.get("completed"), "failed": prompts - int(doc.get("completed")
                                                                       or 0),
            "short": len([n for n in lens if n < OUT_TOKENS]),
            "tokens": doc.get("total_output_tokens"), "asked": prompts * OUT_TOKENS,
            "output_tok_s": round(doc.get("output_throughput") or 0),
            "p99_ttft_ms": doc.get("p99_ttft_ms"), "max_ttft_s": max(
                doc.get("ttfts") or [0]), "duration_s": doc.get("duration")}


def main(minutes: float, concurrency: int, prompts: int = 3000) -> None:
    WORK.mkdir(parents=True, exist_ok=True)
    before = found_caches()
    t0 = time.monotonic()
    starter = threading.Thread(target=phase_start, daemon=True)
    starter.start()
    wait(lambda: status()["state"] == "RUNNING", 900, "RUNNING")
    running_s = round(time.monotonic() - t0, 1)
    watch = Watch()
    watch.thread.start()
    runs: list[dict[str, Any]] = []
    end = time.monotonic() + minutes * 60
    i = 0
    error = None
    try:
        while time.monotonic() < end:
            doc = bench(PROXY, concurrency, prompts, f"cold-{i}", detailed=True,
                        timeout=max(60.0, end - time.monotonic() + 300))
            runs.append(run_summary(doc, prompts))
            i += 1
            result("cold-run", n=i, **runs[-1], stalled_max=watch.stalled,
                   decisions=len([e for e in events() if e["event"] == "decision"]))
    except Exception as exc:  # recorded with what was seen so far
        error = f"{type(exc).__name__}: {exc}"[:2000]
    watch.stop.set()
    audit = events()
    st = status()
    warmed = [{k: e.get(k) for k in ("pid", "ok", "took_s", "slowest", "paths", "error")}
              for e in audit if e["event"] == "paths_warmed"]
    result("cold-load", minutes=minutes, concurrency=concurrency, caches_before=before,
           running_after_s=running_s, warmed=warmed, runs=runs,
           completed=sum(r["completed"] or 0 for r in runs),
           failed=sum(r["failed"] for r in runs), short=sum(r["short"] for r in runs),
           decisions=[{k: e.get(k) for k in ("rule", "action", "reason", "evidence")}
                      for e in audit if e["event"] == "decision"],
           restarts=st["restarts"], stalled_max=watch.stalled,
           canary_failures_max=watch.canary_failures, states=watch.states,
           standby=(st.get("standby") or {}).get("state"), caches_after=found_caches(),
           compile_cache=st.get("compile_cache"), error=error)


if __name__ == "__main__":
    main(float(sys.argv[1]) if len(sys.argv) > 1 else 10.0,
         int(sys.argv[2]) if len(sys.argv) > 2 else 128)
