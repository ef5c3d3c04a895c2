"""Taking an engine down, and what a start checks first: its tree ended within its
deadline (SIGTERM, then SIGKILL of its group and every known process), its port and its
GPU memory proven free, and what an earlier run of the daemon left behind killed.

Effects, like `process.py`'s: run as tasks of the unit's effects; bounded waits; blocking
/proc and kernel calls in worker threads.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

import structlog

from supervisor.engine.process import proctree
from supervisor.engine.process.process import EngineProcess
from supervisor.engine.snapshot import cuda
from supervisor.ops.descriptors import Shortage, exhausted
from supervisor.settings.sections import EngineConfig
from supervisor.watchdog.gpu import GpuProcessLister

log = structlog.get_logger("supervisor.engine")

T = TypeVar("T")


@dataclass(frozen=True)
class TakeDown:
    """What taking an engine down found: its exit, what survived, what held the GPU."""

    exit_code: int | None
    survivors: list[proctree.ProcInfo]
    gpu_holders: dict[int, int]  # pid -> bytes, for pids of the old tree still on the GPU
    port_problem: str | None
    duration_s: float
    sigkilled: bool


# A dying engine's tree and its card's memory are looked at this often for the first
# seconds, then at the usual interval: on a full card the standby's wake waits on that
# proof, and the card came back 0.27-0.71 s after a kill (docs/standby.md, "Why a woken
# engine's memory comes back slowly"): a 0.25 s poll alone added up to a quarter second.
QUICK_INTERVAL_S = 0.02
# the most a take-down that proved the tree gone waits for the card's look in flight to
# tell (`take_down`): two calls in worker threads
CARD_TELL_S = 1.0
QUICK_FOR_S = 2.0
# A take-down whose steps raised (a /proc read, a signal, NVML: EBADF from a descriptor
# closed under it, 2026-12-01) is tried once more, straight to the kill: a take-down not
# proven costs the standby's failover and a cold start (docs/standby.md)
TAKE_DOWN_TRIES = 2


async def poll_until_clear(check: Callable[[], T], timeout_s: float,
                           interval_s: float = 0.1,
                           settled: Callable[[T], bool] = lambda value: not value,
                           quick_for_s: float = 0.0) -> T:
    """Call `check` in a worker thread until its value is `settled` (by default: falsy)
    or time runs out; return the last value. Every `QUICK_INTERVAL_S` for the first
    `quick_for_s`, then every `interval_s`."""
    start = time.monotonic()
    deadline = start + timeout_s
    while True:
        value = await asyncio.to_thread(check)
        now = time.monotonic()
        if settled(value) or now >= deadline:
            return value
        await asyncio.sleep(QUICK_INTERVAL_S if now - start < quick_for_s else interval_s)


async def wait_exit(proc: asyncio.subprocess.Process) -> int:
    """The main process's exit code, as soon as it exits.

    Not `proc.wait()`: asyncio resolves that only once the process's pipes have closed
    too, and a child that inherited them keeps them open: vLLM's EngineCore, orphaned
    when its API server is SIGKILLed, would hide the exit for as long as it lives. A
    pidfd turns readable the moment the process exits; the child watcher reaps it and
    sets the return code a moment later."""
    loop = asyncio.get_running_loop()
    fd: int | None = None
    if proc.returncode is None:
        with contextlib.suppress(OSError, AttributeError):  # old kernel: poll instead
            fd = os.pidfd_open(proc.pid)
    if fd is not None:
        exited: asyncio.Future[None] = loop.create_future()

        def readable() -> None:
            if not exited.done():
                exited.set_result(None)

        loop.add_reader(fd, readable)
        try:
            await exited
        finally:
            loop.remove_reader(fd)
            os.close(fd)
    # (the child watcher sets the return code from its own callback, with nothing to await)
    while proc.returncode is None:  # noqa: ASYNC110
        await asyncio.sleep(0.002 if fd is not None else 0.05)
    return proc.returncode


def stop_budget_s(cfg: EngineConfig, *, proxy_drain: bool, evidence_s: float) -> float:
    """The one deadline of a restart or a stop, from its start to the old tree proven
    gone: the bounds of its steps added up (the proxy's drain, the evidence capture, the
    engine's own drain and grace, the exit, the tree and the port within reap_timeout_s
    each, the GPU's release). `take_down` keeps within what is left of it."""
    return ((cfg.drain_timeout_s if proxy_drain else 0.0) + evidence_s + cfg.drain_timeout_s
            + cfg.stop_grace_s + 3 * cfg.reap_timeout_s + cfg.gpu_release_timeout_s)


async def card_released(gpu: GpuProcessLister, pids: Callable[[], set[int]],
                        listed_before: bool, tell: Callable[[], None],
                        timeout_s: float, device: str = cuda.NVIDIA) -> bool:
    """Tell (once) when NVML lists none of the tree's `pids()` any more, having listed
    some of them (before this take-down, `listed_before`, or at a look here), and no
    process of the tree holds the GPU's device files open (`device`; one that does keeps
    its memory though NVML lists nobody: a forked child with the descriptors): the tree's
    memory on the card is released, whatever of the tree is still going. Looked at every
    `QUICK_INTERVAL_S` for up to `timeout_s`. A tree that NVML never listed (no GPU, no
    NVML, a container whose pids it cannot see) is told nothing: its end (`Down`) is the
    only proof. Whether it told (a look that fails is logged, and tells nothing)."""
    try:
        return await _card_released(gpu, pids, listed_before, tell, timeout_s, device)
    except Exception as exc:  # (the take-down goes on: its end wakes the standby)
        log.warning("could not look at the card for the old engine's memory",
                    error=f"{type(exc).__name__}: {exc}")
        return False


async def _card_released(gpu: GpuProcessLister, pids: Callable[[], set[int]],
                         listed_before: bool, tell: Callable[[], None],
                         timeout_s: float, device: str) -> bool:
    seen = listed_before
    deadline = time.monotonic() + timeout_s
    while True:
        listed = await asyncio.to_thread(gpu.processes)
        if listed is not None:
            tree = pids()
            if tree & listed.keys():
                seen = True
            elif not seen:
                return False  # (never listed: nothing to tell before the tree's end)
            elif not await asyncio.to_thread(cuda.may_hold, tree, device):
                tell()
                return True
        elif not seen:
            return False
        if time.monotonic() >= deadline:
            return False
        await asyncio.sleep(QUICK_INTERVAL_S)


def _tree_now(pid: int) -> set[int]:
    """The pids of the tree under `pid` now (none where /proc cannot be read)."""
    try:
        return {i.pid for i in proctree.snapshot_tree(pid)}
    except OSError:  # (out of descriptors: the recorded tree alone)
        return set()


async def take_down(engine: EngineProcess, cfg: EngineConfig, *, graceful: bool,
                    force: asyncio.Event, gpu: GpuProcessLister,
                    budget_s: float | None = None,
                    on_card_released: Callable[[float], None] | None = None) -> TakeDown:
    """Stop the engine and prove its tree gone, within `budget_s` (what is left of the
    restart's or stop's deadline; None: the steps' own bounds added up).
    `on_card_released(seconds)`: for a take-down that is not graceful (the one a wake
    can wait on), called at most once and before this returns, as soon as the tree's
    memory on the card is released (`card_released`), which can be before the tree is
    gone (a core killed first, its API server still going).

    graceful: SIGTERM to the main pid only (vLLM drains for --shutdown-timeout, and its
    workers exit at once on SIGTERM, so never the group), wait for the drain plus a
    grace; `force` being set skips the wait. Then, always: SIGKILL the group, wait for
    every process of the tree to vanish, for the port to free and for the GPU to be
    released by the old tree. Each wait is its own bound or what is left of the budget,
    whichever is less; past the budget, the kill is still made and checked once (the
    exit and the tree for at least a second). Steps that raise are tried once more,
    straight to the kill (`TAKE_DOWN_TRIES`); then the error is raised.
    """
    t0 = time.monotonic()
    end = t0 + (budget_s if budget_s is not None
                else stop_budget_s(cfg, proxy_drain=False, evidence_s=0.0))

    def within(bound: float, floor: float = 0.0) -> float:
        return min(bound, max(floor, end - time.monotonic()))

    card: asyncio.Task[bool] | None = None
    if on_card_released is not None and not graceful:
        tell = on_card_released
        # the tree as recorded (its looks, every 10 s once healthy) and as it is now,
        # before the kill: a process of it that holds the card counts, recorded or not
        tree_now = await asyncio.to_thread(_tree_now, engine.pid)
        card = asyncio.ensure_future(card_released(
            gpu, lambda: {i.pid for i in engine.known} | {engine.pid} | tree_now,
            engine.gpu_listed, lambda: tell(time.monotonic() - t0),
            within(cfg.reap_timeout_s + cfg.gpu_release_timeout_s)))
    try:
        result = await _tried(engine, cfg, graceful, force, gpu, within, t0)
        if card is not None and not card.done() and not result.survivors \
                and not result.gpu_holders:
            # The tree is gone and NVML lists none of it: the look in flight tells, as
            # promised, before this returns (on a loaded host the take-down's own looks
            # could end first), within a bound.
            await asyncio.wait({card}, timeout=within(CARD_TELL_S, 0.1))
        return result
    finally:
        if card is not None:
            card.cancel()  # (it never raises: `card_released`)


async def _tried(engine: EngineProcess, cfg: EngineConfig, graceful: bool,
                 force: asyncio.Event, gpu: GpuProcessLister,
                 within: Callable[..., float], t0: float) -> TakeDown:
    """`_take_down`, tried again where its steps raised: up to `TAKE_DOWN_TRIES` times,
    each later try straight to the kill (its steps are safe to repeat: a signal to a
    group gone is nothing, the proofs look again); the last one's error is raised."""
    killed = _Killed()  # (shared by the tries: the first one's SIGKILL is the result's)
    for attempt in range(1, TAKE_DOWN_TRIES):
        try:
            return await _take_down(engine, cfg, graceful and attempt == 1, force, gpu,
                                    within, t0, killed)
        except Exception as exc:
            log.warning("take-down failed; trying it again, straight to the kill",
                        pid=engine.pid, attempt=attempt, error=repr(exc)[:500])
    return await _take_down(engine, cfg, graceful and TAKE_DOWN_TRIES == 1, force, gpu,
                            within, t0, killed)


@dataclass
class _Killed:
    """Whether a try of the take-down found the main process alive and SIGKILLed it."""

    sigkilled: bool = False


async def _take_down(engine: EngineProcess, cfg: EngineConfig, graceful: bool,
                     force: asyncio.Event, gpu: GpuProcessLister,
                     within: Callable[..., float], t0: float, killed: _Killed) -> TakeDown:
    """`take_down`'s steps (its docstring), `within` its budget."""
    proc = engine.proc
    if graceful and proc.returncode is None:
        proctree.signal_pid(engine.pid, signal.SIGTERM)
        waiter = asyncio.ensure_future(wait_exit(proc))
        forced = asyncio.ensure_future(force.wait())
        await asyncio.wait({waiter, forced},
                           timeout=within(cfg.drain_timeout_s + cfg.stop_grace_s),
                           return_when=asyncio.FIRST_COMPLETED)
        forced.cancel()
        waiter.cancel()
    if proc.returncode is None:
        killed.sigkilled = True
    # The group may hold the engine core and workers even when the main pid has exited.
    known = list(engine.known)
    await asyncio.to_thread(proctree.kill_group, engine.pgid, known)
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(wait_exit(proc), timeout=within(cfg.reap_timeout_s, 1.0))
    # Kill again each time round: a process forked during the first kill joins the group.
    # Out of descriptors, /proc cannot be read: the proof falls back to signal 0 and
    # getpgid (stricter), and /proc is tried again at the next round.
    shortage = Shortage("take-down", pid=engine.pid)

    def still_there() -> list[proctree.ProcInfo]:
        try:
            left = proctree.survivors(known, engine.pgid)
            shortage.ok()
        except OSError as exc:
            if not exhausted(exc):
                raise
            shortage.failed(exc)
            left = proctree.survivors_by_signal(known, engine.pgid)
        if left:
            proctree.kill_group(engine.pgid, left)
        return left

    survivors = await poll_until_clear(still_there, within(cfg.reap_timeout_s, 1.0),
                                       quick_for_s=QUICK_FOR_S)
    tree_pids = {i.pid for i in known} | {engine.pid}

    def gpu_held() -> dict[int, int]:
        listed = gpu.processes() or {}
        return {pid: mem for pid, mem in listed.items() if pid in tree_pids}

    gpu_holders = await poll_until_clear(gpu_held, within(cfg.gpu_release_timeout_s),
                                         interval_s=0.25, quick_for_s=QUICK_FOR_S)
    # (a port the daemon has no descriptor to check is unknown: reported, not waited for)
    port_problem = await poll_until_clear(
        lambda: _port_busy(cfg.host, cfg.port), within(cfg.reap_timeout_s),
        settled=lambda why: why is None or why.startswith(_UNCHECKED))
    if port_problem is not None and port_problem.endswith("is in use"):
        # (who holds it: asked once, it is costly)
        port_problem = await asyncio.to_thread(_port_holder, cfg.host, cfg.port)
    return TakeDown(exit_code=proc.returncode, survivors=survivors, gpu_holders=gpu_holders,
                    port_problem=port_problem, duration_s=time.monotonic() - t0,
                    sigkilled=killed.sigkilled)


_UNCHECKED = "cannot check"


def _port_busy(host: str, port: int) -> str | None:
    """`proctree.port_busy`, saying so when the daemon has no descriptor to check with."""
    return _unless_exhausted(proctree.port_busy, host, port,
                             f"{_UNCHECKED} {host}:{port}: the daemon is out of file descriptors")


def _port_holder(host: str, port: int) -> str | None:
    return _unless_exhausted(
        proctree.port_holder, host, port,
        f"{host}:{port} is in use (holder not read: the daemon is out of file descriptors)")


def _unless_exhausted(check: Callable[[str, int], str | None], host: str, port: int,
                      instead: str) -> str | None:
    try:
        return check(host, port)
    except OSError as exc:
        if not exhausted(exc):
            raise
        return instead


async def clean_leftovers(state: proctree.StateFile,
                          timeout_s: float) -> tuple[list[str], set[int]]:
    """Kill what an earlier run of the daemon left alive (per its state file), and wait,
    bounded, for it to go. Returns one line per process found, for the log and audit,
    and their pids. Raises RuntimeError if the file belongs to a daemon that still runs,
    or if the leftovers survive SIGKILL."""
    found = await asyncio.to_thread(proctree.leftovers, state)
    if found is None:
        return [], set()
    pgid, alive = found
    lines = [await asyncio.to_thread(proctree.describe, p.pid) for p in alive]
    if alive:
        await asyncio.to_thread(proctree.kill_group, pgid, alive)
        left = await poll_until_clear(lambda: [p for p in alive if proctree.is_alive(p)],
                                      timeout_s)
        if left:
            raise RuntimeError("processes left by an earlier run survive SIGKILL: "
                               + ", ".join(str(p.pid) for p in left))
    await asyncio.to_thread(state.remove)
    return lines, {p.pid for p in alive}


class GpuBusy(RuntimeError):
    """Processes this daemon did not start hold memory on the engine's GPUs."""


async def check_gpus_free(gpu: GpuProcessLister, own: set[int], allowance_bytes: int,
                          timeout_s: float, siblings: frozenset[int] = frozenset()) -> None:
    """Before a start, on a host where NVML answers: the processes of an earlier engine
    tree of ours (`own`, already killed) must be gone from the engine's GPUs (NVML frees
    memory a moment after a process dies: waited for, bounded by `timeout_s`), and every
    other process together may hold at most `allowance_bytes` there. The processes of the
    daemon's other engines (`siblings`, on a GPU they share) are neither waited for nor
    foreign.

    Raises GpuBusy naming each other process, its command and its memory; RuntimeError
    when our own leftovers still hold memory after the timeout. Unknown (no NVML, or the
    call failed) is not a refusal: the take-down of the last engine proved its own tree
    off the GPU, and an unknown is never a guess."""
    def ours_listed() -> dict[int, int]:
        listed = gpu.processes() or {}
        return {p: b for p, b in listed.items() if p in own}

    if own:
        held = await poll_until_clear(ours_listed, timeout_s, interval_s=0.25)
        if held:
            raise RuntimeError("GPU memory of processes left by an earlier run was not "
                               f"released within {timeout_s:g} s: " + ", ".join(
                                   f"pid {p} ({b / 2**20:.0f} MiB)" for p, b in held.items()))
    listed = await asyncio.to_thread(gpu.processes)
    if listed is None:
        return
    others = {p: b for p, b in listed.items()
              if p not in own and p not in siblings and p != os.getpid()}
    if others and sum(others.values()) > allowance_bytes:
        parts = []
        for pid, used in sorted(others.items(), key=lambda kv: -kv[1]):
            who = await asyncio.to_thread(proctree.describe, pid)
            parts.append(f"{who}: {used / 2**20:.0f} MiB")
        raise GpuBusy(f"the engine's GPUs hold memory of processes this daemon did not start "
                      f"({'; '.join(parts)}), over the {allowance_bytes / 2**20:.0f} MiB "
                      "that engine.gpu_foreign_allowance_mib allows")
