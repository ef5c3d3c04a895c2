"""Evidence before a kill: a bounded snapshot of a failing engine, kept on disk.

When the daemon takes an engine down for a fault it cannot see into (a hang, no
progress, an XID, a remedy that failed), the reasons die with the processes. Before the
take-down it captures one bundle: Python stacks of every process of the engine tree
(py-spy, `--nonblocking`: read from memory without pausing the process, so a stopped or
wedged process is read too, never waited on), the engine's last log lines, the signals
the watchdog last computed, and NVML's last reading; and, from a vLLM that writes its
own (0.33's `--watchdog-config`, `stackdumps.py`), the newest dumps of the tree's
processes, copied under `vllm-stack-dumps/` within `stackdumps.COPY_TOTAL_BYTES`. py-spy
runs all the same: older engines have no such dumps, the API server never writes one,
and a dump may be from an earlier stall (each copy says when it was written). One folder
per bundle under the evidence directory (`<UTC time>-<rule>`), the newest `keep` kept.

Owns that directory and nothing else. Bounded: every py-spy runs with a deadline, all
of them at once, and the caller awaits `capture()` under the same bound, so a kill never
waits longer than `timeout_s` for it; whatever did not finish is written as missing, with
why. Never blocks the event loop: files are written from a thread. Never raises: a
bundle that could not be written says so in its result.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import signal
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil

from supervisor.watchdog import stackdumps


@dataclass(frozen=True)
class EvidenceRequest:
    reason: str
    rule: str  # the rule (or remedy) that takes the engine down
    engine_pid: int
    pids: Sequence[int]  # the engine tree, main pid first
    log_lines: Sequence[str]
    signals: Mapping[str, float | None]
    gpu: Mapping[str, Any] | None
    wall: float = field(default_factory=time.time)
    # where the engine's vLLM writes its own stack dumps, and whether only this engine's
    # are there (the daemon's folder of its start) or the pids must pick them (the
    # operator's folder)
    dump_dir: str | None = None
    dump_dir_owned: bool = True

    @property
    def name(self) -> str:
        stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime(self.wall))
        return f"{stamp}-{''.join(c if c.isalnum() or c in '-_' else '_' for c in self.rule)}"


@dataclass(frozen=True)
class Bundle:
    path: str
    duration_s: float
    bytes: int
    stacks: Mapping[int, str]  # pid -> "ok", or why it has none
    error: str | None = None  # the bundle could not be written
    # vLLM's own stack dumps copied in: each file's copy, its source, its last dump
    vllm_dumps: Sequence[Mapping[str, Any]] = ()

    def as_dict(self) -> dict[str, Any]:
        return {"path": self.path, "duration_s": round(self.duration_s, 3),
                "bytes": self.bytes, "stacks": {str(k): v for k, v in self.stacks.items()},
                "vllm_dumps": [dict(d) for d in self.vllm_dumps], "error": self.error}


def find_py_spy() -> str | None:
    """py-spy beside this interpreter (the supervisor's virtualenv), else on PATH."""
    near = Path(sys.executable).parent / "py-spy"
    return str(near) if near.exists() else shutil.which("py-spy")


async def capture(req: EvidenceRequest, directory: Path, keep: int, timeout_s: float,
                  py_spy: str | None) -> Bundle:
    t0 = time.monotonic()
    deadline = t0 + timeout_s
    stacks = await _dump_all(req.pids, py_spy, deadline)
    text = "\n".join(f"==== pid {pid}: {status}\n{out}" for pid, (status, out) in
                     stacks.items())
    summary = {pid: status for pid, (status, _) in stacks.items()}
    doc = {"reason": req.reason, "rule": req.rule, "engine_pid": req.engine_pid,
           "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(req.wall)),
           "processes": await asyncio.to_thread(lambda: [_describe(p) for p in req.pids]),
           "stacks": {str(k): v for k, v in summary.items()},
           "signals": dict(req.signals), "gpu": req.gpu}
    path = directory / req.name
    try:
        path, size, dumps = await asyncio.to_thread(_write, path, doc, text, req,
                                                    directory, keep)
    except OSError as exc:
        return Bundle(str(path), time.monotonic() - t0, 0, summary,
                      f"could not write the bundle: {exc}")
    return Bundle(str(path), time.monotonic() - t0, size, summary, vllm_dumps=dumps)


async def _dump_all(pids: Sequence[int], py_spy: str | None,
                    deadline: float) -> dict[int, tuple[str, str]]:
    if py_spy is None:
        return {pid: ("skipped: py-spy is not installed", "") for pid in pids}
    results = await asyncio.gather(*(_dump(pid, py_spy, deadline) for pid in pids))
    return dict(zip(pids, results, strict=True))


async def _dump(pid: int, py_spy: str, deadline: float) -> tuple[str, str]:
    note = await asyncio.to_thread(_state_note, pid)  # (reads /proc: off the loop)
    if note is None:
        return "skipped: the process is gone", ""
    try:
        proc = await asyncio.create_subprocess_exec(
            py_spy, "dump", "--nonblocking", "--pid", str(pid),
            stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE, start_new_session=True)
    except OSError as exc:
        return f"skipped: py-spy could not run: {exc}", ""
    try:
        out, err = await asyncio.wait_for(proc.communicate(),
                                          max(0.1, deadline - time.monotonic()))
    except TimeoutError:
        # its own group, all of it: a child holding its pipes would keep wait() waiting
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        await proc.wait()
        return f"failed: py-spy took longer than the evidence bound{note}", ""
    if proc.returncode != 0:
        why = (err or out).decode("utf-8", "replace").strip().splitlines()
        first = why[0] if why else f"exit code {proc.returncode}"
        if "ermission" in first or "ptrace" in first.lower():
            return f"skipped: not permitted to read the process ({first}){note}", ""
        return f"failed: {first}{note}", ""
    return f"ok{note}", out.decode("utf-8", "replace")


def _state_note(pid: int) -> str | None:
    """'' for a running process, a note for a stopped one, None when it is gone."""
    try:
        status = psutil.Process(pid).status()
    except psutil.Error:
        return None
    if status in (psutil.STATUS_STOPPED, psutil.STATUS_TRACING_STOP):
        return " (the process is stopped: read from its memory without resuming it)"
    if status == psutil.STATUS_ZOMBIE:
        return None
    return ""


def _describe(pid: int) -> dict[str, Any]:
    try:
        p = psutil.Process(pid)
        with p.oneshot():
            return {"pid": pid, "name": p.name(), "status": p.status(),
                    "cmdline": " ".join(p.cmdline())[:500],
                    "rss_bytes": p.memory_info().rss, "threads": p.num_threads()}
    except psutil.Error as exc:
        return {"pid": pid, "error": type(exc).__name__}


def _write(path: Path, doc: dict[str, Any], stacks: str, req: EvidenceRequest,
           directory: Path, keep: int) -> tuple[Path, int, list[dict[str, Any]]]:
    directory.mkdir(parents=True, exist_ok=True, mode=0o750)
    base, n = path, 1
    while True:  # two bundles in one second keep both
        try:
            path.mkdir(mode=0o750)
            break
        except FileExistsError:
            n += 1
            path = base.with_name(f"{base.name}-{n}")
    dumps: list[dict[str, Any]] = []
    if req.dump_dir:
        found = stackdumps.find(req.dump_dir, None if req.dump_dir_owned else set(req.pids))
        dumps = stackdumps.copy(found, path / "vllm-stack-dumps")
    doc["vllm_dumps"] = dumps
    files = {"bundle.json": json.dumps(doc, indent=2, default=str) + "\n",
             "stacks.txt": stacks, "engine.log": "\n".join(req.log_lines) + "\n"}
    size = sum(d.get("bytes", 0) for d in dumps)
    for name, text in files.items():
        data = text.encode("utf-8", "replace")
        (path / name).write_bytes(data)
        size += len(data)
    prune(directory, keep)
    return path, size, dumps


def list_bundles(directory: Path) -> list[dict[str, Any]]:
    """The bundles kept, oldest first: name, path, reason, rule, time, bytes."""
    out: list[dict[str, Any]] = []
    if not directory.is_dir():
        return out
    for d in sorted(p for p in directory.iterdir() if p.is_dir()):
        entry: dict[str, Any] = {"name": d.name, "path": str(d)}
        try:
            doc = json.loads((d / "bundle.json").read_text())
            entry.update(reason=doc.get("reason"), rule=doc.get("rule"), time=doc.get("time"),
                         stacks=doc.get("stacks"),
                         vllm_dumps=[v.get("file") for v in doc.get("vllm_dumps") or ()
                                     if v.get("file")])
        except (OSError, ValueError, AttributeError):
            entry["error"] = "no readable bundle.json"
        entry["bytes"] = sum(f.stat().st_size for f in d.rglob("*") if f.is_file())
        out.append(entry)
    return out


def prune(directory: Path, keep: int) -> list[str]:
    """Remove the oldest bundles beyond `keep` (names sort by time); the names removed."""
    bundles = sorted(p for p in directory.iterdir() if p.is_dir())
    gone = bundles[:max(0, len(bundles) - keep)]
    for d in gone:
        shutil.rmtree(d, ignore_errors=True)
    return [d.name for d in gone]

