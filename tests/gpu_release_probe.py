"""Issue 49, the open cost of route 3: a killed engine's GPU memory came back in 3.76 s
when that engine had been restored and woken, and in 0.11 s when it had been freshly
started (docs/standby.md, "Route 3 probed"). A standby's wake at 0.88 waits for it.

The suspect: Linux tears down a dying process's address space (`exit_mm`) before it
closes its files (`exit_files`), and the card gets the memory back only when the NVIDIA
device files close. An engine that slept (level 1) and woke keeps its weights' pinned
host backup in torch's host allocator cache (~15 GiB for the 8B shape): its exit unmaps
that first. A snapshot's copy is such an engine (restored asleep, then woken).

Not collected by pytest (no GPU in CI). On a lent GPU machine, after the stage calls of
docs/gpu-validation.md (vLLM only, raw engines, no daemon), in the background:

    WORK=/tmp/vs-release PYTHONPATH=~/vllm-site python3 tests/gpu_release_probe.py

Three raw engines of Llama-3.1-8B's shape at 0.88 (`--load-format dummy`, eager, sleep
mode), one after another, alone on GPU 0:

1. `fresh`: started, asked once, its tree SIGKILLed (the process group).
2. `woken`: started, asked, slept (level 1), woken, asked, SIGKILLed.
3. `woken_emptied`: as 2, and once woken torch's pinned host cache emptied in the core
   (`torch._C._host_emptyCache()`, through `/collective_rpc` and a worker extension
   written into the vLLM site): is the cache what the exit waits on?
4. `woken_mrelease`: as 2, and right after the SIGKILL each process of the tree is reaped
   from here by `process_mrelease(2)` (Linux 5.15+; Android's low-memory killer uses it to
   free a dying process's memory without waiting for its exit), opened by pidfd before
   the kill: does the memory come back sooner?

Run with names (`woken_register woken_emptied_bg`) for the follow-ups instead:

5. `woken_register`: as 2, with torch's pinned host memory allocated by malloc and
   registered (`PYTORCH_CUDA_ALLOC_CONF=pinned_use_cuda_host_register:True`) rather than
   by `cudaHostAlloc`: does the exit still wait on it?
6. `woken_emptied_bg`: as 3, the emptying on a thread of its own in the core (the rpc
   returns at once): how long a generation asked meanwhile takes, and when the core's
   shared memory is down.
7. `woken_register_thp`: as 5, with glibc's malloc asking for transparent huge pages
   (`GLIBC_TUNABLES=glibc.malloc.hugetlb=1`): the registered backup in 2 MiB pages, 512
   times fewer to unpin at the exit. Is the exit's wait the count of pages?
8. `woken_unpinned`: as 2, with vLLM's sleep backup in ordinary (pageable) host memory
   (the worker extension's module sets vLLM's cumem `PIN_MEMORY` off when
   `VS_UNPINNED=1`): the exit unmaps plain memory; what does the wake cost instead?

Each run also records the machine's THP settings and the core's AnonHugePages.

For each: every process's memory just before the kill (VmRSS, RssAnon, RssFile, RssShmem,
VmPin, VmLck, from /proc), and from the SIGKILL the seconds until the card's memory was
back and until each process had exited. Each appends `RESULT {json}` to
$WORK/results.jsonl.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import sys
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

os.environ.setdefault("WORK", "/tmp/vs-release")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from tests.gpu_kv_probe import MODEL, WORK, Engine, card, result
from tests.gpu_shapes import STAGED, VLLM_SITE, ensure_m8b
from tests.gpu_snapshot_probe import tree

FULL = ["--gpu-memory-utilization", "0.88"]
EXT = "vs_host_cache"  # the worker extension's module, written into the vLLM site
EXT_SOURCE = '''import gc
import os

import torch

if os.environ.get("VS_UNPINNED") == "1":  # imported by the worker at its start
    import vllm.device_allocator.cumem as _cumem
    if hasattr(_cumem, "PIN_MEMORY"):
        _cumem.PIN_MEMORY = False
    if hasattr(_cumem, "is_pin_memory_available"):
        _cumem.is_pin_memory_available = lambda: False
    print("vs_host_cache: sleep backup unpinned", flush=True)


class HostCache:
    """Mixed into vLLM's worker (`--worker-extension-cls`)."""

    def vs_empty_host_cache(self) -> bool:
        gc.collect()
        torch._C._host_emptyCache()
        return True

    def vs_empty_host_cache_bg(self) -> bool:
        import threading
        threading.Thread(target=torch._C._host_emptyCache, daemon=True).start()
        return True
'''
REGISTER = "pinned_use_cuda_host_register:True,pinned_num_register_threads:8"
THP = "glibc.malloc.hugetlb=1"
MEM_KEYS = ("VmRSS", "RssAnon", "RssFile", "RssShmem", "VmPin", "VmLck")
SYS_PIDFD_OPEN, SYS_PROCESS_MRELEASE = 434, 448  # x86_64
LIBC = ctypes.CDLL(None, use_errno=True)


def memory(pid: int) -> dict[str, Any]:
    """The process's memory in MiB, by /proc/PID/status's keys."""
    out: dict[str, Any] = {}
    with contextlib.suppress(OSError):
        status = Path(f"/proc/{pid}/status").read_text()
        for line in status.splitlines():
            key, _, value = line.partition(":")
            if key in MEM_KEYS:
                out[key] = round(int(value.split()[0]) / 1024)
            elif key == "Name":
                out["name"] = value.strip()
        for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
            if line.startswith("AnonHugePages:"):
                out["AnonHugePages"] = round(int(line.split()[1]) / 1024)
    return out


def thp_settings() -> dict[str, str]:
    out = {}
    for name in ("enabled", "defrag", "shmem_enabled"):
        with contextlib.suppress(OSError):
            out[name] = Path(f"/sys/kernel/mm/transparent_hugepage/{name}").read_text().strip()
    out["glibc"] = os.confstr("CS_GNU_LIBC_VERSION") or "?"
    return out


def exited(pid: int) -> bool:
    """Gone, or a zombie (its exit done; only its parent's wait left)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


def mrelease(pidfd: int, into: dict[str, Any], pid: int) -> None:
    t = time.monotonic()
    rc = LIBC.syscall(SYS_PROCESS_MRELEASE, pidfd, 0)
    into[str(pid)] = {"rc": rc, "errno": ctypes.get_errno() if rc else 0,
                      "s": round(time.monotonic() - t, 3)}


def kill_and_time(engine: Engine, reap: bool, timeout: float = 60) -> dict[str, Any]:
    """The tree SIGKILLed; seconds until each process exited and the card's memory was back."""
    pids = tree(engine.proc.pid)
    before = {str(p): memory(p) for p in pids}
    in_use = card()["used_mib"]
    pidfds = {p: LIBC.syscall(SYS_PIDFD_OPEN, p, 0) for p in pids} if reap else {}
    reaped: dict[str, Any] = {}
    t0 = time.monotonic()
    os.killpg(engine.proc.pid, 9)
    threads = [threading.Thread(target=mrelease, args=(fd, reaped, p))
               for p, fd in pidfds.items() if fd >= 0]
    for th in threads:
        th.start()
    exit_s: dict[str, float] = {}
    back_s = None
    samples = []
    while time.monotonic() - t0 < timeout and (back_s is None or len(exit_s) < len(pids)):
        now = round(time.monotonic() - t0, 3)
        for p in pids:
            if str(p) not in exit_s and exited(p):
                exit_s[str(p)] = now
        used = card()["used_mib"]
        samples.append((now, used))
        if back_s is None and used < in_use - 1024:
            back_s = now
        time.sleep(0.02)
    for th in threads:
        th.join(30)
    for fd in pidfds.values():
        with contextlib.suppress(OSError):
            os.close(fd)
    engine.proc.wait(30)
    return {"before": before, "in_use_mib": in_use, "card_back_s": back_s,
            "exit_s": exit_s, "mrelease": reaped, "samples": samples[:: max(1, len(samples) // 40)],
            "after": card()}


def empty_host_cache(engine: Engine, method: str = "vs_empty_host_cache") -> float:
    t = time.monotonic()
    body = json.dumps({"method": method}).encode()
    req = urllib.request.Request(engine.url("/collective_rpc"), data=body,
                                 headers={"content-type": "application/json"})
    urllib.request.urlopen(req, timeout=120).read()
    return round(time.monotonic() - t, 3)


def shmem_mib(engine: Engine) -> int:
    return max((memory(p).get("RssShmem", 0) for p in tree(engine.proc.pid)), default=0)


def run(name: str, port: int, sleep_first: bool, reap: bool, empty: bool = False,
        background: bool = False, register: bool = False, thp: bool = False,
        unpinned: bool = False) -> None:
    ext = ["--worker-extension-cls", f"{EXT}.HostCache"] if empty or unpinned else []
    env = {"PYTORCH_CUDA_ALLOC_CONF": REGISTER} if register else {}
    if thp:
        env["GLIBC_TUNABLES"] = THP
    if unpinned:
        env["VS_UNPINNED"] = "1"
    saved = {key: os.environ.get(key) for key in env}
    os.environ.update(env)
    try:
        engine = Engine(name, port, [*FULL, *ext])
    finally:
        for key, value in saved.items():
            os.environ.pop(key, None)
            if value is not None:
                os.environ[key] = value
    up = engine.wait_healthy()
    if not up:
        result(name, healthy_s=up, tail=engine.tail())
        engine.kill()
        return
    steps: dict[str, Any] = {"healthy_s": up, "first_s": engine.complete()}
    if unpinned:
        steps["unpinned_said"] = "sleep backup unpinned" in engine.log.read_text(errors="replace")
    if sleep_first:
        steps["sleep_s"] = engine.post("/sleep?level=1")
        steps["asleep"] = {str(p): memory(p) for p in tree(engine.proc.pid)}
        steps["wake_s"] = engine.post("/wake_up")
        steps["answer_s"] = engine.complete()
        steps["woken"] = {str(p): memory(p) for p in tree(engine.proc.pid)}
    if empty and background:
        t0 = time.monotonic()
        steps["empty_rpc_s"] = empty_host_cache(engine, "vs_empty_host_cache_bg")
        steps["answer_meanwhile_s"] = engine.complete()
        while shmem_mib(engine) > 1024 and time.monotonic() - t0 < 60:
            time.sleep(0.05)
        steps["shmem_down_s"] = round(time.monotonic() - t0, 3)
        steps["answer_after_s"] = engine.complete()
    elif empty:
        steps["empty_s"] = empty_host_cache(engine)
    result(name, **steps, **engine.facts(), **kill_and_time(engine, reap))


def main() -> None:
    WORK.mkdir(parents=True, exist_ok=True)
    ensure_m8b(MODEL)
    assert STAGED.exists()
    (Path(VLLM_SITE) / f"{EXT}.py").write_text(EXT_SOURCE)
    result("card", kernel=os.uname().release, thp=thp_settings(), **card())
    asked = sys.argv[1:]
    if asked:
        if "woken_register" in asked:
            run("woken_register", 8125, sleep_first=True, reap=False, register=True)
        if "woken_register_thp" in asked:
            run("woken_register_thp", 8127, sleep_first=True, reap=False, register=True,
                thp=True)
        if "woken_unpinned" in asked:
            run("woken_unpinned", 8128, sleep_first=True, reap=False, unpinned=True)
        if "woken_emptied_bg" in asked:
            run("woken_emptied_bg", 8126, sleep_first=True, reap=False, empty=True,
                background=True)
        result("done", **card())
        return
    run("fresh", 8121, sleep_first=False, reap=False)
    run("woken", 8122, sleep_first=True, reap=False)
    run("woken_emptied", 8123, sleep_first=True, reap=False, empty=True)
    run("woken_mrelease", 8124, sleep_first=True, reap=True)
    result("done", **card())


if __name__ == "__main__":
    main()
