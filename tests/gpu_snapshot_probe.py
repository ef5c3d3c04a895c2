"""Issue 49, route 3 ("checkpoint and restore of a sleeping standby"): can a full-size
standby, started once while the card was free and put to sleep, be taken off the GPU
entirely and be brought back, and be snapshotted and restored as a process?

Not collected by pytest (no GPU in CI). On a lent GPU machine, after the stage calls of
docs/gpu-validation.md (vLLM only, raw engines, no daemon), with a CRIU and its libraries
carried as Debian packages in the folder CRIU_DEBS names (ignored by git; CRIU 4.2 or later
on kernels from 6.16: sid's `criu` 4.2.1 with its libraries and libc6, run through that
libc's own loader; `apt-get download` with a sid sources list, see docs/standby.md):

    WORK=/tmp/vs-snap CRIU_DEBS=.criu4 UV_USE_IO_URING=0 VLLM_HOST_IP=127.0.0.1 \
        python3 tests/gpu_snapshot_probe.py [criu]    # run it in the background, poll

`criu`: steps 1-3 and 6-8 only (no serving engine, no failover). VLLM_HOST_IP keeps vLLM's
own sockets on loopback (step 8's namespace has nothing else); the standby starts under
supervisor/engine/snapshot/no_io_uring.py (CRIU cannot dump an io_uring).

Steps, each appending `RESULT {json}` to $WORK/results.jsonl (a step that fails records
why and the next runs where it can):

1. `env`: the kernel, root's capabilities, the driver, and `criu check`.
2. `standby`: a raw vLLM engine of Llama-3.1-8B's shape at 0.88 (`--load-format dummy`,
   eager, sleep mode) started alone, asked once and put to sleep (level 1): what it holds.
3. `cuda_checkpoint`: the CUDA driver's checkpoint API (`cuCheckpointProcessLock` and
   `cuCheckpointProcessCheckpoint`, through ctypes on libcuda) on every process of its
   tree that has the GPU open: what the card holds for it afterwards (the goal: nothing).
4. `serving`: a second engine at 0.88 beside it: does it start with a lone engine's KV
   cache?
5. `failover`: the serving engine's tree SIGKILLed; once its memory is back, the standby's
   GPU state restored (`cuCheckpointProcessRestore`, `...Unlock`), woken and asked: each
   step's seconds, and the KV cache it serves with.
6. `criu_dump`: the standby put to sleep and checkpointed again, then dumped by CRIU (its
   tree stops); the image's size and the seconds.
7. `criu_restore`: the image restored (the same PIDs, free again), its GPU state restored,
   woken and asked: a snapshot brought back serves.
8. `armed_b`, `fault_onto_b`, `armed_c`: the re-arm beside a serving engine and the fault
   onto it. Copy B restored while A serves, in new PID, network and mount namespaces
   (its own stdout file bind-mounted where the image's was), its GPU state restored
   (asleep: 827 MiB beside A) and its /health answered in its namespace: armed. Then A's
   tree SIGKILLed, B woken and asked (the second fault at full capacity: seconds from the
   kill to its answer), and copy C armed beside B the same way (the third).
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

os.environ.setdefault("WORK", "/tmp/vs-snap")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from supervisor.engine.snapshot.cuda import LOCK_MS, LibCuda, open_driver
from tests.gpu_kv_probe import MODEL, WORK, Engine, card, released, result
from tests.gpu_shapes import STAGED, ensure_m8b

T = TypeVar("T")
CRIU_DEBS = Path(__file__).resolve().parent.parent / os.environ.get("CRIU_DEBS", ".criu")
CRIU_ROOT = Path("/tmp/criu-root") / CRIU_DEBS.name
LIBS = CRIU_ROOT / "usr/lib/x86_64-linux-gnu"
IMAGES = Path(os.environ.get("IMAGES", "/dev/shm/vs-snap-img"))
# The new network namespace's loopback up (SIOCSIFFLAGS, IFF_UP | IFF_RUNNING): no `ip` there.
LO_UP = ("import socket, fcntl, struct; fcntl.ioctl(socket.socket(), 0x8914, "
         "struct.pack(\"16sH14s\", b\"lo\", 0x41, b\"\"))")
# The core's loopback TCP connections (torch.distributed's store) go in the image; CRIU
# would lock them with iptables, which the image lacks (`--network-lock skip` at the dump).
CRIU_OPTS = ["--tcp-established", "--ext-unix-sk", "--file-locks", "--link-remap"]
RPC = WORK / "rpc"  # vLLM's ZMQ sockets (VLLM_RPC_BASE_PATH), bind-mounted per copy
DUMPED: list[int] = []  # the pids of the tree CRIU dumped
FULL = ["--gpu-memory-utilization", "0.88"]
# The engine started under a seccomp filter that answers io_uring_setup with ENOSYS: CRIU
# cannot dump an io_uring, and the libraries that open one fall back without it.
NO_IO_URING = [sys.executable, str(Path(__file__).resolve().parent.parent / "supervisor"
                                   / "engine" / "snapshot" / "no_io_uring.py")]


def sh(*argv: str, timeout: float = 120, env: dict[str, str] | None = None) -> dict[str, Any]:
    t = time.monotonic()
    try:
        p = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, env=env)
        out = (p.stdout + p.stderr).strip().splitlines()
        return {"rc": p.returncode, "s": round(time.monotonic() - t, 2), "out": out[-15:]}
    except (OSError, subprocess.TimeoutExpired) as e:
        return {"rc": None, "s": round(time.monotonic() - t, 2), "out": [repr(e)]}


def criu_argv() -> list[str]:
    """CRIU as carried: through the carried C library's own loader when its packages bring
    one (trixie's CRIU 4 needs a newer glibc than the GPU image's), else on LD_LIBRARY_PATH."""
    binary = str(CRIU_ROOT / "usr/sbin/criu")
    loader = LIBS / "ld-linux-x86-64.so.2"
    if loader.exists():
        return [str(loader), "--library-path", str(LIBS), binary]
    return ["env", f"LD_LIBRARY_PATH={LIBS}:{CRIU_ROOT}/lib/x86_64-linux-gnu", binary]


def criu(*args: str, timeout: float = 300) -> dict[str, Any]:
    return sh(*criu_argv(), *args, timeout=timeout)


def cuda_driver() -> LibCuda:
    """The CUDA driver's process checkpoint API, as the daemon opens it
    (supervisor/engine/snapshot/cuda.py): the probe runs the package's calls."""
    driver, why = open_driver()
    if driver is None:
        raise RuntimeError(why)
    assert isinstance(driver, LibCuda)
    return driver


def tree(pid: int) -> list[int]:
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        with contextlib.suppress(OSError):
            for task in os.listdir(f"/proc/{p}/task"):
                with contextlib.suppress(OSError):
                    todo += [int(c) for c in
                             Path(f"/proc/{p}/task/{task}/children").read_text().split()]
    return sorted(set(out))


def gpu_open(pids: list[int]) -> dict[int, int]:
    """Each pid with NVIDIA device files open, and how many."""
    out = {}
    for p in pids:
        n = 0
        with contextlib.suppress(OSError):
            for fd in os.listdir(f"/proc/{p}/fd"):
                with contextlib.suppress(OSError):
                    n += os.readlink(f"/proc/{p}/fd/{fd}").startswith("/dev/nvidia")
        if n:
            out[p] = n
    return out


def compute_apps() -> list[str]:
    out: list[str] = sh("nvidia-smi", "--query-compute-apps=pid,used_memory",
                        "--format=csv,noheader,nounits")["out"]
    return out


def take_off(cuda: LibCuda, engine: Engine) -> list[int]:
    """Lock and checkpoint every process of the engine's tree that has the GPU open."""
    pids = list(gpu_open(tree(engine.proc.pid)))
    times: dict[str, Any] = {}
    for p in pids:
        t = time.monotonic()
        try:
            cuda.lock(p, LOCK_MS)
            times[f"{p}_lock_s"] = round(time.monotonic() - t, 3)
            cuda.checkpoint(p)
            times[f"{p}_checkpoint_s"] = round(time.monotonic() - t, 3)
        except RuntimeError as e:
            times[f"{p}_error"] = str(e)
    time.sleep(1)
    result("cuda_checkpoint", pids=pids, states={p: cuda.state(p) for p in pids},
           still_open=gpu_open(tree(engine.proc.pid)), apps=compute_apps(), **times, **card())
    return pids


def bring_back(cuda: LibCuda, engine: Engine, pids: list[int], step: str,
               t0: float | None = None) -> None:
    """The GPU state restored, unlocked, the engine woken and asked once."""
    t = time.monotonic()
    errors = {}
    for p in pids:
        try:
            cuda.restore(p)
            cuda.unlock(p)
        except RuntimeError as e:
            errors[str(p)] = str(e)
    restore_s = round(time.monotonic() - t, 3)
    doc: dict[str, Any] = {"restore_s": restore_s, "errors": errors,
                           "states": {p: cuda.state(p) for p in pids}}
    try:
        doc["wake_s"] = engine.post("/wake_up")
        doc["first_answer_s"] = engine.complete()
        if t0 is not None:
            doc["since_kill_s"] = round(time.monotonic() - t0, 2)
    except OSError as e:
        doc["error"] = repr(e)
        doc["tail"] = engine.tail(15)
    result(step, **doc, **engine.facts(), **card())


def step_env() -> None:
    CRIU_ROOT.mkdir(parents=True, exist_ok=True)
    for deb in sorted(CRIU_DEBS.glob("*.deb")):
        subprocess.run(["dpkg", "-x", str(deb), str(CRIU_ROOT)], check=True)
    caps = [ln for ln in Path("/proc/self/status").read_text().splitlines()
            if ln.startswith("Cap")]
    result("env", uname=os.uname().release, uid=os.getuid(), caps=caps,
           driver=sh("nvidia-smi", "--query-gpu=driver_version,name,memory.total",
                     "--format=csv,noheader")["out"],
           criu_version=criu("--version"), criu_check=criu("check"),
           shm=sh("df", "-h", "/dev/shm", "/tmp")["out"], **card())


def step_dump(cuda: LibCuda, standby: Engine) -> bool:
    shutil.rmtree(IMAGES, ignore_errors=True)
    IMAGES.mkdir(parents=True)
    standby.post("/sleep?level=1")
    pids = take_off(cuda, standby)
    if any(cuda.state(p) != "checkpointed" for p in pids):
        return False
    DUMPED[:] = tree(standby.proc.pid)
    shutil.copy(standby.log, IMAGES / "stdout.log")  # its size: CRIU checks it at a restore
    out = criu("dump", "-t", str(standby.proc.pid), "-D", str(IMAGES), "-v2",
               "-o", "dump.log", "--network-lock", "skip", *CRIU_OPTS, "--ghost-limit", "256M",
               timeout=580)
    size = sum(f.stat().st_size for f in IMAGES.iterdir()) / 2**30
    log = (IMAGES / "dump.log").read_text(errors="replace").splitlines()[-15:] \
        if (IMAGES / "dump.log").exists() else []
    result("criu_dump", **out, image_gib=round(size, 2), log=log,
           alive=standby.proc.poll() is None, **card())
    return bool(out["rc"] == 0)


def step_restore(cuda: LibCuda, standby: Engine) -> bool:
    with contextlib.suppress(ChildProcessError, subprocess.TimeoutExpired):
        standby.proc.wait(30)  # the dumped tree's root, reaped
    t = time.monotonic()  # every pid of the dumped tree free again (an exit takes a while)
    while any(Path(f"/proc/{p}").exists() for p in DUMPED) and time.monotonic() - t < 90:
        time.sleep(0.2)
    result("pids_free", s=round(time.monotonic() - t, 2),
           left=[p for p in DUMPED if Path(f"/proc/{p}").exists()])
    out = criu("restore", "-D", str(IMAGES), "-d", "-v2", "-o", "restore.log",
               *CRIU_OPTS, timeout=580)
    log = (IMAGES / "restore.log").read_text(errors="replace").splitlines()[-15:] \
        if (IMAGES / "restore.log").exists() else []
    pid = standby.proc.pid
    alive = Path(f"/proc/{pid}").exists()
    pids = list(gpu_open(tree(pid))) if alive else []
    result("criu_restore", **out, log=log, alive=alive,
           states={p: cuda.state(p) for p in tree(pid)} if alive else {}, **card())
    if out["rc"] != 0 or not alive:
        return False
    # The restored tree is not our child: the Engine's handle keeps the pid for kill().
    bring_back(cuda, standby, pids or tree(pid), "restored_serves")
    return True


def in_netns(pid: int, fn: Callable[[], T]) -> T:
    """`fn` called on a thread moved into `pid`'s network namespace (a copy restored in
    its own: its loopback is not ours)."""
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            fd = os.open(f"/proc/{pid}/ns/net", os.O_RDONLY)
            try:  # (os.setns is Python 3.12's; CLONE_NEWNET)
                if ctypes.CDLL(None, use_errno=True).setns(fd, 0x40000000) != 0:
                    raise OSError(ctypes.get_errno(), "setns")
            finally:
                os.close(fd)
            box["value"] = fn()
        except BaseException as e:  # (raised again on the caller's thread)
            box["error"] = e

    t = threading.Thread(target=run)
    t.start()
    t.join()
    if "error" in box:
        raise box["error"]
    return box["value"]  # type: ignore[no-any-return]


def get(url: str) -> float:
    t = time.monotonic()
    urllib.request.urlopen(url, timeout=10).read()
    return round(time.monotonic() - t, 3)


class Copy:
    """The image restored beside whatever runs, in new PID, network and mount namespaces
    (CRIU the namespace's init: it waits as the tree's parent), with a stdout file of its
    own bind-mounted where the image's was (CRIU checks that file's size), and a folder of
    its own where vLLM's ZMQ sockets are (VLLM_RPC_BASE_PATH: the same paths in every
    copy, or a copy would bind over the serving one's)."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.log = IMAGES / f"restore-{name}.log"
        out_file, rpc = WORK / f"{name}.log", WORK / f"rpc-{name}"
        shutil.copy(IMAGES / "stdout.log", out_file)  # (the size the image recorded)
        rpc.mkdir(exist_ok=True)  # its ZMQ sockets' folder: its own, not the first copy's
        inner = (f"mount --bind {out_file} {WORK / 'standby.log'} && "
                 f"mount --bind {rpc} {RPC} && "
                 f"{sys.executable} -c '{LO_UP}' && exec {' '.join(criu_argv())} restore "
                 f"-D {IMAGES} -v3 -o {self.log.name} {' '.join(CRIU_OPTS)}")
        self.t0 = time.monotonic()
        self.proc = subprocess.Popen(
            ["unshare", "--pid", "--net", "--mount", "--fork", "--mount-proc",
             "sh", "-c", inner], start_new_session=True,
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        self.pids: list[int] = []

    def wait_restored(self, timeout: float = 240) -> dict[str, Any]:
        done = False
        while time.monotonic() - self.t0 < timeout and self.proc.poll() is None and not done:
            time.sleep(0.5)
            done = self.log.exists() and \
                "Restore finished successfully" in self.log.read_text(errors="replace")
        inits = {self.proc.pid, *children(self.proc.pid)}  # unshare, and criu its ns's init
        self.pids = [p for p in tree(self.proc.pid) if p not in inits] if done else []
        return {"finished": done, "s": round(time.monotonic() - self.t0, 2),
                "exited": self.proc.poll(), "pids": self.pids,
                "log": self.log.read_text(errors="replace").splitlines()[-12:]
                if self.log.exists() else []}

    def gpu_back(self, cuda: LibCuda) -> dict[str, Any]:
        """Its GPU state restored (asleep: what a sleeping standby holds)."""
        t = time.monotonic()
        errors = {}
        for p in self.pids:
            if cuda.state(p) != "checkpointed":
                continue  # (a process of the tree that never had the GPU)
            try:
                cuda.restore(p)
                cuda.unlock(p)
            except RuntimeError as e:
                errors[str(p)] = str(e)
        return {"gpu_restore_s": round(time.monotonic() - t, 3), "errors": errors,
                "states": {p: cuda.state(p) for p in self.pids}}

    def end(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        for p in self.pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(p, signal.SIGKILL)


def arm_copy(cuda: LibCuda, standby: Engine, name: str) -> Copy | None:
    """A copy restored beside the serving engine, its GPU state back (asleep), and its
    /health answered inside its namespace: armed."""
    copy = Copy(name)
    doc = copy.wait_restored()
    if doc["finished"] and copy.pids:
        doc.update(copy.gpu_back(cuda))
        try:
            doc["health_s"] = in_netns(copy.pids[0], lambda: get(standby.url("/health")))
        except OSError as e:
            doc["health_error"] = repr(e)
    doc["armed_s"] = round(time.monotonic() - copy.t0, 2)
    result(f"armed_{name}", **doc, apps=compute_apps(), **card())
    return copy if "health_s" in doc else None


def step_second(cuda: LibCuda, standby: Engine) -> None:
    """The re-arm beside a serving engine, then the fault onto it, then the re-arm again:
    copy B restored beside the serving A (in its namespaces); A's tree SIGKILLed; B woken
    and asked (the second fault at full capacity); copy C restored beside B."""
    b = arm_copy(cuda, standby, "b")
    if b is None:
        return
    c = None
    try:
        in_use = card()["used_mib"]
        t_kill = time.monotonic()
        kill_tree(standby.proc.pid)  # A, the copy serving in the daemon's namespaces
        gone = released(in_use)
        doc: dict[str, Any] = {"released_s": round(time.monotonic() - t_kill, 2),
                               "card_after_kill": gone}
        try:
            doc["wake_s"] = in_netns(b.pids[0], lambda: standby.post("/wake_up"))
            doc["first_answer_s"] = in_netns(b.pids[0], standby.complete)
            doc["since_kill_s"] = round(time.monotonic() - t_kill, 2)
        except OSError as e:
            doc["error"] = repr(e)
        result("fault_onto_b", **doc, **card())
        if "since_kill_s" in doc:
            c = arm_copy(cuda, standby, "c")
    finally:
        b.end()
        if c is not None:
            c.end()


def children(pid: int) -> list[int]:
    with contextlib.suppress(OSError):
        return [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    return []


def kill_tree(pid: int) -> None:
    for p in reversed(tree(pid)):
        with contextlib.suppress(ProcessLookupError):
            os.kill(p, 9)


def snapshot(cuda: LibCuda, standby: Engine) -> None:
    """Steps 6-8 on a serving standby; its tree ended whatever happens."""
    try:
        if step_dump(cuda, standby) and step_restore(cuda, standby):
            step_second(cuda, standby)
    finally:
        kill_tree(standby.proc.pid)
        shutil.rmtree(IMAGES, ignore_errors=True)
        result("done", **card())


def main() -> None:
    WORK.mkdir(parents=True, exist_ok=True)
    RPC.mkdir(exist_ok=True)
    os.environ["VLLM_RPC_BASE_PATH"] = str(RPC)  # (the engines' environment is ours)
    ensure_m8b(MODEL)
    assert STAGED.exists()
    step_env()
    cuda = cuda_driver()
    standby = Engine("standby", 8111, FULL, wrap=NO_IO_URING)
    up = standby.wait_healthy()
    result("standby", healthy_s=up, **standby.facts(), **card(),
           **({} if up else {"tail": standby.tail()}))
    if not up:
        return
    standby.complete()
    result("standby_asleep", sleep_s=standby.post("/sleep?level=1"), apps=compute_apps(),
           **card())
    pids = take_off(cuda, standby)
    if "criu" in sys.argv[1:]:  # the snapshot alone: no serving engine, no failover
        bring_back(cuda, standby, pids, "woken")
        snapshot(cuda, standby)
        return
    serving = Engine("serving", 8112, FULL)
    up = serving.wait_healthy()
    result("serving", healthy_s=up, **serving.facts(), **card(),
           **({} if up else {"tail": serving.tail()}))
    if up:
        serving.complete()
    in_use = card()["used_mib"]
    t_kill = time.monotonic()
    serving.kill()
    result("serving_gone", s=round(time.monotonic() - t_kill, 2), **released(in_use))
    bring_back(cuda, standby, pids, "failover", t_kill)
    snapshot(cuda, standby)


if __name__ == "__main__":
    main()
