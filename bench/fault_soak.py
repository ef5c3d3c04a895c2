"""A bounded fault soak: steady streaming load through the proxy, a fault every minute.

The daemon (proxy on, `engine.drain = "continue"`) supervises the real vLLM CPU engine.
Streaming clients keep sending greedy completions and chats through the proxy; about
every `--every` seconds (jittered, seeded) one fault arrives, in turn from: SIGKILL of
`VLLM::EngineCore`, SIGSTOP of it (the watchdog decides and kills), SIGKILL of the API
server, a drained restart (`restart`), a KV reset (`kv-reset`, where the engine supports
it), a reload (`reload`, the same file). Every stream is checked as its client saw it:
complete ([DONE], finish_reason "length", usage equal to max_tokens), failed (an HTTP
error, an error event, an exception) or truncated (ended cleanly but short: the one
thing that must never happen). Also counted: the proxy's continuations by outcome,
orphans (processes of an earlier engine tree still alive 30 s after it was replaced),
and the daemon's RSS every 10 s.

    .venv/bin/python bench/fault_soak.py --minutes 15 --out docs/benchmarks.md
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import sys
import tempfile
import threading
import time
from collections import Counter
from datetime import datetime
from pathlib import Path
from typing import Any

import httpx
import psutil
from prometheus_client.parser import text_string_to_metric_families

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.report import write_section  # noqa: E402
from tests.harness import Daemon, free_port, wait_for  # noqa: E402
from tests.test_e2e_vllm import START_TIMEOUT, tree, vllm_config  # noqa: E402

FAULTS = ("core_sigkill", "core_sigstop", "api_sigkill", "drained_restart", "kv_reset",
          "reload")
TOKENS = 96


class Load:
    """Streaming clients through the proxy; each stream's outcome counted."""

    def __init__(self, proxy: str, clients: int) -> None:
        self.proxy, self.clients = proxy, clients
        self.outcomes: Counter[str] = Counter()
        self.errors: Counter[str] = Counter()
        self.stop = threading.Event()
        self.lock = threading.Lock()
        self.threads = [threading.Thread(target=self._client, args=(i,), daemon=True)
                        for i in range(clients)]

    def start(self) -> None:
        for t in self.threads:
            t.start()

    def join(self) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(400)

    def _client(self, i: int) -> None:
        n = 0
        while not self.stop.is_set():
            n += 1
            chat = (i + n) % 3 == 0
            outcome, why = self._one(chat, f"client {i} request {n}")
            with self.lock:
                self.outcomes[outcome] += 1
                if why:
                    self.errors[why[:120]] += 1

    def _one(self, chat: bool, prompt: str) -> tuple[str, str | None]:
        body: dict[str, Any] = {"model": "tiny-llama", "max_tokens": TOKENS,
                                "temperature": 0, "ignore_eos": True, "stream": True,
                                "stream_options": {"include_usage": True}}
        if chat:
            body["messages"] = [{"role": "user", "content": prompt}]
        else:
            body["prompt"] = prompt
        path = "/v1/chat/completions" if chat else "/v1/completions"
        done, usage, finish, error = False, None, None, None
        try:
            with httpx.stream("POST", f"http://{self.proxy}{path}", json=body,
                              timeout=600) as r:
                if r.status_code != 200:
                    return "failed", f"HTTP {r.status_code}"
                buf = ""
                for text in r.iter_text():
                    buf += text
                    *lines, buf = buf.split("\n")
                    for line in lines:
                        if not line.startswith("data: "):
                            continue
                        if line == "data: [DONE]":
                            done = True
                            continue
                        doc = json.loads(line[6:])
                        if "error" in doc:
                            error = doc["error"].get("message", "error event")
                        usage = doc.get("usage") or usage
                        for c in doc.get("choices") or ():
                            finish = c.get("finish_reason") or finish
        except Exception as exc:  # counted
            return "failed", type(exc).__name__
        if error is not None:
            return "failed", f"error event: {error}"
        if done and finish == "length" and usage and usage["completion_tokens"] == TOKENS:
            return "complete", None
        return "truncated", f"done={done} finish={finish} usage={usage}"


def metrics(listen: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    text = httpx.get(f"http://{listen}/metrics", timeout=10).text
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def inject(d: Daemon, fault: str) -> str:
    """One fault; what was done, in words."""
    st = d.status()
    pid = st["pid"]
    procs = tree(pid) if pid else []
    core = next((p for p in procs if p.name().startswith("VLLM::EngineCor")), None)
    if fault == "core_sigkill" and core is not None:
        core.send_signal(signal.SIGKILL)
    elif fault == "core_sigstop" and core is not None:
        core.suspend()  # the watchdog decides (no progress) and kills the tree
    elif fault == "api_sigkill" and pid:
        os.kill(pid, signal.SIGKILL)
    elif fault == "drained_restart":
        return f"restart: rc {d.ctl('restart', timeout=120).returncode}"
    elif fault == "kv_reset":
        r = d.ctl("kv-reset", timeout=120)
        return f"kv-reset: rc {r.returncode} {r.stdout.strip()[:80]}"
    elif fault == "reload":
        return f"reload: rc {d.ctl('reload', timeout=60).returncode}"
    else:
        return f"{fault}: no target (engine not running)"
    return fault


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--minutes", type=float, default=15.0)
    ap.add_argument("--every", type=float, default=60.0, help="seconds between faults")
    ap.add_argument("--clients", type=int, default=6)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    rnd = random.Random(a.seed)
    tmp = Path(tempfile.mkdtemp(prefix="vs-fault-soak-"))
    cfg: dict[str, Any] = vllm_config(tmp)
    cfg["proxy"] = {"enabled": True, "listen": f"127.0.0.1:{free_port()}",
                    "hold_timeout_s": 300.0}
    cfg["engine"]["drain"] = "continue"
    cfg["engine"]["drain_timeout_s"] = 20.0
    cfg["engine"]["env"]["VLLM_SERVER_DEV_MODE"] = "1"  # the KV reset's route
    d = Daemon(tmp, cfg)
    seen: dict[int, float] = {}  # engine pid -> when its tree was replaced (or 0)
    trees: dict[int, list[int]] = {}
    rss: list[float] = []
    log: list[str] = []
    load = Load(cfg["proxy"]["listen"], a.clients)
    t_start = time.monotonic()
    try:
        d.wait_state("RUNNING", START_TIMEOUT)
        wait_for(lambda: d.status()["admission"]["held"] is None, 120, "the gate to open")
        daemon_proc = psutil.Process(d.proc.pid)
        load.start()
        end = time.monotonic() + a.minutes * 60
        next_fault = time.monotonic() + a.every * rnd.uniform(0.5, 1.0)
        next_sample = time.monotonic()
        order = list(FAULTS)
        rnd.shuffle(order)
        k = 0
        while time.monotonic() < end:
            now = time.monotonic()
            if now >= next_sample:
                rss.append(daemon_proc.memory_info().rss / 2**20)
                st = d.status()
                if st["pid"] and st["pid"] not in trees:
                    for old in trees:
                        seen.setdefault(old, now)
                    trees[st["pid"]] = [p.pid for p in tree(st["pid"])]
                next_sample = now + 10
            if now >= next_fault:
                fault = order[k % len(order)]
                k += 1
                what = inject(d, fault)
                log.append(f"{now - t_start:6.0f} s  {what}")
                print(log[-1], flush=True)
                next_fault = now + a.every * rnd.uniform(0.75, 1.25)
            time.sleep(0.5)
        load.join()
        d.wait_state("RUNNING", START_TIMEOUT)
        time.sleep(30)  # the last replaced tree's grace
        current = d.status()["pid"]
        orphans = [p for old, pids in trees.items() if old != current for p in pids
                   if psutil.pid_exists(p) and psutil.Process(p).status() != "zombie"]
        m = metrics(cfg["exporter"]["listen"])
        st = d.status()
    finally:
        load.stop.set()
        d.close()
    cont = {k[1][0][1]: int(v) for k, v in m.items()
            if k[0] == "vllm_supervisor_proxy_continuations_total" and v}
    refusals = {k[1][0][1]: int(v) for k, v in m.items()
                if k[0] == "vllm_supervisor_proxy_continuation_refusals_total" and v}
    gap_n = sum(v for k, v in m.items()
                if k[0] == "vllm_supervisor_client_continuation_gap_seconds_count")
    gap_sum = sum(v for k, v in m.items()
                  if k[0] == "vllm_supervisor_client_continuation_gap_seconds_sum")
    total = sum(load.outcomes.values())
    result = {
        "minutes": a.minutes, "faults": len(log), "streams": total,
        "complete": load.outcomes["complete"], "failed": load.outcomes["failed"],
        "truncated": load.outcomes["truncated"], "continuations": cont,
        "refusals": refusals, "mean_gap_s": round(gap_sum / gap_n, 2) if gap_n else None,
        "restarts": st["restarts"], "orphans": len(orphans),
        "daemon_rss_mib": [round(x, 1) for x in rss[:: max(1, len(rss) // 8)]],
        "errors": dict(load.errors.most_common(5))}
    print(json.dumps(result, indent=1))
    if a.out:
        stamp = datetime.now().strftime("%Y-%m-%d %H:%M")
        text = "\n".join([
            "## Fault soak (`make soak`)", "",
            f"{stamp}; {a.minutes:g} min, {a.clients} streaming clients (greedy "
            f"completions and chats of {TOKENS} tokens) through the proxy to the real vLLM "
            f"CPU engine with `engine.drain = \"continue\"`; a fault about every "
            f"{a.every:g} s, in turn from {', '.join(FAULTS)} (seed {a.seed}).", "",
            "| streams | complete | failed | truncated | continuations | restarts | "
            "orphans | daemon RSS MiB (start → end) |",
            "|---|---|---|---|---|---|---|---|",
            f"| {total} | {result['complete']} | {result['failed']} | "
            f"{result['truncated']} | "
            f"{', '.join(f'{k} {v}' for k, v in cont.items()) or '0'} | "
            f"{st['restarts']} | {len(orphans)} | "
            f"{rss[0]:.0f} → {rss[-1]:.0f} (max {max(rss):.0f}) |", "",
            f"Mean gap a continued stream's client saw: {result['mean_gap_s']} s. "
            f"Refused continuations: {refusals or 'none'}. "
            f"Errors seen by clients: {result['errors'] or 'none'}.", "",
            "Faults:", "", "```", *log, "```"])
        write_section(Path(a.out), "fault-soak", text)
    return 0 if result["failed"] == 0 and result["truncated"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
