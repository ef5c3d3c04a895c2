"""Where an engine's processes spend a few seconds, for the GPU harness (`tests/gpu_vllm.py`
with SPY=1): py-spy records the engine's API server and its core, raw stacks, without
pausing them (`--nonblocking`), while a step runs; a KV reset at 1536-token prompts waited
4.2-4.8 s for vLLM to begin its sleep, whose own log says 0.37 s, and this says which of
the two processes held it up, and in what. The summary is each process's most sampled
stacks, cut to their innermost frames.
"""

from __future__ import annotations

import subprocess
from collections import Counter
from collections.abc import Iterable
from pathlib import Path
from typing import Any

SPY_S = 8  # how long each record runs (py-spy takes whole seconds)
RATE = 50  # samples a second


def targets(tree: Iterable[Any]) -> dict[str, int]:
    """The API server ("api") and the engine core ("core") among an engine's processes
    (psutil's), by vLLM's process titles and the API server's command line; a copy's
    tree (its namespace's init, CRIU) has both below its root."""
    out: dict[str, int] = {}
    for p in tree:
        try:
            name, cmd = p.name(), " ".join(p.cmdline())
        except Exception:  # (a process gone meanwhile: psutil's errors)
            continue
        if name.startswith("VLLM::EngineCor"):
            out.setdefault("core", p.pid)
        elif name.startswith("VLLM::APIServer") or (
                not name.startswith("VLLM::") and "vllm" in cmd and " serve " in f"{cmd} "
                and "no_io_uring" not in cmd):
            out.setdefault("api", p.pid)
    return out


def start(py_spy: str, pids: dict[str, int], into: Path,
          tag: str) -> list[tuple[str, Path, subprocess.Popen[bytes]]]:
    """One `py-spy record` a process, each into `into/spy-<tag>-<role>.txt`, running
    SPY_S seconds by itself."""
    started = []
    for role, pid in pids.items():
        path = into / f"spy-{tag}-{role}.txt"
        proc = subprocess.Popen([py_spy, "record", "--pid", str(pid), "--duration",
                                 str(SPY_S), "--rate", str(RATE), "--format", "raw",
                                 "--nonblocking", "--output", str(path)],
                                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        started.append((role, path, proc))
    return started


def finish(started: list[tuple[str, Path, subprocess.Popen[bytes]]]) -> dict[str, Any]:
    """Each record waited for (bounded) and summed up: role -> its top stacks, or what
    went wrong."""
    out: dict[str, Any] = {}
    for role, path, proc in started:
        try:
            _, err = proc.communicate(timeout=SPY_S + 30)
        except subprocess.TimeoutExpired:
            proc.kill()
            _, err = proc.communicate()
        if path.exists():
            out[role] = summary(path.read_text(errors="replace"))
        else:
            out[role] = {"error": f"rc {proc.returncode}: "
                                  f"{err.decode(errors='replace').strip()[-300:]}"}
    return out


def summary(raw: str, top: int = 5, frames: int = 4) -> dict[str, Any]:
    """py-spy's raw format (one line a stack: frames outermost first, `;`-separated, then
    its count): the samples, and the `top` stacks by count once cut to their `frames`
    innermost frames, each with its share of the samples."""
    counts: Counter[str] = Counter()
    total = 0
    for line in raw.splitlines():
        stack, _, n = line.rpartition(" ")
        if not stack or not n.isdigit():
            continue
        inner = stack.split(";")[-frames:]
        counts[" < ".join(reversed(inner))] += int(n)
        total += int(n)
    return {"samples": total,
            "top": [{"share": round(n / total, 3), "stack": s}
                    for s, n in counts.most_common(top)] if total else []}
