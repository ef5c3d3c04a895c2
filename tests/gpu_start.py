"""Starting and stopping the daemon of the GPU harness (`tests/gpu_vllm.py`): `start` in
its shapes (the 8B shape, the thin and the snapshot pair, a weight cache, the KV tier),
CRIU and the snapshot's tmpfs, `stop` (nothing left on the card), the daemon started
again as it last was (`tier-off`, `backup-off`), `rearm`, `kv-info` and `protected`.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
import tomllib
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from tests.gpu_daemon import (
    EXPORTER,
    HANG_EXT,
    MODEL,
    PROXY,
    ROOT,
    SHAPE,
    SUP_SITE,
    TP,
    VLLM_SITE,
    WEIGHT_CACHE,
    WORK,
    Hopeless,
    ctl,
    engine_tree,
    events,
    host_memory,
    installed_from,
    is_pair,
    kv_info,
    nvml_processes,
    protected_again,
    result,
    running,
    status,
    wait,
)
from tests.gpu_shapes import ensure_m8b
from tests.harness import write_config


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
        ensure_m8b(Path(MODEL))
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
    if os.environ.get("STANDBY_WEIGHTS"):  # a sleeping standby's weights on the card
        # ahead of a fault ("gpu": pair/weights_ahead.py) or on the host ("host")
        demo["engine"]["standby_weights"] = os.environ["STANDBY_WEIGHTS"]
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
           supervisor_from=installed_from(), startup_s=round(startup_s, 1),
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
    """SNAPSHOTS emptied, on a tmpfs mounted there (the machine's root); with
    SNAP_ON_DISK=1 on the disk instead (the images' ~30 GiB not in host memory: slower
    restores, more room for the engines and a KV tier)."""
    SNAPSHOTS.mkdir(parents=True, exist_ok=True)
    if os.environ.get("SNAP_ON_DISK") != "1" and not os.path.ismount(SNAPSHOTS):
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


HANG_EXT_SOURCE = '''import time


class Hang:
    """Mixed into vLLM's worker (`--worker-extension-cls`): `vs_hang` blocks the thread
    that runs it, the engine core's busy loop with one GPU, as a stuck kernel would."""

    def vs_hang(self, seconds: str) -> None:
        time.sleep(float(seconds))
'''


def phase_kv_info() -> None:
    result("kv-info", **kv_info())


def phase_protected(timeout: float = 540) -> None:
    """Wait until the pair is protected again (after a call ran out in the middle)."""
    t0 = time.monotonic()
    st = wait(lambda: protected_again(s := status()) and s, timeout, "protected again")
    result("protected", waited_s=round(time.monotonic() - t0, 1), state=st["state"],
           pid=st.get("pid"), standby=st.get("standby"), admission=st.get("admission"),
           kv_cache=kv_info())


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
