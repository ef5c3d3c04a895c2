"""A process's whole GPU state moved to host memory and back, by pid, through the CUDA
driver's process checkpoint API (driver 570+, `cuCheckpointProcess*`): what makes a
sleeping standby hold nothing of the card, so that CRIU can dump it and a copy can be
restored beside a serving engine (docs/standby.md, "Route 3 probed": 0.8-1.0 s a process
to take off, the card then held 4 MiB of it; 0.9-3.8 s to bring back).

- `Driver`: the five calls by pid, as the daemon uses them; `LibCuda` is the real one
  (plain C calls into `libcuda.so.1` from this process, for any process of the machine),
  and `open_driver` says why there is none (no NVIDIA driver, or one without the API).
- `gpu_holders`: which processes of a tree have the NVIDIA device files open (the API
  server of an engine has none: only its core is taken off).
- `take_off` / `bring_back`: lock and checkpoint each holder, restore and unlock each.
  A take-off that fails half-way brings back what it took, and says what failed.

Every call blocks (a checkpoint copies the process's GPU memory): the daemon makes them
through `asyncio.to_thread`, never on its loop.
"""

from __future__ import annotations

import ctypes
import os
from collections.abc import Iterable
from typing import ClassVar, Protocol

NVIDIA = "/dev/nvidia"  # the device files a process with the GPU open holds
LOCK_MS = 10_000  # how long a lock waits for the process's work on the GPU to end


class CheckpointError(RuntimeError):
    """The driver refused a call; the message names it, the pid and the driver's code."""


class Driver(Protocol):
    def state(self, pid: int) -> str: ...
    def lock(self, pid: int, timeout_ms: int) -> None: ...
    def checkpoint(self, pid: int) -> None: ...
    def restore(self, pid: int) -> None: ...
    def unlock(self, pid: int) -> None: ...


class LibCuda:
    """The CUDA driver's checkpoint API through ctypes (states: running, locked,
    checkpointed, failed)."""

    STATES: ClassVar[dict[int, str]] = {0: "running", 1: "locked", 2: "checkpointed",
                                        3: "failed"}

    def __init__(self, lib: ctypes.CDLL) -> None:
        self.lib = lib
        self._check("cuInit", lib.cuInit(0))

    def _check(self, what: str, rc: int) -> None:
        if rc != 0:
            name = ctypes.c_char_p()
            self.lib.cuGetErrorName(rc, ctypes.byref(name))
            raise CheckpointError(f"{what}: CUDA error {rc} ({(name.value or b'?').decode()})")

    def state(self, pid: int) -> str:
        s = ctypes.c_int(-1)
        rc = self.lib.cuCheckpointProcessGetState(ctypes.c_int(pid), ctypes.byref(s))
        return self.STATES.get(s.value, str(s.value)) if rc == 0 else f"error {rc}"

    def lock(self, pid: int, timeout_ms: int) -> None:
        args = (ctypes.c_uint * 16)()  # CUcheckpointLockArgs: timeoutMs, then reserved
        args[0] = timeout_ms
        self._check(f"lock of {pid}", self.lib.cuCheckpointProcessLock(ctypes.c_int(pid), args))

    def checkpoint(self, pid: int) -> None:
        self._check(f"checkpoint of {pid}",
                    self.lib.cuCheckpointProcessCheckpoint(ctypes.c_int(pid), None))

    def restore(self, pid: int) -> None:
        self._check(f"restore of {pid}",
                    self.lib.cuCheckpointProcessRestore(ctypes.c_int(pid), None))

    def unlock(self, pid: int) -> None:
        self._check(f"unlock of {pid}",
                    self.lib.cuCheckpointProcessUnlock(ctypes.c_int(pid), None))


def open_driver(name: str = "libcuda.so.1") -> tuple[Driver | None, str | None]:
    """The driver's checkpoint API, or None and why not, in one sentence."""
    try:
        lib = ctypes.CDLL(name)
    except OSError as e:
        return None, f"no NVIDIA driver here ({name}: {e})"
    missing = [f for f in ("cuCheckpointProcessLock", "cuCheckpointProcessCheckpoint",
                           "cuCheckpointProcessRestore", "cuCheckpointProcessUnlock",
                           "cuCheckpointProcessGetState") if not hasattr(lib, f)]
    if missing:
        return None, (f"the NVIDIA driver has no process checkpoint API (driver 570 or "
                      f"later; missing {', '.join(missing)})")
    try:
        return LibCuda(lib), None
    except CheckpointError as e:
        return None, str(e)


def _opens(pid: int, device: str) -> bool | None:
    """Whether process `pid` has a device file under `device` open; None where that
    cannot be read of it (a gone pid, or a zombie, holds nothing: False)."""
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except FileNotFoundError:
        return False
    except OSError:
        return None
    unread = False
    for fd in fds:
        try:
            if os.readlink(f"/proc/{pid}/fd/{fd}").startswith(device):
                return True
        except FileNotFoundError:
            continue  # (closed meanwhile)
        except OSError:
            unread = True
    return None if unread else False


def gpu_holders(pids: Iterable[int], device: str = NVIDIA) -> list[int]:
    """The processes among `pids` with a device file under `device` open."""
    return [pid for pid in pids if _opens(pid, device) is True]


def may_hold(pids: Iterable[int], device: str = NVIDIA) -> bool:
    """Whether any of `pids` has a device file under `device` open, or may have: one whose
    descriptors cannot be read while it runs counts (a gone pid, or a zombie, holds
    nothing). Where a process holds the device open, its GPU memory is not released,
    whatever NVML lists (a forked child that inherited the descriptors keeps it all)."""
    return any(_opens(pid, device) is not False for pid in pids)


def bring_back(driver: Driver, pids: Iterable[int]) -> dict[int, str]:
    """Each process's GPU state restored and unlocked; what failed, by pid (a process
    not checkpointed is only unlocked, one not locked left alone)."""
    errors: dict[int, str] = {}
    for pid in pids:
        try:
            state = driver.state(pid)
            if state == "checkpointed":
                driver.restore(pid)
                state = "locked"
            if state == "locked":
                driver.unlock(pid)
        except CheckpointError as e:
            errors[pid] = str(e)
    return errors


def take_off(driver: Driver, pids: Iterable[int], lock_ms: int = LOCK_MS) -> list[int]:
    """Each process locked (its GPU work ended) and checkpointed (its GPU memory in host
    memory, the card's given back): the pids taken off. CheckpointError when one could
    not be: those taken off, and that one, are brought back first."""
    done: list[int] = []
    for pid in pids:
        try:
            driver.lock(pid, lock_ms)
            done.append(pid)
            driver.checkpoint(pid)
        except CheckpointError as e:
            left = bring_back(driver, done)
            raise CheckpointError(
                f"{e}; {len(done)} process(es) brought back"
                + (f", {len(left)} not: " + "; ".join(left.values()) if left else "")) from e
    return done
