"""The daemon under test on a lent GPU machine, for the GPU harness (`tests/gpu_vllm.py`):
where it and the staged vLLM live, how to reach it (`status`, `ctl`, the engine's own
address and `/metrics`), what it wrote (`events`), the engines' process trees and memory,
what the pair reads as (`protected_again`, `Timeline`, `kv_info`), bounded waits, and the
`RESULT` lines each phase prints. Imported first: it puts the installed wheel before the
checkout on `sys.path`, so every other part imports the daemon that runs.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
WORK = Path(os.environ.get("WORK", "/tmp/vs-gpu"))
SUP_SITE = os.environ.get("SUP_SITE", "/tmp/sup-site")
VLLM_SITE = os.environ.get("VLLM_SITE", str(Path.home() / "vllm-site"))
SHAPE = os.environ.get("SHAPE", "tiny")  # "8b": Llama-3.1-8B's shape, random weights
STAGED = Path.home() / "vllm-stage" / "model"  # the tiny model, as staged
TP = int(os.environ.get("TP", "1"))  # >1: both engines tensor-parallel on GPUs 0..TP-1
MODEL = os.environ.get("MODEL", str(Path.home() / "m8b" if SHAPE == "8b" else STAGED))
if os.environ.get("WEIGHT_CACHE") == "1" and "MODEL" not in os.environ:
    MODEL = str(Path.home() / "ckpt8b")  # real bytes to load (tests/gpu_v033.py ckpt)
WEIGHT_CACHE = os.environ.get("WEIGHT_CACHE") == "1"  # `start`: the engine on a weight cache
# RUST_FE=1: `start` runs the engines with VLLM_USE_RUST_FRONTEND=1 (vLLM 0.33)
HANG_EXT = os.environ.get("HANG_EXT") == "1"  # `start` adds the worker method `hang-rpc` uses
PROXY = "127.0.0.1:8000"
EXPORTER = "127.0.0.1:9402"
# the installed wheel first; the checkout only for tests.harness (every process this
# script starts runs in WORK, away from the checkout's own supervisor/ folder)
sys.path[:0] = [SUP_SITE]
sys.path.append(str(ROOT))

import supervisor  # noqa: E402
from supervisor.control.client import call  # noqa: E402
from tests import gpu_spy  # noqa: E402


def installed_from() -> str:
    """Where the supervisor this harness drives was imported from: the wheel's site, not
    the checkout."""
    return str(supervisor.__file__)


def status() -> dict[str, Any]:
    return dict(call(str(WORK / "control.sock"), "status", {}, timeout_s=10))


def ctl(*args: str, timeout: float = 600) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "supervisor.control.cli", "--socket",
                           str(WORK / "control.sock"), *args], capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, "PYTHONPATH": SUP_SITE},
                          cwd=str(WORK))


class Hopeless(AssertionError):
    """What a wait's condition raises when it can no longer come true (a wait would only
    burn the machine's minutes)."""


def wait(cond: Any, timeout: float, what: str,
         daemon: subprocess.Popen[bytes] | None = None) -> Any:
    """`cond()` once true; `daemon`: the wait ends at once if that daemon exits (a daemon
    that cannot start: its log says why)."""
    deadline = time.monotonic() + timeout
    while True:
        if daemon is not None and daemon.poll() is not None:
            raise AssertionError(f"the daemon exited ({daemon.returncode}) while waiting for "
                                 f"{what}; its log: {WORK / 'daemon.log'}")
        try:
            v = cond()
            if v:
                return v
        except Hopeless:
            raise
        except Exception:  # the daemon may be between states
            pass
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:g} s waiting for {what}")
        time.sleep(0.2)


def events() -> list[dict[str, Any]]:
    path = WORK / "events.jsonl"
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()]


def nvml_processes() -> dict[int, int]:
    import pynvml

    pynvml.nvmlInit()
    try:
        h = pynvml.nvmlDeviceGetHandleByIndex(0)
        return {int(p.pid): int(p.usedGpuMemory or 0)
                for p in pynvml.nvmlDeviceGetComputeRunningProcesses(h)}
    finally:
        pynvml.nvmlShutdown()


def engine_tree(pid: int) -> list[Any]:
    import psutil

    p = psutil.Process(pid)
    return [p, *p.children(recursive=True)]


def running(pid: int) -> bool:
    """Alive, a zombie not counted: an orphan's zombie waits for the VM's init to reap
    it, and holds nothing meanwhile (the daemon counts it gone too)."""
    import psutil

    try:
        return bool(psutil.Process(pid).status() != psutil.STATUS_ZOMBIE)
    except psutil.NoSuchProcess:
        return False


def spy(name: str) -> list[Any]:
    """With SPY=1, py-spy records the serving engine's API server and core for
    `gpu_spy.SPY_S` seconds from now (`gpu_spy.finish` sums them up); else nothing."""
    exe = shutil.which("py-spy") or str(Path(SUP_SITE) / "bin" / "py-spy")
    if os.environ.get("SPY") != "1" or not Path(exe).exists():
        return []
    try:
        return gpu_spy.start(exe, gpu_spy.targets(engine_tree(status()["pid"])), WORK, name)
    except Exception as exc:  # (never the step's end: it runs on unrecorded)
        print(f"py-spy not started: {exc!r}", flush=True)
        return []


def core_of(pid: int) -> Any:
    return next(p for p in engine_tree(pid) if p.name().startswith("VLLM::EngineCor"))


def result(phase: str, **values: Any) -> None:
    line = json.dumps({"phase": phase, **values})
    print("RESULT " + line, flush=True)
    with (WORK / "results.jsonl").open("a") as f:
        f.write(line + "\n")
    out = os.environ.get("OUT")
    if out:
        for name in ("results.jsonl", "events.jsonl"):
            if (WORK / name).exists():
                (Path(out) / name).write_bytes((WORK / name).read_bytes())
        log_path = WORK / "daemon.log"
        if log_path.exists():
            with log_path.open("rb") as f:
                f.seek(max(0, log_path.stat().st_size - 4 * 2**20))
                (Path(out) / "daemon-tail.log").write_bytes(f.read())


def protected_again(st: dict[str, Any]) -> bool:
    """A pair that re-arms after every fault, armed: RUNNING, its standby ready (proven),
    no re-arm under way, nothing held at the proxy; the asymmetric pair's (issue 35) thin
    standby not the one serving, the snapshot pair's (issue 49) standby a copy of its
    images. A snapshot pair whose dump failed never re-arms: `Hopeless`, at once."""
    sb = st.get("standby") or {}
    snap = sb.get("snapshot")
    if snap and snap.get("off"):
        raise Hopeless(f"the standby is not dumped: {snap['off']}")
    armed = bool(st["state"] == "RUNNING" and sb.get("state") == "ready"
                 and sb.get("protected") and (st.get("admission") or {}).get("held") is None)
    if snap is not None:
        return armed and bool(snap.get("copy"))
    return armed and bool(sb.get("thin")) and not sb.get("thin_serves")


def started_as() -> str | None:
    """The standby design the last `start` was given ("thin", "snapshot", ...)."""
    started = WORK / "start.json"
    return json.loads(started.read_text())[0] if started.exists() else None


def is_pair(st: dict[str, Any]) -> bool:
    """A pair that re-arms after every fault: the asymmetric one (`start thin`) or the
    snapshot one (`start snapshot`), as the last start was made; else its standby thin
    now. (Not the `thin` key of status, which every standby has: a plan on the sleeping
    pair at 0.88 waited 480 s for a thin standby that never comes, twice.)"""
    if (WORK / "start.json").exists():
        return started_as() in ("thin", "snapshot")
    return bool((st.get("standby") or {}).get("thin"))


class Timeline:
    """`status` polled every 0.2 s from a moment (a fault): each change of the engine's
    state, its pid, the standby's state, thinness, sleep, and whether the proxy holds
    requests, with its time; and when the pair was first protected again with another
    engine serving than `old_pid` (the one the fault hit)."""

    def __init__(self, t0: float, old_pid: int) -> None:
        self.t0, self.old_pid = t0, old_pid
        self.changes: list[dict[str, Any]] = []
        self.protected_at: float | None = None
        self.last: dict[str, Any] = {}
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        seen = None
        while not self.stop.is_set():
            try:
                st = status()
            except Exception:  # the daemon may be between states
                time.sleep(0.2)
                continue
            self.last = st
            sb = st.get("standby") or {}
            key = (st["state"], st.get("pid"), sb.get("state"), sb.get("pid"), sb.get("thin"),
                   sb.get("thin_serves"), sb.get("asleep"), sb.get("protected"),
                   (st.get("admission") or {}).get("held"))
            now = time.monotonic()
            if key != seen:
                seen = key
                self.changes.append({"t": round(now - self.t0, 2), "state": key[0],
                                     "pid": key[1], "standby": key[2], "standby_pid": key[3],
                                     "thin": key[4], "thin_serves": key[5], "asleep": key[6],
                                     "protected": key[7], "held": key[8]})
            if protected_again(st) and st.get("pid") != self.old_pid:
                self.protected_at = now
                return
            time.sleep(0.2)

    def wait(self, timeout: float) -> float | None:
        """Seconds from the moment to protected again (None: not within `timeout`)."""
        self.thread.join(timeout)
        self.stop.set()
        return round(self.protected_at - self.t0, 2) if self.protected_at else None


def kv_info() -> dict[str, Any]:
    """Each engine's KV cache (issue 35, (e)): vLLM's own start lines about it from the
    daemon's log (by generation; a line names its process's pid), each spawn's pid, and
    `vllm:cache_config_info` from the serving engine's /metrics and the standby's."""
    cfg = json.loads((Path(MODEL) / "config.json").read_text())
    heads = cfg.get("num_key_value_heads") or cfg["num_attention_heads"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    per_token = 2 * cfg["num_hidden_layers"] * heads * head_dim * 2  # K and V, bf16
    keys = ("KV cache", "gpu_memory_utilization", "Model loading took", "CUDA graph",
            "Memory profiling", "Maximum concurrency", "num_gpu_blocks", "GPU blocks")
    lines: list[dict[str, Any]] = []
    for raw in (WORK / "daemon.log").read_bytes().decode(errors="replace").splitlines():
        if not raw.startswith("{") or not any(k in raw for k in keys):
            continue
        try:
            e = json.loads(raw)
        except ValueError:
            continue
        if e.get("source") == "engine":
            lines.append({k: e.get(k) for k in ("timestamp", "generation", "proc_pid")}
                         | {"line": str(e.get("event"))[:400]})
    spawns = [{k: e.get(k) for k in ("time", "pid", "generation")}
              for e in events() if e["event"] == "spawn"]
    st = status()
    host = st["engine"]["host"]
    served: dict[str, Any] = {}
    for who, port in (("serving", st["engine"]["port"]),
                      ("standby", (st.get("standby") or {}).get("port"))):
        if port is None:
            continue
        try:
            text = urllib.request.urlopen(f"http://{host}:{port}/metrics",
                                          timeout=5).read().decode()
        except Exception as exc:
            served[who] = {"port": port, "error": repr(exc)}
            continue
        info = next((x for x in text.splitlines()
                     if x.startswith("vllm:cache_config_info{")), None)
        labels: dict[str, str] = {}
        if info:
            for part in info[info.index("{") + 1:info.rindex("}")].split('",'):
                k, _, v = part.partition("=")
                labels[k.strip()] = v.strip().strip('"')
        row: dict[str, Any] = {"port": port, **{k: labels.get(k) for k in (
            "num_gpu_blocks", "block_size", "gpu_memory_utilization", "cache_dtype")}}
        if labels.get("num_gpu_blocks", "").isdigit() and labels.get("block_size", "").isdigit():
            tokens = int(labels["num_gpu_blocks"]) * int(labels["block_size"])
            row.update(tokens=tokens, gib=round(tokens * per_token / 2**30, 2))
        served[who] = row
    return {"bytes_per_token": per_token, "engines": served, "spawns": spawns,
            "log_lines": lines[-60:], "serving_pid": st.get("pid"),
            "standby": st.get("standby")}


def host_memory(pid: int) -> dict[str, int]:
    """A process's host memory in MiB: resident, its shared part (torch's default pinned
    memory), and what of it is in transparent huge pages."""
    out = {}
    for name in (f"/proc/{pid}/status", f"/proc/{pid}/smaps_rollup"):
        with contextlib.suppress(OSError):
            for line in Path(name).read_text().splitlines():
                key, _, value = line.partition(":")
                if key in ("VmRSS", "RssShmem", "AnonHugePages"):
                    out[key] = int(value.split()[0]) // 1024
    return out


def engine_addr() -> str:
    """The serving engine's internal address (with a standby the two engines take turns
    on their ports)."""
    e = status()["engine"]
    return f"{e['host']}:{e['port']}"


def engine_running() -> float:
    """vllm:num_requests_running from the engine's own /metrics (0 when unreadable)."""
    return running_at(engine_addr())


def running_at(addr: str, timeout: float = 2.0) -> float:
    """vllm:num_requests_running from the /metrics of the engine at `addr` (0 when
    unreadable)."""
    try:
        text = urllib.request.urlopen(f"http://{addr}/metrics",
                                      timeout=timeout).read().decode()
    except Exception:
        return 0.0
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("vllm:num_requests_running"))


def exporter_series(prefix: str | tuple[str, ...]) -> dict[str, float]:
    text = urllib.request.urlopen(f"http://{EXPORTER}/metrics", timeout=10).read().decode()
    return {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1])
            for line in text.splitlines() if line.startswith(prefix)}
