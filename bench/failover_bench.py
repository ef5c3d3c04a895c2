"""Failover: a crash of the serving engine with a standby beside it, against a cold start.

The daemon with the front proxy supervises the real vLLM CPU engine, twice in one run:
once with `standby = "awake"` (a second engine of the same arguments loaded and proven
beside the serving one) and once with `standby = "none"` (every crash is a cold start).
The engine's settings are otherwise the same in both (two engines on two cores: no
pinning, one compute thread each, as tests/test_e2e_standby.py runs them).

Each round: a few greedy streams of a few hundred tokens (`ignore_eos`) through the
proxy; once every client has tokens, SIGKILL of the serving `VLLM::EngineCore` (found in
the engine's process tree). On two busy cores vLLM's API server hands chunks out late, so
a token a client receives after the kill may have been produced before it: the core is
SIGSTOPped first and the kill comes once the clients' token counts stop moving
(tests/test_e2e_standby.py does the same), so that every token received after the kill
is a continued one. Measured, from the kill: per stream caught mid-generation, the gap
to its next token (the round's smallest and longest); a new streaming request sent just
after the kill, timed from its send to its first token. Every stream must end whole
([DONE], finish_reason "length", usage equal to max_tokens); failed and short ones are
counted. Between rounds the daemon is RUNNING again and (standby) a new standby ready.
Timings are reported, not asserted.

    .venv/bin/python bench/failover_bench.py --rounds 3 --out docs/benchmarks.md
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import statistics
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.report import write_section  # noqa: E402
from bench.runs import Clock, TreeLedger  # noqa: E402
from tests.harness import Daemon, free_port, wait_for  # noqa: E402
from tests.test_e2e_proxy import sse_lines  # noqa: E402
from tests.test_e2e_vllm import START_TIMEOUT, tree, vllm_config  # noqa: E402

MODES = ("awake", "none")


@dataclass
class Stream:
    """One streaming request as its client saw it, each token-bearing chunk timed."""

    tokens_seen: int = 0  # completion tokens so far (continuous usage stats)
    arrivals: list[tuple[float, int]] = field(default_factory=list)  # (monotonic, tokens)
    usage_tokens: int | None = None
    finish: str | None = None
    done: bool = False
    error: str | None = None
    sent_at: float = 0.0


def body(prompt: str, tokens: int) -> dict[str, Any]:
    return {"model": "tiny-llama", "prompt": prompt, "max_tokens": tokens,
            "ignore_eos": True, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}}


def run_stream(url: str, req: dict[str, Any], s: Stream) -> None:
    s.sent_at = time.monotonic()
    try:
        with httpx.stream("POST", url, json=req,
                          timeout=httpx.Timeout(30.0, read=400.0)) as r:
            if r.status_code != 200:
                s.error = f"HTTP {r.status_code}: {r.read()[:200]!r}"
                return
            for line in sse_lines(r):
                if not line.startswith("data: "):
                    continue
                data = line[len("data: "):]
                if data == "[DONE]":
                    s.done = True
                    continue
                doc = json.loads(data)
                if "error" in doc:
                    s.error = str(doc["error"].get("message", "error event"))
                    continue
                for c in doc.get("choices") or ():
                    s.finish = c.get("finish_reason") or s.finish
                if usage := doc.get("usage"):
                    n = int(usage["completion_tokens"])
                    s.usage_tokens = n
                    if n > s.tokens_seen:
                        s.arrivals.append((time.monotonic(), n))
                        s.tokens_seen = n
    except Exception as exc:  # counted as a failed stream
        s.error = f"{type(exc).__name__}: {exc}"


def start(url: str, reqs: list[dict[str, Any]]) -> tuple[list[Stream], list[threading.Thread]]:
    streams = [Stream() for _ in reqs]
    threads = [threading.Thread(target=run_stream, args=(url, q, s), daemon=True)
               for q, s in zip(reqs, streams, strict=True)]
    for t in threads:
        t.start()
    return streams, threads


def quiet(streams: list[Stream], seconds: float, bound: float) -> None:
    """Until the clients' token counts stop moving (they have all the stopped core made)."""
    deadline = time.monotonic() + bound
    seen, since = -1, time.monotonic()
    while time.monotonic() < deadline and time.monotonic() - since < seconds:
        time.sleep(0.05)
        if (now := sum(s.tokens_seen for s in streams)) != seen:
            seen, since = now, time.monotonic()


def whole(s: Stream, tokens: int) -> bool:
    return s.done and s.error is None and s.finish == "length" and s.usage_tokens == tokens


def config(tmp: Path, mode: str) -> dict[str, Any]:
    cfg: dict[str, Any] = vllm_config(tmp)
    # the same engine in both modes: two engines on two cores (the standby's case), no
    # pinning, one compute thread each (config.two-engines.toml, tests/test_e2e_standby.py)
    cfg["engine"]["env"].update(VLLM_CPU_OMP_THREADS_BIND="nobind", OMP_NUM_THREADS="1")
    cfg["engine"]["standby"] = mode
    if mode != "none":
        port = cfg["engine"]["port"]
        while (spare := free_port()) == port:
            pass
        cfg["engine"]["standby_port"] = spare
    cfg["proxy"] = {"enabled": True, "listen": f"127.0.0.1:{free_port()}",
                    "hold_timeout_s": 300.0, "keepalive_s": 1.0}
    cfg["canary"] = {"period_s": 2.0, "timeout_s": 5.0}
    return cfg


class Bench(TreeLedger):
    def __init__(self, a: argparse.Namespace, clock: Clock) -> None:
        super().__init__()
        self.a, self.clock = a, clock

    def ready(self, d: Daemon, mode: str, restarts: int, old: set[int]) -> None:
        """RUNNING after `restarts` restarts, the gate open, and (standby) a new standby
        proven, none of the pids in `old`."""
        d.wait_state("RUNNING", self.clock.left(START_TIMEOUT),
                     extra=lambda s: s["restarts"] >= restarts)
        if mode != "none":
            wait_for(lambda: (s := d.status()["standby"])["state"] == "ready"
                     and s["pid"] not in old, self.clock.left(START_TIMEOUT),
                     "the standby ready", interval=0.25)
        wait_for(lambda: d.status()["admission"]["held"] is None, self.clock.left(120),
                 "the gate open", interval=0.1)
        st = d.status()
        self.remember(st["pid"])
        self.remember((st.get("standby") or {}).get("pid"))

    def round(self, d: Daemon, cfg: dict[str, Any], mode: str, n: int) -> dict[str, Any]:
        url = f"http://{cfg['proxy']['listen']}/v1/completions"
        logged = len(d.log_records())
        st = d.status()
        serving, spare = st["pid"], (st.get("standby") or {}).get("pid")
        self.remember(serving)
        self.remember(spare)
        core = next(p for p in tree(serving) if p.name().startswith("VLLM::EngineCor"))
        reqs = [body(f"round {n} tale number {i}:", self.a.tokens) for i in range(self.a.streams)]
        streams: list[Stream] = []
        threads: list[threading.Thread] = []
        seen: list[int] = []
        mid: list[int] = []
        for _wave in range(3):
            streams, threads = start(url, reqs)
            wait_for(lambda ss=streams, ts=threads: all(  # type: ignore[misc]
                s.tokens_seen > 0 or not t.is_alive() for s, t in zip(ss, ts, strict=True)),
                     self.clock.left(120), "every stream to have tokens", interval=0.02)
            core.suspend()
            quiet(streams, 1.0, 5.0)
            seen = [s.tokens_seen for s in streams]
            mid = [i for i, k in enumerate(seen) if 0 < k < self.a.tokens]
            if mid:
                break
            core.resume()
            for t in threads:
                t.join(self.clock.left(300))
        if not mid:
            raise RuntimeError("no stream caught mid-generation in three waves")
        t_kill = time.monotonic()
        core.send_signal(signal.SIGKILL)
        new = Stream()
        sent = threading.Thread(target=run_stream, args=(url, body("hi", 8), new), daemon=True)
        sent.start()
        for t in [*threads, sent]:
            t.join(self.clock.left(600))
        gaps: dict[int, float] = {}
        for i in mid:
            after = [at for at, k in streams[i].arrivals if at > t_kill and k > seen[i]]
            if after:
                gaps[i] = after[0] - t_kill
        ttft = new.arrivals[0][0] - new.sent_at if new.arrivals else None
        recs = d.log_records()[logged:]
        out: dict[str, Any] = {
            "mode": mode, "round": n, "tokens_seen_at_kill": seen, "mid_generation": len(mid),
            "first_continued_s": round(min(gaps.values()), 3) if gaps else None,
            "last_continued_s": round(max(gaps.values()), 3) if gaps else None,
            "gaps_s": {i: round(g, 3) for i, g in gaps.items()},
            "new_request_ttft_s": round(ttft, 3) if ttft is not None else None,
            "new_request_whole": whole(new, 8), "new_request_error": new.error,
            "whole": sum(whole(s, self.a.tokens) for s in streams),
            "failed": sum(s.error is not None for s in streams),
            "short": sum(s.error is None and not whole(s, self.a.tokens) for s in streams),
            "not_continued": len(mid) - len(gaps),
            "errors": [s.error for s in streams if s.error],
            "continued_waits_s": [round(float(e["waited_s"]), 3) for e in recs
                                  if e.get("event") == "stream continued"],
            "failover_done_s": [e.get("seconds") for e in recs
                                if e.get("event") == "failover done"],
            "load_avg_1m": round(os.getloadavg()[0], 2),
        }
        # what the next round waits for: the daemon serving again (and a new standby)
        self.ready(d, mode, n, {serving, spare} if spare else {serving})
        startups = [float(m.group(1)) for e in d.log_records()[logged:]
                    if (m := re.search(r"/health answered 200 after ([0-9.]+) s",
                                       json.dumps(e)))]
        out["engine_startups_s"] = startups
        out["backoff_s"] = [float(m.group(1)) for e in d.log_records()[logged:]
                            if e.get("event") == "state change" and (m := re.search(
                                r"retrying in ([0-9.]+) s", str(e.get("reason", ""))))]
        out["pid_after"] = d.status()["pid"]
        out["failed_over_to_standby"] = out["pid_after"] == spare if spare else False
        print(json.dumps(out), flush=True)
        return out

    def mode(self, mode: str, rows: list[dict[str, Any]], notes: list[str]) -> None:
        tmp = Path(tempfile.mkdtemp(prefix=f"vs-fobench-{mode}-"))
        cfg = config(tmp, mode)
        print(f"# mode {mode}: daemon in {tmp}", flush=True)
        d = Daemon(tmp, cfg)
        t0 = time.monotonic()
        try:
            self.ready(d, mode, 0, set())
            print(f"# mode {mode}: serving after {time.monotonic() - t0:.0f} s", flush=True)
            _warm, threads = start(f"http://{cfg['proxy']['listen']}/v1/completions",
                                  [body("warm up", 16)])
            threads[0].join(self.clock.left(120))
            for n in range(1, self.a.rounds + 1):
                rows.append(self.round(d, cfg, mode, n))
        except Exception as exc:
            notes.append(f"{mode}: stopped early: {type(exc).__name__}: {str(exc)[:300]}")
            print(f"# mode {mode}: {notes[-1]}\n{d.log_tail(40)}", flush=True)
        finally:
            try:
                self.remember(d.status()["pid"])
                self.remember((d.status().get("standby") or {}).get("pid"))
            except Exception:
                pass
            try:
                d.ctl("stop", timeout=180)
                d.wait_exit(120)
            except Exception as exc:
                notes.append(f"{mode}: stop: {type(exc).__name__}")
            d.close()
            for p in self.leftovers():  # never expected: the daemon takes its trees down
                notes.append(f"{mode}: engine process {p.pid} left behind, killed")
                p.kill()


def med(xs: list[float]) -> str:
    return f"{statistics.median(xs):.2f}" if xs else "-"


def worst(xs: list[float]) -> str:
    return f"{max(xs):.2f}" if xs else "-"


def times(x: float) -> str:
    return f"{x:.0f}x" if x >= 10 else f"{x:.1f}x"


def report(rows: list[dict[str, Any]], a: argparse.Namespace, notes: list[str]) -> str:
    by = {m: [r for r in rows if r["mode"] == m] for m in MODES}

    def col(m: str, key: str) -> list[float]:
        return [float(r[key]) for r in by[m] if r[key] is not None]

    names = {"awake": '`standby = "awake"`', "none": '`standby = "none"` (cold start)'}
    first = {m: col(m, "first_continued_s") for m in MODES}
    ratio = (statistics.median(first["none"]) / statistics.median(first["awake"])
             if first["none"] and first["awake"] else None)
    lines = [
        "## Failover (`bench/failover_bench.py`)", "",
        f"Run on {datetime.now().strftime('%Y-%m-%d')}, 2 CPU cores (shared), vllm-cpu "
        "0.32.0 with the tiny model behind the front proxy, the same engine settings in "
        "both modes (no pinning, one compute thread per engine). "
        f"{a.rounds} rounds per mode; each round {a.streams} greedy streams of {a.tokens} "
        "tokens (`ignore_eos`) and, once every client has tokens, SIGKILL of the serving "
        "`VLLM::EngineCore` (SIGSTOPped first until the clients have all it produced, so "
        "that a token received after the kill is a continued one). First / last continued "
        "token: from the kill to the first interrupted stream's next token, and to the last "
        "one's (median over rounds, worst in brackets). New request: a stream sent just "
        "after the kill, from its send to its first token. Streams whole: [DONE], "
        "finish_reason `length`, every token asked for.", "",
        "| mode | rounds | streams mid-generation | kill -> first continued token (s) | "
        "kill -> last continued token (s) | new request: first token (s) | streams whole "
        "| failed | short |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for m in MODES:
        rs = by[m]
        if not rs:
            lines.append(f"| {names[m]} | 0 | - | - | - | - | - | - | - |")
            continue
        last, new = col(m, "last_continued_s"), col(m, "new_request_ttft_s")
        lines.append(
            f"| {names[m]} | {len(rs)} | {sum(r['mid_generation'] for r in rs)} | "
            f"{med(first[m])} ({worst(first[m])}) | {med(last)} ({worst(last)}) | "
            f"{med(new)} ({worst(new)}) | {sum(r['whole'] for r in rs)} / "
            f"{a.streams * len(rs)} | {sum(r['failed'] for r in rs)} | "
            f"{sum(r['short'] for r in rs)} |")
    lines.append("")
    if ratio is not None:
        news = {m: col(m, "new_request_ttft_s") for m in MODES}
        tail = ""
        if news["none"] and news["awake"]:
            tail = (f"; for the new request's first token, "
                    f"{times(statistics.median(news['none']) / statistics.median(news['awake']))}")
        lines.append(f"Without a standby the first continued token came "
                     f"{times(ratio)} later (median without / median with){tail}.")
    per = "; ".join(f"{m}: " + ", ".join("-" if r["first_continued_s"] is None else
                                          f"{r['first_continued_s']:.2f}" for r in by[m])
                    for m in MODES if by[m])
    if per:
        lines.append(f"\nKill -> first continued token, round by round (s): {per}.")
    starts = [x for r in by["none"] for x in r["engine_startups_s"]]
    backoffs = [x for r in by["none"] for x in r["backoff_s"]]
    failovers = [float(x) for r in by["awake"] for x in r["failover_done_s"] if x is not None]
    if failovers:
        lines.append(f"\nWith the standby, the daemon's failover (the core's death seen to the "
                     f"held requests released on the standby) took {med(failovers)} s "
                     f"(median; worst {worst(failovers)} s).")
    if starts:
        lines.append(f"\nWithout it, the gap is the daemon's restart backoff (per round: "
                     f"{', '.join(f'{x:g}' for x in backoffs) or '-'} s; it doubles while "
                     f"crashes come within its window) plus the engine's cold start "
                     f"(spawn to `/health` 200: median {med(starts)} s, the compile cache "
                     f"warm) plus the canary before the held requests go.")
    for n in notes:
        lines.append(f"\nNote: {n}")
    return "\n".join(lines) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--streams", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=300, help="per stream (context: 512)")
    ap.add_argument("--modes", default=",".join(MODES), help="awake,none (both by default)")
    ap.add_argument("--deadline-min", type=float, default=25.0, help="the whole run's bound")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    clock = Clock(a.deadline_min)
    bench = Bench(a, clock)
    rows: list[dict[str, Any]] = []
    notes: list[str] = []
    for mode in a.modes.split(","):
        if mode not in MODES:
            ap.error(f"unknown mode {mode!r}")
        if clock.deadline - time.monotonic() < 60:
            notes.append(f"{mode}: not run, the run's deadline was near")
            continue
        bench.mode(mode, rows, notes)
    text = report(rows, a, notes)
    print(text)
    if a.out:
        write_section(Path(a.out), "failover", text)
    bad = any(r["failed"] or r["short"] or r["not_continued"] for r in rows)
    return 1 if bad or notes else 0


if __name__ == "__main__":
    sys.exit(main())
