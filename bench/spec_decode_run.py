"""Speculative decoding for real: the acceptance rules on the vLLM CPU engine (issue 24).

The daemon, with the front proxy, supervises the real vLLM CPU engine started with n-gram
speculation (`--speculative-config {"method": "ngram", "num_speculative_tokens": 3,
"prompt_lookup_max": 5, "prompt_lookup_min": 1}`, no draft model). Two workloads through
the proxy, one after the other, with no pause between them:

- **good**: greedy decoding (temperature 0, `ignore_eos`) of prompts that repeat a short
  phrase. The tiny model's random weights make greedy output fall into a loop within a
  few dozen tokens, and a loop is exactly what an n-gram lookup predicts: most drafts
  are accepted. (That is the property n-gram speculation has with real models on
  outputs that copy their context: code edits, extraction, summaries that quote.)
- **bad**: sampling at temperature 1 over random words. The random model's next-token
  distribution is close to uniform over its 512 tokens, so a drafted token is almost
  never the one sampled. `prompt_lookup_min = 1` makes the lookup find a (one-token)
  match and draft after nearly every step, so drafts are made, and rejected.

The rules are the shipped ones (`spec_decode_high`: acceptance > 0.75, one speculative
token more, up to `policy.spec_tokens_max`; `spec_decode_low`: < 0.4, one fewer), with
their thresholds unchanged and their times shortened so that a run takes minutes, not
the defaults' 10-minute streaks (see `config()`: the acceptance over a 20 s window, at
least 64 drafted tokens in it, held 15 s). Per mode (`standby = "awake"`: the relaunch
is a swap to a standby started with the new count; `standby = "none"`: a drained cold
relaunch), the run:

1. starts the daemon and waits for the engine to serve (awake: its standby is then
   still starting; `--wait-standby` waits for it to be proven before each workload);
2. sends the good workload until the daemon decides `more_spec_tokens` (3 -> 4) and the
   engine serving afterwards runs 4, then keeps it going `--settle-s` on that engine;
3. switches to the bad workload until the daemon decides `fewer_spec_tokens` (4 -> 3)
   and the engine serving afterwards runs 3, and keeps it going a little on that one.

Awake, each decision finds the standby still starting (the one beside the first engine,
then the one started after the first swap): it is retired and one with the new count
started, so each relaunch waits for one standby start either way.

Recorded: the acceptance per workload and per number of speculative tokens, from the
engine's own counters (`vllm:spec_decode_num_accepted_tokens_total` over
`vllm:spec_decode_num_draft_tokens_total`, scraped every second from the serving engine)
and as the daemon saw it (`status --json` signals, the decision's evidence); each
decision with its time (the audit trail, `vllm-supervisorctl events --json`); the time
from the workload change to the decision; the relaunch time (from the decision to the
engine with the new count serving: the daemon's own `remedy` entry, and as polled), and
what clients saw meanwhile (the longest stretch with no request completed, the slowest
request, failures); `num_speculative_tokens` before and after, read back from the running
engine's argv and from the engine's own start line (`num_spec_tokens=N`).

Loopback only; the daemon runs in its own session and is stopped through its control
socket, then by its pid and process group; only engine processes of its trees are ever
killed, by pid, and only if they outlive it. Every wait is bounded, the whole run by
`--deadline-min`.

    .venv/bin/python bench/spec_decode_run.py --out docs/benchmarks.md
    .venv/bin/python bench/spec_decode_run.py --report-from run.json --out docs/benchmarks.md

(`make bench-spec-decode`; about 10 minutes on two shared cores, bounded to 25.)
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import random
import re
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

import httpx
import psutil

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.report import write_section  # noqa: E402
from bench.runs import Clock, TreeLedger  # noqa: E402
from tests.harness import Daemon, free_port, wait_for  # noqa: E402

MODES = ("awake", "none")
MODEL_NAME = "tiny-llama"
START_TIMEOUT = 300.0
_WORDS = ("the of and to in is you that it he was for on are as with his they at be this "
         "have from or one had by word but not what all were we when your can said there "
         "use an each which she do how their if will up other about out many then them "
         "these so some her would make like him into time has look two more write go see "
         "number no way could people my than first water been call who oil its now find "
         "long down day did get come made may part")
WORDS = _WORDS.split()
DRAFTED = "vllm:spec_decode_num_draft_tokens_total"
ACCEPTED = "vllm:spec_decode_num_accepted_tokens_total"


def spec_config(k: int) -> str:
    return json.dumps({"method": "ngram", "num_speculative_tokens": k,
                       "prompt_lookup_max": 5, "prompt_lookup_min": 1})


def config(tmp: Path, a: argparse.Namespace, mode: str) -> dict[str, dict[str, Any]]:
    venv, model = Path(a.engine_venv), Path(a.model)
    port = free_port()
    engine: dict[str, Any] = {
        "command": [str(venv / "bin" / "vllm"), "serve", str(model)],
        "args": ["--served-model-name", MODEL_NAME, "--max-model-len", "512",
                 "--dtype", "float32", "--speculative-config", spec_config(a.k)],
        # two engines on two cores in the standby's case: no pinning, one compute thread
        # each (tests/test_e2e_standby.py); the same in both modes
        "env": {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": "nobind",
                "OMP_NUM_THREADS": "1"},
        "port": port, "startup_timeout_s": START_TIMEOUT, "drain_timeout_s": 10.0,
        "stop_grace_s": 15.0, "reap_timeout_s": 15.0, "health_interval_s": 0.25,
        "standby": mode,
    }
    if mode != "none":
        while (spare := free_port()) == port:
            pass
        engine["standby_port"] = spare
    return {
        "engine": engine,
        "daemon": {"runtime_dir": tempfile.mkdtemp(prefix="vs-", dir="/tmp")},
        "audit": {"path": str(tmp / "events.jsonl")},
        "log": {"format": "json", "level": "info"},
        "exporter": {"listen": f"127.0.0.1:{free_port()}"},
        "gpu": {"sampler": "off"},
        "proxy": {"enabled": True, "listen": f"127.0.0.1:{free_port()}",
                  "hold_timeout_s": 300.0},
        "canary": {"period_s": 5.0, "timeout_s": 10.0},
        "metrics": {"period_s": 1.0},
        # the acceptance over 20 s (known once 10 s are covered), at least 64 drafted
        # tokens in it (defaults: 60 s, 256)
        "signals": {"rate_window_s": 20.0, "min_spec_draft_tokens": 64.0},
        # room above the start value for "more"; two relaunches a run, 20 s apart at least
        "policy": {"spec_tokens_max": a.k + 2, "min_action_gap_s": 20.0,
                   "max_restarts_per_hour": 6},
        # the shipped thresholds (0.4, 0.75); held 15 s instead of 600, and a cooldown
        # longer than the run (one step each way)
        "policy.rules.spec_decode_high": {"for_s": 15.0, "cooldown_s": 1200.0},
        "policy.rules.spec_decode_low": {"for_s": 15.0, "cooldown_s": 1200.0},
    }


def good(rng: random.Random, tokens: int) -> dict[str, Any]:
    phrase = " ".join(rng.sample(WORDS, 4))
    return {"model": MODEL_NAME, "prompt": (phrase + " ") * 12, "max_tokens": tokens,
            "temperature": 0, "ignore_eos": True}


def bad(rng: random.Random, tokens: int) -> dict[str, Any]:
    return {"model": MODEL_NAME, "prompt": " ".join(rng.choice(WORDS) for _ in range(60)),
            "max_tokens": tokens, "temperature": 1.0, "ignore_eos": True}


WORKLOADS = {"good": good, "bad": bad}


@dataclass
class Done:
    workload: str
    sent: float  # wall clock
    ended: float
    ok: bool
    error: str | None = None


class Load:
    """`clients` threads, each sending one completion at a time through the proxy, of
    the current workload; switched at once for every request sent after the switch."""

    def __init__(self, url: str, clients: int, tokens: int) -> None:
        self.url, self.tokens = url, tokens
        self.workload = "good"
        self.in_flight: dict[int, str] = {}  # client -> the workload of its request
        self.stop = threading.Event()
        self.done: list[Done] = []
        self.lock = threading.Lock()
        self.threads = [threading.Thread(target=self._client, args=(i,), daemon=True)
                        for i in range(clients)]

    def start(self) -> None:
        for t in self.threads:
            t.start()

    def _client(self, i: int) -> None:
        rng = random.Random(1000 + i)
        with httpx.Client(timeout=httpx.Timeout(30.0, read=400.0)) as c:
            while not self.stop.is_set():
                kind = self.workload
                sent = time.time()
                with self.lock:
                    self.in_flight[i] = kind
                try:
                    r = c.post(self.url, json=WORKLOADS[kind](rng, self.tokens))
                    ok, err = r.status_code == 200, None if r.status_code == 200 else \
                        f"HTTP {r.status_code}: {r.text[:120]}"
                except httpx.HTTPError as exc:
                    ok, err = False, f"{type(exc).__name__}: {exc}"
                with self.lock:
                    self.in_flight.pop(i, None)
                    self.done.append(Done(kind, sent, time.time(), ok, err))
                if not ok:
                    time.sleep(0.5)

    def finish(self, bound: float) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(bound)

    def latency(self, t0: float, t1: float) -> dict[str, Any]:
        """Requests that ended between two wall times: how many, median and worst time."""
        with self.lock:
            xs = sorted(d.ended - d.sent for d in self.done if t0 <= d.ended <= t1 and d.ok)
        return {"completed": len(xs),
                "median_s": round(xs[len(xs) // 2], 2) if xs else None,
                "slowest_s": round(xs[-1], 2) if xs else None}

    def label(self) -> str:
        """The workload now; "good->bad" while requests of the one before are still at
        the engine (its counters then mix both: such samples count for neither)."""
        with self.lock:
            kinds = set(self.in_flight.values()) - {self.workload}
        return f"{'+'.join(sorted(kinds))}->{self.workload}" if kinds else self.workload

    def between(self, t0: float, t1: float) -> dict[str, Any]:
        """What clients saw between two wall times: completions, failures, the longest
        stretch with none completed, the slowest request that ended in it."""
        with self.lock:
            ds = [d for d in self.done if t0 <= d.ended <= t1]
            # (a request held through the relaunch ends after it: the slowest counts those)
            over = [d for d in self.done if d.sent <= t1 and d.ended >= t0]
        ends = sorted([t0, *(d.ended for d in ds if d.ok), t1])
        return {"completed": sum(d.ok for d in ds), "failed": sum(not d.ok for d in ds),
                "errors": sorted({d.error for d in ds if d.error})[:3],
                "longest_without_completion_s": round(max(b - a for a, b in
                                                          itertools.pairwise(ends)),
                                                      2),
                "slowest_request_s": round(max((d.ended - d.sent for d in over),
                                               default=0.0), 2)}


def argv_k(pid: int | None) -> int | None:
    """num_speculative_tokens in the running engine's own argv."""
    if not pid:
        return None
    try:
        argv = psutil.Process(pid).cmdline()
    except psutil.Error:
        return None
    if "--speculative-config" not in argv:
        return 0
    n = json.loads(argv[argv.index("--speculative-config") + 1]).get("num_speculative_tokens")
    return int(n) if isinstance(n, int) else None


def counters(port: int) -> tuple[float, float] | None:
    try:
        text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=2).text
    except httpx.HTTPError:
        return None
    sums = {DRAFTED: 0.0, ACCEPTED: 0.0}
    seen = set()
    for line in text.splitlines():
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name in sums:
            sums[name] += float(line.rsplit(" ", 1)[1])
            seen.add(name)
    return (sums[DRAFTED], sums[ACCEPTED]) if len(seen) == 2 else None


@dataclass
class Sample:
    at: float  # wall
    workload: str
    state: str
    pid: int | None
    k: int | None
    rate: float | None  # the daemon's spec_decode_acceptance_rate signal
    standby: str | None = None
    drafted: float | None = None
    accepted: float | None = None


@dataclass
class Poller:
    """Every second: the daemon's status and the serving engine's own counters."""

    d: Daemon
    load: Load
    samples: list[Sample] = field(default_factory=list)
    ks: dict[int, int | None] = field(default_factory=dict)  # engine pid -> its argv's K
    stop: threading.Event = field(default_factory=threading.Event)
    last: dict[str, Any] = field(default_factory=dict)

    def run(self) -> None:
        while not self.stop.wait(1.0):
            try:
                st = self.d.status()
            except Exception:
                continue
            self.last = st
            pid = st.get("pid")
            if pid and pid not in self.ks:
                self.ks[pid] = argv_k(pid)
            k = self.ks.get(pid) if pid else None
            s = Sample(time.time(), self.load.label(), st["state"], pid, k,
                       (st.get("signals") or {}).get("spec_decode_acceptance_rate"),
                       (st.get("standby") or {}).get("state"))
            if st["state"] == "RUNNING" and (c := counters(st["engine"]["port"])):
                s.drafted, s.accepted = c
            self.samples.append(s)

    def standby_at(self, t: float) -> str | None:
        """The standby's state in the last sample before `t`."""
        before = [s for s in self.samples if s.at <= t]
        return before[-1].standby if before else None

    def acceptance(self) -> dict[str, dict[str, Any]]:
        """Per workload and number of speculative tokens: accepted / drafted over the
        increases between consecutive samples of one engine under one workload."""
        acc: dict[tuple[str, int | None], list[float]] = {}
        for a, b in zip(self.samples, self.samples[1:], strict=False):
            if (a.pid != b.pid or a.workload != b.workload or a.drafted is None
                    or b.drafted is None or a.accepted is None or b.accepted is None):
                continue
            x = acc.setdefault((b.workload, b.k), [0.0, 0.0])
            x[0] += b.drafted - a.drafted
            x[1] += b.accepted - a.accepted
        out: dict[str, dict[str, Any]] = {}
        for (w, k), (dr, ac) in sorted(acc.items(), key=lambda kv: (kv[0][0], kv[0][1] or 0)):
            out.setdefault(w, {})[f"k={k}"] = {
                "drafted": int(dr), "accepted": int(ac),
                "acceptance": round(ac / dr, 3) if dr else None}
        return out


def wall(iso: str) -> float:
    return datetime.fromisoformat(iso).timestamp()


class Run(TreeLedger):
    def __init__(self, a: argparse.Namespace, clock: Clock) -> None:
        super().__init__()
        self.a, self.clock = a, clock

    def decision(self, d: Daemon, action: str, after: float) -> dict[str, Any]:
        def found() -> dict[str, Any] | None:
            for e in d.events(300):
                if (e.get("event") == "decision" and e.get("action") == action
                        and wall(e["time"]) >= after):
                    return e
            return None

        got = wait_for(found, self.clock.left(self.a.decision_timeout),
                       f"a {action} decision", interval=0.5)
        assert got is not None
        return got

    def serving_k(self, d: Daemon, p: Poller, old_pid: int, k: int) -> tuple[float, int]:
        """Until the engine serving is a new one whose argv says `k` and the gate is open:
        (wall time, pid)."""
        def check() -> tuple[float, int] | None:
            st = d.status()
            pid = st.get("pid")
            if (st["state"] == "RUNNING" and pid and pid != old_pid
                    and (st.get("admission") or {}).get("held") is None
                    and argv_k(pid) == k):
                return time.time(), int(pid)
            return None

        got = wait_for(check, self.clock.left(self.a.relaunch_timeout),
                       f"an engine with num_speculative_tokens={k} serving", interval=0.25)
        assert got is not None
        self.remember(got[1])
        return got

    def standby_ready(self, d: Daemon, mode: str, cap: float, old: set[int]) -> None:
        if mode == "none":
            return
        wait_for(lambda: (s := d.status()["standby"])["state"] == "ready"
                 and s["pid"] not in old, self.clock.left(cap), "the standby ready",
                 interval=0.5)
        self.remember(d.status()["standby"]["pid"])

    def remedy_after(self, d: Daemon, rung: str, after: float) -> dict[str, Any] | None:
        for e in d.events(300):
            if (e.get("event") == "remedy" and e.get("rung") == rung
                    and wall(e["time"]) >= after):
                return e
        return None

    def step(self, d: Daemon, p: Poller, load: Load, mode: str, workload: str, action: str,
             k_before: int, k_after: int) -> dict[str, Any]:
        st = d.status()
        old_pid = int(st["pid"])
        old_standby = (st.get("standby") or {}).get("pid")
        load.workload = workload
        t_change = time.time()
        print(f"# {mode}: workload -> {workload} (K={k_before}, pid {old_pid})", flush=True)
        dec = self.decision(d, action, t_change)
        t_dec = wall(dec["time"])
        print(f"# {mode}: {action} after {t_dec - t_change:.1f} s: {dec['reason']}",
              flush=True)
        t_serving, pid = self.serving_k(d, p, old_pid, k_after)
        remedy = wait_for(lambda: self.remedy_after(d, action, t_dec), self.clock.left(30),
                          f"the {action} remedy entry", interval=0.5)
        events = [e for e in d.events(300) if t_dec <= wall(e["time"]) <= t_serving + 1
                  and e.get("event") in ("upgrade", "failover", "failover_done", "remedy",
                                         "take_down", "state")]
        print(f"# {mode}: K={k_after} serving (pid {pid}) {t_serving - t_dec:.1f} s after "
              f"the decision", flush=True)
        # through the standby: new requests are held from the restart's drain (the old
        # engine's requests finishing) to the handover's end
        drain = next((wall(e["time"]) for e in events if e.get("event") == "state"
                      and str(e.get("reason", "")).startswith("upgrade:")), None)
        done = next((wall(e["time"]) for e in events if e.get("event") == "failover_done"),
                    None)
        return {
            "workload": workload, "action": action, "rule": dec.get("rule"),
            "reason": dec.get("reason"), "evidence": dec.get("evidence"),
            "decision_time": dec["time"],
            "change_to_decision_s": round(t_dec - t_change, 1),
            "decision_to_serving_s": round(t_serving - t_dec, 1),
            "remedy": {k: remedy.get(k) for k in ("outcome", "duration_s", "steps_s", "starts",
                                                  "held")} if remedy else None,
            "through_standby": any(e.get("event") == "failover" for e in events),
            "standby_at_decision": p.standby_at(t_dec),
            # (the decision to the new standby proven and the drain begun)
            "standby_start_s": round(drain - t_dec, 1) if drain else None,
            "swap_hold_s": round(done - drain, 2) if drain and done else None,
            "k_before": k_before, "k_after": argv_k(pid), "pid_before": old_pid,
            "pid_after": pid, "standby_pid_before": old_standby,
            "events": [{k: v for k, v in e.items() if k in ("time", "event", "rung", "outcome",
                                                              "duration_s", "why", "reason",
                                                              "seconds", "pid")}
                       for e in events][:12],
            "_t": (t_change, t_dec, t_serving),
        }

    def mode(self, mode: str) -> dict[str, Any]:
        tmp = Path(tempfile.mkdtemp(prefix=f"vs-specbench-{mode}-"))
        cfg = config(tmp, self.a, mode)
        print(f"# mode {mode}: daemon in {tmp}", flush=True)
        env = {"PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT),
                                                           os.environ.get("PYTHONPATH")]))}
        d = Daemon(tmp, cfg, env=env)
        out: dict[str, Any] = {"mode": mode, "steps": [], "notes": []}
        load = Load(f"http://{cfg['proxy']['listen']}/v1/completions", self.a.clients,
                    self.a.tokens)
        poller = Poller(d, load)
        pt = threading.Thread(target=poller.run, daemon=True)
        t0 = time.monotonic()
        try:
            st = d.wait_state("RUNNING", self.clock.left(START_TIMEOUT))
            out["first_start_s"] = round(time.monotonic() - t0, 1)
            self.remember(st["pid"])
            if self.a.wait_standby:
                self.standby_ready(d, mode, START_TIMEOUT, set())
                out["standby_ready_s"] = round(time.monotonic() - t0, 1)
            st = d.status()
            out["k_start"] = argv_k(st["pid"])
            print(f"# mode {mode}: serving after {out['first_start_s']} s, K={out['k_start']}"
                  f", standby {st['standby']['state']}", flush=True)
            pt.start()
            load.start()
            k = self.a.k
            up = self.step(d, poller, load, mode, "good", "more_spec_tokens", k, k + 1)
            out["steps"].append(up)
            # the good workload a little longer on the new engine (its acceptance with one
            # more token); awake, the standby beside it is then still starting (it is
            # retired by the next decision and one with the next count started)
            t_up = time.monotonic()
            if self.a.wait_standby:
                self.standby_ready(d, mode, START_TIMEOUT,
                                   {up["pid_before"], up["standby_pid_before"]})
            rest = self.a.settle_s - (time.monotonic() - t_up)
            if rest > 0:
                time.sleep(self.clock.left(rest))
            out["steps"].append(self.step(d, poller, load, mode, "bad", "fewer_spec_tokens",
                                          k + 1, k))
            time.sleep(self.clock.left(self.a.settle_s / 2))  # bad on the engine after it
        except Exception as exc:
            out["notes"].append(f"{mode}: stopped early: {type(exc).__name__}: "
                                f"{str(exc)[:300]}")
            print(f"# mode {mode}: {out['notes'][-1]}\n{d.log_tail(40)}", flush=True)
        finally:
            load.finish(60)
            for s in out["steps"]:  # (a request held through a relaunch ends after it)
                s["clients_during_relaunch"] = load.between(*s["_t"][1:])
                s["clients_before_decision"] = load.latency(s["_t"][1] - 30, s["_t"][1])
            poller.stop.set()
            if pt.is_alive():
                pt.join(10)
            try:
                self.remember(d.status()["pid"])
                self.remember((d.status().get("standby") or {}).get("pid"))
            except Exception:
                pass
            out["acceptance"] = poller.acceptance()
            out["engine_log_k"] = self.engine_log_k(d)
            out["signal_by_workload"] = signal_ranges(poller.samples)
            out["audit"] = self.audit(d)
            try:
                d.ctl("stop", timeout=180)
                d.wait_exit(120)
            except Exception as exc:
                out["notes"].append(f"{mode}: stop: {type(exc).__name__}")
            d.close()
            for p in self.leftovers():  # never expected: the daemon takes its trees down
                out["notes"].append(f"{mode}: engine process {p.pid} left behind, killed")
                p.kill()
            out["failed_requests"] = sum(not x.ok for x in load.done)
            out["_requests"] = [[x.workload, round(x.sent, 2), round(x.ended, 2), x.ok]
                                for x in load.done]
            out["requests"] = len(load.done)
        return out

    def engine_log_k(self, d: Daemon) -> list[dict[str, Any]]:
        """Each engine's start line as the daemon logged it: num_spec_tokens=N."""
        out = []
        for r in d.log_records():
            if r.get("source") == "engine" and (m := re.search(
                    r"num_spec_tokens=(\d+)", str(r.get("event", "")))):
                out.append({"time": r.get("timestamp"), "generation": r.get("generation"),
                            "num_spec_tokens": int(m.group(1))})
        return out

    def audit(self, d: Daemon) -> list[dict[str, Any]]:
        """The audit trail as operators read it: `vllm-supervisorctl events --json`."""
        try:
            r = d.ctl("events", "--json", "-n", "200", timeout=30)
            events = [json.loads(x) for x in r.stdout.splitlines() if x.strip()]
        except Exception:
            return []
        keep = ("decision", "upgrade", "failover", "failover_done", "remedy", "standby_woken")
        return [{k: v for k, v in e.items() if k in ("time", "event", "rule", "action",
                                                      "reason", "rung", "outcome",
                                                      "duration_s", "why", "seconds")}
                for e in events if e.get("event") in keep]


def signal_ranges(samples: list[Sample]) -> dict[str, Any]:
    """The daemon's own acceptance signal per workload and K: min, max, last."""
    by: dict[str, list[float]] = {}
    for s in samples:
        if s.rate is not None:
            by.setdefault(f"{s.workload} k={s.k}", []).append(s.rate)
    return {k: {"min": round(min(v), 3), "max": round(max(v), 3), "n": len(v)}
            for k, v in by.items()}


def fmt(x: Any, unit: str = "") -> str:
    return "-" if x is None else f"{x}{unit}"


def conclusion(results: list[dict[str, Any]]) -> list[str]:
    """What the table says, in numbers: the relaunch with and without the standby."""
    by = {r["mode"]: r.get("steps", []) for r in results}
    out = []
    if by.get("none"):
        cold = [s["decision_to_serving_s"] for s in by["none"]]
        gap = [(s.get("clients_during_relaunch") or {}).get("longest_without_completion_s")
               for s in by["none"]]
        out.append(f"Without a standby each relaunch is a drained cold start: "
                   f"{', '.join(f'{x:g}' for x in cold)} s from the decision to the new K "
                   f"serving, and every request sent meanwhile waited for it (longest "
                   f"stretch without a completion {', '.join(fmt(x) for x in gap)} s).")
    if by.get("awake"):
        sw = by["awake"]
        out.append(
            "With `standby = \"awake\"` the relaunch is a swap: the engine serves on while a "
            "standby with the new K starts and is proven ("
            + ", ".join(fmt(s.get("standby_start_s")) for s in sw)
            + " s: longer than a cold start, since it shares the two cores with the engine "
            "serving the load), then new requests are held only while the old engine's "
            "requests finish and the standby takes over ("
            + ", ".join(fmt(s.get("swap_hold_s")) for s in sw)
            + " s); decision to the new K serving "
            + ", ".join(f"{s['decision_to_serving_s']:g}" for s in sw)
            + " s, longest stretch without a completion "
            + ", ".join(fmt((s.get("clients_during_relaunch") or {})
                            .get("longest_without_completion_s")) for s in sw)
            + " s (on two cores the standby's start slows the engine beside it, and the "
            "swap's hold is in it too); no request waited for a cold start.")
    return out


def report(summary: dict[str, Any]) -> str:
    results: list[dict[str, Any]] = summary["results"]
    k, clients, tokens = summary["k"], summary["clients"], summary["tokens"]
    names = {"awake": '`standby = "awake"`', "none": '`standby = "none"` (cold)'}
    lines = [
        "## Speculative decoding for real (`bench/spec_decode_run.py`)", "",
        f"Run on {summary['date']}, 2 CPU cores shared with other work "
        f"(load average {summary['load_avg_end']:.1f} at the end), vllm-cpu 0.32.0 with the "
        "tiny random-weight model behind the front proxy, n-gram speculation "
        f"(`{spec_config(k)}`), {clients} clients sending {tokens}-token completions "
        "one after another. **good**: greedy decoding of prompts that repeat a short phrase "
        "(the random model's greedy output falls into a loop, which the n-gram lookup "
        "predicts); **bad**: temperature 1 over random words (the model's distribution is "
        "near uniform over its 512 tokens: a draft is almost never the token sampled; "
        "`prompt_lookup_min = 1` makes drafts happen at all). The shipped rules and "
        "thresholds (`spec_decode_high`: acceptance > 0.75, one token more, up to "
        f"`policy.spec_tokens_max` = {k + 2}; `spec_decode_low`: < 0.4, one fewer), with "
        "times shortened for a run of minutes: `signals.rate_window_s = 20`, "
        "`signals.min_spec_draft_tokens = 64`, each rule `for_s = 15` (defaults: 60 s, 256, "
        "600 s), `policy.min_action_gap_s = 20`. Acceptance: the engine's own counters "
        "(accepted / drafted tokens, scraped every second from the serving engine; seconds "
        "when requests of both workloads were at the engine count for neither). K: read "
        "back from the running engine's argv and its start line (`num_spec_tokens=N`). "
        "Relaunch: from the decision to the engine with the new K serving with the gate "
        "open (the daemon's own `remedy` entry in brackets). Clients during it: the longest "
        "stretch with no request completed, and the slowest request (the median in the "
        "30 s before the decision in brackets).", "",
        "| mode | workload | acceptance at K before (engine counters) | decision | K before "
        "-> after | workload change -> decision (s) | relaunch (s) | through the standby "
        "| clients: longest without a completion (s) | slowest request (s) | failed |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        acc = r.get("acceptance", {})
        for s in r.get("steps", []):
            at = acc.get(s["workload"], {}).get(f"k={s['k_before']}", {})
            rem = s.get("remedy") or {}
            c = s.get("clients_during_relaunch") or {}
            b = s.get("clients_before_decision") or {}
            via = "no"
            if s["through_standby"]:
                via = f"yes (standby {s.get('standby_at_decision')} at the decision; one " \
                      f"with the new K proven {fmt(s.get('standby_start_s'), ' s')} after " \
                      f"it; new requests held {fmt(s.get('swap_hold_s'), ' s')} at the swap)"
            lines.append(
                f"| {names[r['mode']]} | {s['workload']} | {fmt(at.get('acceptance'))} "
                f"({fmt(at.get('accepted'))} / {fmt(at.get('drafted'))}) | `{s['action']}` | "
                f"{s['k_before']} -> {fmt(s['k_after'])} | {s['change_to_decision_s']} | "
                f"{s['decision_to_serving_s']} ({fmt(rem.get('duration_s'))}) | {via} | "
                f"{fmt(c.get('longest_without_completion_s'))} | "
                f"{fmt(c.get('slowest_request_s'))} ({fmt(b.get('median_s'))}) | "
                f"{fmt(c.get('failed'))} |")
    lines.append("")
    for r in results:
        per = "; ".join(f"{w} {k}: {v['acceptance']} ({v['accepted']} / {v['drafted']})"
                        for w, ks in r.get("acceptance", {}).items() for k, v in ks.items())
        lines.append(f"- {names[r['mode']]}: first start {fmt(r.get('first_start_s'), ' s')}"
                     f"; acceptance by workload and K: {per or '-'}; requests "
                     f"{fmt(r.get('requests'))}, failed {fmt(r.get('failed_requests'))}; the "
                     "engines' start lines in order: "
                     + (", ".join(f"num_spec_tokens={x['num_spec_tokens']}"
                                  for x in r.get("engine_log_k", [])) or "-") + ".")
        for s in r.get("steps", []):
            lines.append(f"  - `{s['rule']}` at {s['decision_time']}: {s['reason']} "
                         f"(evidence {json.dumps(s.get('evidence') or {})}); remedy steps "
                         f"{json.dumps((s.get('remedy') or {}).get('steps_s'))}")
        for n in r.get("notes", []):
            lines.append(f"  - Note: {n}")
    for c in conclusion(results):
        lines += ["", c]
    return "\n".join(lines) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--modes", default=",".join(MODES), help="awake,none (both by default)")
    ap.add_argument("--k", type=int, default=3, help="num_speculative_tokens at start")
    ap.add_argument("--clients", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=256, help="per request (context: 512)")
    ap.add_argument("--settle-s", type=float, default=20.0,
                    help="the good workload on the engine after the first relaunch")
    ap.add_argument("--wait-standby", action="store_true",
                    help="awake: each workload begins with the standby proven (longer)")
    ap.add_argument("--decision-timeout", type=float, default=240.0)
    ap.add_argument("--relaunch-timeout", type=float, default=420.0)
    ap.add_argument("--deadline-min", type=float, default=25.0, help="the whole run's bound")
    ap.add_argument("--engine-venv", default=str(ROOT / ".venv-engine"))
    ap.add_argument("--model", default=str(ROOT / "models" / "tiny-llama"))
    ap.add_argument("--json", default=None, help="also write the summary here")
    ap.add_argument("--out", default=None)
    ap.add_argument("--report-from", default=None,
                    help="no run: write the section from a --json file of an earlier one")
    a = ap.parse_args()
    if a.report_from:
        summary = json.loads(Path(a.report_from).read_text())
        text = report(summary)
        print(text)
        if a.out:
            write_section(Path(a.out), "spec-decode", text)
        return 0
    if not (Path(a.engine_venv) / "bin" / "vllm").exists() or \
            not (Path(a.model) / "config.json").exists():
        ap.error("the real engine is not set up: run `bash scripts/setup.sh all` "
                 "(or pass --engine-venv and --model)")
    clock = Clock(a.deadline_min)
    run = Run(a, clock)
    results: list[dict[str, Any]] = []
    for mode in a.modes.split(","):
        if mode not in MODES:
            ap.error(f"unknown mode {mode!r}")
        if clock.deadline - time.monotonic() < 120:
            results.append({"mode": mode, "steps": [],
                            "notes": [f"{mode}: not run, the run's deadline was near"]})
            continue
        results.append(run.mode(mode))
    for r in results:
        for s in r["steps"]:
            s.pop("_t", None)
    requests = {r["mode"]: r.pop("_requests", []) for r in results}
    summary = {"date": datetime.now().strftime("%Y-%m-%d"),
               "load_avg_end": round(os.getloadavg()[0], 1), "k": a.k, "clients": a.clients,
               "tokens": a.tokens, "spec_config_start": json.loads(spec_config(a.k)),
               "results": results}
    text = report(summary)
    print(text)
    print(json.dumps(summary, indent=1, default=str))
    if a.json:  # (with every request: workload, sent, ended, ok)
        Path(a.json).write_text(json.dumps({**summary, "requests": requests}, default=str))
    if a.out:
        write_section(Path(a.out), "spec-decode", text)
    ok = all(len(r["steps"]) == 2 and not r["notes"] for r in results)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
