"""The fake engine's KV tier: what vLLM's fs tier does that the daemon relies on, with
none of its KV (engine/process/kv_tier.py, docs/standby.md "The KV tier").

Given the `--kv-transfer-config` the daemon adds (an `OffloadingConnector` whose
`TieringOffloadingSpec` names an `fs` secondary tier), a prompt's full chunks of
`block_size` token ids are named by a chained hash, as vLLM names its blocks: the chunks
found as files in the tier's folder are "loaded", the others "computed" and written there
(a `.tmp` file renamed into place, as vLLM writes them). The chain starts from
`PYTHONHASHSEED`, or from random bytes without it, as vLLM's `init_none_hash` does. Two
engines given the same folder and one seed therefore find each other's chunks; with two
seeds, never; a pruned file is computed again.

Its CPU part (`cpu_bytes_to_use`) is what every new chunk passes through on its way to a
file, at `token_bytes` a token (`--tier-token-bytes`; default Llama-3.1-8B's 128 KiB):
a prompt with more new chunks than that holds at once has the rest refused, not written,
and counted as vLLM counts a store it could not place (`vllm:kv_offload_allocation_
failure`, its log's `cannot store chunks`). `page` is its counters as vLLM's /metrics
shows them: each series from its first count on (a labelled prometheus_client child).
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any


class FakeTier:
    def __init__(self, folder: str, chunk_tokens: int, failure_policy: str,
                 cpu_bytes: int = 8 << 30, token_bytes: int = 128 << 10) -> None:
        self.folder, self.chunk, self.failure_policy = Path(folder), chunk_tokens, failure_policy
        seed = os.environ.get("PYTHONHASHSEED")
        self.seed = hashlib.sha256(seed.encode()).digest() if seed is not None else os.urandom(32)
        self.chunk_bytes = chunk_tokens * token_bytes
        self.cpu_chunks = cpu_bytes // self.chunk_bytes  # new chunks one prompt may store
        self.refusals = self.stored_bytes = self.loaded_bytes = 0

    @classmethod
    def from_config(cls, raw: str | None, token_bytes: int = 128 << 10) -> FakeTier | None:
        """The tier a `--kv-transfer-config` names; None without an fs tier."""
        if not raw:
            return None
        doc: dict[str, Any] = json.loads(raw)
        extra = doc.get("kv_connector_extra_config") or {}
        fs = [t for t in extra.get("secondary_tiers") or () if t.get("type") == "fs"]
        if doc.get("kv_connector") != "OffloadingConnector" or not fs:
            return None
        return cls(fs[0]["root_dir"], int(extra.get("block_size") or 16),
                   doc.get("kv_load_failure_policy", "fail"),
                   int(extra.get("cpu_bytes_to_use") or 8 << 30), token_bytes)

    def _path(self, digest: str) -> Path:
        # vLLM's layout: a folder per model and layout, hash-named subfolders under it
        return self.folder / "fake_model_0" / digest[:3] / f"{digest}.bin"

    def take(self, prompt: list[int]) -> tuple[int, int, bool]:
        """(chunks loaded from files, full chunks in all, whether a store was refused) for
        this prompt; the chunks not found are written, as many as the CPU part holds."""
        h, loaded, stored, full = self.seed, 0, 0, len(prompt) // self.chunk
        refused = False
        for i in range(full):
            ids = prompt[i * self.chunk:(i + 1) * self.chunk]
            h = hashlib.sha256(h + json.dumps(ids).encode()).digest()
            path = self._path(h.hex())
            if path.exists():
                loaded += 1
                continue
            if stored >= self.cpu_chunks:  # (no room left in the CPU part)
                refused = True
                continue
            stored += 1
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(".tmp")
            tmp.write_bytes(b"\0" * 4096)  # (a block's bytes: the size is what counts)
            os.replace(tmp, path)
        self.refusals += refused
        self.stored_bytes += stored * self.chunk_bytes
        self.loaded_bytes += loaded * self.chunk_bytes
        return loaded, full, refused

    def page(self, model: str) -> str:
        """The tier's series of vLLM's /metrics (0.33), those that counted."""
        labels = f'{{engine="0",model_name="{model}"}}'
        return "".join(
            f"# TYPE {name} counter\n{name}_total{labels} {float(value)}\n"
            for name, value in (("vllm:kv_offload_allocation_failure", self.refusals),
                                ("vllm:kv_offload_store_bytes", self.stored_bytes),
                                ("vllm:kv_offload_load_bytes", self.loaded_bytes))
            if value)
