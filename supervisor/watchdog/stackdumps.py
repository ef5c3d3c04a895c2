"""vLLM's own stack dumps (`--watchdog-config`, new in vLLM 0.33): what the daemon asks
for, where the dumps go, how they are kept bounded, and reading them for evidence.

vLLM 0.33's stack-dump watchdog (`vllm/utils/watch_dog.py`) is a thread in the engine
core and in each worker. When the process's main loop has not been fed for `timeout`
seconds (looked at every `check_interval`), it appends a dump of every thread's stack
(faulthandler) to `<dump_dir>/VLLM_STACK_DUMP_for_<name>_<pid>.log` (`engine_<dp rank>`
for a core, `worker_<rank>` for a worker), once per stall; the core also dumps when
SIGTERM reaches it, and a worker when its parent dies. Waiting for input does not count
(the loops disable it there). It never kills. Older versions refuse the flag.

What the daemon makes of it (docs/watchdog.md, "vLLM's own stack dumps"):
- the timeout is under the daemon's own stall deadline (`stall_deadline_s`): a core that
  stalls has written its dump before a rule takes it down, and no ptrace is needed;
- the dump directory is the daemon's: one folder per start under its state directory,
  the newest `KEEP_STARTS` kept and all of them within `MAX_ROOT_BYTES`, and a file past
  `MAX_FILE_BYTES` cut back to its newest dumps while its engine runs;
- an operator's own `--watchdog-config` wins: its `dump_dir` is read, never pruned.

The functions that touch files run in worker threads; none raises for a file that vLLM,
the operator or a prune removed meanwhile.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
import shutil
import time
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from supervisor.ops import vllm_versions
from supervisor.watchdog.conditions import parse_condition
from supervisor.watchdog.rules import RuleConfig
from supervisor.watchdog.signal_list import SIGNAL_NAMES

FLAG = "--watchdog-config"
FIRST_VERSION = (0, 33)
_FILE = re.compile(r"VLLM_STACK_DUMP_for_(.+)_(\d+)\.log")
_MARK = b">>> Call stack dump #"
KEEP_STARTS = 8  # folders of the latest starts of one engine (its own and its standby's)
MAX_ROOT_BYTES = 64 << 20  # all of one engine's folders
MAX_FILE_BYTES = 4 << 20  # one file while its engine runs: cut to its newest half past it
COPY_FILE_BYTES = 1 << 20  # what an evidence bundle copies of one file: its newest dumps
COPY_TOTAL_BYTES = 4 << 20  # ... and of all of them
DEFAULT_TIMEOUT_S = 30  # when no rule of the daemon's takes a stalled engine down
_STALL_SECONDS = ("engine_stalled_s", "metrics_staleness_s", "metrics_age_s")
_TAKES_DOWN = ("restart", "restart_now", "hold_down")


def has_watchdog(version: str | None) -> bool:
    """Whether vLLM `version` (as installed: `0.33.0`, `0.33.1rc1`, `0.34.0+cu130`) takes
    `--watchdog-config`. Unknown: no (an older vLLM would refuse to start with it)."""
    return vllm_versions.at_least(version, FIRST_VERSION)


def operator_config(argv: Sequence[str]) -> dict[str, Any] | None:
    """The `--watchdog-config` the operator's arguments give (JSON, `=JSON`, or vLLM's
    dotted form `--watchdog-config.dump_dir DIR`; vLLM also reads `--watchdog_config`),
    merged as vLLM merges them; None when they give none. A value that is not JSON is
    kept as {} (vLLM will say what is wrong with it)."""
    found: dict[str, Any] | None = None
    i = 0
    while i < len(argv):
        a = argv[i]
        i += 1
        if not a.startswith(("--watchdog-config", "--watchdog_config")):
            continue
        name, eq, value = a.partition("=")
        key = name[len(FLAG):]
        if key and not key.startswith("."):
            continue  # another flag that begins the same way
        if not eq:
            if i >= len(argv):
                break
            value = argv[i]
            i += 1
        found = found if found is not None else {}
        if key:  # --watchdog-config.dump_dir DIR
            try:
                found[key[1:]] = json.loads(value)
            except ValueError:
                found[key[1:]] = value
            continue
        try:
            doc = json.loads(value)
        except ValueError:
            doc = None
        if isinstance(doc, dict):
            found.update(doc)
    return found


def stall_deadline_s(rules: Mapping[str, RuleConfig], *, canary_enabled: bool,
                     canary_period_s: float, canary_timeout_s: float) -> float | None:
    """The earliest moment after an engine stops making progress at which one of the
    daemon's rules can take it down (a restart or a hold-down): over the enabled rules,
    a condition's stall comparisons (`engine_stalled_s >= 6`: 6 s; `canary_failures >=
    3`: the first failure after a canary's deadline, each further one a period and a
    deadline later), those of one alternative taken together, plus the rule's `for_s`.
    None when no rule acts on a stall."""
    best: float | None = None
    for rule in rules.values():
        if not rule.enabled or rule.action not in _TAKES_DOWN:
            continue
        try:
            cond = parse_condition(rule.when, SIGNAL_NAMES)
        except ValueError:
            continue
        for group in cond.groups:
            bounds = []
            for c in group:
                if c.op not in (">=", ">"):
                    continue
                if c.signal in _STALL_SECONDS:
                    bounds.append(max(0.0, c.value))
                elif c.signal == "canary_failures" and canary_enabled:
                    n = max(1, math.ceil(c.value + (c.op == ">")))
                    bounds.append(canary_timeout_s + (n - 1) * (canary_period_s
                                                                + canary_timeout_s))
            if bounds:
                at = max(bounds) + rule.for_s
                best = at if best is None else min(best, at)
    return best


def timing(deadline_s: float | None) -> tuple[int, int]:
    """(timeout, check_interval) in whole seconds, as vLLM takes them (integers above 0):
    the dump written within timeout + interval of the last feed, about 5/6 of the
    deadline, never before a second (6 s: 4 and 1, dumped 4-5 s into the stall)."""
    if deadline_s is None:
        return DEFAULT_TIMEOUT_S, 5
    timeout = max(1, int(deadline_s * 2 / 3))
    return timeout, max(1, min(10, timeout // 4))


@dataclass(frozen=True)
class StackDumps:
    """Where an engine's vLLM writes its stack dumps, and whose that folder is."""

    dir: str  # "": the operator's --watchdog-config turned them off
    owner: str  # "daemon" (made per start, pruned) or "operator" (read only)
    timeout_s: int | None = None
    check_interval_s: int | None = None

    @property
    def owned(self) -> bool:
        return self.owner == "daemon"

    def flag(self) -> list[str]:
        """The argument the daemon adds to the engine's command line ([] for the
        operator's own)."""
        if not self.owned:
            return []
        doc = {"timeout": self.timeout_s, "check_interval": self.check_interval_s,
               "dump_dir": self.dir}
        return [FLAG, json.dumps(doc, separators=(",", ":"))]

    def view(self) -> dict[str, Any]:
        return {"dir": self.dir or None, "owner": self.owner, "timeout_s": self.timeout_s,
                "check_interval_s": self.check_interval_s}


def plan(argv: Sequence[str], cwd: str, version: str | None, deadline_s: float | None,
         folder: Path) -> StackDumps | None:
    """The stack dumps of an engine about to start with `argv`: the operator's own
    setting (its dump_dir, relative to the engine's cwd), else the daemon's in `folder`
    (to be made) when `version` has the watchdog, else None."""
    own = operator_config(argv)
    if own is not None:
        where = own.get("dump_dir")
        where = where if isinstance(where, str) else ""
        timeout = own.get("timeout", 300)
        interval = own.get("check_interval", 10)
        return StackDumps(os.path.join(cwd, where) if where else "", "operator",
                          timeout if isinstance(timeout, int) else None,
                          interval if isinstance(interval, int) else None)
    if not has_watchdog(version):
        return None
    timeout, interval = timing(deadline_s)
    return StackDumps(str(folder), "daemon", timeout, interval)


def start_folder(root: Path, bay: int, generation: int, wall: float) -> Path:
    """The name of one start's folder: its time first, so that names sort by age."""
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime(wall))
    return root / f"{stamp}-bay{bay}-gen{generation}"


def make(folder: Path, keep: Collection[str]) -> list[str]:
    """Makes a start's folder (its parent pruned first, `keep` and it spared); the names
    of the folders dropped."""
    root = folder.parent
    root.mkdir(parents=True, exist_ok=True, mode=0o750)
    dropped = prune(root, {*keep, str(folder)}, reserve=1)
    folder.mkdir(exist_ok=True, mode=0o750)
    return dropped


def _size(d: Path) -> int:
    total = 0
    with contextlib.suppress(OSError):
        for f in d.iterdir():
            with contextlib.suppress(OSError):
                total += f.lstat().st_size
    return total


def prune(root: Path, keep: Collection[str], *, reserve: int = 0,
          starts: int = KEEP_STARTS, max_bytes: int = MAX_ROOT_BYTES) -> list[str]:
    """Drops the oldest start folders under `root` beyond `starts` (less `reserve`, the
    room for one about to be made) or `max_bytes` together; those in `keep` (engines
    still running) never. The names dropped."""
    try:
        folders = sorted((p for p in root.iterdir() if p.is_dir()), reverse=True)
    except OSError:
        return []
    kept, total, full, dropped = 0, 0, False, []
    for d in folders:  # newest first; past the first that does not fit, every older one
        size = _size(d)
        full = full or kept >= starts - reserve or total + size > max_bytes
        if str(d) in keep or not full:
            kept += 1
            total += size
            continue
        shutil.rmtree(d, ignore_errors=True)
        dropped.append(d.name)
    return dropped


def _newest(data: bytes, limit: int) -> bytes:
    """The newest whole dumps of a file's bytes within `limit` (the tail, cut at a dump's
    first line; the bare tail if one dump alone is larger)."""
    if len(data) <= limit:
        return data
    tail = data[-limit:]
    at = tail.find(_MARK)
    return tail[at:] if at >= 0 else tail


def trim(folder: str, max_bytes: int = MAX_FILE_BYTES) -> list[str]:
    """Cuts each dump file in `folder` larger than `max_bytes` to its newest dumps within
    half of it (vLLM opens the file afresh for every dump, so a replaced file is simply
    appended to); the names cut."""
    cut = []
    with contextlib.suppress(OSError):
        for entry in os.scandir(folder):
            if not _FILE.fullmatch(entry.name):
                continue
            with contextlib.suppress(OSError):
                if entry.stat(follow_symlinks=False).st_size <= max_bytes:
                    continue
                data = Path(entry.path).read_bytes()
                kept = b"(older dumps dropped by vllm-supervisor)\n\n" + _newest(
                    data, max_bytes // 2)
                tmp = Path(entry.path + ".trim")
                tmp.write_bytes(kept)
                os.replace(tmp, entry.path)
                cut.append(entry.name)
    return cut


@dataclass(frozen=True)
class DumpFile:
    path: str
    name: str  # vLLM's name of the process: engine_0, worker_1
    pid: int
    bytes: int
    written: float  # wall time of its last write


def find(folder: str, pids: Collection[int] | None) -> list[DumpFile]:
    """The dump files in `folder` of the processes `pids` (None: all of them), newest
    first."""
    out = []
    with contextlib.suppress(OSError):
        for entry in os.scandir(folder):
            m = _FILE.fullmatch(entry.name)
            if m is None or (pids is not None and int(m.group(2)) not in pids):
                continue
            with contextlib.suppress(OSError):
                st = entry.stat(follow_symlinks=False)
                out.append(DumpFile(entry.path, m.group(1), int(m.group(2)), st.st_size,
                                    st.st_mtime))
    return sorted(out, key=lambda f: f.written, reverse=True)


def copy(files: Sequence[DumpFile], dest: Path, *, per_file: int = COPY_FILE_BYTES,
         total: int = COPY_TOTAL_BYTES) -> list[dict[str, Any]]:
    """Copies the newest dumps of each file into `dest` (made when there is one), within
    `per_file` each and `total` together (newest files first); what each copy holds."""
    out: list[dict[str, Any]] = []
    left = total
    for f in files:
        if left <= 0:
            out.append({"source": f.path, "pid": f.pid, "file": None,
                        "skipped": "the bundle's bound on vLLM's dumps was reached"})
            continue
        try:
            data = Path(f.path).read_bytes()
        except OSError as exc:
            out.append({"source": f.path, "pid": f.pid, "file": None,
                        "skipped": f"unreadable: {exc.strerror or exc}"})
            continue
        kept = _newest(data, min(per_file, left))
        dest.mkdir(parents=True, exist_ok=True)
        target = dest / os.path.basename(f.path)
        target.write_bytes(kept)
        left -= len(kept)
        heads = [line.decode("utf-8", "replace").strip() for line in kept.splitlines()
                 if line.startswith(_MARK)]
        out.append({"source": f.path, "pid": f.pid, "process": f.name, "file": str(target),
                    "bytes": len(kept), "truncated": len(kept) < len(data),
                    "dumps": len(heads), "last": heads[-1] if heads else None,
                    "written": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(f.written))})
    return out
