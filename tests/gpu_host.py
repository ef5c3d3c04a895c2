"""A whole multi-GPU host under one daemon, for real (issue 52; docs/gpu-validation.md).

Not collected by pytest (no GPU in CI). On a lent machine of several GPUs, the staged vLLM
installed as for tests/gpu_vllm.py, each phase in its own call (the daemon lives on
between them in its own session; run long phases in the background and poll):

    python3 tests/gpu_host.py start     # one daemon, one engine per GPU (LAYOUT), each an
                                        # asymmetric pair (0.60 + a thin standby at 0.28,
                                        # asleep), routed by model name e0, e1, ...: from
                                        # nothing to every engine serving and every standby
                                        # armed, with what `status` showed meanwhile
    python3 tests/gpu_host.py throughput 2 512  # `vllm bench serve` against every engine
                                        # at once, 128 streams each, direct and through the
                                        # daemon, alternating, ROUNDS x PROMPTS: tokens/s,
                                        # the ratio, CPU of the daemon and its workers a token
    python3 tests/gpu_host.py faults 1200  # the same load through the daemon twice: no
                                        # fault, then a core SIGKILL on e0, a KV reset on
                                        # e1 and a `restart` of e2 in turn; every stream
                                        # counted on every engine, each engine's p99
                                        # inter-token latency against its no-fault run,
                                        # status and the exporter polled throughout
    python3 tests/gpu_host.py stop      # the daemon stopped: nothing left on any GPU
    python3 tests/gpu_host.py plan start throughput faults stop  # in order, across calls

LAYOUT: GPUs per engine, in order ("1,1,1,1": four engines on GPUs 0-3; "2,1,1": a TP=2
engine on GPUs 0-1 beside single-GPU engines on 2 and 3). Each engine `e<i>` serves the
model name `e<i>` on port 8100 + 2i (its standby on the next port). TP_ARGS: more flags
for the tensor-parallel engines (docs/gpu-validation.md, issue 52). INPUT_LEN: the
prompts' tokens (1024); PROXY_WORKERS: the front door's processes (8). The engines are
Llama-3.1-8B's shape with random weights (tests/gpu_shapes.py), compile on.

DRY=1: the same phases on a machine without a GPU, over the fake engine (tests/
fake_engine.py, a child titled VLLM::EngineCore, sleep mode) and no NVML: the harness's own
check before device time is spent on it (BENCH_PYTHON: a Python with vLLM's bench client).

Each phase prints `RESULT {json}` and appends it to $WORK/results.jsonl (and copies it to
$OUT); failures raise.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
# (both import tests.gpu_daemon, which puts the installed wheel before the checkout on
# sys.path, before anything here imports supervisor)
from tests import gpu_load, gpu_plane
from tests.gpu_daemon import (
    EXPORTER,
    MODEL,
    PROXY,
    ROOT,
    SUP_SITE,
    VLLM_SITE,
    WORK,
    call,
    core_of,
    ctl,
    engine_tree,
    result,
    running,
    running_at,
    wait,
)
from tests.gpu_load import cost_row

LAYOUT = [int(x) for x in os.environ.get("LAYOUT", "1,1,1,1").split(",")]
INPUT_LEN = int(os.environ.get("INPUT_LEN", "1024"))
WORKERS = int(os.environ.get("PROXY_WORKERS", "8"))
DRY = os.environ.get("DRY") == "1"
BENCH_PYTHON = os.environ.get("BENCH_PYTHON", sys.executable)
TOKENIZER = str(ROOT / "models" / "tiny-llama") if DRY else MODEL
CONC, WANT = 128, 256
FAULTS = ("kill", "kvreset", "restart")  # e0, e1, e2 in turn


def names() -> list[str]:
    return [f"e{i}" for i in range(len(LAYOUT))]


def gpus_of() -> dict[str, list[int]]:
    out, first = {}, 0
    for name, n in zip(names(), LAYOUT, strict=True):
        out[name] = list(range(first, first + n))
        first += n
    return out


def host_status() -> dict[str, dict[str, Any]]:
    """Each engine's own status, by name (the host's answer has them under `detail`)."""
    st = dict(call(str(WORK / "control.sock"), "status", {}, timeout_s=10))
    return dict(st["detail"]) if "detail" in st else {st["engine_name"]: st}


def armed(st: dict[str, Any]) -> bool:
    """One engine serving and protected (gpu_daemon.protected_again, for one engine of many)."""
    sb = st.get("standby") or {}
    return bool(st.get("state") == "RUNNING" and sb.get("state") == "ready"
                and sb.get("protected") and not sb.get("thin_serves")
                and (st.get("admission") or {}).get("held") is None)


def engine_config(i: int, name: str, gpus: list[int]) -> dict[str, Any]:
    port = 8100 + 2 * i
    common = {"host": "127.0.0.1", "port": port, "standby": "sleep", "drain": "continue",
              "standby_args": ["--gpu-memory-utilization", "0.28"]}
    if DRY:
        fake = ROOT / "tests" / "fake_engine.py"
        return {**common, "command": [sys.executable, str(fake), "--child",
                                      "--enable-sleep-mode", "--token-delay", "0.02"],
                "args": ["--served-model-name", name, "--gpu-memory-utilization", "0.60",
                         "--kv-tokens", "100000"],
                "env": {"VLLM_SERVER_DEV_MODE": "1"}, "startup_timeout_s": 60.0,
                "drain_timeout_s": 10.0}
    args = ["--served-model-name", name, "--load-format", "dummy", "--dtype", "bfloat16",
            "--max-model-len", os.environ.get("MAX_MODEL_LEN", "2048"),
            "--enable-sleep-mode", "--gpu-memory-utilization", "0.60"]
    if len(gpus) > 1:  # TP_ARGS: more flags for these (the first run's TP=2 engine failed
        # in vLLM's custom all-reduce, probably: "--disable-custom-all-reduce" is the next try)
        args += ["--tensor-parallel-size", str(len(gpus)), *os.environ.get("TP_ARGS", "").split()]
    return {**common, "command": [sys.executable, "-m", "vllm.entrypoints.cli.main", "serve",
                                  MODEL],
            "args": args, "env": {"PYTHONPATH": VLLM_SITE, "VLLM_SERVER_DEV_MODE": "1"},
            "gpus": gpus, "gpu_foreign_allowance_mib": 0, "gpu_release_timeout_s": 60,
            # four engines compiling at once, then four thin standbys
            "startup_timeout_s": 900.0, "drain_timeout_s": 20.0}


def host_config() -> Path:
    from tests.gpu_shapes import ensure_m8b
    from tests.harness import write_config

    if not DRY:
        ensure_m8b(Path(MODEL))
    sections: dict[str, dict[str, Any]] = {
        f"engines.{n}": engine_config(i, n, g) for i, (n, g) in enumerate(gpus_of().items())}
    sections.update({
        "control": {"socket": str(WORK / "control.sock")},
        "daemon": {"runtime_dir": str(WORK)},
        "audit": {"path": str(WORK / "events.jsonl")},
        "log": {"format": "json", "level": "info"},
        "canary": {"period_s": 2.0, "timeout_s": 5.0},
        "gpu": {"sampler": "off" if DRY else "nvml"},
        "exporter": {"listen": EXPORTER},
        "policy": {"max_restarts_per_hour": 20, "min_action_gap_s": 10},
        "proxy": {"listen": PROXY, "max_concurrency": 256, "hold_timeout_s": 300,
                  "workers": WORKERS}})
    return write_config(WORK / "config.toml", sections)


class HostTimeline:
    """`status` every 0.5 s and the exporter every 1 s from a moment: each engine's changes
    (state, pid, standby state and pid, thin one serving, protected, requests held) with
    their times, the polls the daemon did not answer or answered without an engine, and
    how long the exporter disagreed with `status` on an engine's state or its standby
    being armed."""

    def __init__(self, t0: float) -> None:
        self.t0 = t0
        self.changes: dict[str, list[dict[str, Any]]] = {n: [] for n in names()}
        self.armed_at: dict[str, list[float]] = {n: [] for n in names()}
        self.missing = self.unanswered = self.polls = 0
        self.disagree: dict[str, float] = {}
        self._since: dict[str, float] = {}  # each disagreement still open: since when
        self.last: dict[str, dict[str, Any]] = {}
        self.stop = threading.Event()
        self.threads = [threading.Thread(target=self._status, daemon=True),
                        threading.Thread(target=self._exporter, daemon=True)]
        for t in self.threads:
            t.start()

    def _status(self) -> None:
        seen: dict[str, Any] = {}
        was_armed: dict[str, bool] = {}
        while not self.stop.is_set():
            self.polls += 1
            try:
                detail = host_status()
            except Exception:
                self.unanswered += 1
                time.sleep(0.5)
                continue
            now = time.monotonic() - self.t0
            self.last = detail
            for n in names():
                st = detail.get(n)
                if st is None:
                    self.missing += 1
                    continue
                sb = st.get("standby") or {}
                key = (st.get("state"), st.get("pid"), sb.get("state"), sb.get("pid"),
                       sb.get("thin_serves"), sb.get("protected"),
                       (st.get("admission") or {}).get("held"))
                if key != seen.get(n):
                    seen[n] = key
                    self.changes[n].append(dict(zip(
                        ("state", "pid", "standby", "standby_pid", "thin_serves",
                         "protected", "held"), key, strict=True), t=round(now, 2)))
                a = armed(st)
                if a and not was_armed.get(n):
                    self.armed_at[n].append(round(now, 2))
                was_armed[n] = a
            time.sleep(0.5)

    def _exporter(self) -> None:
        since = self._since
        while not self.stop.is_set():
            try:
                text = urllib.request.urlopen(f"http://{EXPORTER}/metrics",
                                              timeout=5).read().decode()
            except Exception:
                time.sleep(1.0)
                continue
            now = time.monotonic()
            for n in names():
                st = self.last.get(n)
                if st is None:
                    continue
                state_1 = f'vllm_supervisor_engine_state{{engine="{n}",state="{st["state"]}"}} 1'
                ready = (st.get("standby") or {}).get("state") == "ready"
                sb_1 = f'vllm_supervisor_standby_ready{{engine="{n}"}} {1.0 if ready else 0.0}'
                agrees = state_1 in text and sb_1 in text
                if agrees:
                    if n in since:
                        self.disagree[n] = max(self.disagree.get(n, 0.0), now - since.pop(n))
                else:
                    since.setdefault(n, now)
            time.sleep(1.0)

    def end(self) -> dict[str, Any]:
        self.stop.set()
        for t in self.threads:
            t.join(10)
        now = time.monotonic()
        for n, t0 in self._since.items():  # (still disagreeing at the end counts too)
            self.disagree[n] = max(self.disagree.get(n, 0.0), now - t0)
        return {"changes": self.changes, "armed_at_s": self.armed_at, "polls": self.polls,
                "unanswered": self.unanswered, "engine_missing": self.missing,
                "exporter_longest_disagreement_s": {k: round(v, 1)
                                                    for k, v in self.disagree.items()}}


def gpu_memory() -> dict[str, Any]:
    """Per GPU: each process's MiB (NVML)."""
    if DRY:
        return {}
    import pynvml

    pynvml.nvmlInit()
    try:
        out = {}
        for i in range(pynvml.nvmlDeviceGetCount()):
            h = pynvml.nvmlDeviceGetHandleByIndex(i)
            out[str(i)] = {str(p.pid): round((p.usedGpuMemory or 0) / 2**20)
                           for p in pynvml.nvmlDeviceGetComputeRunningProcesses(h)}
        return out
    finally:
        pynvml.nvmlShutdown()


def phase_start() -> None:
    WORK.mkdir(parents=True, exist_ok=True)
    cfg = host_config()
    t0 = time.monotonic()
    subprocess.Popen([sys.executable, "-m", "supervisor", "run", "--config", str(cfg)],
                     stdout=(WORK / "daemon.log").open("ab"), stderr=subprocess.STDOUT,
                     env={**os.environ, "PYTHONPATH": SUP_SITE}, cwd=str(WORK),
                     start_new_session=True)
    wait(lambda: (WORK / "control.sock").exists() and host_status(), 120, "the daemon")
    tl = HostTimeline(t0)
    shown: list[dict[str, Any]] = []  # what `status` showed, every 15 s
    next_shot = 0.0
    deadline = t0 + 1500
    while True:
        detail = tl.last
        if time.monotonic() >= next_shot:
            next_shot = time.monotonic() + 15
            r = ctl("status")
            shown.append({"t": round(time.monotonic() - t0, 1),
                          "lines": [x for x in r.stdout.splitlines() if x.strip()][:12]})
        if len(detail) == len(LAYOUT) and all(armed(s) for s in detail.values()):
            break
        if time.monotonic() > deadline:
            tl.end()
            raise AssertionError(f"not every engine armed after 1500 s: {tl.changes}")
        time.sleep(1.0)
    ready_s = time.monotonic() - t0
    line = tl.end()
    detail = host_status()
    serving = {n: next((c["t"] for c in line["changes"][n] if c["state"] == "RUNNING"), None)
               for n in names()}
    result("host-start", layout=LAYOUT, gpus=gpus_of(), workers=WORKERS,
           every_engine_armed_s=round(ready_s, 1), serving_s=serving,
           armed_s={n: v[0] if v else None for n, v in line["armed_at_s"].items()},
           kv_tokens={n: (s.get("engine") or {}).get("kv_tokens") or s.get("kv_tokens")
                      for n, s in detail.items()},
           standby={n: s.get("standby") for n, s in detail.items()},
           status_meanwhile=shown, changes=line["changes"], gpu_memory_mib=gpu_memory(),
           gpu_signals={n: {k: v for k, v in (s.get("signals") or {}).items()
                            if k.startswith(("gpu_", "engine_gpu"))}
                        for n, s in detail.items()})


def addr_of(st: dict[str, Any]) -> str:
    e = st["engine"]
    return f"{e['host']}:{e['port']}"


def bench(base: str, model: str, prompts: int, tag: str) -> dict[str, Any]:
    """vLLM's own benchmark client at 128 streams of INPUT_LEN random tokens and 256 out,
    against one model; its saved detailed JSON (its output in WORK/TAG.log)."""
    return gpu_load.bench(base, CONC, prompts, tag, detailed=True, timeout=900,
                          input_len=INPUT_LEN, model=model, tokenizer=TOKENIZER,
                          python=BENCH_PYTHON, env=dict(os.environ) if DRY else None)


def bench_all(bases: dict[str, str], prompts: int, tag: str) -> dict[str, dict[str, Any]]:
    """One bench client per engine, all at once; each one's result by engine name."""
    docs: dict[str, dict[str, Any]] = {}
    errors: dict[str, str] = {}

    def one(n: str) -> None:
        try:
            docs[n] = bench(bases[n], n, prompts, f"{tag}-{n}")
        except Exception as exc:  # recorded, raised below
            errors[n] = repr(exc)[-1500:]

    threads = [threading.Thread(target=one, args=(n,), daemon=True) for n in bases]
    for t in threads:
        t.start()
    for t in threads:
        t.join(960)
    if errors:
        raise AssertionError(f"{tag}: {errors}")
    return docs


def front_procs() -> list[psutil.Process]:
    """The daemon's process and its proxy workers (not its engines)."""
    return gpu_plane.front_procs(next(iter(host_status().values()))["daemon_pid"])


def counted(doc: dict[str, Any], prompts: int) -> dict[str, Any]:
    lens = doc.get("output_lens") or []
    worst = [max(x) for x in doc.get("itls") or [] if x]
    return {"completed": doc.get("completed"), "failed": prompts - int(doc.get("completed") or 0),
            "short": len([n for n in lens if n < WANT]),
            "errors": sorted({e for e in doc.get("errors") or [] if e})[:3],
            "output_tokens_per_s": round(float(doc.get("output_throughput") or 0), 1),
            "p99_itl_ms": round(float(doc.get("p99_itl_ms") or 0), 2),
            "median_itl_ms": round(float(doc.get("median_itl_ms") or 0), 2),
            "p99_ttft_ms": round(float(doc.get("p99_ttft_ms") or 0), 1),
            "longest_gap_s": round(max(worst), 3) if worst else None}


def phase_throughput(rounds: int = 2, prompts: int = 512) -> None:
    """Every engine at once, direct and through the daemon, alternating (the order turns
    each round): the host's output tokens/s on each path, their ratio, and the front
    door's CPU (the daemon and its workers) per output token."""
    detail = host_status()
    paths = {"direct": {n: addr_of(s) for n, s in detail.items()},
             "daemon": {n: PROXY for n in detail}}
    procs = front_procs()
    rows: dict[str, list[dict[str, Any]]] = {"direct": [], "daemon": []}
    for i in range(rounds):
        for path in (["direct", "daemon"] if i % 2 == 0 else ["daemon", "direct"]):
            c0, t0 = gpu_plane.cpu_s(procs), time.monotonic()
            docs = bench_all(paths[path], prompts, f"host-{path}-{i}")
            c1, t1 = gpu_plane.cpu_s(procs), time.monotonic()
            tokens = sum(int(d.get("total_output_tokens") or 0) for d in docs.values())
            per = {n: counted(d, prompts) for n, d in docs.items()}
            rows[path].append({
                "output_tokens_per_s": round(sum(p["output_tokens_per_s"]
                                                 for p in per.values()), 1),
                "wall_s": round(t1 - t0, 1), "tokens": tokens,
                "failed": sum(p["failed"] for p in per.values()),
                "short": sum(p["short"] for p in per.values()),
                "front_cpu_us_per_token": round((c1 - c0) / max(1, tokens) * 1e6, 2)
                if path == "daemon" else None,
                "front_cpu_cores": round((c1 - c0) / (t1 - t0), 2) if path == "daemon"
                else None, "engines": per})
            print(path, i, {k: v for k, v in rows[path][-1].items() if k != "engines"},
                  flush=True)
    ratios = [round(d["output_tokens_per_s"] / r["output_tokens_per_s"], 3)
              for d, r in zip(rows["daemon"], rows["direct"], strict=True)]
    per_engine = {n: [round(d["engines"][n]["output_tokens_per_s"]
                            / r["engines"][n]["output_tokens_per_s"], 3)
                      for d, r in zip(rows["daemon"], rows["direct"], strict=True)]
                  for n in detail}
    result("host-throughput", rounds=rounds, prompts=prompts, input_len=INPUT_LEN,
           concurrency=CONC, workers=WORKERS, ratios=ratios, per_engine_ratios=per_engine,
           rows=rows)
    assert all(r["failed"] == 0 and r["short"] == 0 for v in rows.values() for r in v)


def phase_faults(prompts: int = 1200) -> None:
    """The same load through the daemon on every engine twice: no fault, then a core
    SIGKILL on e0 (5 s after it runs >= 64 streams), a KV reset on e1 (10 s after e0
    serves again) and a `restart` of e2 (15 s after that), with status and the exporter
    polled throughout. Every stream of every engine counted; each engine's p99
    inter-token latency against its own no-fault run."""
    detail = host_status()
    bases = {n: PROXY for n in detail}
    base = bench_all(bases, prompts, "host-none")
    wait(lambda: all(armed(s) for s in host_status().values()), 300, "every engine armed")
    detail = host_status()
    targets = dict(zip(names(), FAULTS, strict=False))
    fired: dict[str, dict[str, Any]] = {}
    t_ref = time.monotonic()
    tl = HostTimeline(t_ref)
    events_at = len((WORK / "events.jsonl").read_text().splitlines())

    def faults() -> None:
        for n in names():
            wait(lambda n=n: b"Starting main benchmark run"
                 in (WORK / f"host-faults-{n}.log").read_bytes(), 300, f"{n}'s main run")
        first = names()[0]
        wait(lambda: running_at(addr_of(detail[first]), 5.0) >= 64, 300, "64 running at e0")
        time.sleep(5.0)
        for n, fault in targets.items():
            st = host_status()[n]
            fired[n] = {"fault": fault, "t": time.monotonic(), "pid": st["pid"],
                        "running": running_at(addr_of(st), 5.0)}
            if fault == "kill":
                core_of(st["pid"]).send_signal(signal.SIGKILL)
                wait(lambda n=n, pid=st["pid"]: host_status()[n]["state"] == "RUNNING"
                     and host_status()[n]["pid"] != pid, 120, f"{n} serving again")
                time.sleep(10.0)
            else:
                cmd = ("kv-reset",) if fault == "kvreset" else ("restart", "--reason",
                                                                "host test")
                holder: dict[str, Any] = fired[n]

                def run(cmd: tuple[str, ...] = cmd, holder: dict[str, Any] = holder,
                        n: str = n) -> None:
                    r = ctl(*cmd, "--engine", n)
                    holder.update(rc=r.returncode, out=(r.stdout + r.stderr).strip()[-300:],
                                  took_s=round(time.monotonic() - holder["t"], 2))

                threading.Thread(target=run, daemon=True).start()
                time.sleep(15.0)

    watcher = threading.Thread(target=faults, daemon=True)
    watcher.start()
    docs = bench_all(bases, prompts, "host-faults")
    watcher.join(60)
    def armed_again() -> bool:
        """Every engine armed in the timeline's own last look, and each one a kill or a
        restart hit seen armed again after it (a wait on a status of its own could end
        before the timeline saw the last change: issue 52's first run)."""
        return all(armed(tl.last.get(n) or {}) for n in names()) and all(
            any(t > f["t"] - t_ref for t in tl.armed_at[n]) for n, f in fired.items()
            if f["fault"] != "kvreset")  # (a KV reset's hold may fall between two looks)

    wait(armed_again, 600, "every engine armed again")
    line = tl.end()
    audit = [json.loads(x) for x in
             (WORK / "events.jsonl").read_text().splitlines()[events_at:] if x.strip()]
    rows = {}
    for n in names():
        f = fired.get(n, {})
        before, after = counted(base[n], prompts), counted(docs[n], prompts)
        armed_again = [t for t in line["armed_at_s"][n] if f and t > f["t"] - t_ref]
        rows[n] = {"fault": f.get("fault", "none"), "no_fault": before, "fault_run": after,
                   "p99_itl_ratio": round(after["p99_itl_ms"] / before["p99_itl_ms"], 3)
                   if before["p99_itl_ms"] else None,
                   "gap_added_s": round(after["longest_gap_s"] - before["longest_gap_s"], 3)
                   if after["longest_gap_s"] is not None
                   and before["longest_gap_s"] is not None else None,
                   "cost": cost_row(docs[n], f.get("t")) if f else None,
                   "fired": {k: v for k, v in f.items() if k != "t"} | (
                       {"at_s": round(f["t"] - t_ref, 2)} if f else {}),
                   "armed_again_after_s": round(armed_again[0] - (f["t"] - t_ref), 1)
                   if armed_again else None,
                   "audit": [{k: e.get(k) for k in ("time", "event", "reason", "seconds",
                                                    "generation")}
                             for e in audit if e.get("engine") == n][:40]}
    result("host-faults", prompts=prompts, input_len=INPUT_LEN, concurrency=CONC,
           engines=rows, status=line)
    for n, row in rows.items():
        assert row["fault_run"]["failed"] == 0 and row["fault_run"]["short"] == 0, (n, row)
        assert row["no_fault"]["failed"] == 0 and row["no_fault"]["short"] == 0, (n, row)
    assert line["unanswered"] == 0 and line["engine_missing"] == 0, line


def phase_stop() -> None:
    detail = host_status()
    pids = {p.pid for s in detail.values() for pid in (s.get("pid"),
                                                       (s.get("standby") or {}).get("pid"))
            if pid for p in engine_tree(pid)}
    daemon = next(iter(detail.values()))["daemon_pid"]
    t0 = time.monotonic()
    r = ctl("stop", timeout=900)
    took = time.monotonic() - t0
    wait(lambda: not running(daemon), 60, "the daemon gone")
    left = gpu_memory()
    alive = sorted(p for p in pids if running(p))
    result("host-stop", rc=r.returncode, out=r.stdout.strip()[-300:], seconds=round(took, 1),
           engine_processes=len(pids), alive=alive, gpu_processes_left=left)
    assert r.returncode == 0 and not alive and not any(left.values()), (alive, left)


def phase_plan(steps: list[str]) -> None:
    """The steps in order; a step done (in WORK/plan-done) is not run again."""
    done_path = WORK / "plan-done"
    WORK.mkdir(parents=True, exist_ok=True)
    done = done_path.read_text().split() if done_path.exists() else []
    for step in steps:
        if step in done:
            continue
        t0 = time.monotonic()
        run_step(step.split(":"))
        done.append(step)
        done_path.write_text("\n".join(done))
        result("host-plan-step", step=step, seconds=round(time.monotonic() - t0, 1))


def run_step(argv: list[str]) -> None:
    name, rest = argv[0], [int(x) for x in argv[1:]]
    {"start": phase_start, "throughput": phase_throughput, "faults": phase_faults,
     "stop": phase_stop}[name](*rest)


if __name__ == "__main__":
    if sys.argv[1] == "plan":
        phase_plan(sys.argv[2:])
    else:
        run_step(sys.argv[1:])
