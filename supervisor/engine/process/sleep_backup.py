"""How a sleeping vLLM's backup of its weights is kept in host memory: so that, once the
engine has slept and woken, its death gives the card back at once.

A level-1 sleep copies the weights to pinned host memory (torch's pinned host
allocator, `cudaHostAlloc` by default) and, after the wake, that memory stays in torch's
host cache for the rest of the engine's life: ~15-18 GiB for an 8B model. When the
engine dies, Linux takes its memory down before it closes its files, and the card's
memory comes back only when the NVIDIA device files close: unpinning 18 GiB of 4 KiB
pages took 2.0-2.7 s on an H200, and a standby's wake after a fault waits for it.

Measured there (vLLM 0.26, the 8B shape at 0.88, one engine slept, woken and SIGKILLed;
docs/standby.md, "Why a woken engine's memory comes back slowly"):

| the backup's host memory | sleep | wake | card back after the kill |
|---|---|---|---|
| torch's default (`cudaHostAlloc`) | 10.95 s | 0.79 s | 2.67 s |
| registered (malloc, then `cudaHostRegister`) | 3.90 s | 0.79 s | 2.04 s |
| registered, in transparent huge pages | 2.23 s | 0.77 s | 0.71 s |
| pageable (not pinned) | 11.03 s | 3.09 s | 0.32 s |

(A fresh engine's card came back in 0.34 s.) Registered memory in huge pages unpins 512
times fewer pages, and a fault's release and wake together go from 3.5 s to 1.5 s; a
pageable backup gives the card back sooner but wakes 2.3 s slower, on the same path.

So an engine started with `--enable-sleep-mode` gets, where its environment does not
already set them:
- torch's allocator options (`PYTORCH_ALLOC_CONF` where set, else
  `PYTORCH_CUDA_ALLOC_CONF`): `pinned_use_cuda_host_register:True` and
  `pinned_num_register_threads:8`;
- glibc's `GLIBC_TUNABLES`: `glibc.malloc.hugetlb=1` (its malloc asks for transparent huge
  pages; glibc 2.35 and later, an older one ignores it).
An option already in the operator's value wins, either way (`...register:False` or
`glibc.malloc.hugetlb=0` turn each off). The huge pages need the kernel's transparent
huge pages at `madvise` or `always` (`never`: registered 4 KiB pages, 2.0 s).

`env` and `refused` are pure: `env` reads the environment the engine is given and
returns what to set; `refused` says why the huge pages it asks for will not come, from
the kernel's setting (`thp_setting`, a read of sysfs).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

from supervisor.settings.weight_cache_argv import has_flag

SLEEP_FLAG = "--enable-sleep-mode"
REGISTER = ("pinned_use_cuda_host_register", "True")
THREADS = ("pinned_num_register_threads", "8")
HUGE_PAGES = ("glibc.malloc.hugetlb", "1")


def _with(value: str, option: tuple[str, str], pair: str, sep: str) -> str:
    """`value` (a `sep`-separated list of options, `name<pair>value`) with `option`
    added, unless it names that option already."""
    name, setting = option
    names = {part.split(pair, 1)[0].strip() for part in value.split(sep) if part.strip()}
    if name in names:
        return value
    added = f"{name}{pair}{setting}"
    return f"{value}{sep}{added}" if value.strip() else added


def env(argv: Sequence[str], environ: Mapping[str, str]) -> dict[str, str]:
    """What an engine of `argv` started with `environ` needs set for its sleep backup
    (docstring above); {} for one that cannot sleep, or whose environment says it all."""
    if not has_flag(list(argv), SLEEP_FLAG):
        return {}
    out: dict[str, str] = {}
    key = "PYTORCH_ALLOC_CONF" if "PYTORCH_ALLOC_CONF" in environ else "PYTORCH_CUDA_ALLOC_CONF"
    conf = _with(environ.get(key, ""), REGISTER, ":", ",")
    if conf != environ.get(key, ""):  # (registering named by the operator: theirs alone)
        out[key] = _with(conf, THREADS, ":", ",")
    tunables = _with(environ.get("GLIBC_TUNABLES", ""), HUGE_PAGES, "=", ":")
    if tunables != environ.get("GLIBC_TUNABLES", ""):
        out["GLIBC_TUNABLES"] = tunables
    return out


THP_ENABLED = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def asks_huge_pages(environ: Mapping[str, str]) -> bool:
    """Whether an engine of this environment asks glibc's malloc for huge pages."""
    return f"{HUGE_PAGES[0]}={HUGE_PAGES[1]}" in environ.get("GLIBC_TUNABLES", "").split(":")


def thp_setting(path: Path = THP_ENABLED) -> str:
    """The kernel's transparent huge pages setting (`always [madvise] never`), "" where it
    cannot be read (no such kernel feature)."""
    try:
        return path.read_text().strip()
    except OSError:
        return ""


def refused(setting: str) -> str | None:
    """Why an engine that asks for huge pages will not get them, from the kernel's
    setting; None when it will (or the setting does not say)."""
    if "[never]" in setting:
        return ("transparent huge pages are off on this host (/sys/kernel/mm/"
                "transparent_hugepage/enabled: never): a sleeping engine's backup stays in "
                "4 KiB pages, and once it has slept and woken its death gives the card back "
                "in ~2 s, not ~0.7 (set it to madvise)")
    return None
