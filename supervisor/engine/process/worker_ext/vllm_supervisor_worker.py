"""Methods the daemon adds to a vLLM engine's worker (vLLM's `--worker-extension-cls
vllm_supervisor_worker.HostCache`), asked through the engine's `/collective_rpc`
(docs/standby.md, "Its weights on the card ahead of a fault").

This file runs in the engine's interpreter, beside vLLM and torch: it imports nothing
of the daemon's, and nothing beyond the standard library and torch.
"""

from __future__ import annotations

import gc
import time
from typing import Any


class HostCache:
    """Mixed into vLLM's worker class."""

    def vs_empty_host_cache(self) -> dict[str, Any]:
        """Empty torch's pinned host cache: where a level-1 sleep's backup of the weights
        stays once they were woken (~16 GiB for an 8B model), which the engine's death
        must unpin before its card memory comes back. Asked of an engine that serves
        nobody yet (a standby whose weights went onto the card ahead of a fault): emptying
        it holds the worker for its length."""
        import torch  # type: ignore[import-not-found]  # (the engine's, not the daemon's)

        empty = getattr(torch._C, "_host_emptyCache", None)
        if empty is None:
            return {"emptied": False, "why": f"torch {torch.__version__} has no pinned "
                    "host cache to empty (torch._C._host_emptyCache)"}
        t = time.monotonic()
        gc.collect()  # (a backup tensor still referenced is not returned to the cache)
        empty()
        return {"emptied": True, "seconds": round(time.monotonic() - t, 3)}
