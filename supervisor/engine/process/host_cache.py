"""The worker extension that lets the daemon empty a woken engine's pinned host cache
(docs/standby.md, "Its weights on the card ahead of a fault").

A level-1 sleep backs the weights up in pinned host memory, and after the wake torch
keeps those blocks cached for the engine's life (`sleep_backup.py`): when the engine dies,
Linux unpins them before the card's memory comes back. In registered huge pages that
took 0.71 s on an H200 against 0.34 s for an engine that never slept, and a failover's
wake of the standby's KV cache waits for it (0.63-0.84 s from the failover to the old
tree gone, in six kills of the full-capacity pair: the critical path). Emptying the cache
inside the engine gives that back, but holds the engine while it runs (2.66 s in 4 KiB
pages; a generation asked meanwhile waited as long): so only an engine that serves
nobody is asked, a standby whose weights were woken onto the card ahead of a fault.

vLLM calls into a worker only through its `--worker-extension-cls` (methods mixed into
the worker) and `/collective_rpc`. So an engine started with `--enable-sleep-mode` gets
`--worker-extension-cls vllm_supervisor_worker.HostCache` and the folder of that module
(`worker_ext/`, nothing else in it) at the end of its PYTHONPATH, unless its arguments
name an extension of their own (vLLM takes one): then no cache is emptied, and `status`
says why. Every such engine gets it, whatever `engine.standby_weights` says (the one
setting under which a cache is emptied, reloaded at once): were it added only with
"gpu", a reload to "gpu" would change the arguments of what runs, and a full-size
standby that no longer matched them could not be started again beside its engine. The
engines are the daemon's children on this host, which read its files; the class is
mixed in and does nothing until it is called.

`argv_env` and `why_not` are pure (what to add to an engine's argv and environment; why
an engine has no cache to empty); `empty` asks an engine over its port, bounded.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from supervisor.engine.process.sleep_backup import SLEEP_FLAG
from supervisor.ops.descriptors import raise_if_exhausted
from supervisor.settings.weight_cache_argv import has_flag
from supervisor.watchdog.relaunch import arg_value

EXTENSION_FLAG = "--worker-extension-cls"
EXTENSION = "vllm_supervisor_worker.HostCache"
METHOD = "vs_empty_host_cache"  # (HostCache's, in worker_ext/vllm_supervisor_worker.py)
FOLDER = str(Path(__file__).with_name("worker_ext"))


def argv_env(argv: Sequence[str], environ: Mapping[str, str]
             ) -> tuple[list[str], dict[str, str]]:
    """The arguments and environment to add to an engine of `argv` started with
    `environ`: the extension and its folder for one that can sleep and names no
    extension of its own, else nothing."""
    if not has_flag(list(argv), SLEEP_FLAG) or has_flag(list(argv), EXTENSION_FLAG):
        return [], {}
    path = environ.get("PYTHONPATH", "")
    if FOLDER in path.split(":"):
        return [EXTENSION_FLAG, EXTENSION], {}
    return [EXTENSION_FLAG, EXTENSION], {"PYTHONPATH": f"{path}:{FOLDER}" if path else FOLDER}


def why_not(argv: Sequence[str]) -> str | None:
    """Why an engine of `argv` has no pinned host cache the daemon can empty (None: it
    has the extension)."""
    if not has_flag(list(argv), SLEEP_FLAG):
        return "it cannot sleep (no --enable-sleep-mode): it has no such cache"
    if arg_value(argv, EXTENSION_FLAG) == EXTENSION:
        return None
    return ("its arguments name a worker extension of their own (--worker-extension-cls: "
            "vLLM takes one), so the daemon's is not added")


# emptying 18 GiB in 4 KiB pages took 2.66 s on the H200; a wedged worker is not waited on
EMPTY_TIMEOUT_S = 30.0


@dataclass(frozen=True)
class Emptied:
    """What one `empty` found: `emptied` (every worker said so), the daemon's seconds and
    the workers' own (the longest), or why not."""

    emptied: bool
    seconds: float
    worker_s: float | None = None
    error: str | None = None


async def empty(client: httpx.AsyncClient, base_url: str,
                timeout_s: float = EMPTY_TIMEOUT_S) -> Emptied:
    """`POST /collective_rpc` of METHOD: every worker of the engine empties its cache.
    Raises OutOfDescriptors when the daemon could not ask."""
    t0 = time.monotonic()
    try:
        r = await client.post(f"{base_url}/collective_rpc", json={
            "method": METHOD, "timeout": timeout_s}, timeout=timeout_s + 5.0)
    except httpx.TimeoutException:
        return Emptied(False, time.monotonic() - t0,
                       error=f"POST /collective_rpc: no answer within {timeout_s + 5.0:g} s")
    except (httpx.HTTPError, OSError) as exc:
        raise_if_exhausted(exc)
        return Emptied(False, time.monotonic() - t0,
                       error=f"POST /collective_rpc: {type(exc).__name__}: {exc}")
    seconds = time.monotonic() - t0
    if r.status_code != 200:
        return Emptied(False, seconds, error=f"POST /collective_rpc: HTTP {r.status_code}: "
                       f"{r.text[:200]}")
    return _answers(r, seconds)


def _answers(r: httpx.Response, seconds: float) -> Emptied:
    """The workers' answers (vLLM's `{"results": [...]}`, one per worker) read."""
    try:
        results: Any = r.json()["results"]
    except (ValueError, KeyError, TypeError):
        results = None
    if not isinstance(results, list) or not results \
            or not all(isinstance(x, dict) for x in results):
        return Emptied(False, seconds, error=f"POST /collective_rpc: unexpected answer "
                       f"{r.text[:200]!r}")
    not_emptied = [x for x in results if x.get("emptied") is not True]
    if not_emptied:
        why = not_emptied[0].get("why")
        return Emptied(False, seconds, error=str(why) if why else f"a worker answered "
                       f"{not_emptied[0]!r}")
    took = [x["seconds"] for x in results if isinstance(x.get("seconds"), int | float)]
    return Emptied(True, seconds, worker_s=max(took) if took else None)
