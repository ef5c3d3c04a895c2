"""The CUDA checkpoint seam (supervisor/engine/snapshot/cuda.py) on CPU: no driver here is
refused saying so, a library without the API too; taking a tree's GPU holders off and
bringing them back, against a scripted driver (the real calls run on a GPU machine:
tests/gpu_snapshot_probe.py), a failure half-way bringing back what was taken; which
processes hold a device file, read from /proc."""

from __future__ import annotations

import subprocess

import pytest

from supervisor.engine.snapshot import cuda

GUARD_S = 30.0


class Scripted:
    """A driver whose processes are states, failing where told."""

    def __init__(self, pids: list[int], fail: tuple[str, int] | None = None) -> None:
        self.states = {p: "running" for p in pids}
        self.fail = fail
        self.calls: list[tuple[str, int]] = []

    def _call(self, what: str, pid: int, want: str, then: str) -> None:
        self.calls.append((what, pid))
        if self.fail == (what, pid):
            raise cuda.CheckpointError(f"{what} of {pid}: CUDA error 999 (CUDA_ERROR_UNKNOWN)")
        assert self.states[pid] == want, (what, pid, self.states)
        self.states[pid] = then

    def state(self, pid: int) -> str:
        return self.states[pid]

    def lock(self, pid: int, timeout_ms: int) -> None:
        assert timeout_ms == cuda.LOCK_MS
        self._call("lock", pid, "running", "locked")

    def checkpoint(self, pid: int) -> None:
        self._call("checkpoint", pid, "locked", "checkpointed")

    def restore(self, pid: int) -> None:
        self._call("restore", pid, "checkpointed", "locked")

    def unlock(self, pid: int) -> None:
        self._call("unlock", pid, "locked", "running")


def test_no_driver_here_is_refused_saying_so_and_a_library_without_the_api_too() -> None:
    driver, why = cuda.open_driver()
    assert driver is None and why is not None and "no NVIDIA driver here" in why
    driver, why = cuda.open_driver("libc.so.6")
    assert driver is None and why is not None
    assert "no process checkpoint API" in why and "cuCheckpointProcessLock" in why


def test_the_holders_are_taken_off_and_brought_back() -> None:
    d = Scripted([11, 12])
    assert cuda.take_off(d, [11, 12]) == [11, 12]
    assert d.states == {11: "checkpointed", 12: "checkpointed"}
    assert cuda.bring_back(d, [11, 12]) == {}
    assert d.states == {11: "running", 12: "running"}
    assert d.calls == [("lock", 11), ("checkpoint", 11), ("lock", 12), ("checkpoint", 12),
                       ("restore", 11), ("unlock", 11), ("restore", 12), ("unlock", 12)]


def test_a_take_off_that_fails_half_way_brings_back_what_it_took() -> None:
    d = Scripted([11, 12, 13], fail=("checkpoint", 12))
    with pytest.raises(cuda.CheckpointError,
                       match=r"checkpoint of 12: CUDA error 999 .*2 process\(es\) brought back"):
        cuda.take_off(d, [11, 12, 13])
    assert d.states == {11: "running", 12: "running", 13: "running"}  # (13 never touched)
    assert ("lock", 13) not in d.calls


def test_a_bring_back_says_what_failed_and_goes_on_with_the_rest() -> None:
    d = Scripted([11, 12], fail=("restore", 11))
    cuda.take_off(d, [11, 12])
    errors = cuda.bring_back(d, [11, 12])
    assert list(errors) == [11] and "restore of 11" in errors[11]
    assert d.states == {11: "checkpointed", 12: "running"}


def test_the_holders_of_a_device_file_are_read_from_proc() -> None:
    holds = subprocess.Popen(["sleep", "30"], stdin=subprocess.DEVNULL,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    free = subprocess.Popen(["sleep", "30"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE)
    try:
        assert cuda.gpu_holders([holds.pid, free.pid], device="/dev/null") == [holds.pid]
        assert cuda.gpu_holders([holds.pid, free.pid]) == []  # (no GPU here)
        assert cuda.gpu_holders([2**22 + 7]) == []  # (a pid that is not there)
    finally:
        for p in (holds, free):
            p.kill()
            p.wait(GUARD_S)
