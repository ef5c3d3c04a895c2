"""The KV tier an engine's pair shares (`engine.kv_tier`): vLLM's multi-tier KV offloading
with a file-system tier that outlives the engine, kept in a folder this daemon owns.

vLLM (0.32 and later, CUDA; its CPU build refuses it) writes every block it computes to
a CPU tier in host memory and from there to files named by the block's content hash
(`OffloadingConnector` with `TieringOffloadingSpec`, secondary tier `fs`). Both engines of
a pair are given the same folder, so after a failover the standby loads a continued
stream's prompt from the files instead of computing it again. Measured on an H200 with
128 continued 1.7k-token streams (docs/standby.md, "The KV tier"): the last one's first
token after 1.74 s from files on /dev/shm in 256-token chunks, 4.83 s computing them; from
files on disk, 6.11 s (worse than computing).

vLLM's fs tier has no bound: on tmpfs every computed block is host memory, and an
unbounded tier ran the H200 host out of memory within three minutes of 1.5k-token load
(the kernel killed an engine core). So the daemon keeps it under `kv_tier_max_gib`,
removing the oldest files first (`prune`), and empties it when the daemon starts and
stops (`clear`). A block removed between vLLM's lookup and its load is computed again,
not failed: the daemon sets `kv_load_failure_policy` to "recompute" (vLLM's default,
"fail", would end that request with an error).

The bound is soft: the folder is walked every second or two (longer walks, slower
looks), so it may pass the bound by what the engines write meanwhile (an H200's pair
wrote ~3 GiB/s). Eviction is by write time, oldest first: vLLM does not write a block
again that is already there, and a load does not touch its file, so a prefix every
request shares (a system prompt) is evicted like any other and written again at its next
use.

`argv` and `folder_of` are pure; `prune` and `clear` touch only the folder they are given
(run them off the event loop: a folder can hold thousands of files).
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import stat
from dataclasses import dataclass, field
from pathlib import Path

from supervisor.settings.sections import EngineConfig

GIB = 2**30
# what a prune leaves, as a share of the bound: room for a few seconds of writes
LOW_WATER = 0.9
# the fs tier's own threads for reads and for writes: 32 loaded 256-token chunks at
# ~13 GB/s on the H200 (16, vLLM's default, with 16-token chunks: ~5 GB/s)
THREADS = 32
# the file that says a folder is this daemon's to empty
MARKER = ".vllm-supervisor-kv-tier"
# the block-hash seed of every engine with a tier, once per daemon run (`env`); its tier
# is emptied when the daemon starts, so no file outlives the seed that named it
SEED = str(secrets.randbelow(2**32))


def folder_of(cfg: EngineConfig) -> Path | None:
    """The tier's folder, normalised ("/dev/shm/kv/" and "/dev/shm/kv" are one); None
    without a tier."""
    return Path(os.path.normpath(cfg.kv_tier)) if cfg.kv_tier else None


def argv(cfg: EngineConfig) -> list[str]:
    """The engine's `--kv-transfer-config` for its tier (the same for both engines of a
    pair: one folder, one chunk size); [] without one."""
    folder = folder_of(cfg)
    if folder is None:
        return []
    extra = {"spec_name": "TieringOffloadingSpec",
             "cpu_bytes_to_use": int(cfg.kv_tier_cpu_gib * GIB),
             "block_size": cfg.kv_tier_chunk_tokens,
             "secondary_tiers": [{"type": "fs", "root_dir": str(folder),
                                  "n_read_threads": THREADS, "n_write_threads": THREADS}]}
    return ["--kv-transfer-config", json.dumps({
        "kv_connector": "OffloadingConnector", "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute", "kv_connector_extra_config": extra},
        separators=(",", ":"))]


def env(cfg: EngineConfig) -> dict[str, str]:
    """What the engine's environment needs for its tier: one block-hash seed for both
    engines of the pair (the operator's own `PYTHONHASHSEED` wins); {} without a tier."""
    if folder_of(cfg) is None or "PYTHONHASHSEED" in cfg.env:
        return {}
    return {"PYTHONHASHSEED": SEED}


def without(argv_: list[str]) -> list[str]:
    """`argv_` less the tier's argument (an engine started while its folder is refused:
    served without a tier rather than with one nobody bounds)."""
    out = list(argv_)
    if "--kv-transfer-config" in out:
        at = out.index("--kv-transfer-config")
        del out[at:at + 2]
    return out


@dataclass(frozen=True)
class Usage:
    """The folder as one look saw it, and what that look removed."""

    files: int
    bytes: int
    removed_files: int = 0
    removed_bytes: int = 0
    error: str | None = None
    warning: str | None = None  # `host_warning`'s, said with every look
    # what the host lacked of its floor at this look (`host_short`), the tier in memory:
    # the oldest blocks went for it, past what the bound asked
    host_short_bytes: int = 0

    def fields(self) -> dict[str, object]:
        return {"files": self.files, "bytes": self.bytes, "error": self.error,
                "warning": self.warning, "host_short_bytes": self.host_short_bytes}


# a `.tmp` file older than this is one a killed engine left half written (vLLM writes a
# block to `<name>.bin_<random>.tmp` and renames it)
ORPHAN_TMP_S = 60.0


def _files(folder: Path) -> list[tuple[float, int, Path]]:
    """(mtime, size, path) of every block file under `folder`, and of every `.tmp` one."""
    out: list[tuple[float, int, Path]] = []
    for root, _dirs, names in os.walk(folder):
        for name in names:
            if not (name.endswith(".bin") or name.endswith(".tmp")):
                continue
            path = Path(root, name)
            try:
                st = path.stat()
            except FileNotFoundError:  # (vLLM replaced it meanwhile)
                continue
            out.append((st.st_mtime, st.st_size, path))
    return out


# the host memory a tier in memory leaves free at the least (MemAvailable): below it its
# oldest blocks go, whatever its bound (on an H200 host of 128 GiB the tier on /dev/shm,
# a snapshot's images on tmpfs, a sleeping copy and the serving engine filled it, and
# engine cores died without a word, 2026-11-30); a floor of a few seconds of writes
HOST_FLOOR_MIN = 8 * GIB
HOST_FLOOR_SHARE = 0.08  # of the host's memory, where that is more


def host_short(available: int, total: int) -> int:
    """The bytes a tier in host memory gives back now for the host to keep its floor
    (0: none), from the host's MemAvailable and MemTotal."""
    return max(0, max(HOST_FLOOR_MIN, int(HOST_FLOOR_SHARE * total)) - available)


def prune(folder: Path, max_bytes: int, now: float, short: int = 0) -> Usage:
    """Keep the folder's files under `max_bytes`: past it, the oldest written blocks go
    until `LOW_WATER` of it is left; and a `.tmp` file older than ORPHAN_TMP_S (at wall
    time `now`) goes whatever the size. `short` (`host_short`): the host lacks that much
    memory, so the oldest blocks go until that much is given back, or what the bound
    asks, whichever is more. Never raises; an error is in the result."""
    if not folder.is_dir():
        return Usage(0, 0, error=f"{folder} is gone: the engines cannot write their tier")
    try:
        files = _files(folder)
    except OSError as exc:
        return Usage(0, 0, error=f"{type(exc).__name__}: {exc}")
    total = sum(size for _, size, _ in files)
    # what is left once done: LOW_WATER of the bound past it, less the host's shortfall
    left = max_bytes * LOW_WATER if total > max_bytes else total
    if short > 0:
        left = min(left, max(0, total - short))
    orphans = [f for f in files if f[2].name.endswith(".tmp") and now - f[0] > ORPHAN_TMP_S]
    over = [] if total <= left else sorted(
        (f for f in files if f[2].name.endswith(".bin")), key=lambda f: f[0])
    removed_files = removed_bytes = 0
    error = None
    for i, (_, size, path) in enumerate([*orphans, *over]):
        if i >= len(orphans) and total - removed_bytes <= left:
            break
        try:
            path.unlink()
        except FileNotFoundError:
            pass
        except OSError as exc:
            error = f"{type(exc).__name__}: {exc}"
            break
        removed_files += 1
        removed_bytes += size
    return Usage(len(files) - removed_files, total - removed_bytes, removed_files,
                 removed_bytes, error, host_short_bytes=short)


def _unsafe(folder: Path) -> str | None:
    """Why another user could read or replace what is in `folder` (None: nobody can): the
    folder not this process's own or open to others, or a folder above it that another
    user owns, or that anyone may write to without the sticky bit (/dev/shm has it)."""
    me = os.getuid()
    st = folder.lstat()
    if stat.S_ISLNK(st.st_mode) or not stat.S_ISDIR(st.st_mode):
        return f"{folder} is not a folder"
    if st.st_uid != me or st.st_mode & 0o077:
        return f"{folder} is uid {st.st_uid}'s, mode {st.st_mode & 0o777:o}"
    for up in folder.parents:
        st = up.lstat()
        if st.st_uid not in (0, me):
            return f"{up}, above it, is uid {st.st_uid}'s: that user could replace it"
        if st.st_mode & 0o002 and not st.st_mode & stat.S_ISVTX:
            return f"{up}, above it, is writable by anyone (mode {st.st_mode & 0o7777:o})"
    return None


def clear(folder: Path) -> str | None:
    """Empty the folder: created if missing, owner only (the blocks are the clients'
    prompts), with `MARKER` in it. A folder that holds files and no marker is not this
    daemon's (an operator's `kv_tier = "/dev/shm"`): it is left as it is, and why is
    returned. None once the folder is empty and marked."""
    marker = folder / MARKER
    try:
        if folder.exists():
            children = [c for c in folder.iterdir() if c.name != MARKER]
            if children and not marker.exists():
                return (f"{folder} holds files this daemon did not put there (no "
                        f"{MARKER}): not emptied, and not kept under its bound")
            for child in children:
                if child.is_dir() and not child.is_symlink():
                    shutil.rmtree(child)
                else:
                    child.unlink()
        folder.mkdir(mode=0o700, parents=True, exist_ok=True)
        if os.stat(folder).st_uid == os.getuid():
            os.chmod(folder, 0o700)
        if (why := _unsafe(folder)) is not None:
            return f"not safe for the clients' prompts: {why}"
        marker.write_text("vLLM's KV tier, kept by vllm-supervisor (engine.kv_tier)\n")
    except OSError as exc:
        return f"{type(exc).__name__}: {exc}"
    return None


# what a tier may hold in host memory beside the engines, as a share of the host's, past
# which the keeper warns (the H200 host ran out at 52 GB of shared memory in 128 GiB)
HOST_SHARE_WARN = 0.5
_MEMORY_FILESYSTEMS = frozenset({"tmpfs", "ramfs"})


def in_memory(folder: Path, mounts: str) -> bool:
    """Whether `folder` is on a file system in memory (tmpfs, ramfs), by the longest
    mount point of /proc/mounts that holds it."""
    best, fstype = "", ""
    target = str(folder)
    for line in mounts.splitlines():
        parts = line.split()
        if len(parts) < 3:
            continue
        point = parts[1].replace("\\040", " ")
        inside = target == point or target.startswith(point.rstrip("/") + "/")
        if inside and len(point) > len(best):
            best, fstype = point, parts[2]
    return fstype in _MEMORY_FILESYSTEMS


def _engines(cfg: EngineConfig) -> int:
    """The engines whose CPU tiers may be in host memory at once (`host_worst_case`)."""
    return 3 if cfg.standby != "none" else 2


def host_worst_case(cfg: EngineConfig, folder_in_memory: bool) -> int:
    """The host memory the tier may take at once: each engine's CPU tier (a file in
    /dev/shm per engine: with a standby, three while a new engine starts beside the two
    and the dead one's file is not yet removed; two without) and, on tmpfs, the
    folder's bound."""
    return int(_engines(cfg) * cfg.kv_tier_cpu_gib * GIB
               + (cfg.kv_tier_max_gib * GIB if folder_in_memory else 0))


def host_warning(cfg: EngineConfig, folder: Path, mounts: str, host_bytes: int) -> str | None:
    """A sentence when the tier's worst case passes HOST_SHARE_WARN of the host's memory
    (beside it the engines need their own, and a sleeping standby keeps its weights in
    host memory too); None otherwise."""
    memory = in_memory(folder, mounts)
    need = host_worst_case(cfg, memory)
    if host_bytes <= 0 or need <= HOST_SHARE_WARN * host_bytes:
        return None
    parts = (f"{_engines(cfg)} x kv_tier_cpu_gib "
             f"{cfg.kv_tier_cpu_gib:g}" + (f" + kv_tier_max_gib {cfg.kv_tier_max_gib:g} "
                                           "(the folder is in memory)" if memory else ""))
    return (f"the KV tier may take {need / GIB:.1f} GiB of host memory ({parts}), "
            f"{need / host_bytes:.0%} of the host's {host_bytes / GIB:.1f} GiB: an "
            "unbounded tier ran an H200 host out of memory (docs/standby.md)")


# the keeper's prunes said at info level at most this often, summed (each look's at debug:
# under load a tier on /dev/shm is pruned every few seconds)
SAY_PRUNED_EVERY_S = 300.0


@dataclass
class Pruned:
    """The prunes since the keeper last said them, summed for one log line a period."""

    since: float  # monotonic
    files: int = 0
    bytes: int = 0
    looks: int = 0

    def add(self, usage: Usage, now: float) -> dict[str, object] | None:
        """One look's prune; the period's sums, once a period is over (then restarted)."""
        if usage.removed_files:
            self.files += usage.removed_files
            self.bytes += usage.removed_bytes
            self.looks += 1
        if not self.files or now - self.since < SAY_PRUNED_EVERY_S:
            return None
        out: dict[str, object] = {"files": self.files, "bytes": self.bytes,
                                  "looks": self.looks, "over_s": round(now - self.since, 1),
                                  "left_bytes": usage.bytes}
        self.since, self.files, self.bytes, self.looks = now, 0, 0, 0
        return out


# vLLM's refused stores said at warning level at most this often, summed (the first at once)
SAY_REFUSED_EVERY_S = 300.0


@dataclass
class Refused:
    """vLLM's own count of the stores its KV tier refused (each a request's new blocks at
    one step, its CPU part full: `vllm:kv_offload_allocation_failure`, 0.33+, its log's
    `cannot store chunks`), summed over the unit's engines: each
    engine counts from 0, so its first count is taken whole, then what it added (an
    engine may serve again after another did: the thin pair's returning one)."""

    total: int = 0
    _engines: dict[int, float] = field(default_factory=dict)  # generation -> last count
    _unsaid: int = 0
    _said_at: float | None = None  # monotonic

    def saw(self, generation: int, count: float, now: float) -> int | None:
        """An engine's count at a scrape; the refusals to say now (None: none, or said
        less than SAY_REFUSED_EVERY_S ago: summed into the next)."""
        last = self._engines.pop(generation, 0.0)
        added = count - last if count >= last else count  # (below: a counter reset)
        self._engines[generation] = count
        while len(self._engines) > 4:  # (the pair's engines, and one or two gone)
            del self._engines[next(iter(self._engines))]
        self.total += int(added)
        self._unsaid += int(added)
        if not self._unsaid or (self._said_at is not None
                                and now - self._said_at < SAY_REFUSED_EVERY_S):
            return None
        said, self._unsaid, self._said_at = self._unsaid, 0, now
        return said


def refused_warning(cfg: EngineConfig, refused: int) -> str:
    """The log's sentence for `refused` stores vLLM's KV tier could not make."""
    return (f"vLLM's KV tier refused {refused} stores (each a request's new blocks): its "
            f"CPU part (engine.kv_tier_cpu_gib = {cfg.kv_tier_cpu_gib:g} GiB) had no room, "
            "full of blocks still being written to the folder. Those blocks are not in the "
            "tier: after a fault they are computed again. Raise kv_tier_cpu_gib if the "
            "host's memory allows (docs/standby.md, \"The KV tier\")")


@dataclass
class Record:
    """What the unit knows of its KV tier: the keeper's last look at each folder it keeps
    (one; two after a reload moved it), what the looks removed in all, and the blocks
    vLLM could not store (status's `kv_tier`)."""

    looks: dict[str, Usage] = field(default_factory=dict)
    removed_files: int = 0
    removed_bytes: int = 0
    refused: Refused = field(default_factory=Refused)

    def saw(self, folder: str, usage: Usage) -> None:
        self.looks[folder] = usage
        self.removed_files += usage.removed_files
        self.removed_bytes += usage.removed_bytes

    def _last(self, cfg: EngineConfig) -> tuple[Path | None, Usage | None]:
        """The tier's folder now, and the keeper's last look at it (None: not yet)."""
        folder = folder_of(cfg)
        return folder, self.looks.get(str(folder)) if folder is not None else None

    def view(self, cfg: EngineConfig) -> dict[str, object] | None:
        """None without a tier; its numbers null until the keeper looked at its folder."""
        folder, last = self._last(cfg)
        if folder is None:
            return None
        return {"folder": str(folder), "max_bytes": int(cfg.kv_tier_max_gib * GIB),
                "chunk_tokens": cfg.kv_tier_chunk_tokens,
                **(last.fields() if last is not None
                   else {"files": None, "bytes": None, "error": None, "warning": None}),
                "removed_files_total": self.removed_files,
                "removed_bytes_total": self.removed_bytes,
                "store_refusals_total": self.refused.total}

    def numbers(self, cfg: EngineConfig) -> tuple[float | None, ...]:
        """The exporter's: the folder's bytes at the last look (None before one), its
        bound, the bytes removed in all, the stores vLLM refused in all; all None
        without a tier."""
        folder, last = self._last(cfg)
        if folder is None:
            return None, None, None, None
        return (float(last.bytes) if last is not None else None,
                float(int(cfg.kv_tier_max_gib * GIB)), float(self.removed_bytes),
                float(self.refused.total))
