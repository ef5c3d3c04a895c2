"""The daemon's own cost on an 8-GPU host beside one engine, side by side in one run.

Two daemons, each run fresh in every round, the two alternating (the order flipping from
round to round) so that the machine's noise hits both:

  one    one engine (`[engine]`): the fake engine with the arguments of the example's
         `small-a` (one model, "small"), one scripted GPU
  eight  `config.8-gpus.toml` as it is, its six vLLMs swapped for the fake engine
         (`tests/fake_engine.py`, every argument kept) and its 8 NVML GPUs for a scripted
         8-GPU file (`[gpu] sampler = "file"`)

Both with the watchdog on at the defaults the example gets (metrics scrape every 2 s,
canary every 10 s, policy every 1 s, GPU sampling every 5 s), the proxy on (loopback), the
exporter on, logging JSON at info (one line per proxied request) to a file. Every fake
engine serves a real vLLM `/metrics` page (vLLM 0.26 on an H100,
`tests/fixtures/vllm-0.26-h100-metrics/idle.txt`) whose token counter moves (rewritten
twice a second by this script): a static page under load would be a stalled engine to the
progress rule, which would restart it mid-measurement. Each GPU lists its engine's
process, as NVML would.

Measured, of the daemon's own process only (its pid: every thread of it, none of its
children; the fake engines and the `sh` guard of each engine are other processes):

1. RSS (`VmRSS` of /proc/PID/status) sampled every second through the idle window, after
   a warm-up (every engine serving, one canary and one GPU sample each, a short proxy
   load); the median; and under load.
2. CPU idle: utime + stime (/proc/PID/stat) over the idle window, per second of wall time.
3. CPU under a proxy load: one loopback client process (aiohttp, keep-alive) sending
   short non-streaming completions (`max_tokens` 1) through the proxy at a fixed
   concurrency for a fixed time, alternating the models ("big" and "small" for the 8-GPU
   host; "small" for one engine); requests/s, daemon CPU per second and per request.

    .venv/bin/python bench/host_cost_bench.py --out docs/benchmarks.md
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import platform
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import tomllib
from datetime import date
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.report import write_section  # noqa: E402
from tests.harness import FAKE_ENGINE, Daemon, fake_engine_config, free_port, wait_for  # noqa: E402

PY = sys.executable
PAGE = ROOT / "tests" / "fixtures" / "vllm-0.26-h100-metrics" / "idle.txt"
EXAMPLE = ROOT / "config.8-gpus.toml"
CONFIGS = ("one", "eight")
LABEL = {"one": "1 engine", "eight": "8 GPUs"}
TICK = os.sysconf("SC_CLK_TCK")
# The fake engine run as vLLM's server talks: HTTP/1.1 keep-alive (uvicorn) in place of
# the standard library's HTTP/1.0, a connection per request (a py-spy look put a quarter
# of the daemon's CPU under load in that connect; the proxy keeps its upstream connections
# alive), and a listen backlog of 2048 (uvicorn's) in place of 5, at which concurrent
# connects would be dropped and retried 1-3 s later. Every answer of the fake engine but a
# stream (none here) has a Content-Length. Its argv keeps tests/fake_engine.py, which the
# harness's clean-up looks for.
ENGINE = ("import http.server, runpy, socketserver, sys; "
          "socketserver.TCPServer.request_queue_size = 2048; "
          "http.server.BaseHTTPRequestHandler.protocol_version = 'HTTP/1.1'; "
          "sys.argv = sys.argv[1:]; runpy.run_path(sys.argv[0], run_name='__main__')")
GPU = {"temperature_c": 55.0, "slowdown_temperature_c": 89.0, "power_w": 250.0,
       "power_limit_w": 700.0, "utilization_ratio": 0.5, "memory_used_bytes": 60 << 30,
       "memory_total_bytes": 80 << 30, "clock_event_reasons": 0, "process_memory": {},
       "xids": []}


# ---- the process under test, as /proc sees it ------------------------------------------

def cpu_s(pid: int) -> float:
    """utime + stime of the process (all its threads, not its children), in seconds."""
    with open(f"/proc/{pid}/stat") as f:
        rest = f.read().rsplit(")", 1)[1].split()
    return (int(rest[11]) + int(rest[12])) / TICK


def status_kb(pid: int, key: str) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1])
    raise KeyError(key)


def rss_mib(pid: int) -> float:
    return status_kb(pid, "VmRSS") / 1024


def threads(pid: int) -> int:
    return status_kb(pid, "Threads")


def guards(pid: int) -> tuple[int, float]:
    """The daemon's guard shells (`vllm-supervisor-guard`): how many, their RSS in MiB."""
    import psutil

    n, rss = 0, 0.0
    for c in psutil.Process(pid).children():
        with contextlib.suppress(psutil.Error):
            if "vllm-supervisor-guard" in " ".join(c.cmdline()):
                n += 1
                rss += c.memory_info().rss / (1 << 20)
    return n, rss


class Sampler:
    """RSS of a pid every `period` seconds on a thread, until stopped."""

    def __init__(self, pid: int, period: float = 1.0) -> None:
        self.pid, self.period = pid, period
        self.rss: list[float] = []
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)
        self._t.start()

    def _run(self) -> None:
        while True:
            with contextlib.suppress(OSError):
                self.rss.append(rss_mib(self.pid))
            if self._stop.wait(self.period):
                return

    def stop(self) -> list[float]:
        self._stop.set()
        self._t.join(5)
        return self.rss


class MovingPage:
    """The real vLLM page for every fake engine, its generation counter moving: rewritten
    (atomically) twice a second."""

    def __init__(self, path: Path) -> None:
        self.path, self.text, self.tokens = path, PAGE.read_text(), 0.0
        self._stop = threading.Event()
        self._write()
        self._t = threading.Thread(target=self._run, daemon=True)
        self._t.start()

    def _write(self) -> None:
        self.tokens += 25.0
        text = re.sub(r"^(vllm:generation_tokens_total\{[^}]*\}) \S+",
                      lambda m: f"{m.group(1)} {self.tokens}", self.text, flags=re.M)
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(text)
        os.replace(tmp, self.path)

    def _run(self) -> None:
        while not self._stop.wait(0.5):
            self._write()

    def stop(self) -> None:
        self._stop.set()
        self._t.join(5)


# ---- the two configurations -------------------------------------------------------------

def write_gpus(path: Path, n: int, owners: dict[int, int] | None = None) -> None:
    """A scripted host of n GPUs; `owners`: GPU -> the pid NVML lists on it."""
    doc = {"gpus": {str(i): {**GPU, "process_memory": (
        {str(owners[i]): 30 << 30} if owners and i in owners else {})} for i in range(n)}}
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(doc))
    os.replace(tmp, path)


def sections(kind: str, tmp: Path, page: Path, gpu_file: Path) -> dict[str, dict[str, Any]]:
    """The daemon's config: the test harness's skeleton (runtime dir, audit, exporter port),
    with the defaults put back where the harness shortens them for tests."""
    example = tomllib.loads(EXAMPLE.read_text())
    cfg = fake_engine_config(tmp)
    base = cfg.pop("engine")
    cfg.pop("restart")  # (the harness's short backoff: the defaults here)
    cfg["log"] = {"format": "json", "level": "info"}
    cfg["gpu"] = {"sampler": "file", "file": str(gpu_file)}  # period: the default 5 s
    cfg["proxy"] = {**example["proxy"], "enabled": True, "listen": f"127.0.0.1:{free_port()}"}
    engines = example["engines"] if kind == "eight" else {"small-a": example["engines"]["small-a"]}
    for name, table in engines.items():
        eng = {k: v for k, v in table.items() if k not in ("command", "port", "fallback")}
        if kind == "eight" and "fallback" in table:
            eng["fallback"] = table["fallback"]
        eng.update(command=[PY, "-c", ENGINE, str(FAKE_ENGINE), "--child", "--metrics-file",
                            str(page)],
                   port=free_port(), env={"FAKE_ENGINE_PIDFILE": str(tmp / "engine.pids")},
                   # only the take-down at the end is shortened (bounded bench)
                   drain_timeout_s=2.0, stop_grace_s=2.0, reap_timeout_s=base["reap_timeout_s"])
        if kind == "one":
            eng["gpus"] = [0]
            cfg["engine"] = eng
        else:
            cfg[f"engines.{name}"] = eng
    return cfg


def per_engine(st: dict[str, Any]) -> dict[str, dict[str, Any]]:
    detail: dict[str, dict[str, Any]] | None = st.get("detail")
    return detail if detail else {"engine": st}


def serving(d: Daemon, n: int, canary: bool = False) -> bool:
    """Every engine serving with a GPU reading (and with `canary`, a canary result)."""
    engines = per_engine(d.status())
    return len(engines) == n and all(
        e["state"] == "RUNNING" and bool(e.get("gpus")) and (
            not canary or e["signals"].get("canary_latency_s") is not None)
        for e in engines.values())


# ---- the client (its own process) --------------------------------------------------------

async def client_run(cmd: dict[str, Any]) -> dict[str, Any]:
    """Keep `concurrency` requests in flight: `warmup_s`, then "START", `seconds` counted,
    "END"; then the result as one JSON line."""
    import aiohttp

    bodies = [json.dumps({"model": m, "prompt": "hello", "max_tokens": 1}).encode()
              for m in cmd["models"]]
    headers = {"Content-Type": "application/json"}
    counting, stop = False, False
    n = errors = 0
    lat: list[float] = []
    by_engine: dict[str, int] = {}
    sent = 0
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector,
                                     timeout=aiohttp.ClientTimeout(total=60)) as session:

        async def worker() -> None:
            nonlocal n, errors, sent
            while not stop:
                body = bodies[sent % len(bodies)]
                sent += 1
                t0 = time.perf_counter()
                try:
                    async with session.post(cmd["url"], data=body, headers=headers) as r:
                        await r.read()
                        ok = r.status == 200
                        eng = r.headers.get("x-supervisor-engine", "?")
                except (aiohttp.ClientError, TimeoutError):
                    ok, eng = False, "?"
                if counting:
                    n += 1
                    errors += not ok
                    lat.append(time.perf_counter() - t0)
                    by_engine[eng] = by_engine.get(eng, 0) + 1

        tasks = [asyncio.create_task(worker()) for _ in range(int(cmd["concurrency"]))]
        await asyncio.sleep(float(cmd["warmup_s"]))
        counting = True
        print("START", flush=True)
        t0 = time.perf_counter()
        await asyncio.sleep(float(cmd["seconds"]))
        counting = False
        elapsed = time.perf_counter() - t0
        print("END", flush=True)
        stop = True
        await asyncio.gather(*tasks)
    return {"n": n, "errors": errors, "elapsed_s": elapsed, "rate": n / elapsed,
            "p50_ms": statistics.median(lat) * 1e3 if lat else float("nan"),
            "by_engine": by_engine}


def load(pid: int, url: str, models: list[str], concurrency: int, warmup_s: float,
         seconds: float) -> dict[str, Any]:
    """The client's load through the proxy, and the daemon's CPU and RSS meanwhile."""
    cmd = {"url": url, "models": models, "concurrency": concurrency, "warmup_s": warmup_s,
           "seconds": seconds}
    p = subprocess.Popen([PY, __file__, "_client", json.dumps(cmd)], stdout=subprocess.PIPE,
                         text=True, cwd=ROOT, start_new_session=True)
    killer = threading.Timer(warmup_s + seconds + 60, lambda: os.killpg(p.pid, signal.SIGKILL))
    killer.start()
    try:
        assert p.stdout is not None
        if p.stdout.readline().strip() != "START":
            raise RuntimeError(f"the client exited {p.wait()}")
        c0, t0, sampler = cpu_s(pid), time.monotonic(), Sampler(pid)
        if p.stdout.readline().strip() != "END":
            raise RuntimeError(f"the client exited {p.wait()}")
        c1, wall, rss = cpu_s(pid), time.monotonic() - t0, sampler.stop()
        res = dict(json.loads(p.stdout.readline()))
        p.wait(10)
    finally:
        killer.cancel()
        if p.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGKILL)
            p.wait(5)
    res.update(cpu_s=c1 - c0, wall_s=wall, rss_mib=statistics.median(rss),
               rss_max_mib=max(rss))
    return res


# ---- one run -------------------------------------------------------------------------------

def one_run(kind: str, root: Path, rnd: int, args: argparse.Namespace) -> dict[str, Any]:
    tmp = Path(tempfile.mkdtemp(dir=root, prefix=f"{kind}{rnd}-"))
    n_gpus, n_engines = (8, 6) if kind == "eight" else (1, 1)
    gpu_file, page = tmp / "gpus.json", MovingPage(tmp / "metrics.txt")
    write_gpus(gpu_file, n_gpus)
    cfg = sections(kind, tmp, page.path, gpu_file)
    env = {"PYTHONPATH": os.pathsep.join([str(ROOT), *filter(None, [
        os.environ.get("PYTHONPATH")])])}
    load0 = os.getloadavg()[0]
    d = Daemon(tmp, cfg, env=env)
    try:
        t0 = time.monotonic()
        wait_for(lambda: serving(d, n_engines), 120, f"{kind}: engines serving with a GPU "
                 "reading", interval=0.2)
        started = time.monotonic() - t0
        owners: dict[int, int] = {}
        for e in per_engine(d.status()).values():
            for g in e.get("gpus") or ():
                owners[int(g["index"])] = int(e["pid"])
        write_gpus(gpu_file, n_gpus, owners)
        url = f"http://{cfg['proxy']['listen']}/v1/completions"
        models = ["big", "small"] if kind == "eight" else ["small"]
        load(d.pid, url, models, args.concurrency, 1.0, args.warmup_s)  # the proxy warm
        # the warm-up's end: a canary of every engine (its first comes a period after
        # the start), then a settle
        wait_for(lambda: serving(d, n_engines, canary=True), 60, f"{kind}: a canary each",
                 interval=0.2)
        time.sleep(args.settle_s)
        # idle
        c0, t0, sampler = cpu_s(d.pid), time.monotonic(), Sampler(d.pid)
        time.sleep(args.idle_s)
        c1, wall, rss = cpu_s(d.pid), time.monotonic() - t0, sampler.stop()
        n_threads, (n_guards, guard_rss) = threads(d.pid), guards(d.pid)
        under = load(d.pid, url, models, args.concurrency, 1.0, args.load_s)
        decisions = len(d.decisions())
        restarts = sum(int(e.get("restarts") or 0) for e in per_engine(d.status()).values())
    finally:
        # NVML lists no process once it is gone: the daemon's stop waits for the GPUs to
        # be released
        write_gpus(gpu_file, n_gpus)
        d.close()
        page.stop()
        shutil.rmtree(cfg["daemon"]["runtime_dir"], ignore_errors=True)
    idle_per_s = (c1 - c0) / wall
    out: dict[str, Any] = {"kind": kind, "round": rnd, "start_s": started, "idle_cpu_s": c1 - c0,
           "idle_wall_s": wall, "idle_cpu_per_s": idle_per_s,
           "rss_mib": statistics.median(rss), "rss_samples": len(rss), "threads": n_threads,
           "guards": n_guards, "guard_rss_mib": guard_rss, "load": under,
           "decisions": decisions, "restarts": restarts,
           "loadavg": (load0, os.getloadavg()[0])}
    print(f"round {rnd + 1} {kind:<5} start {started:.1f} s, rss {out['rss_mib']:.1f} MiB, "
          f"idle {idle_per_s * 1e3:.1f} ms/s, load {under['rate']:.0f} req/s, "
          f"{under['cpu_s'] / under['wall_s'] * 1e3:.0f} ms/s, "
          f"{under['cpu_s'] / max(1, under['n']) * 1e6:.0f} us/req, errors {under['errors']}, "
          f"rss under load {under['rss_mib']:.1f} MiB, decisions {decisions}, "
          f"loadavg {load0:.1f} -> {os.getloadavg()[0]:.1f}", flush=True)
    return out


# ---- the report ----------------------------------------------------------------------------

# Where the CPU goes: a separate py-spy look, not redone by this script
PROFILE = (
    "Where the daemon's CPU goes (a separate py-spy look at the 8-GPU daemon, 2026-11-25, "
    "commit a30a742, 100 Hz, busy samples only): idle, about 80 % in parsing the engines' "
    "/metrics pages (`parse_metrics`: prometheus_client's text parser over the 572-line "
    "page, in a worker thread, once per engine every 2 s), 7 % in the HTTP of the scrapes "
    "and canaries (httpx), 5 % in psutil's walk of /proc for the process trees, about 1 % "
    "in the policy and the GPU samples together. Under load, about a third in the proxy's "
    "request path (aiohttp server and client, routing, the log line), a quarter in "
    "socket writes, and the parsing goes on beside it (15 %). The fake engine's own HTTP "
    "is 1.0, a connection per request: run that way, an upstream connect took 29 % of the "
    "daemon's samples under load, so the bench runs it with keep-alive, as vLLM's server "
    "answers."
)


def figures(runs: list[dict[str, Any]]) -> dict[str, list[float]]:
    return {
        "rss": [r["rss_mib"] for r in runs],
        "idle": [r["idle_cpu_per_s"] * 1e3 for r in runs],
        "rate": [r["load"]["rate"] for r in runs],
        "busy": [r["load"]["cpu_s"] / r["load"]["wall_s"] * 1e3 for r in runs],
        "per_req": [r["load"]["cpu_s"] / max(1, r["load"]["n"]) * 1e6 for r in runs],
        # less the idle work going on meanwhile (the same run's idle CPU per second)
        "net_req": [(r["load"]["cpu_s"] - r["idle_cpu_per_s"] * r["load"]["wall_s"])
                    / max(1, r["load"]["n"]) * 1e6 for r in runs],
        "rss_load": [r["load"]["rss_mib"] for r in runs],
        "start": [r["start_s"] for r in runs],
    }


def render(res: dict[str, list[dict[str, Any]]], args: argparse.Namespace) -> str:
    f1, f8 = figures(res["one"]), figures(res["eight"])
    m = statistics.median

    def row(label: str, key: str, nd: int) -> str:
        a, b = m(f1[key]), m(f8[key])
        runs = (", ".join(f"{x:.{nd}f}" for x in f1[key]) + " / "
                + ", ".join(f"{x:.{nd}f}" for x in f8[key]))
        return f"| {label} | {a:.{nd}f} | {b:.{nd}f} | {b / a:.2f} | {runs} |"

    rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                         text=True, cwd=ROOT).stdout.strip()
    one, eight = res["one"], res["eight"]
    errors = sum(r["load"]["errors"] for k in CONFIGS for r in res[k])
    decisions = sum(r["decisions"] + r["restarts"] for k in CONFIGS for r in res[k])
    spread: dict[str, int] = {}
    for r in eight:
        for e, c in r["load"]["by_engine"].items():
            spread[e] = spread.get(e, 0) + c
    total = sum(spread.values()) or 1
    spread_s = ", ".join(f"{e} {100 * c / total:.0f} %" for e, c in sorted(spread.items()))
    loads = "; ".join(f"{LABEL[k]}: " + ", ".join(f"{r['loadavg'][0]:.1f}" for r in res[k])
                      for k in CONFIGS)
    idle1, idle8 = m(f1["idle"]), m(f8["idle"])
    rss1, rss8 = m(f1["rss"]), m(f8["rss"])
    out = [
        "## The daemon's own cost: an 8-GPU host beside one engine "
        "(`bench/host_cost_bench.py`)", "",
        f"Run by `make bench-host-cost` on {date.today().isoformat()} at commit {rev}, "
        f"{platform.machine()}, {os.cpu_count()} cores (shared with other jobs, noisy; "
        f"nothing pinned), loopback only, Python {platform.python_version()}.", "",
        "Two daemons side by side: **1 engine** (`[engine]`: the fake engine with the "
        "arguments of the example's `small-a`, one scripted GPU) and **8 GPUs** "
        "(`config.8-gpus.toml` as it is: 2 x TP=2 \"big\" + 4 x TP=1 \"small\" with their "
        "fallback, each vLLM swapped for the fake engine with its arguments kept, 8 "
        "scripted GPUs; the fake engine speaking HTTP/1.1 keep-alive with uvicorn's listen "
        "backlog, as vLLM's server does). Both with the watchdog at the defaults (scrape "
        "every 2 s, canary every 10 s, policy every 1 s, GPU sampling every 5 s), the proxy "
        "and the exporter "
        "on, JSON logs at info to a file. Each fake engine serves a real 572-line vLLM page "
        "(0.26 on an H100) whose token counter moves, and each GPU lists its engine's "
        "process. A fresh daemon per run; "
        f"{args.rounds} rounds, the two alternating (the order flipping each round); every "
        "figure is the median over the rounds. **Daemon process only**: /proc/PID of "
        "the daemon (all its threads), not its children; the fake engines' own CPU and "
        "memory are not in any figure.", "",
        f"- RSS: `VmRSS` sampled every second over the idle window, after a warm-up (every "
        "engine serving with a canary and a GPU reading, then "
        f"{args.warmup_s:g} s of proxy load and {args.settle_s:g} s to settle); the median.",
        f"- Idle CPU: utime + stime over a {args.idle_s:g} s window, per second of wall "
        "time.",
        f"- Under load: one loopback client process (aiohttp, keep-alive) keeping "
        f"{args.concurrency} non-streaming completions (`max_tokens` 1) in flight through "
        f"the proxy for {args.load_s:g} s after a 1 s warm-up, the models alternating "
        "(\"big\", \"small\" on the 8-GPU host; \"small\" for one engine); the daemon's CPU "
        "over the counted window, per second and per request.", "",
        "| | 1 engine | 8 GPUs (6 engines) | ratio 8-GPU / 1 | runs (1 engine / 8 GPUs) |",
        "|---|---|---|---|---|",
        row("daemon RSS, idle (MiB)", "rss", 1),
        row("daemon CPU idle (ms per s = ‰ of one core)", "idle", 2),
        row("requests/s through the proxy", "rate", 0),
        row("daemon CPU under load (ms per s)", "busy", 0),
        row("daemon CPU per request (µs)", "per_req", 0),
        row("... less the idle work meanwhile (µs)", "net_req", 0),
        row("daemon RSS under load (MiB)", "rss_load", 1),
        row("daemon start to every engine serving (s)", "start", 1),
        "",
        f"Per added engine (8-GPU minus 1-engine, over 5): RSS "
        f"{(rss8 - rss1) / 5:+.2f} MiB, idle CPU {(idle8 - idle1) / 5:+.2f} ms/s. Daemon "
        f"threads: {one[0]['threads']} / {eight[0]['threads']}. Beside the daemon, its "
        f"guard shells (`sh`): {one[0]['guards']} "
        f"({one[0]['guard_rss_mib']:.1f} MiB) / {eight[0]['guards']} "
        f"({eight[0]['guard_rss_mib']:.1f} MiB RSS).", "",
        f"Requests over the 8-GPU runs by engine: {spread_s}. Failed requests: {errors}. "
        f"Policy decisions and restarts over all runs: {decisions}. 1-minute load average "
        f"at the start of each run, by round: {loads}.", "",
        reading(f1, f8), "",
        PROFILE,
    ]
    return "\n".join(out) + "\n"


def reading(f1: dict[str, list[float]], f8: dict[str, list[float]]) -> str:
    m = statistics.median
    rss1, rss8, idle1, idle8 = m(f1["rss"]), m(f8["rss"]), m(f1["idle"]), m(f8["idle"])
    per1, per8, net1, net8 = m(f1["per_req"]), m(f8["per_req"]), m(f1["net_req"]), m(f8["net_req"])
    ratio = idle8 / idle1 if idle1 else float("inf")
    scaling = ("close to linear" if 4.5 <= ratio <= 7.5 else
               "less than linear" if ratio < 4.5 else "more than linear")
    return (
        f"Reading: memory hardly depends on the engine count ({rss8:.0f} MiB for six engines "
        f"on eight GPUs against {rss1:.0f} MiB for one, {(rss8 - rss1) / 5:+.1f} MiB per "
        "added engine): most of the daemon's RSS is the interpreter and its libraries. "
        f"Idle CPU is what grows with the engines, {scaling}: {idle1:.1f} ms/s for one "
        f"engine, {idle8:.1f} ms/s for six ({ratio:.1f}x for 6x the engines, "
        f"{(idle8 - idle1) / 5:.1f} ms/s per added engine), since the watchdog's periodic "
        "work is per engine (a scrape and parse of its /metrics page every 2 s, a canary "
        "every 10 s, the policy every second, a GPU sample every 5 s, a look at its process "
        f"tree every 10 s); still {idle8 / 10:.1f} % of one core for the whole 8-GPU host. "
        f"Under load a request costs the daemon {per1:.0f} µs with one engine and "
        f"{per8:.0f} µs on the 8-GPU host ({net1:.0f} against {net8:.0f} µs less the idle "
        "work going on meanwhile, which is larger on the 8-GPU host): routing by model "
        f"across six engines adds {net8 - net1:+.0f} µs per request, within this machine's "
        "noise or near it. Requests/s is not the daemon's limit here: the client, the fake "
        "engines and other jobs share the same 2 cores."
    )


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "_client":
        print(json.dumps(asyncio.run(client_run(json.loads(sys.argv[2])))), flush=True)
        return 0
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, help="rewrite the host-cost section of this file")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--idle-s", type=float, default=30.0)
    ap.add_argument("--load-s", type=float, default=20.0)
    ap.add_argument("--warmup-s", type=float, default=3.0)
    ap.add_argument("--settle-s", type=float, default=5.0)
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--from-json", type=Path, metavar="RESULTS",
                    help="render the results.json of an earlier run (its options given "
                         "again) instead of measuring")
    args = ap.parse_args()
    t0 = time.monotonic()
    res: dict[str, list[dict[str, Any]]]
    if args.from_json is not None:
        res = json.loads(args.from_json.read_text())
    else:
        root = Path(tempfile.mkdtemp(prefix="vs-hostcost-"))
        res = {k: [] for k in CONFIGS}
        try:
            for rnd in range(args.rounds):
                for kind in (CONFIGS if rnd % 2 == 0 else CONFIGS[::-1]):
                    res[kind].append(one_run(kind, root, rnd, args))
        finally:
            (root / "results.json").write_text(json.dumps(res, indent=1))
            print(f"results: {root / 'results.json'}")
        for run in root.iterdir():  # the runs' logs go; kept only after a failure
            if run.is_dir():
                shutil.rmtree(run, ignore_errors=True)
    text = render(res, args)
    print(text)
    print(f"total: {time.monotonic() - t0:.0f} s")
    if args.out is not None:
        write_section(args.out, "host-cost", text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
