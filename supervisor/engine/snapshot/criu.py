"""An engine's process tree kept as files and brought back as copies, through CRIU (issue
49's route 3, docs/standby.md "The snapshot route"): the standby that needs the card only
once.

- `Criu`: how CRIU is run here, and why it cannot be (`refusal`): missing, too old for the
  kernel (CRIU 4.2 from kernel 6.16: a TCP socket's options cannot be read by 4.1), without
  the privilege (CAP_SYS_ADMIN or CAP_CHECKPOINT_RESTORE), or its own `criu check` failing.
- `dump`: a tree dumped into a folder of images, left stopped while the files it uses in
  /dev/shm are kept beside them (vLLM's queues between its processes: each copy gets its
  own /dev/shm), then killed. The pipes its output goes through are the daemon's
  (`external`): each copy gets its own instead. What the engine was made of is kept with
  the images (`made_of`), and `stale` says what changed since.
- `Copy`: the images restored beside whatever runs, in new PID, network and mount
  namespaces, so that every copy has the dumped tree's pids and port while the engine it
  was dumped from (or another copy) still has them outside. CRIU waits as the namespace's
  init; a copy ends when that init is killed (the kernel then kills every process in the
  namespace), by the pid this module spawned, never by a name.
- `connect_in`: a socket connected inside a copy's network namespace (its loopback is not
  the daemon's), made on a thread of its own moved there (`setns`): a socket keeps the
  namespace it was made in, so the caller uses it from anywhere.

Every call is bounded by a timeout and none blocks the event loop (CRIU runs as a child
process, the namespace move on a thread that ends with the call).
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import json
import os
import re
import shutil
import signal
import socket
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import psutil

from supervisor.engine.process import proctree

# what a dump and a restore need beyond CRIU's defaults: the engine's established loopback
# connections (torch.distributed's store) kept, unix sockets to outside and file locks
# taken as they are; files deleted while open go in the image (up to GHOST_LIMIT each),
# or, mapped shared (a semaphore's in /dev/shm), are linked back beside themselves as
# `link_remap.N`: those are moved from /dev/shm into the copy's own at the dump
OPTS = ("--tcp-established", "--ext-unix-sk", "--file-locks", "--link-remap")
GHOST_LIMIT = "256M"
REMAP = "link_remap."
# CRIU says a restore finished only from this verbosity up; a copy is seen restored by it
RESTORED = "Restore finished successfully"
MANIFEST = "snapshot.json"  # beside the images: what the dump was of
SHM = Path("/dev/shm")
SHM_KEPT = "dev-shm"  # beside the images: the files the tree had open or mapped in SHM
# beside the images: where a copy holds the host's shared folders under SHM while its own
# SHM is mounted (`_shared_mounts`; empty folders, mounted only in copies' namespaces)
SHARED_HELD = "shared-held"
CLONE_NEWNET = 0x40000000
CAP_SYS_ADMIN, CAP_CHECKPOINT_RESTORE = 21, 40
# the new network namespace's loopback up (SIOCSIFFLAGS with IFF_UP | IFF_RUNNING), by the
# interpreter running the daemon: nothing else is needed inside the namespace
LO_UP = ("import socket, fcntl, struct; fcntl.ioctl(socket.socket(), 0x8914, "
         "struct.pack('16sH14s', b'lo', 0x41, b''))")
TAIL_LINES = 8  # of a CRIU log, in an error


class SnapshotError(RuntimeError):
    """CRIU could not dump or restore; the message says what it said."""


@dataclass(frozen=True)
class Criu:
    """CRIU as run here: its command line (a path, or a carried loader and its libraries
    before it)."""

    argv: tuple[str, ...]

    @classmethod
    def at(cls, path: str) -> Criu:
        return cls((path,))


def version_of(text: str) -> tuple[int, int] | None:
    """`criu --version`'s "Version: 4.2.1" as (4, 2)."""
    m = re.search(r"Version:\s*(\d+)\.(\d+)", text)
    return (int(m[1]), int(m[2])) if m else None


def kernel_of(release: str) -> tuple[int, int] | None:
    m = re.match(r"(\d+)\.(\d+)", release)
    return (int(m[1]), int(m[2])) if m else None


def too_old(criu: tuple[int, int], kernel: tuple[int, int]) -> str | None:
    """Why this CRIU cannot dump an engine on this kernel: from 6.16 a TCP socket's options
    are read as 4.2 reads them (CRIU issue 2705); None when it can."""
    if kernel >= (6, 16) and criu < (4, 2):
        return (f"CRIU {criu[0]}.{criu[1]} cannot dump an engine's TCP sockets on kernel "
                f"{kernel[0]}.{kernel[1]} (4.2 or later is needed from 6.16)")
    if criu < (3, 17):
        return f"CRIU {criu[0]}.{criu[1]} is too old (3.17 or later)"
    return None


def privileged(status: str) -> bool:
    """Whether /proc/self/status's effective capabilities allow a dump and a restore."""
    m = re.search(r"^CapEff:\s*([0-9a-f]+)", status, re.M)
    caps = int(m[1], 16) if m else 0
    return bool(caps & (1 << CAP_SYS_ADMIN) or caps & (1 << CAP_CHECKPOINT_RESTORE))


async def _run(argv: list[str], within_s: float,
               pass_fds: tuple[int, ...] = ()) -> tuple[int, str]:
    """A command's exit code and its output, killed after `within_s` (then -9)."""
    try:
        proc = await asyncio.create_subprocess_exec(
            *argv, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
            stdin=asyncio.subprocess.DEVNULL, pass_fds=pass_fds, start_new_session=True)
    except OSError as e:
        return 127, f"{argv[0]}: {e.strerror or e}"
    try:
        out, _ = await asyncio.wait_for(proc.communicate(), within_s)
    except (TimeoutError, asyncio.CancelledError) as e:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        await asyncio.shield(proc.wait())
        if isinstance(e, asyncio.CancelledError):
            raise
        return -9, f"{argv[0]}: no answer within {within_s:g} s"
    return proc.returncode or 0, out.decode(errors="replace")


async def refusal(criu: Criu, within_s: float = 30.0) -> str | None:
    """Why engines cannot be snapshotted here, in one sentence; None when they can."""
    rc, out = await _run([*criu.argv, "--version"], within_s)
    if rc != 0:
        return f"CRIU does not run ({' '.join(criu.argv)}): {out.strip()[-200:]}"
    have, kernel = version_of(out), kernel_of(os.uname().release)
    if have is None or kernel is None:
        return f"CRIU's version ({out.strip()[:80]!r}) or the kernel's is unreadable"
    if (why := too_old(have, kernel)) is not None:
        return why
    if not privileged(await asyncio.to_thread(_read, Path("/proc/self/status"))):
        return "the daemon has neither CAP_SYS_ADMIN nor CAP_CHECKPOINT_RESTORE"
    rc, out = await _run([*criu.argv, "check"], within_s)
    if rc != 0:
        return f"`criu check` failed: {out.strip()[-300:]}"
    return None


def _before_criu(path: Path) -> str:
    """What a copy's shell said on its stderr (a mount that failed), if anything."""
    words = _tail(path)
    return "" if words in ("", "(no log)") else f"; before CRIU: {words}"


def _tail(path: Path) -> str:
    with contextlib.suppress(OSError):
        return " | ".join(path.read_text(errors="replace").splitlines()[-TAIL_LINES:])
    return "(no log)"


def pipe_inode(fd: int) -> int:
    """The inode CRIU names a pipe by (`pipe:[N]`)."""
    return os.fstat(fd).st_ino


def _emptied(images: Path) -> None:
    images.mkdir(parents=True, exist_ok=True)
    shutil.rmtree(images / SHM_KEPT, ignore_errors=True)
    for old in images.iterdir():
        if old.is_file():
            old.unlink()


def _shared_mounts(shared: Sequence[Path], hold: Path) -> tuple[str, str]:
    """The copy's shell commands that keep the host's `shared` folders under /dev/shm
    through the tmpfs mounted over it: each bound first to a folder of `hold` (outside
    /dev/shm), then moved to its own path on the copy's /dev/shm (a mount namespace of
    `unshare`'s own is private, so the move stays in it). Folders outside /dev/shm need
    nothing: the copy sees the host's mounts. (before the tmpfs, after it)."""
    under = [f for f in shared if f.is_relative_to(SHM) and f != SHM]
    held = "".join(f"mkdir -p {_quote(str(hold / str(i)))} && "
                   f"mount --bind {_quote(str(f))} {_quote(str(hold / str(i)))} && "
                   for i, f in enumerate(under))
    moved = "".join(f"mkdir -p {_quote(str(f))} && "
                    f"mount --move {_quote(str(hold / str(i)))} {_quote(str(f))} && "
                    for i, f in enumerate(under))
    return held, moved


def _shm_used(pids: list[int]) -> set[str]:
    """The files in /dev/shm the processes have mapped or open (vLLM's message queues
    between its processes: each copy needs the tree's own, not another copy's)."""
    names: set[str] = set()
    for pid in pids:
        with contextlib.suppress(OSError):
            for line in Path(f"/proc/{pid}/maps").read_text().splitlines():
                fields = line.split(maxsplit=5)
                path = fields[5] if len(fields) > 5 else ""
                if path.startswith(f"{SHM}/") and not path.endswith(" (deleted)"):
                    names.add(path[len(str(SHM)) + 1:])
        with contextlib.suppress(OSError):
            for fd in Path(f"/proc/{pid}/fd").iterdir():
                with contextlib.suppress(OSError):
                    target = os.readlink(fd)
                    if target.startswith(f"{SHM}/") and not target.endswith(" (deleted)"):
                        names.add(target[len(str(SHM)) + 1:])
    return {n for n in names if "/" not in n}


def _remaps() -> set[str]:
    with contextlib.suppress(OSError):
        return {n for n in os.listdir(SHM) if n.startswith(REMAP)}
    return set()


def _keep_shm(names: set[str], remaps: set[str], images: Path) -> None:
    """Those files as they are now (the tree stopped), beside the images, and the links
    the dump made back to deleted ones moved there (nothing of the dump stays in the
    host's /dev/shm)."""
    kept = images / SHM_KEPT
    kept.mkdir(exist_ok=True)
    for name in names:
        with contextlib.suppress(FileNotFoundError):
            shutil.copy2(SHM / name, kept / name)
    for name in remaps:
        with contextlib.suppress(FileNotFoundError):
            shutil.move(SHM / name, kept / name)


def _signal(pids: list[int], sig: signal.Signals) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, sig)


def stale(made_of: Mapping[str, str], now: Mapping[str, str]) -> str | None:
    """Why images made of `made_of` (what `dump` was told the engine was: its command
    line, its vLLM, the kernel, the driver...) are no copy of what would start `now`;
    None when nothing of it changed."""
    for key in sorted(set(made_of) | set(now)):
        if made_of.get(key) != now.get(key):
            return (f"its {key} changed ({made_of.get(key, 'unknown')!r} when it was made, "
                    f"{now.get(key, 'unknown')!r} now)")
    return None


async def made_of(images: Path) -> dict[str, str] | None:
    """What the images in `images` were made of; None when there are none."""
    text = await asyncio.to_thread(_read, images / MANIFEST)
    if not text:
        return None
    with contextlib.suppress(ValueError, AttributeError):
        return {str(k): str(v) for k, v in json.loads(text).get("made_of", {}).items()}
    return None


async def dump(criu: Criu, pid: int, images: Path, pipes: tuple[int, ...] = (),
               within_s: float = 600.0, made: Mapping[str, str] | None = None,
               gpu: Sequence[int] = (), port: int = 0, warmed: bool = False,
               vllm_version: str | None = None, weights_bytes: int | None = None) -> float:
    """The tree rooted at `pid` dumped into `images` (made empty first), with the files
    in /dev/shm it uses as they were at the dump; then the tree is killed. `pipes`: the
    inodes of the pipes it writes to whose other end is the daemon's, given to each copy
    afresh; `made`, what the engine is (`stale` compares it with what a start would be);
    `gpu`, its processes whose GPU state was taken off (`cuda.take_off`), which each copy
    brings back (`Copy.gpu`: the same processes in the copy); `port`, the one it listens
    on (each copy's, inside its namespace); `warmed`, its client paths were warmed (each
    copy carries what that built); `vllm_version`, its vLLM's, as its start lines said;
    `weights_bytes`, its weights' backup, as its sleep said.
    The manifest also says which boot of the host made them (`kept`).
    Seconds taken; SnapshotError with CRIU's last lines, the tree running on (what
    becomes of it is the caller's)."""
    await asyncio.to_thread(_emptied, images)
    pids = await asyncio.to_thread(_pids, pid)
    remaps = await asyncio.to_thread(_remaps)  # (others', before the dump)
    external = [a for ino in pipes for a in ("--external", f"pipe:[{ino}]")]
    t0 = time.monotonic()
    # (a sleeping standby has no traffic to lock out, and the image has no iptables;
    # left stopped, so that its files in /dev/shm are kept as the image has them)
    rc = -1
    try:
        rc, out = await _run([*criu.argv, "dump", "-t", str(pid), "-D", str(images), "-v2",
                              "-o", "dump.log", "--network-lock", "skip", "--leave-stopped",
                              "--ghost-limit", GHOST_LIMIT, *OPTS, *external], within_s)
        linked = await asyncio.to_thread(_remaps) - remaps
        shm = await asyncio.to_thread(_shm_used, pids) if rc == 0 else set()
        await asyncio.to_thread(_keep_shm, shm, linked, images)
    finally:
        # dumped: the tree goes (copies are made of the image); else it runs on (CRIU
        # resumes it, unless it was cut short)
        await asyncio.to_thread(_signal, pids,
                                signal.SIGKILL if rc == 0 else signal.SIGCONT)
    if rc != 0:
        raise SnapshotError(f"criu dump of {pid} failed ({rc}): {_tail(images / 'dump.log')}"
                            + (f" {out.strip()[-200:]}" if out.strip() else ""))
    await asyncio.to_thread((images / MANIFEST).write_text,
                            json.dumps({"pid": pid, "pipes": list(pipes),
                                        "made_of": dict(made or {}), "gpu": list(gpu),
                                        "port": port, "warmed": warmed,
                                        "vllm_version": vllm_version,
                                        "weights_bytes": weights_bytes,
                                        "boot": _boot_id()}))
    return round(time.monotonic() - t0, 3)


BOOT_ID = Path("/proc/sys/kernel/random/boot_id")  # Linux's, new at each boot


def _boot_id() -> str:
    return _read(BOOT_ID).strip()


@dataclass(frozen=True)
class Kept:
    """Images an earlier run of the daemon left: what the dumped engine was made of, the
    port it listened on, whether its client paths were warmed, its vLLM's version, its
    weights' backup."""

    made_of: dict[str, str]
    port: int
    warmed: bool = False
    vllm_version: str | None = None
    weights_bytes: int | None = None


def kept(images: Path) -> Kept | None:
    """The images in `images`, if a dump of this boot of the host made them (a daemon
    restarted since can restore its standby from them; after a reboot the driver, the
    kernel and the GPU's state may differ, and a start dumps afresh); None when there
    are none, or their manifest is unreadable. Blocking: through a thread."""
    try:
        manifest = json.loads(_read(images / MANIFEST) or "{}")
        made, port, boot = manifest["made_of"], int(manifest["port"]), manifest["boot"]
    except (ValueError, KeyError, TypeError):
        return None
    if not boot or boot != _boot_id() or not isinstance(made, dict) or not port:
        return None
    version, weights = manifest.get("vllm_version"), manifest.get("weights_bytes")
    return Kept({str(k): str(v) for k, v in made.items()}, port,
                bool(manifest.get("warmed")), version if isinstance(version, str) else None,
                weights if isinstance(weights, int) and weights > 0 else None)


class Copy:
    """The images restored in new PID, network and mount namespaces (`restore`): `proc`
    is what this module spawned (`unshare`, whose child CRIU is the namespace's init and
    the restored tree's parent), `pids` the restored tree as the daemon numbers it."""

    def __init__(self, proc: asyncio.subprocess.Process, log: Path,
                 outputs: dict[int, int]) -> None:
        self.proc = proc
        self.log = log
        # for each pipe the image named, the read end of the copy's own (the daemon's)
        self.outputs = outputs
        self.pids: list[int] = []
        # those of `pids` whose GPU state the dump took off: to bring back
        self.gpu: list[int] = []

    @property
    def root(self) -> int:
        """The restored engine's main process (as the daemon numbers it)."""
        return self.pids[0]

    async def end(self, within_s: float = 10.0) -> bool:
        """Every process of the copy killed: `unshare` and the namespace's init (one
        process group, spawned here), which makes the kernel kill the rest; True once
        none is left within `within_s`."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        for fd in self.outputs.values():
            with contextlib.suppress(OSError):
                os.close(fd)
        self.outputs = {}
        deadline = time.monotonic() + within_s
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self.proc.wait(), within_s)
        while time.monotonic() < deadline:
            if not any(_alive(p) for p in self.pids):
                return True
            await asyncio.sleep(0.05)
        return False


def _alive(pid: int) -> bool:
    """Neither gone nor a zombie."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def _pids(root: int) -> list[int]:
    """The tree rooted at `root`, root first (`proctree.snapshot_tree`)."""
    return [p.pid for p in proctree.snapshot_tree(root)]


def _restored(unshare: int) -> list[int]:
    """The restored tree: under `unshare`'s child CRIU (the namespace's init), its root
    first."""
    try:
        inits = psutil.Process(unshare).children()
        roots = [r.pid for i in inits for r in i.children()]
    except psutil.NoSuchProcess:
        return []
    return [pid for root in roots for pid in _pids(root)]


async def restore(criu: Criu, images: Path, name: str, within_s: float = 300.0,
                  binds: Sequence[tuple[Path, Path]] = (),
                  shared: Sequence[Path] = ()) -> Copy:
    """A copy of the dumped tree, restored from `images` in namespaces of its own, each
    pipe the dump named external given afresh (its read end in `Copy.outputs`). `binds`:
    (a folder of the copy's own, the path the image has it at), mounted there in the
    copy's mount namespace first: where the engine binds unix sockets (vLLM's
    `VLLM_RPC_BASE_PATH`), two copies would otherwise bind the same files. `shared`:
    the host's folders the copy must write to as they are, even under the /dev/shm of
    its own (a KV tier both engines read: `_shared_mounts`); a folder that is not there
    ends the copy, saying so. Returns once CRIU says the restore finished; SnapshotError
    (the copy ended) otherwise."""
    log = images / f"restore-{name}.log"
    try:
        manifest = json.loads(await asyncio.to_thread(_read, images / MANIFEST) or "{}")
        pipes = [int(ino) for ino in manifest["pipes"]]
        gpu = {int(pid) for pid in manifest.get("gpu", [])}
    except (ValueError, KeyError, TypeError) as e:
        raise SnapshotError(f"no snapshot in {images} (its {MANIFEST} is missing or "
                            f"unreadable: {e!r})") from None
    await asyncio.to_thread(log.unlink, missing_ok=True)
    ends = {ino: os.pipe() for ino in pipes}
    inherit = [a for ino, (_, w) in ends.items() for a in ("--inherit-fd",
                                                          f"fd[{w}]:pipe:[{ino}]")]
    restore_argv = [*criu.argv, "restore", "-D", str(images), "-v3", "-o", log.name,
                    *OPTS, *inherit]
    # (exec: CRIU itself becomes the namespace's init, and waits as the tree's parent)
    mounts = "".join(f"mount --bind {_quote(str(own))} {_quote(str(at))} && "
                     for own, at in binds)
    if await asyncio.to_thread((images / SHM_KEPT).is_dir):  # a /dev/shm of its own
        held, moved = _shared_mounts(shared, images / SHARED_HELD)
        mounts += (f"{held}mount -t tmpfs -o mode=1777 tmpfs {SHM} && "
                   f"cp -a {_quote(str(images / SHM_KEPT))}/. {SHM}/ && {moved}")
    inner = f"{mounts}{_quote(sys.executable)} -c {_quote(LO_UP)} && exec " + \
        " ".join(_quote(a) for a in restore_argv)
    writes = tuple(w for _, w in ends.values())
    # (what the shell and its mounts say before CRIU writes a log of its own)
    said = images / f"restore-{name}.err"
    try:
        said_fd = await asyncio.to_thread(os.open, said,
                                          os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    except OSError:
        for fd in (*writes, *(r for r, _ in ends.values())):
            os.close(fd)
        raise
    try:
        proc = await asyncio.create_subprocess_exec(
            "unshare", "--pid", "--net", "--mount", "--fork", "--mount-proc", "sh", "-c",
            inner, stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.DEVNULL,
            stderr=said_fd, pass_fds=writes, start_new_session=True)
    finally:
        for w in (*writes, said_fd):
            os.close(w)
    copy = Copy(proc, log, {ino: r for ino, (r, _) in ends.items()})
    deadline = time.monotonic() + within_s
    while True:
        if RESTORED in await asyncio.to_thread(_read, log):
            break
        if proc.returncode is not None or time.monotonic() > deadline:
            why = ("ended" if proc.returncode is not None
                   else f"not restored within {within_s:g} s")
            await copy.end()
            words = await asyncio.to_thread(lambda: _tail(log) + _before_criu(said))
            raise SnapshotError(f"criu restore of copy {name} {why}: {words}")
        await asyncio.sleep(0.05)
    copy.pids = await asyncio.to_thread(_restored, proc.pid)
    # (a restored process keeps its pid inside the copy's namespace: the dumped one's)
    copy.gpu = await asyncio.to_thread(_inside, copy.pids, gpu)
    return copy


def _inside(pids: list[int], wanted: set[int]) -> list[int]:
    """Those of `pids` whose pid in their own PID namespace is one of `wanted`."""
    return [p for p in pids if _pid_inside(p) in wanted]


def _pid_inside(pid: int) -> int | None:
    """The pid process `pid` has in its own (innermost) PID namespace."""
    for line in _read(Path(f"/proc/{pid}/status")).splitlines():
        if line.startswith("NSpid:"):
            return int(line.split()[-1])
    return None


def _read(path: Path) -> str:
    with contextlib.suppress(OSError):
        return path.read_text(errors="replace")
    return ""


def _quote(arg: str) -> str:
    return "'" + arg.replace("'", "'\"'\"'") + "'"


def _setns(pid: int) -> None:
    fd = os.open(f"/proc/{pid}/ns/net", os.O_RDONLY)
    try:
        if ctypes.CDLL(None, use_errno=True).setns(fd, CLONE_NEWNET) != 0:
            errno = ctypes.get_errno()
            raise OSError(errno, f"setns into {pid}'s network namespace: {os.strerror(errno)}")
    finally:
        os.close(fd)


async def connect_in(pid: int, host: str, port: int, within_s: float = 5.0) -> socket.socket:
    """A TCP socket connected to host:port inside `pid`'s network namespace (non-blocking,
    for the caller's event loop). OSError when it cannot be."""
    loop = asyncio.get_running_loop()
    done: asyncio.Future[socket.socket] = loop.create_future()

    def settle(sock: socket.socket | None, err: BaseException | None) -> None:
        if done.cancelled():
            if sock is not None:
                sock.close()
        elif err is not None:
            done.set_exception(err)
        else:
            done.set_result(sock)  # type: ignore[arg-type]

    def run() -> None:  # a thread of its own: it stays in the namespace, and ends here
        try:
            _setns(pid)
            sock = socket.create_connection((host, port), timeout=within_s)
            sock.setblocking(False)
            loop.call_soon_threadsafe(settle, sock, None)
        except OSError as e:
            loop.call_soon_threadsafe(settle, None, e)

    threading.Thread(target=run, name=f"netns-{pid}", daemon=True).start()
    return await asyncio.wait_for(done, within_s + 1.0)
