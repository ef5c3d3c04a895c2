"""The clients of the GPU harness (`tests/gpu_vllm.py`): a small load of completions, vLLM's
own `vllm bench serve` through the proxy, raw streams tapped beside it, and what a run's
answers and audit say (`served_summary`, `handover_times`, `cost_row`).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from tests.gpu_daemon import (
    MODEL,
    PROXY,
    VLLM_SITE,
    WORK,
    engine_addr,
    wait,
)


def complete(max_tokens: int = 16, timeout: float = 600) -> int:
    body = json.dumps({"model": "tiny-llama", "prompt": "hello there", "max_tokens": max_tokens,
                       "ignore_eos": True}).encode()
    req = urllib.request.Request(f"http://{PROXY}/v1/completions", data=body,
                                 headers={"content-type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            json.loads(r.read())
            return int(r.status)
    except urllib.error.HTTPError as exc:
        return int(exc.code)
    except Exception:
        return -1


class Load:
    """A small concurrent load through the proxy; counts answers by status."""

    def __init__(self, clients: int = 8, max_tokens: int = 32) -> None:
        self.stop = threading.Event()
        self.codes: list[int] = []
        self.latencies: list[float] = []
        self.threads = [threading.Thread(target=self._run, args=(max_tokens,), daemon=True)
                        for _ in range(clients)]

    def _run(self, max_tokens: int) -> None:
        while not self.stop.is_set():
            t0 = time.monotonic()
            self.codes.append(complete(max_tokens))
            self.latencies.append(time.monotonic() - t0)

    def __enter__(self) -> Load:
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(700)

    def summary(self) -> dict[str, Any]:
        lat = sorted(self.latencies)
        return {"requests": len(self.codes),
                "failed": len([c for c in self.codes if c != 200]),
                "codes": sorted(set(self.codes)),
                "latency_p50_s": round(lat[len(lat) // 2], 3) if lat else None,
                "latency_max_s": round(lat[-1], 3) if lat else None}


def bench(base: str, concurrency: int, prompts: int, tag: str, detailed: bool = False,
          timeout: float = 540, input_len: int = 32, model: str = "tiny-llama",
          tokenizer: str = MODEL, python: str = sys.executable,
          env: dict[str, str] | None = None) -> dict[str, Any]:
    """vLLM's own benchmark client (a client nobody here wrote), one run; its saved JSON.
    Its output goes to WORK/TAG.log as it runs. `input_len`: each random prompt's tokens;
    `model`: the name asked for; `python`, `env`: where vLLM's client runs (the staged
    site by default)."""
    out = WORK / "bench"
    out.mkdir(parents=True, exist_ok=True)
    name = f"{tag}.json"
    cmd = [python, "-m", "vllm.entrypoints.cli.main", "bench", "serve",
           "--backend", "openai", "--base-url", f"http://{base}", "--endpoint",
           "/v1/completions", "--model", model, "--tokenizer", tokenizer,
           "--dataset-name", "random", "--random-input-len", str(input_len), "--random-output-len",
           "256", "--num-prompts", str(prompts), "--max-concurrency", str(concurrency),
           "--ignore-eos", "--ready-check-timeout-sec", "0", "--save-result",
           "--result-dir", str(out), "--result-filename", name,
           *(["--save-detailed"] if detailed else [])]
    log_path = WORK / f"{tag}.log"
    with log_path.open("wb") as logf:
        r = subprocess.run(cmd, stdout=logf, stderr=subprocess.STDOUT, timeout=timeout,
                           cwd=str(WORK),
                           env=env or {**os.environ, "PYTHONPATH": VLLM_SITE})
    if r.returncode != 0:
        raise AssertionError(f"bench {tag} exit {r.returncode}: "
                             f"{log_path.read_text(errors='replace')[-2000:]}")
    doc: dict[str, Any] = json.loads((out / name).read_text())
    return doc


def main_run_began(tag: str) -> float:
    """Once `bench`'s client (its output in WORK/TAG.log) says its main run started: when
    (monotonic)."""
    log_path = WORK / f"{tag}.log"
    wait(lambda: log_path.exists() and b"Starting main benchmark run" in log_path.read_bytes(),
         300, "the client's main run")
    return time.monotonic()


def capture_sse() -> dict[str, Any]:
    """One short stream straight from the engine, with token ids, as vLLM writes it; how
    many of its events the proxy's fast path reads without decoding."""
    from supervisor.front.continuation import _PLAIN

    got = {}
    for path, extra in (("/v1/completions", {"prompt": "hello"}),
                        ("/v1/chat/completions",
                         {"messages": [{"role": "user", "content": "hi"}]})):
        body = json.dumps({"model": "tiny-llama", "max_tokens": 4, "stream": True,
                           "ignore_eos": True, "return_token_ids": True, **extra}).encode()
        req = urllib.request.Request(f"http://{engine_addr()}{path}", data=body,
                                     headers={"content-type": "application/json"})
        raw = urllib.request.urlopen(req, timeout=60).read()
        name = "sse-" + path.strip("/").replace("/", "-") + ".txt"
        (WORK / name).write_bytes(raw)
        if os.environ.get("OUT"):
            (Path(os.environ["OUT"]) / name).write_bytes(raw)
        events = [e[6:] for e in raw.split(b"\n\n") if e.startswith(b"data: {")]
        got[path] = {"events": len(events),
                     "plain": len([e for e in events if _PLAIN.fullmatch(e)])}
    return got


class Tap:
    """One streamed completion through the proxy, read raw as a client's socket gets it:
    every read's bytes and time (issue 20: what vLLM's client saw of a resent stream)."""

    def __init__(self, name: str, tokens: int) -> None:
        self.name, self.tokens = name, tokens
        self.reads: list[tuple[float, bytes]] = []
        self.error: str | None = None
        self.thread = threading.Thread(target=self._run, daemon=True)

    def start(self) -> Tap:
        self.t0 = time.monotonic()
        self.thread.start()
        return self

    def _run(self) -> None:
        import http.client

        body = json.dumps({"model": "tiny-llama", "prompt": f"tap {self.name} " * 8,
                           "max_tokens": self.tokens, "ignore_eos": True, "stream": True,
                           "stream_options": {"include_usage": True}})
        try:
            conn = http.client.HTTPConnection(PROXY, timeout=600)
            conn.request("POST", "/v1/completions", body,
                         {"content-type": "application/json"})
            r = conn.getresponse()
            while True:
                data = r.read1(65536)
                if not data:
                    break
                self.reads.append((time.monotonic() - self.t0, data))
        except Exception as exc:  # recorded: the summary says the tap failed
            self.error = repr(exc)

    def summary(self) -> dict[str, Any]:
        self.thread.join(600)
        raw = b"".join(d for _, d in self.reads)
        events = [e for e in raw.split(b"\n\n") if e.startswith(b"data: ")]
        docs = [json.loads(e[6:]) for e in events if e != b"data: [DONE]"]
        texts = [c for d in docs for c in d.get("choices") or ()]
        usage = [d["usage"] for d in docs if d.get("usage")]
        gaps = [b - a for (a, _), (b, _) in zip(self.reads, self.reads[1:], strict=False)]
        at = gaps.index(max(gaps)) + 1 if gaps else 0
        return {"name": self.name, "error": self.error, "reads": len(self.reads),
                "keepalive_reads": sum(1 for _, d in self.reads if not d.strip()),
                "comment_reads": sum(1 for _, d in self.reads if d.lstrip().startswith(b":")),
                "token_events": len(texts), "errors": [d["error"] for d in docs
                                                       if "error" in d],
                "usage_completion_tokens": usage[-1]["completion_tokens"] if usage else None,
                "done": raw.endswith(b"data: [DONE]\n\n"),
                "first_reads": [repr(d[:300]) for _, d in self.reads[:2]],
                "around_longest_gap": [(round(t, 3), repr(d[:300]))
                                       for t, d in self.reads[max(0, at - 2):at + 3]]}

    def save(self, tag: str) -> None:
        doc = [{"t": round(t, 4), "bytes": d.decode(errors="replace")} for t, d in self.reads]
        path = WORK / f"tap-{tag}-{self.name}.json"
        path.write_text(json.dumps(doc))


def served_summary(doc: dict[str, Any], served: list[dict[str, Any]],
                   continued: list[dict[str, Any]], want: int, before: dict[str, float],
                   after: dict[str, float]) -> dict[str, Any]:
    """What a bench run's requests saw through the proxy, from the client's saved result
    (`doc`), the proxy's access lines and its continuation counters."""
    return {
        "proxy_requests": len(served),
        "proxy_short": len([e for e in served if (e.get("tokens") or 0) < want]),
        "proxy_not_ok": len([e for e in served if e.get("outcome")]),
        "p99_ttft_ms": doc.get("p99_ttft_ms"), "p99_itl_ms": doc.get("p99_itl_ms"),
        # the saved per-request gaps are in seconds (the percentiles in ms)
        "max_itl_s": max((max(x) for x in doc.get("itls") or [] if x), default=None),
        "duration_s": doc.get("duration"),
        "continuations": {k: v - before.get(k, 0.0) for k, v in after.items()
                          if v - before.get(k, 0.0)},
        "continued_logged": len(continued),
        "max_gap_s": max((e.get("waited_s", 0) for e in continued), default=None),
        # from a continuation's answer beginning to its first token (the engine's part)
        "resumed_s": quantiles([e["resumed_s"] for e in served if "resumed_s" in e])}


def quantiles(xs: list[float]) -> dict[str, float] | None:
    """Median, p90 and max of `xs`; None when there are none."""
    if not xs:
        return None
    xs = sorted(xs)
    return {"n": len(xs), "median": xs[len(xs) // 2], "p90": xs[int(0.9 * (len(xs) - 1))],
            "max": xs[-1]}


HANDOVER_EVENTS = ("core_exit", "failover", "standby_weights_woken", "standby_woken",
                   "failover_done",
                   "failover_failed", "drained", "take_down", "card_released", "reaped",
                   "remedy",
                   # an asymmetric pair's re-arm: a full-size engine spawned, ready, the
                   # swap back to it (an upgrade), the thin one asleep again
                   "spawn", "standby_ready", "upgrade", "rearm", "standby_failed",
                   "retired_engine_died", "exit")


def handover_times(audit: list[dict[str, Any]]) -> dict[str, Any]:
    """A handover's steps from the audit: the failover, the wake, the held requests
    released (`failover_done`: seconds from the fault seen), and how the old engine was
    taken down (graceful or SIGKILLed, how long until its tree was proven gone)."""
    from datetime import datetime

    def at(e: dict[str, Any]) -> float:
        return datetime.fromisoformat(e["time"].replace("Z", "+00:00")).timestamp()

    first: dict[str, dict[str, Any]] = {}
    for e in audit:
        first.setdefault(e["event"], e)
    out: dict[str, Any] = {}
    fo = first.get("failover")
    if fo is not None:
        out["failover_at"] = fo["time"]
        out["weights_early"] = bool(fo.get("weights_early"))
        out["weights_ahead"] = fo.get("weights_ahead")  # (on the card before the fault)
        for name in ("standby_weights_woken", "standby_woken", "failover_done", "take_down",
                     "card_released", "reaped"):
            if name in first:
                out[f"{name}_after_failover_s"] = round(at(first[name]) - at(fo), 3)
    if "standby_weights_woken" in first:  # (the weights alone, while the old engine went)
        w = first["standby_weights_woken"]
        out["weights_wake_s"], out["weights_wake_vllm_s"] = w.get("seconds"), w.get("vllm_s")
    if "standby_woken" in first:
        out["wake_s"] = first["standby_woken"].get("seconds")
    if "failover_done" in first:
        out["failover_done_s"] = first["failover_done"].get("seconds")
    if "take_down" in first:
        out["old_take_down_graceful"] = first["take_down"].get("graceful")
    if "reaped" in first:
        r = first["reaped"]
        out["old_reaped"] = {k: r.get(k) for k in ("duration_s", "sigkilled", "problem")}
    return out


def cost_row(doc: dict[str, Any], fault_t: float | None, window: float = 120.0
             ) -> dict[str, Any]:
    """Issue 51's row of what a fault cost the clients of one `vllm bench serve` run (its
    detailed result): failed requests, TTFT median and p99, the longest gap between two
    tokens of any stream, how many streams had a gap over 2, 5 and 10 s, and the TTFT p99
    of the requests the client sent in the `window` seconds from `fault_t` (the client's
    start times are perf_counter's, the same clock as time.monotonic on Linux; None where
    this vLLM's client does not save them)."""
    def pct(xs: list[float], q: float) -> float | None:
        xs = sorted(xs)
        return round(xs[min(len(xs) - 1, int(len(xs) * q / 100))], 3) if xs else None

    ttfts = [x for x in doc.get("ttfts") or [] if x]
    worst = [max(x) for x in doc.get("itls") or [] if x]
    starts = doc.get("start_times") or []
    after = [t for s0, t in zip(starts, doc.get("ttfts") or [], strict=False)
             if t and fault_t is not None and fault_t <= s0 < fault_t + window]
    return {"failed": doc.get("failed"), "completed": doc.get("completed"),
            "ttft_median_s": pct(ttfts, 50), "ttft_p99_s": pct(ttfts, 99),
            "longest_gap_s": round(max(worst), 3) if worst else None,
            "streams_gap_over_s": {str(b): len([w for w in worst if w > b])
                                   for b in (2, 5, 10)},
            "ttft_p99_after_fault_s": pct(after, 99) if starts else None,
            "requests_after_fault": len(after) if starts else None}
