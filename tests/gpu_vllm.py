"""The GPU path against the real vLLM on a lent NVIDIA machine (docs/gpu-validation.md).

Not collected by pytest (no GPU in CI): run by hand on the GPU machine, in phases that fit
its 10-minute calls, the daemon living on between them in its own session:

    python3 tests/gpu_vllm.py start     # daemon up (installed from the project's wheel),
                                        # NVML in status and on the exporter
    python3 tests/gpu_vllm.py start awake  # the same, with an awake standby beside it
    python3 tests/gpu_vllm.py start sleep 0.42  # a sleeping standby, each engine at 0.42
    python3 tests/gpu_vllm.py kv-reset  # KV resets through sleep/wake under a small load
    python3 tests/gpu_vllm.py crash     # SIGKILL of the API server: orphan, release, restart
    python3 tests/gpu_vllm.py hang      # SIGSTOP of VLLM::EngineCore: detected and healed
    python3 tests/gpu_vllm.py continue kill late   # vLLM's own bench client through the
    python3 tests/gpu_vllm.py continue kill early  # proxy, 3000 prompts at 128 streams,
    python3 tests/gpu_vllm.py continue stop late   # EngineCore SIGKILLed / SIGSTOPped 5 s
    python3 tests/gpu_vllm.py continue restart late  # (or `vllm-supervisorctl restart`)
                                              # after 64 run, or as soon as all 128 are in
                                              # their first tokens: every stream whole,
                                              # four raw streams tapped (issues 12, 20)
    python3 tests/gpu_vllm.py throughput 1 8 32 256  # output tokens/s, proxy vs direct
    python3 tests/gpu_vllm.py kv-reset-streams 256 3000 3  # `vllm bench serve` at 256
                                        # streams, three KV resets during it, each 3 s after
                                        # the last ended (issue 35: `drain = "continue"`
                                        # pauses the streams instead of draining them)
    python3 tests/gpu_vllm.py rearm     # a cold restart that arms a sleeping standby again
                                        # (after a swap at 0.88 none fits beside: no_room)
    python3 tests/gpu_vllm.py start thin [0.60 [0.28]]  # an asymmetric pair (issue 35):
                                        # the engine at 0.60, `standby_args` a thin standby
                                        # at 0.28, `standby = "sleep"`, `drain = "continue"`
                                        # (0.62 + 0.30 does not fit an 80 GB H100 in the 8B
                                        # shape: docs/gpu-validation.md)
    python3 tests/gpu_vllm.py protected  # wait until protected again (the pair: RUNNING,
                                        # the thin standby ready and not serving, nothing
                                        # held); its status and the KV caches
    python3 tests/gpu_vllm.py kills 3   # `continue kill late` three times, each as soon as
                                        # protected again; each kill's time to protected
                                        # again (KILLS_BUDGET_S: no kill begun that would not
                                        # end within it, by the last one's length)
    python3 tests/gpu_vllm.py kill-twice 10  # the same load; a second SIGKILL (of the core
                                        # that serves then, the thin one) 10 s after the
                                        # first, while the full-size engine starts
    python3 tests/gpu_vllm.py plan kill-swapback  # a kill under 8000 prompts: the swap
                                        # back to the full-size engine under load too
    python3 tests/gpu_vllm.py kv-info   # each engine's KV cache: vLLM's own start lines
                                        # (from the daemon's log) and `vllm:cache_config_info`
    python3 tests/gpu_vllm.py plan kill kill kill restart kv-info kv-reset-streams \
        kill-twice stop                 # those steps in order, across calls: the same
                                        # command again goes on where the last call stopped
    MAX_MODEL_LEN=4608 python3 tests/gpu_vllm.py start thin  # (room for 4096-token prompts)
    python3 tests/gpu_vllm.py plan cost-none-1536 cost-kill-1536 cost-restart-1536 \
        cost-kvreset-1536               # issue 51: what a fault costs at a prompt length,
                                        # the no-fault run first (`phase_cost`, `cost_row`)
    SHAPE=8b KV_TIER=1 python3 tests/gpu_vllm.py plan cost-none-1536 cost-kill-1536 \
        tier-off cost-none-1536 cost-kill-1536  # the same with and without the KV tier in
                                        # one session (`tier-on`/`tier-off`: the daemon
                                        # stopped and started again as its last `start`)
    SHAPE=8b python3 tests/gpu_vllm.py start  # issue 49: the sleeping pair at 0.88, then
    python3 tests/gpu_vllm.py plan kv-reset cost-kill-32 backup-off kv-reset cost-kill-32
                                        # a kill of an engine that slept and woke (three
                                        # KV resets), with the daemon's sleep backup, then
                                        # with torch's default (`SLEEP_BACKUP=off`: the
                                        # operator's own environment)
    SHAPE=8b python3 tests/gpu_vllm.py start snapshot  # issue 49's route 3 in the daemon:
                                        # both at 0.88, `standby = "snapshot"` (the standby
                                        # started first, asleep, dumped to /tmp/vs-snap
                                        # by .tools/criu, carried; a copy restored as the
                                        # standby, the engine beside it); then `plan kv-info
                                        # kill kill kill restart kv-reset-streams stop`: each
                                        # fault re-armed by a copy (`protected_again`)
    python3 tests/gpu_vllm.py stop      # stopped; nothing left on the GPU

TP=2 (with SHAPE=8b, on nvidia-h100-x2): both engines `--tensor-parallel-size 2`, gpus 0 and 1.
SHAPE=8b (issue 35's setup): the model is ~/m8b, made from the staged tiny model's files
with Llama-3.1-8B's dimensions (`--load-format dummy`: real sizes, random weights), both
engines at `--gpu-memory-utilization 0.88` with torch.compile and CUDA graphs (no
--enforce-eager), `standby = "sleep"` (the standby starts first and sleeps, the engine
then starts beside it) and `drain = "continue"`; `start` alone takes 4-5 minutes cold.
`start thin`: the asymmetric pair (`engine.standby_args`), the engine at 0.60 and the thin
standby at 0.28 (both fit awake: the engine starts first, the standby beside it, asleep);
with it `continue` waits for "protected again" before the fault and times the fault to it.

PROXY_WORKERS=N: `start` runs the proxy over N processes (tests/gpu_plane.py measures it).
SPY=1: each KV reset of `kv-reset-streams` and `cost-kvreset-N` is recorded by py-spy in
the engine's API server and core for 8 s (`tests/gpu_spy.py`; WORK/spy-*.txt, the top
stacks in the reset's row).
Environment: SUP_SITE (the supervisor's --target site), VLLM_SITE (vLLM's, kept apart:
vLLM's dependencies bring the PyPI package `supervisor`), MODEL (the staged model), OUT
(where results go). Each phase prints `RESULT {json}` and appends it to
$WORK/results.jsonl; failures raise.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
import tomllib
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
from tests import gpu_spy, gpu_waits  # noqa: E402
from tests.gpu_shapes import make_m8b  # noqa: E402
from tests.harness import write_config  # noqa: E402


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


def phase_start(standby: str | None = None, share: str | None = None,
                thin_share: str | None = None) -> None:
    """`standby` "thin": the asymmetric pair, the engine at `share` (0.60) and its sleeping
    standby at `thin_share` (0.28) through `engine.standby_args`. (At 0.62 + 0.30 the thin
    one ran out of memory in its warm-up beside the 8B engine: each vLLM engine holds
    2.5-3.2 GiB of the card beyond its share.)"""
    WORK.mkdir(parents=True, exist_ok=True)
    # (what a plan's restart of the daemon starts again: `phase_restart_daemon`)
    (WORK / "start.json").write_text(json.dumps([standby, share, thin_share]))
    demo = tomllib.loads((ROOT / "config.gpu.toml").read_text())
    thin: list[str] = []
    if standby == "thin":
        standby, share = "sleep", share or "0.60"
        thin = ["--gpu-memory-utilization", thin_share or "0.28"]
    if SHAPE == "8b":
        standby, share = standby or "sleep", share or "0.88"
        if not (Path(MODEL) / "config.json").exists():
            make_m8b(Path(MODEL))
        # torch.compile and CUDA graphs on (no --enforce-eager): a cold start of the
        # standby and then the engine took about 240 s on a fresh H100
        # MAX_MODEL_LEN (issue 51): 4608 lets the `cost` steps send 4096-token prompts
        args = ["--served-model-name", "tiny-llama", "--load-format", "dummy",
                "--dtype", "bfloat16", "--max-model-len",
                os.environ.get("MAX_MODEL_LEN", "2048"), "--enable-sleep-mode",
                "--gpu-memory-utilization", share]
        if TP > 1:  # issue 35's (a) with a TP engine: both engines span the same GPUs
            args += ["--tensor-parallel-size", str(TP)]
            demo["engine"]["gpus"] = list(range(TP))
        extra = {"startup_timeout_s": 600.0, "drain": "continue"}
    else:
        standby, share = standby or "none", share or "0.3"
        args = ["--served-model-name", "tiny-llama", "--enforce-eager",
                "--gpu-memory-utilization", share, "--max-model-len", "512",
                "--enable-sleep-mode"]
        extra = {"startup_timeout_s": 480.0}
    if WEIGHT_CACHE:  # issue 36: the engine's weights from `vllm preload`, real bytes
        # (tests/gpu_v033.py ckpt: ~/ckpt8b), no sleep mode (refused beside the cache), no
        # standby; `crash` then times a restart that maps the cached weights
        args = [a for a in args if a != "--enable-sleep-mode"]
        i = args.index("--load-format")
        del args[i:i + 2]
        standby = "none"
        demo["engine"]["weight_cache"] = True
    env = {"PYTHONPATH": VLLM_SITE, "VLLM_SERVER_DEV_MODE": "1"}
    if os.environ.get("SLEEP_BACKUP") == "off":  # torch's default pinned backup, as an
        # operator's own environment says it (engine/process/sleep_backup.py: theirs wins)
        env.update(PYTORCH_CUDA_ALLOC_CONF="pinned_use_cuda_host_register:False",
                   GLIBC_TUNABLES="glibc.malloc.hugetlb=0")
    if os.environ.get("KV_TIER") == "1":  # issue 51: the pair on one fs KV tier (0.32+),
        # the daemon's (engine.kv_tier): on /dev/shm in 256-token chunks, kept under its bound
        root = Path("/dev/shm/vs-kv-tier")
        shutil.rmtree(root, ignore_errors=True)
        demo["engine"].update(kv_tier=str(root),
                              kv_tier_max_gib=float(os.environ.get("KV_TIER_MAX_GIB", "24")),
                              kv_tier_cpu_gib=float(os.environ.get("KV_TIER_GIB", "8")))
    if os.environ.get("RUST_FE") == "1":  # vLLM 0.33's Rust API server in front (issue 36)
        env["VLLM_USE_RUST_FRONTEND"] = "1"
    if HANG_EXT:  # `hang-rpc`: a worker method that blocks the core's loop (it runs there)
        ext = WORK / "ext"
        ext.mkdir(parents=True, exist_ok=True)
        (ext / "vs_hang_ext.py").write_text(HANG_EXT_SOURCE)
        args += ["--worker-extension-cls", "vs_hang_ext.Hang"]
        env["PYTHONPATH"] = f"{VLLM_SITE}:{ext}"
    demo["engine"].update({
        # `vllm serve` (the module form is deprecated); the staged site has no `vllm`
        # script on PATH, so its CLI module runs it
        "command": [sys.executable, "-m", "vllm.entrypoints.cli.main", "serve", MODEL],
        "args": args,
        "env": env,
        "drain_timeout_s": 20.0, "standby": standby, **extra,
        **({"standby_args": thin, "drain": "continue"} if thin else {})})
    demo["control"] = {"socket": str(WORK / "control.sock")}
    demo["daemon"] = {"runtime_dir": str(WORK)}
    demo["audit"] = {"path": str(WORK / "events.jsonl")}
    demo["log"] = {"format": "json", "level": "info"}
    demo["canary"] = {"period_s": 2.0, "timeout_s": 5.0}
    demo["proxy"].update({"listen": PROXY})
    if os.environ.get("PROXY_WORKERS"):  # the front door over N processes (issue 38)
        demo["proxy"]["workers"] = int(os.environ["PROXY_WORKERS"])
    snapshot = standby == "snapshot"
    if snapshot:  # issue 49's route 3 in the daemon: the standby's images on tmpfs
        # (~22 GiB for the 8B shape), dumped and restored by sid's CRIU 4.2.1, carried
        snapshot_tmpfs()
        demo["engine"].update(criu=str(criu_wrapper()), snapshot_dir=str(SNAPSHOTS))
    cfg = write_config(WORK / "config.toml", demo)
    t0 = time.monotonic()
    daemon = subprocess.Popen([sys.executable, "-m", "supervisor", "run", "--config", str(cfg)],
                              stdout=(WORK / "daemon.log").open("ab"), stderr=subprocess.STDOUT,
                              env={**os.environ, "PYTHONPATH": SUP_SITE}, cwd=str(WORK),
                              start_new_session=True)
    # (a snapshot pair serves once its standby started, slept, was dumped and restored)
    st = wait(lambda: status()["state"] == "RUNNING" and status(),
              900 if snapshot else 580 if SHAPE == "8b" else 540, "RUNNING", daemon)
    startup_s = time.monotonic() - t0
    if not WEIGHT_CACHE:  # (no sleep mode beside a weight cache)
        wait(lambda: status()["remedies"]["kv_reset_unavailable"] is None
             and status()["remedies"]["kv_reset"], 60, "sleep mode probed")
    wait(lambda: status()["signals"].get("engine_gpu_memory_bytes"), 60, "NVML readings")
    standby_s = None
    if standby != "none":
        t1 = time.monotonic()
        if thin or snapshot:  # (ready and asleep; a snapshot pair's a copy)
            try:
                wait(lambda: protected_again(status()), 540, "the thin standby or copy ready")
            except AssertionError as exc:  # (what the daemon says of it, then the error)
                result("start-standby", error=str(exc), standby=status().get("standby"),
                       startup_s=round(startup_s, 1),
                       snapshot=snapshot_facts() if snapshot else None)
                raise
        else:
            wait(lambda: status()["standby"]["state"] == "ready", 540, "the standby ready")
        standby_s = round(time.monotonic() - t1, 1)
        time.sleep(2.0)  # (NVML's view of the standby once asleep)
    st = status()
    spare = st.get("standby") or {}
    spare_tree = engine_tree(spare["pid"]) if spare.get("pid") else []
    spare_gpu = {str(pid): round(b / 2**20) for pid, b in nvml_processes().items()
                 if pid in {q.pid for q in spare_tree}}
    sig = st["signals"]
    procs = nvml_processes()
    tree = {p.pid: p.name() for p in engine_tree(st["pid"])}
    # what the daemon gave the engine (issue 27): its GPUs, in NVML's order
    pinning = {str(p.pid): {k: v for k, v in p.environ().items() if k.startswith("CUDA_")}
               for p in engine_tree(st["pid"])}
    metrics = urllib.request.urlopen(f"http://{EXPORTER}/metrics", timeout=10).read().decode()
    exported = {line.split(" ")[0]: line.split(" ")[-1] for line in metrics.splitlines()
                if line.startswith(("vllm_supervisor_gpu_", "vllm_supervisor_engine_gpu"))}
    result("start", shape=SHAPE, model=MODEL, args=args,
           supervisor_from=supervisor.__file__, startup_s=round(startup_s, 1),
           standby=st.get("standby"), standby_ready_after_s=standby_s,
           gpu_memory_utilization=share, standby_nvml_mib=spare_gpu,
           reason=st["reason"],
           signals={k: v for k, v in sig.items() if k.startswith(("gpu_", "engine_gpu"))},
           nvml_processes_mib={str(p): round(b / 2**20) for p, b in procs.items()},
           engine_tree=tree, engine_cuda_env=pinning, exporter=exported,
           remedies=st["remedies"], standby_args=thin or None,
           kv_cache=kv_info() if thin or snapshot else None,
           snapshot=snapshot_facts() if snapshot else None,
           weight_cache=st.get("weight_cache"),
           dev_routes=st.get("dev_routes"), off=st.get("off"),
           stack_dumps=st.get("stack_dumps"))


# `start snapshot`: engine.snapshot_dir, a tmpfs of its own (not in /dev/shm, which each
# copy gets afresh: the daemon refuses it since the H200 run where every copy failed so)
SNAPSHOTS = Path("/tmp/vs-snap")


def snapshot_tmpfs() -> None:
    """SNAPSHOTS emptied, on a tmpfs mounted there (the machine's root)."""
    SNAPSHOTS.mkdir(parents=True, exist_ok=True)
    if not os.path.ismount(SNAPSHOTS):
        subprocess.run(["mount", "-t", "tmpfs", "-o", "size=100g", "tmpfs", str(SNAPSHOTS)],
                       check=True)
    for old in SNAPSHOTS.iterdir():
        shutil.rmtree(old) if old.is_dir() else old.unlink()


def criu_wrapper() -> Path:
    """`scripts/setup.sh criu`'s CRIU (sid's 4.2.1 and its libraries in .tools/criu/root,
    carried to the machine), run through its own loader from where the checkout is."""
    root = ROOT / ".tools" / "criu" / "root"
    lib = root / "usr" / "lib" / "x86_64-linux-gnu"
    if not (root / "usr" / "sbin" / "criu").exists():
        raise Hopeless(f"no CRIU at {root}: carry .tools/criu (scripts/setup.sh criu)")
    path = WORK / "criu"
    path.write_text(f"#!/bin/sh\nexec {lib}/ld-linux-x86-64.so.2 --library-path {lib} "
                    f'{root}/usr/sbin/criu "$@"\n')
    path.chmod(0o755)
    return path


def snapshot_facts() -> dict[str, Any]:
    """The snapshot pair's images (their size on tmpfs), the dump's and the copies'
    audit lines, and the host memory of the standby's tree (a copy, asleep)."""
    size = sum(f.stat().st_size for f in SNAPSHOTS.rglob("*") if f.is_file()) \
        if SNAPSHOTS.exists() else 0
    names = ("standby_dumped", "standby_not_dumped", "standby_images_dropped",
             "standby_ready", "standby_failed")
    sb = status().get("standby") or {}
    tree = engine_tree(sb["pid"]) if sb.get("pid") else []
    lines = (WORK / "daemon.log").read_bytes().decode(errors="replace").splitlines() \
        if (WORK / "daemon.log").exists() else []
    said = ("copy's memory collapsed into huge pages", "copy's memory not collapsed",
            "engine restored from its snapshot", "standby images kept from an earlier run",
            "kept images are of another start")
    return {"images_gib": round(size / 2**30, 2),
            "audit": [e for e in events() if e.get("event") in names][-8:],
            # each copy's collapse into huge pages (its seconds for ~18 GiB) and restore
            "logged": [line[:600] for line in lines if any(x in line for x in said)][-8:],
            "standby_host_mib": {str(p.pid): host_memory(p.pid) for p in tree},
            "standby_nvml_mib": {str(pid): round(b / 2**20) for pid, b in
                                 nvml_processes().items() if pid in {q.pid for q in tree}}}


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


def phase_kv_info() -> None:
    result("kv-info", **kv_info())


def phase_protected(timeout: float = 540) -> None:
    """Wait until the pair is protected again (after a call ran out in the middle)."""
    t0 = time.monotonic()
    st = wait(lambda: protected_again(s := status()) and s, timeout, "protected again")
    result("protected", waited_s=round(time.monotonic() - t0, 1), state=st["state"],
           pid=st.get("pid"), standby=st.get("standby"), admission=st.get("admission"),
           kv_cache=kv_info())


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


def phase_kv_reset() -> None:
    runs = []
    with Load() as load:
        time.sleep(3)
        for _ in range(3):
            before = status()["signals"].get("engine_gpu_memory_bytes")
            r = ctl("kv-reset")
            assert r.returncode == 0, r.stdout + r.stderr
            ev = [e for e in events() if e["event"] == "remedy"][-1]
            runs.append({"duration_s": ev["duration_s"], "steps_s": ev["steps_s"],
                         "held": ev["held"], "idle_counts": ev.get("idle_counts"),
                         "engine_gpu_mib_before":
                         round(before / 2**20) if before else None})
            time.sleep(3)
    # memory actually dropped while asleep: sleep alone, read NVML, wake
    core = core_of(status()["pid"])
    full = nvml_processes().get(core.pid)
    base = "http://127.0.0.1:8100"
    urllib.request.urlopen(urllib.request.Request(base + "/sleep?level=1", method="POST"),
                           timeout=60).read()
    asleep = nvml_processes().get(core.pid)
    urllib.request.urlopen(urllib.request.Request(base + "/wake_up", method="POST"),
                           timeout=60).read()
    awake = nvml_processes().get(core.pid)
    assert complete() == 200
    st = status()
    result("kv-reset", runs=runs, load=load.summary(), restarts=st["restarts"],
           core_host_mib=host_memory(core.pid),
           core_gpu_mib={"before": round((full or 0) / 2**20),
                         "asleep": round((asleep or 0) / 2**20),
                         "awake": round((awake or 0) / 2**20)})
    assert load.summary()["failed"] == 0 and st["restarts"] == 0


def phase_crash() -> None:
    st = status()
    main = st["pid"]
    core = core_of(main)
    with Load(clients=4, max_tokens=16) as load:
        time.sleep(2)
        t0 = time.monotonic()
        os.kill(main, signal.SIGKILL)
        orphan_ppid: int | str = "not seen"
        while time.monotonic() - t0 < 2:  # the core, orphaned, until the daemon kills it
            try:
                ppid = core.ppid()
            except Exception:  # gone already
                break
            if ppid != main:
                orphan_ppid = ppid
                break
        # the core's end and its NVML release, watched together from the kill (each
        # observed at most one poll, ~0.2 s, after it happened)
        seen: dict[str, float] = {}

        def both() -> bool:
            if "gone" not in seen and not running(core.pid):
                seen["gone"] = time.monotonic()
            if "released" not in seen and core.pid not in nvml_processes():
                seen["released"] = time.monotonic()
            return len(seen) == 2

        wait(both, 120, "the core gone and its GPU memory released")
        gone, released = seen["gone"], seen["released"]
        released_wall = time.time() - (time.monotonic() - released)
        st2 = wait(lambda: status()["state"] == "RUNNING" and status()["restarts"] >= 1
                   and status(), 540, "RUNNING again")
        back = time.monotonic()
        time.sleep(3)
    evs = events()
    reaped = [e for e in evs if e["event"] == "reaped"][-1]
    spawn = [e for e in evs if e["event"] == "spawn"][-1]
    from datetime import datetime

    spawn_wall = datetime.fromisoformat(spawn["time"].replace("Z", "+00:00")).timestamp()
    reaped_wall = datetime.fromisoformat(reaped["time"].replace("Z", "+00:00")).timestamp()
    # The daemon's own proof: its take-down reports no problem only once NVML lists none
    # of the tree's pids, and the next spawn comes after that report.
    proved = reaped["problem"] is None and spawn_wall >= reaped_wall
    result("crash", orphan_ppid=orphan_ppid, core_pid=core.pid,
           daemon_proved_release_before_spawn=proved,
           seen_released_before_spawn=released_wall <= spawn_wall,
           core_gone_after_s=round(gone - t0, 2), nvml_released_after_s=round(released - t0, 2),
           running_again_after_s=round(back - t0, 1), reaped=reaped, next_spawn=spawn,
           last_exit=st2["last_exit"], load=load.summary())
    assert proved and load.summary()["failed"] == 0


def phase_hang() -> None:
    st = status()
    core = core_of(st["pid"])
    restarts = st["restarts"]
    with Load(clients=4, max_tokens=16) as load:
        time.sleep(2)
        t0 = time.monotonic()
        core.send_signal(signal.SIGSTOP)
        decided = wait(lambda: status()["state"] != "RUNNING" and time.monotonic(), 120,
                       "the hang verdict")
        st2 = wait(lambda: status()["state"] == "RUNNING"
                   and status()["restarts"] > restarts and status(), 540, "RUNNING again")
        back = time.monotonic()
        time.sleep(3)
    decision = [e for e in events() if e["event"] == "decision"][-1]
    result("hang", detected_after_s=round(decided - t0, 1),
           running_again_after_s=round(back - t0, 1), decision=decision,
           state_reason=st2["reason"], load=load.summary())
    assert decision["rule"] == "hang"


HANG_EXT_SOURCE = '''import time


class Hang:
    """Mixed into vLLM's worker (`--worker-extension-cls`): `vs_hang` blocks the thread
    that runs it, the engine core's busy loop with one GPU, as a stuck kernel would."""

    def vs_hang(self, seconds: str) -> None:
        time.sleep(float(seconds))
'''


def phase_hang_rpc(seconds: float = 600.0) -> None:
    """A hang with the process running (HANG_EXT=1 at `start`): `/collective_rpc` calls
    the worker's `vs_hang`, which blocks the core's loop, as a stuck kernel would; its
    other threads run on (vLLM 0.33's watchdog can dump them, which a SIGSTOP cannot give).
    The daemon's verdict, the handover, and the evidence bundle (its files to $OUT)."""
    st = status()
    base, decisions = engine_addr(), len([e for e in events() if e["event"] == "decision"])
    body = json.dumps({"method": "vs_hang", "args": [str(seconds)]}).encode()

    def call_hang() -> None:
        req = urllib.request.Request(f"http://{base}/collective_rpc", data=body,
                                     headers={"content-type": "application/json"})
        with contextlib.suppress(Exception):  # cut when the engine is taken down
            urllib.request.urlopen(req, timeout=seconds + 30).read()

    with Load(clients=4, max_tokens=16) as load:
        time.sleep(2)
        t0 = time.monotonic()
        threading.Thread(target=call_hang, daemon=True).start()
        decided = wait(lambda: len([e for e in events() if e["event"] == "decision"])
                       > decisions and time.monotonic(), 180, "the hang verdict")
        wait(lambda: status()["state"] == "RUNNING" and status()["pid"] != st["pid"], 560,
             "another engine serving")
        back = time.monotonic()
        time.sleep(3)
    evs = events()
    decision = [e for e in evs if e["event"] == "decision"][-1]
    evidence = [e for e in evs if e["event"] == "evidence"]
    bundle = Path(evidence[-1]["path"]) if evidence else None
    files = ({f.name: f.stat().st_size for f in sorted(bundle.iterdir())}
             if bundle and bundle.is_dir() else {})
    out = os.environ.get("OUT")
    if out and bundle and bundle.is_dir():
        subprocess.run(["tar", "czf", str(Path(out) / "hang-evidence.tgz"), "-C",
                        str(bundle.parent), bundle.name], check=False)
    result("hang-rpc", detected_after_s=round(decided - t0, 1),
           serving_again_after_s=round(back - t0, 1), decision=decision,
           evidence=evidence[-1] if evidence else None, bundle_files=files,
           load=load.summary())
    assert decision["rule"] in ("hang", "progress", "canary") or decision


def engine_addr() -> str:
    """The serving engine's internal address (with a standby the two engines take turns
    on their ports)."""
    e = status()["engine"]
    return f"{e['host']}:{e['port']}"



# `late`: the fault 5 s after 64 run at the engine, or after this long into the main run
LATE_BY_S = 8.0


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


def exporter_series(prefix: str | tuple[str, ...]) -> dict[str, float]:
    text = urllib.request.urlopen(f"http://{EXPORTER}/metrics", timeout=10).read().decode()
    return {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1])
            for line in text.splitlines() if line.startswith(prefix)}


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


HANDOVER_EVENTS = ("core_exit", "failover", "standby_woken", "failover_done",
                   "failover_failed", "drained", "take_down", "reaped", "remedy",
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
        for name in ("standby_woken", "failover_done", "take_down", "reaped"):
            if name in first:
                out[f"{name}_after_failover_s"] = round(at(first[name]) - at(fo), 3)
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


def phase_continue(fault: str, when: str, tag: str | None = None, prompts: int = 3000,
                   second_after: float | None = None,
                   protected_timeout: float = 420, input_len: int = 32) -> dict[str, Any]:
    """Issue 20's procedure: 3000 streams of 256 tokens through the proxy at 128 at a
    time; once the client says its main run started, the core is SIGKILLed (or
    SIGSTOPped) `late` (5 s after the engine runs >= 64) or `early` (as soon as it runs
    all 128, in their first tokens). Four raw streams ride along (two started a second
    before the fault, two just before it, in their prefill). Every stream must end whole:
    0 failed, the tokens generated equal to those asked for, none short.

    With an asymmetric pair (`start thin`) the fault waits until the pair is protected
    again, and the time from the fault to protected again is measured (`Timeline`);
    `second_after`: the core that serves then (the thin one) is SIGKILLed too, that many
    seconds after the first kill (no assertion on the streams: it is a cold start).

    `fault` "none": the same load and moment, nothing done (the baseline of a `cost` row);
    `input_len`: the prompts' tokens (issue 51). The result's `cost` is the row of
    docs/standby.md's table of what a fault costs (`cost_row`)."""
    conc, want = 128, 256
    tag = tag or f"continue-{fault}-{when}"
    pair = is_pair(status())
    if pair:
        wait(lambda: protected_again(status()), 540, "protected again")
    elif (status().get("standby") or {}).get("state", "none") not in ("none", "no_room"):
        wait(lambda: status()["standby"]["state"] == "ready", 400, "the standby ready")
    st = status()
    restarts = st["restarts"]
    core = core_of(st["pid"])
    log_at = (WORK / "daemon.log").stat().st_size
    events_at = len(events())
    before = exporter_series("vllm_supervisor_proxy_continuations_total")
    waits_before = exporter_series(gpu_waits.SERIES)
    fired: dict[str, float] = {}
    second: dict[str, Any] = {}
    taps: list[Tap] = []
    timeline: list[Timeline] = []

    def fault_once() -> None:
        log_path = WORK / f"{tag}.log"
        wait(lambda: log_path.exists()
             and b"Starting main benchmark run" in log_path.read_bytes(), 300,
             "the client's main run")
        fired["main"] = time.monotonic()
        if when == "early":
            wait(lambda: engine_running() >= conc - 8, 60, "the 128 running at the engine")
            taps.extend(Tap(f"fresh{i}", want).start() for i in range(2))
            time.sleep(0.05)
        else:
            # 64 running as the engine's page says, or LATE_BY_S into the main run: under
            # long prompts that page took over 2 s to answer and a kill fired anywhere
            # from 8 to 46 s in (issue 51, 2026-11-29): the time bounds where it lands
            late_by = time.monotonic() + LATE_BY_S
            wait(lambda: time.monotonic() >= late_by or running_at(engine_addr(), 5.0) >= 64,
                 300, "64 requests running at the engine")
            time.sleep(4.0)
            taps.extend(Tap(f"midway{i}", want).start() for i in range(2))
            time.sleep(0.95)
            taps.extend(Tap(f"fresh{i}", want).start() for i in range(2))
            time.sleep(0.05)
        fired["running"] = engine_running()
        fired["t"] = time.monotonic()
        if fault == "none":
            return
        if pair:
            timeline.append(Timeline(fired["t"], st["pid"]))
        if fault == "restart":  # an operator's restart (a swap with a standby)
            threading.Thread(target=ctl, args=("restart", "--reason", "gpu test"),
                             daemon=True).start()
        else:
            core.send_signal(signal.SIGKILL if fault == "kill" else signal.SIGSTOP)
        if second_after is not None:
            time.sleep(second_after)
            now = status()
            core2 = core_of(now["pid"])
            core2.send_signal(signal.SIGKILL)
            # (timed at the kill itself: a /metrics read before it took seconds under load)
            second.update(at_s=round(time.monotonic() - fired["t"], 2), pid=now.get("pid"),
                          core_pid=core2.pid, state=now["state"],
                          standby=now.get("standby"))

    watcher = threading.Thread(target=fault_once, daemon=True)
    watcher.start()
    doc = bench(PROXY, conc, prompts, tag, detailed=True, input_len=input_len)
    watcher.join(5)
    back = wait(lambda: status()["state"] == "RUNNING"
                and (fault == "none" or status()["restarts"] > restarts)
                and status(), 300, "RUNNING again")
    bench_done = time.monotonic()
    protected_s = timeline[0].wait(protected_timeout) if timeline else None
    if timeline:
        back = timeline[0].last or status()
    tapped = [t.summary() for t in taps]
    for t in taps:
        t.save(tag)
    lens = doc.get("output_lens") or []
    errors = [e for e in doc.get("errors") or [] if e]
    texts = doc.get("generated_texts") or []
    lines = (WORK / "daemon.log").read_bytes()[log_at:].decode(errors="replace").splitlines()
    logged = [json.loads(x) for x in lines if x.startswith("{")]
    continued = [e for e in logged if e.get("event") == "stream continued"]
    served = [e for e in logged if e.get("event") == "request"
              and e.get("path") == "/v1/completions"]
    after = exporter_series("vllm_supervisor_proxy_continuations_total")
    waits = gpu_waits.wait_summary(waits_before, exporter_series(gpu_waits.SERIES))
    audit = [e for e in events()[events_at:] if e.get("event") in HANDOVER_EVENTS]
    ttfts = sorted(x for x in doc.get("ttfts") or [] if x is not None)
    held = sorted(e.get("held_s") or 0.0 for e in served)
    # the daemon's own complaints meanwhile (not the engines' lines)
    bad = [e for e in logged if e.get("level") in ("error", "critical")
           and e.get("source") != "engine"]
    engine_bad = [e for e in logged if e.get("level") in ("error", "critical")
                  and e.get("source") == "engine"]
    out = dict(prompts=prompts, concurrency=conc, standby_at_fault=st.get("standby"),
               # what the new requests waited (issue 35: held at the swap until the standby
               # served), as the client saw it (its TTFTs, in s) and as the proxy held them
               held={"max_ttft_s": round(ttfts[-1], 3) if ttfts else None,
                     "ttft_over_1s": len([x for x in ttfts if x > 1.0]),
                     "proxy_held": len([x for x in held if x > 0]),
                     "proxy_max_held_s": round(held[-1], 3) if held else None,
                     **handover_times(audit)},
               running_at_fault=fired.get("running"),
               fault_after_main_s=round(fired["t"] - fired["main"], 1) if "t" in fired else None,
               completed=doc.get("completed"), failed=doc.get("failed"),
               errors=sorted(set(errors))[:5], total_output_tokens=doc.get("total_output_tokens"),
               tokens_asked=prompts * want, short_streams=len([n for n in lens if n < want]),
               empty_texts=len([x for x in texts if not x]),
               **served_summary(doc, served, continued, want, before, after),
               gate_waits=waits,
               running_again_after_kill_s=round(time.monotonic() - fired["t"], 1)
               if "t" in fired else None,
               taps=tapped, state_reason=back["reason"], standby_after=back.get("standby"),
               handover=audit, input_len=input_len, cost=cost_row(doc, fired.get("t")))
    if pair:
        out.update(
            protected_again_after_s=protected_s,
            bench_ended_after_fault_s=round(bench_done - fired["t"], 1) if "t" in fired
            else None,
            pid_at_fault=st["pid"], pid_after=back.get("pid"),
            admission_after=back.get("admission"),
            timeline=timeline[0].changes if timeline else None,
            # the longest the proxy held a request that came after the fault, and p99
            # TTFT in s (the brief's columns)
            p99_ttft_s=round(doc["p99_ttft_ms"] / 1000, 3) if doc.get("p99_ttft_ms")
            else None)
    if second_after is not None:
        out["second_kill"] = second
    out.update(daemon_errors=[{k: e.get(k) for k in ("timestamp", "level", "event", "error",
                                                      "reason")} for e in bad][:10],
               daemon_error_count=len(bad), engine_error_lines=len(engine_bad),
               engine_error_first=[str(e.get("event"))[:300] for e in engine_bad][:5])
    result(tag, **out)
    if second_after is not None:
        return out
    assert doc.get("completed") == prompts and not errors
    assert doc.get("total_output_tokens") == prompts * want
    assert not [n for n in lens if n < want]
    assert all(t["usage_completion_tokens"] == want and t["token_events"] and t["done"]
               and not t["errors"] for t in tapped)
    assert not pair or fault == "none" or protected_s is not None, "not protected again"
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


def phase_kills(n: int = 3) -> None:
    """Issue 35's H100 criterion (a): `continue kill late` `n` times in a row on an
    asymmetric pair, each as soon as the pair is protected again; each kill's longest
    client gap and the time from the kill to protected again. KILLS_BUDGET_S (default
    560): a kill is begun only if, by the last one's length, it ends within it (the
    machine's calls last 10 minutes; the daemon lives on, so the rest go in the next)."""
    budget = float(os.environ.get("KILLS_BUDGET_S", "560"))
    first = int(os.environ.get("KILLS_FIRST", "1"))  # (the tag's number, across calls)
    t0 = time.monotonic()
    rows: list[dict[str, Any]] = []
    last = 0.0
    for i in range(first, first + n):
        if rows and time.monotonic() - t0 + last * 1.1 > budget:
            break
        t1 = time.monotonic()
        out = phase_continue("kill", "late", tag=f"continue-kill-late-{i}")
        last = time.monotonic() - t1
        held = out["held"]
        rows.append({"kill": i, "failed": out["failed"], "completed": out["completed"],
                     "tokens": out["total_output_tokens"], "asked": out["tokens_asked"],
                     "short": out["short_streams"], "running": out["running_at_fault"],
                     "max_gap_s": out["max_gap_s"], "max_itl_s": out["max_itl_s"],
                     "p99_ttft_s": out.get("p99_ttft_s"), "max_ttft_s": held["max_ttft_s"],
                     "proxy_max_held_s": held["proxy_max_held_s"],
                     "failover_done_s": held.get("failover_done_s"),
                     "protected_again_after_s": out["protected_again_after_s"],
                     "daemon_errors": out["daemon_error_count"],
                     "phase_s": round(last, 1)})
    result("kills", done=len(rows), asked=n, rows=rows)


# a step's length as first guessed (s); once run, its last length
PLAN_GUESS_S = {"kill": 200.0, "restart": 200.0, "kv-reset-streams": 200.0,
                "tier-on": 330.0, "tier-off": 330.0, "backup-on": 330.0,
                "backup-off": 330.0, "kv-reset": 60.0,
                "kill-swapback": 300.0,
                "kill-twice": 480.0, "kv-info": 10.0, "stop": 60.0, "hang-rpc": 200.0}


# steps that stop the daemon (no wait for the pair to be protected first)
RESTARTS = ("stop", "tier-on", "tier-off", "backup-on", "backup-off")


def phase_plan(steps: list[str]) -> None:
    """Steps run in order across calls (the machine's calls last 10 minutes, and it is
    given back 30 s after one ends: no time to choose the next between calls). The same
    command again goes on where the last stopped: WORK/plan.json keeps the steps done and
    each step's last length (a plan of other steps begins afresh, the lengths kept); a
    step begins only if, by that length, it ends within CALL_BUDGET_S (default 560) of
    the call's start. With an asymmetric pair each step begins once it is protected
    again. A step that fails is recorded; the plan goes on only if the pair is protected
    again within 3 minutes, else it stops for good with the daemon's status and log tail
    (`plan-stopped`)."""
    budget = float(os.environ.get("CALL_BUDGET_S", "560"))
    t0 = time.monotonic()
    path = WORK / "plan.json"
    plan: dict[str, Any] = (json.loads(path.read_text()) if path.exists()
                            else {"done": [], "seconds": {}, "failed": {}})
    if plan.get("steps") != steps:  # another plan: only its lengths are kept, as guesses
        plan = {"steps": steps, "done": [], "seconds": plan["seconds"], "failed": {}}
    kills = 0
    for i, step in enumerate(steps):
        key = f"{i}:{step}"
        kills += step == "kill"
        if key in plan["done"]:
            continue
        if plan.get("stopped"):
            result("plan", stopped=plan["stopped"], next=key)
            return
        # (a restart's re-arm is a kill's: its guess the last kill's length until run)
        guess = plan["seconds"].get(step) or (step == "restart" and plan["seconds"].get("kill")
                                              ) or PLAN_GUESS_S.get(step, 300.0)
        left = budget - (time.monotonic() - t0)
        if guess * 1.05 + 15 > left:
            result("plan", next=key, left_s=round(left), guess_s=guess, done=plan["done"])
            return
        if step not in RESTARTS and is_pair(status()):
            wait(lambda: protected_again(status()), max(30.0, left - guess), "protected again")
        t1 = time.monotonic()
        error = None
        try:
            if step == "kill":
                phase_continue("kill", "late", tag=f"continue-kill-late-{kills}")
            elif step == "restart":
                phase_continue("restart", "late")
            elif step == "kill-swapback":
                phase_kill_swapback()
            elif step == "kill-twice":
                phase_kill_twice(10.0)
            elif step == "kv-reset-streams":
                phase_kv_reset_streams(256, 3000, 3)
            elif step == "kv-info":
                phase_kv_info()
            elif step == "hang-rpc":
                phase_hang_rpc()
            elif step == "stop":
                phase_stop()
            elif step.startswith("cost-"):
                phase_cost(*step.split("-")[1:])
            elif step == "kv-reset":
                phase_kv_reset()
            elif step in RESTARTS[1:]:
                phase_restart_daemon(*step.split("-"))
            else:
                raise ValueError(f"no step {step!r}")
        except Exception as exc:  # recorded; the plan goes on only if the pair is armed
            error = f"{type(exc).__name__}: {exc}"[:1000]
            plan["failed"][key] = error
        plan["seconds"][step] = round(time.monotonic() - t1, 1)
        plan["done"].append(key)
        path.write_text(json.dumps(plan))
        result("plan-step", step=key, seconds=plan["seconds"][step], error=error)
        if error and step not in ("kill-twice", "stop"):
            try:
                wait(lambda: protected_again(status()), 180, "protected again")
            except Exception as exc:
                plan["stopped"] = f"{key}: {error}; then {exc}"
                path.write_text(json.dumps(plan))
                st = status()
                result("plan-stopped", why=plan["stopped"], status=st)
                return
    result("plan", finished=True, done=plan["done"], failed=plan["failed"],
           seconds=plan["seconds"])


COST_PROMPTS = {"none": 600, "kill": 1200, "restart": 1200, "kvreset": 1200}


def phase_cost(fault: str, input_len: str) -> dict[str, Any]:
    """Issue 51's table, one cell: `vllm bench serve` at 128 streams of 256 tokens with
    `input_len`-token prompts through the daemon, and `fault` (none, kill, restart, or
    kvreset: one KV reset) 5 s after 64 run. Plan steps `cost-FAULT-LEN`, the no-fault
    run first at each length: `plan cost-none-1536 cost-kill-1536 ...`."""
    n = int(input_len)
    if fault == "kvreset":
        out = phase_kv_reset_streams(128, COST_PROMPTS["kvreset"], 1, input_len=n,
                                     tag=f"cost-kvreset-{n}")
    else:
        out = phase_continue(fault, "late", tag=f"cost-{fault}-{n}",
                             prompts=COST_PROMPTS[fault], input_len=n)
    # (what the clients waited for at the gate: which of the fault's cost is admission's)
    result("cost", fault=fault, input_len=n, kv_tier=status().get("kv_tier") is not None,
           **out["cost"], gate_waits=out.get("gate_waits"))
    return out


def phase_restart_daemon(what: str, on: str) -> None:
    """Plan steps `tier-on` and `tier-off` (issue 51), `backup-on` and `backup-off`
    (issue 49): the daemon stopped and started again as its last `start` was, with the
    KV tier (`engine.kv_tier`) on or off, or the sleep backup in registered huge pages
    (the daemon's) or in torch's default pinned memory (`SLEEP_BACKUP=off`), so that one
    session measures the same faults both ways: `plan cost-none-1536 cost-kill-1536
    tier-off cost-none-1536 cost-kill-1536`. A start of the same shapes takes about 3
    minutes once flashinfer's JIT is cached."""
    phase_stop()
    name, value = {"tier": ("KV_TIER", "1"), "backup": ("SLEEP_BACKUP", "off")}[what]
    if on == ("on" if what == "tier" else "off"):
        os.environ[name] = value
    else:
        os.environ.pop(name, None)
    phase_start(*json.loads((WORK / "start.json").read_text()))
    if is_pair(status()):
        wait(lambda: protected_again(status()), 300, "protected again")
    result("restart-daemon", kv_tier=status().get("kv_tier") is not None,
           sleep_backup=os.environ.get("SLEEP_BACKUP", "on"))


def phase_kill_swapback(prompts: int = 8000) -> None:
    """Issue 35 with an asymmetric pair: `continue kill late` with a load long enough
    that the full-size engine is proven and takes over again (the swap back) while the
    thin one still serves streams: every stream whole across both handovers, and the
    longest client gap is the larger of the two."""
    out = phase_continue("kill", "late", tag="continue-kill-swapback", prompts=prompts)
    ended, armed = out.get("bench_ended_after_fault_s"), out.get("protected_again_after_s")
    result("kill-swapback", swap_back_under_load=bool(ended and armed and armed < ended),
           protected_again_after_s=armed, bench_ended_after_fault_s=ended,
           max_itl_s=out["max_itl_s"], max_gap_s=out["max_gap_s"], failed=out["failed"],
           # (the swap back is audited as a failover whose reason is the upgrade's)
           short=out["short_streams"], upgrades=[
               e for e in out["handover"] if e.get("event") == "upgrade"
               or str(e.get("reason", "")).startswith("upgrade")])


def phase_kill_twice(delay: float = 10.0) -> None:
    """Issue 35's (b): under the same load a second SIGKILL `delay` s after the first, of
    the core that serves then (the thin one, while the full-size engine starts beside
    it): no standby is ready, so a cold start, clients held. Reported as it happens."""
    out = phase_continue("kill", "late", tag="kill-twice", prompts=1500, second_after=delay,
                         protected_timeout=float(os.environ.get("PROTECTED_TIMEOUT_S", "240")))
    result("kill-twice-summary", failed=out["failed"], completed=out["completed"],
           tokens=out["total_output_tokens"], asked=out["tokens_asked"],
           short=out["short_streams"], held=out["held"], max_gap_s=out["max_gap_s"],
           max_itl_s=out["max_itl_s"], p99_ttft_s=out.get("p99_ttft_s"),
           protected_again_after_s=out.get("protected_again_after_s"),
           second_kill=out.get("second_kill"), errors=out["errors"])


def phase_throughput(concurrencies: list[int]) -> None:
    """Output tokens/s through the proxy against direct to the engine, alternating runs."""
    rows = []
    for conc in concurrencies:
        prompts = {1: 6, 8: 64, 32: 192}.get(conc, conc * 3)
        runs: dict[str, list[float]] = {"direct": [], "proxy": []}
        for i in range(2):
            for where, base in (("direct", engine_addr()), ("proxy", PROXY)):
                doc = bench(base, conc, prompts, f"tp-{conc}-{where}-{i}")
                runs[where].append(round(float(doc["output_throughput"]), 1))
        ratio = sum(runs["proxy"]) / sum(runs["direct"])
        rows.append({"concurrency": conc, "prompts": prompts, **runs,
                     "ratio": round(ratio, 3)})
        result("throughput", **rows[-1])


def phase_kv_reset_streams(conc: int = 256, prompts: int = 3000, resets: int = 3,
                           input_len: int = 32, tag: str | None = None) -> dict[str, Any]:
    """Issue 35, point 3: `vllm bench serve` through the proxy at `conc` streams of 256
    tokens, and `vllm-supervisorctl kv-reset` `resets` times during it (the first 4 s
    after the engine runs most of them, each next 3 s after the last ended). With
    `drain = "continue"` the streams in flight are paused for continuation, not drained:
    per reset the remedy's duration, steps and held requests, the streams paused; over
    the run every stream whole, the longest gap a client saw."""
    want = 256
    tag = tag or f"kv-reset-streams-{conc}"
    st = status()
    restarts = st["restarts"]
    log_at = (WORK / "daemon.log").stat().st_size
    events_at = len(events())
    before = exporter_series("vllm_supervisor_proxy_continuations_total")
    waits_before = exporter_series(gpu_waits.SERIES)
    runs: list[dict[str, Any]] = []
    spied: list[list[Any]] = []
    marks: dict[str, float] = {}

    def resets_during() -> None:
        log_path = WORK / f"{tag}.log"
        wait(lambda: log_path.exists()
             and b"Starting main benchmark run" in log_path.read_bytes(), 300,
             "the client's main run")
        marks["main"] = time.monotonic()
        wait(lambda: engine_running() >= min(conc, 256) * 3 // 4, 120,
             "most streams running at the engine")
        time.sleep(4.0)
        for i in range(resets):
            running = engine_running()
            spying = spy(f"{tag}-{i}")
            t0 = time.monotonic()
            marks.setdefault("first", t0)
            r = ctl("kv-reset")
            wall = time.monotonic() - t0
            # (the KV resets' own entries: a policy remedy meanwhile is not one of them)
            ev = [e for e in events()[events_at:] if e["event"] == "remedy"
                  and e.get("rung") == "kv_reset"]
            row: dict[str, Any] = {"rc": r.returncode, "running_before": running,
                                   "at_s": round(t0 - marks["main"], 1),
                                   "ctl_wall_s": round(wall, 3)}
            if r.returncode != 0:
                row["out"] = (r.stdout + r.stderr)[-500:]
            if len(ev) > i:
                row.update({k: ev[i].get(k) for k in ("outcome", "duration_s", "steps_s",
                                                      "held", "error", "idle_counts")})
            runs.append(row)
            spied.append(spying)
            time.sleep(3.0)
        marks["done"] = time.monotonic()
        for row, spying in zip(runs, spied, strict=True):
            if spying:  # (SPY=1: where the API server and the core spent the reset)
                row["spy"] = gpu_spy.finish(spying)

    watcher = threading.Thread(target=resets_during, daemon=True)
    watcher.start()
    doc = bench(PROXY, conc, prompts, tag, detailed=True, input_len=input_len)
    watcher.join(120)
    lines = (WORK / "daemon.log").read_bytes()[log_at:].decode(errors="replace").splitlines()
    logged = [json.loads(x) for x in lines if x.startswith("{")]
    paused = [e.get("paused") for e in logged
              if e.get("event") == "streams paused, to go on after it"]
    for row, n in zip(runs, paused, strict=False):
        row["streams_paused"] = n
    continued = [e for e in logged if e.get("event") == "stream continued"]
    served = [e for e in logged if e.get("event") == "request"
              and e.get("path") == "/v1/completions"]
    after = exporter_series("vllm_supervisor_proxy_continuations_total")
    waits = gpu_waits.wait_summary(waits_before, exporter_series(gpu_waits.SERIES))
    lens = doc.get("output_lens") or []
    errors = [e for e in doc.get("errors") or [] if e]
    ttfts = sorted(x for x in doc.get("ttfts") or [] if x is not None)
    st2 = status()
    out = dict(prompts=prompts, concurrency=conc, resets=runs, input_len=input_len,
               cost=cost_row(doc, marks.get("first")))
    result(tag, **out,
           resets_within_run=bool(marks.get("done")) and len(runs) == resets,
           completed=doc.get("completed"), failed=doc.get("failed"),
           errors=sorted(set(errors))[:5], total_output_tokens=doc.get("total_output_tokens"),
           tokens_asked=prompts * want, short_streams=len([n for n in lens if n < want]),
           max_ttft_s=round(ttfts[-1], 3) if ttfts else None,
           **served_summary(doc, served, continued, want, before, after),
           gate_waits=waits,
           restarts=st2["restarts"] - restarts, state=st2["state"],
           # what else the daemon did meanwhile (a policy decision: a restart)
           decisions=[e for e in events()[events_at:] if e["event"] == "decision"],
           other_remedies=[e for e in events()[events_at:] if e["event"] == "remedy"
                           and e.get("rung") != "kv_reset"])
    assert doc.get("completed") == prompts and not errors
    assert doc.get("total_output_tokens") == prompts * want
    assert len(runs) == resets and all(r["rc"] == 0 for r in runs)
    assert st2["restarts"] == restarts
    return out


def phase_rearm() -> None:
    """A cold restart: with a sleeping standby at a share where none fits beside the
    engine that took over (`no_room` after a swap), the next cold start arms one first."""
    st = status()
    restarts = st["restarts"]
    t0 = time.monotonic()
    r = ctl("restart", "--reason", "re-arm the standby")
    back = wait(lambda: status()["state"] == "RUNNING" and status()["restarts"] > restarts
                and (status().get("standby") or {}).get("state") == "ready" and status(),
                560, "RUNNING with the standby ready")
    result("rearm", rc=r.returncode, out=(r.stdout + r.stderr)[-300:],
           standby_before=st.get("standby"), seconds=round(time.monotonic() - t0, 1),
           standby=back.get("standby"), reason=back["reason"])


def phase_stop() -> None:
    st = status()
    spare = (st.get("standby") or {}).get("pid")
    pids = [p.pid for p in engine_tree(st["pid"])] + (
        [p.pid for p in engine_tree(spare)] if spare else [])
    r = ctl("stop")
    left = {p: b for p, b in nvml_processes().items() if p in pids}
    alive = [p for p in pids if running(p)]
    # (anything on the card at all: a copy's processes are in a namespace of their own)
    result("stop", rc=r.returncode, out=r.stdout.strip(), nvml_left=left, alive=alive,
           nvml_any={str(p): round(b / 2**20) for p, b in nvml_processes().items()})
    assert r.returncode == 0 and not left and not alive


if __name__ == "__main__":
    if sys.argv[1] == "continue":
        phase_continue(sys.argv[2], sys.argv[3] if len(sys.argv) > 3 else "late")
    elif sys.argv[1] == "throughput":
        phase_throughput([int(x) for x in sys.argv[2:]])
    elif sys.argv[1] == "start":
        phase_start(*sys.argv[2:5])
    elif sys.argv[1] == "plan":
        phase_plan(sys.argv[2:])
    elif sys.argv[1] == "kills":
        phase_kills(int(sys.argv[2]) if len(sys.argv) > 2 else 3)
    elif sys.argv[1] == "kill-twice":
        phase_kill_twice(float(sys.argv[2]) if len(sys.argv) > 2 else 10.0)
    elif sys.argv[1] == "kv-reset-streams":
        phase_kv_reset_streams(*(int(x) for x in sys.argv[2:5]))
    else:
        {"kv-reset": phase_kv_reset, "crash": phase_crash, "hang": phase_hang,
         "rearm": phase_rearm, "stop": phase_stop, "kv-info": phase_kv_info,
         "protected": phase_protected, "hang-rpc": phase_hang_rpc}[sys.argv[1]]()
