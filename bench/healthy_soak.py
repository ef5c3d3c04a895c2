"""The watchdog's false-alarm budget, and beside it what it catches (issue 48).

The daemon with the front proxy supervises the real vLLM CPU engine with the default
rules, periods and windows (the demo's engine flags and canary: every 10 s, a 5 s
deadline), started from cold: the engine gets compile and JIT caches of its own, empty
(removed at the end). Traffic through the proxy looks like a service's
(`bench/soak_traffic.py`: a seeded mix of chats and completions, streamed and not,
prompts up to 480 tokens, log-probabilities, several choices, stop strings, JSON-schema
output with a new schema every few minutes, clients that hang up mid-stream, silences
ended by a burst of 32 requests at once).

Phase A, healthy (`--minutes`, 60 by default): a CPU hog beside the engine for the
middle third. Every policy decision is a false one; per default rule: the decisions
(target 0), the ones held back, how near it came (its signals at their worst) and the
longest its condition held. Phase B, faults (`--fault-minutes`, 10 by default; 0 skips
it): the same mix, and a fault about every 2 minutes once the engine serves again, in
turn a SIGKILL of `VLLM::EngineCore`, a SIGSTOP of it (a hang) and a SIGSTOP of
`VLLM::Worker` (a stalled step), nothing ever continued: per fault, by what it was
detected, how fast, when the engine served again, the requests failed and truncated
around it, and whether any process of the old tree outlived it. Both into
docs/benchmarks.md (`--out`), section `healthy-soak`.

    .venv/bin/python bench/healthy_soak.py --minutes 60 --fault-minutes 10 \
        --out docs/benchmarks.md
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.report import write_section  # noqa: E402
from bench.runs import TreeLedger  # noqa: E402
from bench.soak_traffic import (  # noqa: E402
    NOT_CONTINUABLE,
    Hog,
    Record,
    SchemaPool,
    Segment,
    Traffic,
    schedule,
)
from bench.soak_watch import (  # noqa: E402
    PREFIX,
    Fault,
    Watcher,
    inject,
    serving,
    wall,
    window_counts,
)
from supervisor.watchdog.rules import DEFAULT_RULES  # noqa: E402
from tests.harness import Daemon, cache_env, free_port, wait_for  # noqa: E402
from tests.test_e2e_vllm import START_TIMEOUT, vllm_config  # noqa: E402

FAULTS = ("core_sigkill", "core_sigstop", "worker_sigstop")
BROKE = "error event: the engine closed the connection inside its answer; "
OUTCOMES = ("answered", "failed", "truncated", "cancelled", "refused")
COLD_START_S = 900.0  # a first start compiles everything, on two shared cores


@dataclass
class Run:
    """What a run saw, for its report."""

    seed: int
    minutes: float
    fault_minutes: float
    clients: int = 48
    commit: str = ""
    cold_start_s: float | None = None
    phase_a: tuple[float, float] = (0.0, 0.0)  # wall
    phase_a_s: float = 0.0
    phase_b_s: float = 0.0
    hog: tuple[float, float] | None = None  # into phase A, seconds
    restarts_a: int | None = None
    load: tuple[float, float, float] = (0.0, 0.0, 0.0)
    events: list[dict[str, Any]] = field(default_factory=list)
    records: list[Record] = field(default_factory=list)
    faults: list[Fault] = field(default_factory=list)
    schemas: int = 0
    bursts: int = 0
    leftovers: list[int] = field(default_factory=list)
    logs: str = ""


def drive(traffic: Traffic, segs: list[Segment], total_s: float, stop: threading.Event,
          hog: Hog | None = None, watcher: Watcher | None = None,
          label: str = "A") -> None:
    """Walk the schedule: the clients' level, bursts, the hog for the middle third."""
    t0 = time.monotonic()
    i = 0
    while not stop.is_set() and (el := time.monotonic() - t0) < total_s:
        while i < len(segs) and segs[i].start_s <= el:
            traffic.set_level(segs[i].level)
            if segs[i].burst:
                traffic.burst(segs[i].burst)
            i += 1
        if hog is not None and watcher is not None:
            if hog.proc is None and el >= total_s / 3:
                hog.start()
                watcher.label = f"{label}+hog"
            elif hog.stopped is None and hog.proc is not None and el >= 2 * total_s / 3:
                hog.stop()
                watcher.label = label
        stop.wait(0.5)


def answered_since(traffic: Traffic, t: float) -> int:
    return sum(1 for r in traffic.snapshot() if r.outcome == "answered" and r.t1 > t)


def fault_loop(d: Daemon, traffic: Traffic, total_s: float) -> list[Fault]:
    """A fault about every 2 minutes (each of FAULTS at least once in a short phase), each
    once the engine serves again and has answered since."""
    every = min(120.0, total_s / len(FAULTS))
    t0 = time.monotonic()
    next_at, last_back = t0 + min(30.0, every / 2), t0
    out: list[Fault] = []
    while time.monotonic() < t0 + total_s:
        if time.monotonic() < next_at:
            time.sleep(0.5)
            continue
        st = d.status()
        if not serving(st) or answered_since(traffic, last_back) < 3:
            time.sleep(1)
            continue
        f = Fault(FAULTS[len(out) % len(FAULTS)], time.monotonic() - t0)
        inject(d, f, START_TIMEOUT + 120)
        print(f"phase B +{f.at_s:.0f} s: {f.kind} at "
              f"{datetime.fromtimestamp(f.wall0, UTC).strftime('%H:%M:%S.%f')[:12]}Z",
              flush=True)
        print(f"  -> {f.detected_by} after {f.detect_s} s, serving after {f.back_s} s"
              f"{'; ' + f.note if f.note else ''}", flush=True)
        out.append(f)
        if f.t_back is None:
            break  # (nothing more to inject into)
        next_at, last_back = f.t0 + every, f.t_back
    return out


def git_commit() -> str:
    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=ROOT, capture_output=True,
                              text=True).stdout.strip()

    # (what the result depends on: the daemon and this bench; the tests' changes of other
    # work in the same tree do not count)
    dirty = (" (with uncommitted changes)"
             if git("status", "--porcelain", "--", "supervisor", "bench") else "")
    return git("rev-parse", "--short", "HEAD") + dirty


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--minutes", type=float, default=60.0, help="phase A, healthy")
    ap.add_argument("--fault-minutes", type=float, default=10.0,
                    help="phase B, faults (0: none)")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--clients", type=int, default=48)
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    run = Run(a.seed, a.minutes, a.fault_minutes, a.clients, commit=git_commit())
    rnd = random.Random(a.seed)
    caches = Path(tempfile.mkdtemp(prefix="vsc-", dir="/tmp"))  # (short: vLLM's sockets)
    for sub in ("vllm", "inductor", "triton", "xdg", "tmp"):
        (caches / sub).mkdir()
    tmp = Path(tempfile.mkdtemp(prefix="vs-soak-"))
    cfg: dict[str, Any] = vllm_config(tmp)
    cfg["engine"]["env"].update(cache_env(caches))
    cfg["proxy"] = {"enabled": True, "listen": f"127.0.0.1:{free_port()}"}
    cfg["canary"] = {"period_s": 10.0, "timeout_s": 5.0}  # (the demo's config.toml)
    cfg["log"] = {"format": "json", "level": "info"}
    a_s, b_s = a.minutes * 60, a.fault_minutes * 60
    schemas = SchemaPool(a.seed, min(150.0, (a_s + b_s) / 8))
    traffic = Traffic(f"http://{cfg['proxy']['listen']}", a.seed, schemas, a.clients)
    d = Daemon(tmp, cfg)
    watcher, ledger, hog, stop = Watcher(d), TreeLedger(), Hog(), threading.Event()
    run.logs = str(tmp)
    print(f"daemon log, audit: {tmp}; caches: {caches}", flush=True)
    t_spawn, wall_spawn = time.monotonic(), time.time()
    try:
        # a few clients from the moment it listens (held until the engine is proven)
        wait_for(lambda: d.status(), 60, "the control socket")
        watcher.start()
        traffic.start()
        traffic.set_level(2)
        d.wait_state("RUNNING", COLD_START_S)
        wait_for(lambda: serving(d.status()), 120, "the gate to open")
        run.cold_start_s = time.monotonic() - t_spawn
        print(f"serving after {run.cold_start_s:.0f} s (cold); phase A", flush=True)
        wall_a0, t_a0 = time.time(), time.monotonic()
        traffic.phase = watcher.label = "A"
        drive(traffic, schedule(rnd, a_s, silences=True), a_s, stop, hog, watcher, "A")
        hog.stop()
        run.hog = ((hog.started or t_a0) - t_a0, (hog.stopped or t_a0) - t_a0)
        run.phase_a = (wall_a0, time.time())
        run.phase_a_s = time.monotonic() - t_a0
        run.restarts_a = int(d.status()["restarts"])
        run.load = os.getloadavg()
        print(f"phase A over: {dict(traffic.counts())}, restarts {run.restarts_a}",
              flush=True)
        if b_s > 0:
            traffic.phase = watcher.label = "B"
            t_b0 = time.monotonic()
            driver = threading.Thread(target=drive, args=(
                traffic, schedule(rnd, b_s + 900, silences=False), b_s + 900, stop),
                daemon=True)
            driver.start()
            run.faults = fault_loop(d, traffic, b_s)
            stop.set()
            driver.join(5)
            run.phase_b_s = time.monotonic() - t_b0
        traffic.set_level(0)
        traffic.stop(480)
        for pid in watcher.pids:
            ledger.remember(pid)
        run.events = d.events(10000)
    finally:
        stop.set()
        traffic.stop(0)
        hog.stop()
        watcher.stop()
        d.close()
        shutil.rmtree(caches, ignore_errors=True)
    for f in run.faults:
        f.requests = window_counts(f, traffic.snapshot())
    for p in ledger.leftovers():  # (never expected; processes of this run's engines)
        run.leftovers.append(p.pid)
        os.kill(p.pid, signal.SIGKILL)
    run.records, run.schemas, run.bursts = traffic.snapshot(), len(schemas.used), traffic.bursts
    with (tmp / "requests.jsonl").open("w") as out:  # every request, to look into after
        for r in run.records:
            start = datetime.fromtimestamp(wall_spawn + r.t0 - t_spawn, UTC)
            out.write(json.dumps({"start": start.isoformat(timespec="milliseconds"),
                                  "s": round(r.t1 - r.t0, 3), "phase": r.phase,
                                  "tags": r.tags, "outcome": r.outcome,
                                  "detail": r.detail}) + "\n")
    text, ok = report(run, watcher)
    print(text)
    if a.out:
        write_section(Path(a.out), "healthy-soak", text)
    return 0 if ok else 1


def counts(records: list[Record], phases: tuple[str, ...]) -> Counter[str]:
    return Counter(r.outcome for r in records if r.phase in phases)


def report(run: Run, w: Watcher) -> tuple[str, bool]:
    """The section's text, and whether the run met its targets."""
    a0, a1 = run.phase_a
    decisions = [e for e in run.events if e["event"] == "decision"]
    held = [e for e in run.events if e["event"] == "decision_held_back"]
    false_a = [e for e in decisions if wall(e) < a1]
    held_a = [e for e in held if wall(e) < a1]
    labels_a = ("start", "A", "A+hog")
    stalled = {lab: w.worst((lab,), "no_progress").worst.get((0, 0)) for lab in labels_a}
    canary = w.worst(labels_a, "hang").worst.get((0, 0))

    def peak(name: str) -> float | None:
        return w.peak(labels_a, name)

    lines = [
        "## False alarms and faults caught: the watchdog's budget (`bench/healthy_soak.py`)",
        "",
        f"Run on {datetime.fromtimestamp(a0).strftime('%Y-%m-%d')} at commit {run.commit} "
        f"(seed {run.seed}): the real vLLM CPU engine (tiny model, `--max-model-len 512`, "
        f"the demo's flags) on {os.cpu_count()} cores (load average at the end of phase A "
        f"{run.load[0]:.1f} / {run.load[1]:.1f} / {run.load[2]:.1f}), started with empty "
        f"compile and JIT caches of its own (serving {run.cold_start_s or 0:.0f} s after "
        "the daemon started); the daemon with the proxy, the default rules, periods and "
        "windows, the canary every 10 s with a 5 s deadline. Traffic through the proxy "
        f"(`bench/soak_traffic.py`): up to {run.clients} clients in turn, their number "
        "redrawn every "
        "1-4 minutes, a seeded mix of chats and completions, streamed and not, prompts of "
        "4-480 tokens as token ids, log-probabilities (`logprobs: 5`, `top_logprobs: 5`), "
        "`n` of 2-4, stop strings, JSON-schema output (a new schema every few minutes), "
        "clients that hang up after a few chunks; silences of 2-3 minutes each ended by "
        f"32 requests at once; a CPU hog (`while True: pass`) beside the engine from "
        f"{(run.hog or (0, 0))[0] / 60:.1f} to {(run.hog or (0, 0))[1] / 60:.1f} min.",
        "",
        f"### Phase A: healthy, {run.phase_a_s / 60:.1f} minutes (every decision is false)",
        "",
        "| rule | default | condition | decisions (target 0) | held back | nearest approach "
        "| longest held (s) |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, rule in DEFAULT_RULES.items():
        near = w.worst(labels_a, name)
        n_dec = sum(e["rule"] == name for e in false_a)
        n_held = sum(e["rule"] == name for e in held_a)
        hold = f" for {rule.for_s:g} s" if rule.for_s else ""
        lines.append(
            f"| `{name}` | {'on' if rule.enabled else 'off'} | `{rule.when}`{hold} | "
            f"{n_dec} | {n_held} | {near.text(name)} | {near.holding_s:.0f} |")
    lines += [
        "",
        f"Largest `engine_stalled_s`: {_num(stalled['A+hog'])} with the hog on, "
        f"{_num(stalled['A'])} without, {_num(stalled['start'])} during the cold start "
        f"(the progress rule fires at 6); canary failures at most {_num(canary)} (3 fire "
        f"the hang rule), the canary's longest answer {_num(peak('canary_latency_s'))} s "
        f"(its deadline 5 s); at most {_num(peak('requests_running'))} requests running "
        f"and {_num(peak('requests_waiting'))} waiting at the engine, `kv_cache_usage` "
        f"{_num(peak('kv_cache_usage'))}; engine restarts in phase A: {run.restarts_a}.",
        "",
    ]
    for e in false_a:
        lines.append(f"- false decision {e['time']}: `{e['rule']}` -> {e['action']} "
                     f"({e['reason']}); evidence `{json.dumps(e.get('evidence'))[:300]}`")
    lines += ["", "Requests, as their clients saw them:", "",
              "| phase | requests | answered | failed | truncated | cancelled by the client "
              "| refused (4xx) |", "|---|---|---|---|---|---|---|"]
    phases = {"A (healthy)": ("start", "A"), "B (faults)": ("B",)}
    for title, ph in phases.items():
        c = counts(run.records, ph)
        lines.append(f"| {title} | {sum(c.values())} | "
                     + " | ".join(str(c[o]) for o in OUTCOMES) + " |")
    tags = Counter(t for r in run.records if r.phase in ("start", "A") for t in r.tags)
    lines += ["", "Phase A's mix: " + ", ".join(f"{k} {v}" for k, v in sorted(tags.items()))
              + f"; {run.schemas} JSON schemas; {run.bursts} bursts.", ""]
    for title, ph in phases.items():
        bad = [r for r in run.records
               if r.phase in ph and r.outcome in ("failed", "truncated", "refused")]
        why = Counter(r.detail.replace(BROKE, "")[:120] for r in bad)
        if why:
            lines.append(f"{title}, what went wrong: "
                         + "; ".join(f"{k} ({v})" for k, v in why.most_common(8)) + ".")
        odd = [r for r in bad if not set(r.tags) & set(NOT_CONTINUABLE)]
        if bad:
            lines += ["", f"Of those, {len(bad) - len(odd)} asked what the proxy never "
                      "continues on another engine (several choices, log-probabilities, "
                      f"stop strings, structured output): {len(odd)} did not"
                      + (": " + "; ".join(f"{r.tags} {r.detail[:80]}" for r in odd[:5])
                         if odd else "") + ".", ""]
    ok = not false_a and not any(counts(run.records, ("start", "A"))[o]
                                 for o in ("failed", "truncated", "refused"))
    if run.fault_minutes > 0:
        lines += _faults(run, decisions)
        ok = ok and all(bool(f.detected_by and f.t_back and not f.leftovers)
                        for f in run.faults)
    lines += ["", f"Processes of the run's engines left at the end: {len(run.leftovers)}."]
    return "\n".join(lines) + "\n", ok and not run.leftovers


def _faults(run: Run, decisions: list[dict[str, Any]]) -> list[str]:
    a1 = run.phase_a[1]
    lines = ["", f"### Phase B: faults, {run.phase_b_s / 60:.1f} minutes", "",
             "| fault | at (s) | target | detected by | detection (s) | serving again "
             "after (s) | failed, truncated, answered, cancelled around it | old tree "
             "left |", "|---|---|---|---|---|---|---|---|"]
    for f in run.faults:
        r = f.requests
        lines.append(
            f"| {f.kind} | {f.at_s:.0f} | {f.target or '-'} | {f.detected_by or 'not'} | "
            f"{_num(f.detect_s)} | {_num(f.back_s)} | {r.get('failed', 0)}, "
            f"{r.get('truncated', 0)}, {r.get('answered', 0)}, {r.get('cancelled', 0)} | "
            f"{len(f.leftovers) if f.t0 else '-'} |")
    lines.append("| kv_leak | - | - | not injectable on the CPU engine: no sleep mode, and "
                 "no way to hold KV blocks with nothing running; covered by "
                 "tests/test_watchdog.py's scripted metrics | - | - | - | - |")
    caught = [f for f in run.faults if f.t0 and f.detected_by]
    windows = [(f.wall0, f.wall0 + (f.back_s or 600)) for f in run.faults if f.t0]
    in_b = [e for e in decisions if wall(e) >= a1]
    true = [e for e in in_b if any(lo - 1 <= wall(e) <= hi for lo, hi in windows)]
    stopped = [f for f in run.faults if f.kind != "core_sigkill" and f.t0]
    by_rule = sum(bool(f.detected_by and f.detected_by.startswith("`")) for f in stopped)
    lines += [
        "",
        f"Recall: {len(caught)} of {len([f for f in run.faults if f.t0])} faults detected "
        f"(a hang or stalled step by a policy decision: {by_rule} of {len(stopped)}; a "
        "SIGKILL is the process "
        f"watch's, not a decision). Precision in phase B: {len(true)} of {len(in_b)} "
        "decisions fell in a fault's window; phase A's decisions are all false (above). "
        "Detection: from the signal to the decision's (or the state change's) audit time; "
        "serving again: a new engine proven and the gate open. No stopped process was "
        "resumed (no SIGCONT): the daemon kills the stopped tree, and no process of it "
        "may remain. "
        f"Fault targets: {', '.join(sorted(set(PREFIX.values())))}.",
    ]
    for f in run.faults:
        if f.note or f.last_exit:
            lines.append(f"- {f.kind} at {f.at_s:.0f} s: last exit {f.last_exit!r}; "
                         f"restarts {f.restarts[0]} -> {f.restarts[1]}"
                         f"{'; ' + f.note if f.note else ''}")
    return lines


def _num(v: float | None) -> str:
    return "-" if v is None else f"{v:.3g}"


if __name__ == "__main__":
    sys.exit(main())
