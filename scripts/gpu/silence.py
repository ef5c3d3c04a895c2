"""How long a busy vLLM API server answers nothing (issue 51; docs/watchdog.md, "The pause
waits for the API server"). On a lent GPU machine, the staged vLLM installed
(scripts/gpu/go.sh's first lines) and ~/m8b made (tests/gpu_shapes.make_m8b):

    python3 scripts/gpu/silence.py 8192 160   # prompt tokens, prompts (128 at a time)

Starts one raw engine (8B shape, random weights, --enforce-eager: the silences are the
prefill's, and the start is short), then `vllm bench serve` against it while a prober
asks `GET /metrics` every 0.5 s with the daemon's own 2 s deadline. Writes
$OUT/silence.json as it goes: every probe (time, seconds, answered), the longest run of
unanswered probes, and the bench's summary at the end. No daemon: what is measured is
vLLM's.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

SITE = str(Path.home() / "vllm-site")
MODEL = str(Path.home() / "m8b")
OUT = Path(os.environ.get("OUT", "/tmp/silence"))
PORT = 8300


def probe(stop: threading.Event, probes: list[tuple[float, float, bool]]) -> None:
    t0 = time.monotonic()
    while not stop.is_set():
        t = time.monotonic()
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{PORT}/metrics", timeout=2) as r:
                ok = r.status == 200 and bool(r.read())
        except Exception:
            ok = False
        probes.append((round(t - t0, 2), round(time.monotonic() - t, 3), ok))
        stop.wait(max(0.0, 0.5 - (time.monotonic() - t)))


def longest_silence(probes: list[tuple[float, float, bool]]) -> tuple[float, int]:
    """(seconds from the first unanswered probe of a run to the next answered one, the
    run's probes), the longest run."""
    best, run_start, n, best_n = 0.0, None, 0, 0
    for t, _, ok in probes:
        if not ok:
            run_start = t if run_start is None else run_start
            n += 1
        elif run_start is not None:
            if t - run_start > best:
                best, best_n = t - run_start, n
            run_start, n = None, 0
    return round(best, 2), best_n


def save(doc: dict, probes: list[tuple[float, float, bool]] | None = None) -> None:
    """Write `doc`, with the probes so far and their summary when given."""
    if probes is not None:
        doc["longest_silence_s"], doc["longest_silence_probes"] = longest_silence(probes)
        doc["unanswered"] = sum(1 for p in probes if not p[2])
        doc["probes"] = probes
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "silence.json").write_text(json.dumps(doc))


def main(input_len: int, prompts: int) -> None:
    env = {**os.environ, "PYTHONPATH": SITE}
    OUT.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    engine = subprocess.Popen(
        [sys.executable, "-m", "vllm.entrypoints.cli.main", "serve", MODEL,
         "--served-model-name", "tiny-llama", "--load-format", "dummy", "--dtype",
         "bfloat16", "--max-model-len", str(input_len + 512), "--enforce-eager",
         "--gpu-memory-utilization", "0.88", "--port", str(PORT)],
        stdout=(OUT / "engine.log").open("wb"), stderr=subprocess.STDOUT, env=env,
        start_new_session=True)
    doc: dict = {"input_len": input_len, "prompts": prompts}
    try:
        while True:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{PORT}/health", timeout=2):
                    break
            except Exception:
                if engine.poll() is not None or time.monotonic() - t0 > 400:
                    raise SystemExit(f"engine did not start: {engine.poll()}") from None
                time.sleep(1)
        doc["start_s"] = round(time.monotonic() - t0, 1)
        save(doc)
        probes: list[tuple[float, float, bool]] = []
        stop = threading.Event()
        prober = threading.Thread(target=probe, args=(stop, probes), daemon=True)
        prober.start()
        bench = subprocess.Popen(
            [sys.executable, "-m", "vllm.entrypoints.cli.main", "bench", "serve",
             "--backend", "openai", "--base-url", f"http://127.0.0.1:{PORT}",
             "--endpoint", "/v1/completions", "--model", "tiny-llama", "--tokenizer", MODEL,
             "--dataset-name", "random", "--random-input-len", str(input_len),
             "--random-output-len", "256", "--num-prompts", str(prompts),
             "--max-concurrency", "128", "--ignore-eos", "--save-result", "--result-dir",
             str(OUT), "--result-filename", "bench.json", "--ready-check-timeout-sec", "0"],
            stdout=(OUT / "bench.log").open("wb"), stderr=subprocess.STDOUT, env=env)
        while bench.poll() is None:
            save(doc, probes)
            time.sleep(3)
        stop.set()
        prober.join(5)
        doc["bench_rc"] = bench.returncode
        result = OUT / "bench.json"
        if result.exists():
            b = json.loads(result.read_text())
            doc["bench"] = {k: b.get(k) for k in (
                "completed", "failed", "duration", "median_ttft_ms", "p99_ttft_ms",
                "median_itl_ms", "p99_itl_ms", "output_throughput", "total_input_tokens")}
        save(doc, probes)
    finally:
        os.killpg(engine.pid, 9)


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]))
