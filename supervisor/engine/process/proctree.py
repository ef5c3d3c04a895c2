"""The engine's process tree: finding it, killing it, proving it gone.

Processes are selected only by what this daemon knows for certain: the pid it spawned,
that pid's process group (the engine is its own session leader, so group = main pid),
and pids it saw in the tree, each paired with its start time so that a recycled pid is
never mistaken for ours. Never by a name pattern.

Every function here blocks on /proc or on the kernel (psutil, bind); the daemon calls
them through `asyncio.to_thread`, never on the event loop.

Reading /proc takes a file descriptor, and a daemon whose clients took them all (EMFILE)
must still take its engine down: killing needs none (`os.killpg`), a process is never
signalled by a pid whose identity could not be checked, and `survivors_by_signal`
proves a tree gone with signal 0 and getpgid alone.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import signal
import socket
import subprocess
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil
import structlog

from supervisor.ops.descriptors import exhausted

log = structlog.get_logger("supervisor.engine")

@dataclass(frozen=True)
class ProcInfo:
    pid: int
    create_time: float  # psutil's start time: (pid, create_time) names one process for ever
    name: str = ""

    def as_dict(self) -> dict[str, Any]:
        return {"pid": self.pid, "create_time": self.create_time, "name": self.name}


def _info(p: psutil.Process) -> ProcInfo | None:
    try:
        with p.oneshot():
            return ProcInfo(p.pid, p.create_time(), p.name())
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return None


def snapshot_tree(root_pid: int) -> list[ProcInfo]:
    """The root and all its descendants, as they are now."""
    try:
        root = psutil.Process(root_pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return []
    return [i for i in map(_info, procs) if i is not None]


def tree_usage(procs: list[ProcInfo]) -> tuple[int, float]:
    """(resident bytes, CPU seconds used so far) summed over the live processes given,
    with what the children each of them reaped used (a compiler run by a worker, gone
    before the look, took a core meanwhile)."""
    rss, cpu = 0, 0.0
    for info in procs:
        try:
            p = psutil.Process(info.pid)
            with p.oneshot():
                if abs(p.create_time() - info.create_time) >= 0.01:
                    continue  # a recycled pid: not ours
                rss += p.memory_info().rss
                t = p.cpu_times()
                cpu += t.user + t.system + t.children_user + t.children_system
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return rss, cpu


def group_members(pgid: int) -> list[ProcInfo]:
    """Every live (non-zombie) process whose process group is pgid."""
    out = []
    for pid in psutil.pids():
        try:
            if os.getpgid(pid) != pgid:
                continue
            proc = psutil.Process(pid)
            if proc.status() == psutil.STATUS_ZOMBIE:
                continue
        except (ProcessLookupError, PermissionError, psutil.NoSuchProcess):
            continue
        info = _info(proc)
        if info is not None:
            out.append(info)
    return out


def is_alive(info: ProcInfo) -> bool:
    """Whether this very process (same pid and start time) still runs (zombies do not)."""
    try:
        p = psutil.Process(info.pid)
        same = abs(p.create_time() - info.create_time) < 0.01
        return bool(same and p.status() != psutil.STATUS_ZOMBIE)
    except psutil.NoSuchProcess:
        return False


def survivors(known: list[ProcInfo], pgid: int | None) -> list[ProcInfo]:
    """Processes of the tree still alive: the known ones plus any member of its group.
    Raises OSError (EMFILE) when /proc cannot be read: see `survivors_by_signal`."""
    alive = {i.pid: i for i in known if is_alive(i)}
    if pgid is not None:
        for i in group_members(pgid):
            alive.setdefault(i.pid, i)
    return sorted(alive.values(), key=lambda i: i.pid)


def survivors_by_signal(known: list[ProcInfo], pgid: int | None) -> list[ProcInfo]:
    """`survivors` without a file descriptor (no /proc): signal 0 and getpgid only.

    Stricter, never looser: a known pid that still answers signal 0 counts as alive (a
    zombie not reaped yet, or the pid of another process since, cannot be told apart
    here), and a group that answers with no known member in it counts as one process
    under the group's number. An empty list is a proof: no known pid and no process of
    the group exists."""
    left = [i for i in known if _answers(os.kill, i.pid)]
    if (pgid is not None and _answers(os.killpg, pgid)
            and not any(_pgid_of(i.pid) == pgid for i in left)):
        left.append(ProcInfo(pgid, 0.0, f"a process of group {pgid} (/proc unreadable)"))
    return sorted(left, key=lambda i: i.pid)


def _answers(kill: Callable[[int, int], None], target: int) -> bool:
    """Whether signal 0 finds a process (or a group) there."""
    try:
        kill(target, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # (it exists, as someone else's)
        return True
    return True


def _pgid_of(pid: int) -> int | None:
    try:
        return os.getpgid(pid)
    except OSError:
        return None


def signal_pid(pid: int, sig: int) -> bool:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        return False
    return True


def kill_group(pgid: int, known: list[ProcInfo]) -> None:
    """SIGKILL the group, and each known process of the tree that left the group. The
    group's kill needs no descriptor; a known pid is signalled only once /proc showed it
    is still the process that was seen (out of descriptors, it is left for the next try)."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pgid, signal.SIGKILL)
    for info in known:
        try:
            ours = is_alive(info)
        except OSError as exc:
            if not exhausted(exc):
                raise
            continue  # (never a pid whose identity is not proven)
        if ours:
            with contextlib.suppress(ProcessLookupError):
                os.kill(info.pid, signal.SIGKILL)


def describe(pid: int) -> str:
    try:
        p = psutil.Process(pid)
        cmd = " ".join(p.cmdline()) or p.name()
    except (psutil.NoSuchProcess, psutil.AccessDenied, OSError):  # (OSError: EMFILE)
        return f"pid {pid}"
    if len(cmd) > 160:
        cmd = cmd[:157] + "..."
    return f"pid {pid} ({cmd})"


def port_busy(host: str, port: int) -> str | None:
    """None if host:port can be bound now, else why not (cheap: one bind). Raises
    OSError when no socket can be made (EMFILE)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
            return None
        except OSError as exc:
            if exc.errno != errno.EADDRINUSE:
                return f"cannot bind {host}:{port}: {exc.strerror}"
            return f"{host}:{port} is in use"


def free_port(host: str, avoid: set[int]) -> int:
    """A port the kernel gives as free on `host` now, none of `avoid` (one bind: cheap).
    Raises OSError when no socket can be made."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    for _ in range(20):
        with socket.socket(family, socket.SOCK_STREAM) as s:
            s.bind((host, 0))
            port = int(s.getsockname()[1])
        if port not in avoid:
            return port
    raise OSError(f"no free port on {host} outside {sorted(avoid)}")


def port_holder(host: str, port: int) -> str | None:
    """None if host:port can be bound now; otherwise who holds it, as best we can tell.
    Costly when the port is in use (psutil reads every process's sockets, in Python,
    holding the GIL for a good part of a second on a busy host): poll `port_busy`, and
    ask this once."""
    busy = port_busy(host, port)
    if busy is None or not busy.endswith("is in use"):
        return busy
    holders = set()
    try:
        for c in psutil.net_connections(kind="inet"):
            if (c.laddr and c.laddr.port == port and c.status == psutil.CONN_LISTEN
                    and c.pid is not None):
                holders.add(c.pid)
    except psutil.AccessDenied:
        pass
    if not holders:
        return f"{host}:{port} is in use (holder not visible to this user)"
    return f"{host}:{port} is in use by " + ", ".join(describe(p) for p in sorted(holders))


class StateFile:
    """The engine tree of the running daemon, on disk, so that a later run can clean up
    what a crashed or SIGKILLed daemon left behind. Written at spawn, refreshed with the
    tree, removed once the tree is proven gone."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def write(self, pgid: int, procs: list[ProcInfo]) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps({"daemon_pid": os.getpid(), "pgid": pgid,
                                   "procs": [p.as_dict() for p in procs]}))
        tmp.replace(self.path)

    def read(self) -> tuple[int, int, list[ProcInfo]] | None:
        """(daemon_pid, pgid, procs), or None if there is no readable state file."""
        try:
            doc = json.loads(self.path.read_text())
            procs = [ProcInfo(int(p["pid"]), float(p["create_time"]), str(p.get("name", "")))
                     for p in doc["procs"]]
            return int(doc["daemon_pid"]), int(doc["pgid"]), procs
        except (OSError, ValueError, KeyError, TypeError):
            return None

    def remove(self) -> None:
        self.path.unlink(missing_ok=True)


def leftovers(state: StateFile) -> tuple[int, list[ProcInfo]] | None:
    """Processes recorded by an earlier run of the daemon that are still alive.

    Only processes whose pid *and* start time match the record count, and only when the
    daemon that recorded them is gone (it is not us, and no longer runs).
    """
    rec = state.read()
    if rec is None:
        return None
    daemon_pid, pgid, procs = rec
    if daemon_pid != os.getpid() and psutil.pid_exists(daemon_pid):
        try:
            # the recording daemon still runs: another instance owns that tree
            if psutil.Process(daemon_pid).status() != psutil.STATUS_ZOMBIE:
                raise RuntimeError(f"state file {state.path} belongs to a running daemon "
                                   f"({describe(daemon_pid)})")
        except psutil.NoSuchProcess:
            pass
    alive = [p for p in procs if is_alive(p)]
    # the leader recorded with its start time proves the group is still ours
    leader = next((p for p in procs if p.pid == pgid), None)
    if leader is not None and is_alive(leader):
        for m in group_members(pgid):
            if m.pid not in {a.pid for a in alive}:
                alive.append(m)
    return pgid, alive


# The guard: a tiny shell process that outlives a SIGKILLed daemon just long enough to
# take the engine's group down with it. The daemon writes the engine's pgid to the
# guard's stdin at every spawn and 0 once the tree is proven gone; when the daemon dies
# for any reason, the kernel closes the pipe, the guard reads EOF and, if a group is
# armed, SIGTERMs its leader, then SIGKILLs the group after a grace.
_GUARD_SCRIPT = r"""
trap '' INT HUP TERM
pg=0
while IFS= read -r line; do pg=$line; done
case "$pg" in ''|*[!0-9]*|0) exit 0;; esac
kill -TERM "$pg" 2>/dev/null
i=0
while [ "$i" -lt "$GRACE_TENTHS" ] && kill -0 "-$pg" 2>/dev/null; do
  sleep 0.1; i=$((i+1))
done
kill -KILL "-$pg" 2>/dev/null
exit 0
"""


class Guard:
    def __init__(self, grace_s: float = 5.0) -> None:
        self._grace_tenths = max(1, int(grace_s * 10))
        self._proc: subprocess.Popen[bytes] | None = None

    def _ensure(self) -> subprocess.Popen[bytes]:
        if self._proc is None or self._proc.poll() is not None:
            self._proc = subprocess.Popen(
                ["/bin/sh", "-c", _GUARD_SCRIPT, "vllm-supervisor-guard"],
                stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                env={"PATH": os.environ.get("PATH", "/usr/bin:/bin"),
                     "GRACE_TENTHS": str(self._grace_tenths)},
                start_new_session=True, close_fds=True)
        return self._proc

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    def arm(self, pgid: int) -> None:
        self._send(str(pgid))

    def disarm(self) -> None:
        self._send("0")

    def _send(self, line: str) -> None:
        for attempt in (1, 2):  # a guard that died is started again, once
            try:
                proc = self._ensure()
            except OSError as exc:
                # (out of descriptors, say): the guard is the net under a SIGKILLed
                # daemon, not the daemon's own hand; it starts again at the next word
                log.error("cannot start the guard process", error=str(exc), sent=line)
                return
            assert proc.stdin is not None
            try:
                proc.stdin.write(line.encode() + b"\n")
                proc.stdin.flush()
                return
            except BrokenPipeError:
                self._proc = None
                if attempt == 2:
                    raise

    def close(self) -> None:
        """Disarm and let the guard exit (normal daemon exit: nothing to kill)."""
        if self._proc is None:
            return
        with contextlib.suppress(OSError, ValueError):
            assert self._proc.stdin is not None
            self._proc.stdin.write(b"0\n")
            self._proc.stdin.close()
        try:
            self._proc.wait(timeout=2)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait(timeout=2)
        self._proc = None


def merge_known(known: list[ProcInfo], seen: list[ProcInfo]) -> list[ProcInfo]:
    """Every process ever seen in a tree, each once (a pid with its start time)."""
    merged = {(p.pid, p.create_time): p for p in known}
    for p in seen:
        merged.setdefault((p.pid, p.create_time), p)
    return list(merged.values())
