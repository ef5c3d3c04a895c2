"""vLLM's shared-memory files of an engine tree: seen while it runs, removed once it is
proven gone.

vLLM's CPU KV offload keeps its host cache in one file per engine (`SharedOffloadRegion`,
vLLM 0.32: `/dev/shm/vllm_offload_{engine_id}.mmap`), created by the first of the
engine's processes to get there and opened by the others, each holding its descriptor
for the region's life. The creator unlinks it at a clean shutdown; a SIGKILL, the OOM
killer or a crash leaves it, and its size of host memory (tmpfs) with it. A start of an
engine of the same `engine_id` (one an operator names in --kv-transfer-config) then
finds it there, takes the joiner's path and waits for a size that never comes: a start
that fails, and fails again at every restart.

The name holds no pid: `engine_id` is the KV transfer config's (a uuid4 drawn inside the
engine unless the operator names one), with `_dp<rank>` per data-parallel replica
(`hisparse_<instance>_dp<n>` for HiSparse's pool). On a shared host other engines' files
sit beside ours under the same prefix, so a file is never chosen by its name. It is the
dead engine's when one of its processes held it open (`held`, at each look at the tree:
their /proc/PID/fd), or when the engine's own lines said it created or opened it
(`named`: vLLM's "Created mmap file ..." at INFO, for one that died before a look). Once
the tree is proven gone, such a file is removed (`remove`) if it is still the file that
was seen (the same inode) and no live process holds it open (an engine of the same
`engine_id` beside ours, a standby of the same arguments).

vLLM's message queues between its processes (`ShmRingBuffer`: the broadcast from the
core to its workers, each worker's answers) are Python's `SharedMemory` segments,
`/dev/shm/psm_<8 hex>` of 160-240 MiB each, made by one process and opened by the others,
each holding its descriptor while the queue lives. A SIGKILLed tree leaves them too:
their pages once written stay taken (tmpfs) until the file goes, after every crash
(seen on vLLM's CPU build: files of 160 and 240 MiB). They are chosen the same way:
held by the tree, no live process holding them. (Its `sem.mp-*` semaphores, a few bytes
each, are mapped without a descriptor kept, and are left.)

Descriptors, not /proc/PID/maps: vLLM keeps its descriptor as long as its mapping, and
reading a process's maps takes its memory map's lock, which a busy engine would feel
at every look.

The folder is a parameter (`SHM_DIR` by default) so that tests use a folder of their own.
Every function here blocks on /proc or the file system: the daemon calls them through
`asyncio.to_thread`.
"""

from __future__ import annotations

import os
import re
import stat
from collections.abc import Iterable, Iterator
from pathlib import Path

import structlog

from supervisor.ops.descriptors import exhausted

log = structlog.get_logger("supervisor.engine")

SHM_DIR = Path("/dev/shm")
PREFIX = "vllm_offload_"  # the CPU KV offload's region
QUEUE_PREFIX = "psm_"  # Python's SharedMemory: vLLM's message queues
_DELETED = " (deleted)"  # readlink's mark for an open file that has no name any more
# vLLM's own lines for its region's file (shared_offload_region.py, 0.32)
_NAMED = re.compile(r"(?:Created|Opened existing) mmap file (/\S+)")

# path -> its (device, inode) when a process of the tree held it open; None when only
# the engine's lines named it
Seen = dict[str, tuple[int, int] | None]


def is_offload_file(path: str, folder: Path) -> bool:
    """Whether `path` names one of vLLM's offload files directly in `folder`."""
    p = Path(path)
    return p.parent == folder and p.name.startswith(PREFIX)


def is_engine_file(path: str, folder: Path) -> bool:
    """Whether `path` names a shared-memory file of the kinds a vLLM tree leaves (its
    offload region's, a message queue's) directly in `folder`."""
    p = Path(path)
    return p.parent == folder and p.name.startswith((PREFIX, QUEUE_PREFIX))


def held(pids: Iterable[int], folder: Path) -> Seen:
    """The offload and message-queue files in `folder` that these processes hold open
    now. Raises OSError when the daemon is out of descriptors."""
    out: Seen = {}
    for target, link in _open_files(pids):
        if target.endswith(_DELETED) or not is_engine_file(target, folder):
            continue
        try:
            st = os.stat(link)  # (the open file itself, through its descriptor)
        except OSError:
            continue
        out[target] = (st.st_dev, st.st_ino)
    return out


def named(lines: Iterable[str], folder: Path) -> list[str]:
    """The offload files in `folder` that the engine's own lines say it created or
    opened."""
    return [m[1] for line in lines if (m := _NAMED.search(line)) is not None
            and is_offload_file(m[1], folder)]


def remove(seen: Seen, pid: int) -> list[str]:
    """Remove the offload files a dead engine's tree (`pid`, its main process) held, of
    those still there; returns the paths removed, each logged with its size. Kept, and
    logged: one replaced under its name since it was seen, one a live process holds
    open, all of them when /proc cannot be read to tell."""
    there: dict[str, int] = {}
    for path, ident in sorted(seen.items()):
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            continue  # (vLLM removed it itself, at a clean exit)
        except OSError as exc:
            log.warning("cannot read a shared-memory file of the dead engine", path=path,
                        pid=pid, error=str(exc))
            continue
        if not stat.S_ISREG(st.st_mode):
            continue
        if ident is not None and (st.st_dev, st.st_ino) != ident:
            log.info("a shared-memory file of the dead engine kept: another file has its "
                     "name since", path=path, pid=pid)
            continue
        there[path] = st.st_size
    if not there:
        return []
    try:
        busy = open_anywhere(set(there))
    except OSError as exc:
        log.warning("shared-memory files of the dead engine kept: cannot tell whether a "
                    "process holds them", paths=sorted(there), pid=pid, error=str(exc))
        return []
    removed = []
    for path, size in there.items():
        if path in busy:
            log.warning("a shared-memory file of the dead engine kept: a live process "
                        "holds it open", path=path, pid=pid)
            continue
        try:
            os.unlink(path)
        except FileNotFoundError:
            continue
        except OSError as exc:
            log.warning("cannot remove a shared-memory file of the dead engine", path=path,
                        pid=pid, error=str(exc))
            continue
        removed.append(path)
        log.info("shared-memory file of the dead engine removed", path=path, bytes=size,
                 pid=pid)
    return removed


def open_anywhere(paths: set[str]) -> set[str]:
    """Those of `paths` that a live process holds open (of the processes whose
    descriptors this user may read: the files are the engine's user's, 0600). Raises
    OSError when /proc cannot be listed."""
    pids = [int(name) for name in os.listdir("/proc") if name.isdigit()]
    return {target for target, _ in _open_files(pids) if target in paths}


def _open_files(pids: Iterable[int]) -> Iterator[tuple[str, str]]:
    """(what a descriptor points at, the descriptor's /proc link), for each
    descriptor of these processes that can be read (a process gone, or another user's,
    has none here). Raises OSError when the daemon is out of descriptors."""
    for pid in pids:
        fds = f"/proc/{pid}/fd"
        try:
            names = os.listdir(fds)
        except OSError as exc:
            if exhausted(exc):  # (not an answer: never "held by no one")
                raise
            continue
        for fd in names:
            link = f"{fds}/{fd}"
            try:
                target = os.readlink(link)
            except OSError:
                continue
            yield target, link
