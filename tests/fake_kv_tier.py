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
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any


class FakeTier:
    def __init__(self, folder: str, chunk_tokens: int, failure_policy: str) -> None:
        self.folder, self.chunk, self.failure_policy = Path(folder), chunk_tokens, failure_policy
        seed = os.environ.get("PYTHONHASHSEED")
        self.seed = hashlib.sha256(seed.encode()).digest() if seed is not None else os.urandom(32)

    @classmethod
    def from_config(cls, raw: str | None) -> FakeTier | None:
        """The tier a `--kv-transfer-config` names; None without an fs tier."""
        if not raw:
            return None
        doc: dict[str, Any] = json.loads(raw)
        extra = doc.get("kv_connector_extra_config") or {}
        fs = [t for t in extra.get("secondary_tiers") or () if t.get("type") == "fs"]
        if doc.get("kv_connector") != "OffloadingConnector" or not fs:
            return None
        return cls(fs[0]["root_dir"], int(extra.get("block_size") or 16),
                   doc.get("kv_load_failure_policy", "fail"))

    def _path(self, digest: str) -> Path:
        # vLLM's layout: a folder per model and layout, hash-named subfolders under it
        return self.folder / "fake_model_0" / digest[:3] / f"{digest}.bin"

    def take(self, prompt: list[int]) -> tuple[int, int]:
        """(chunks loaded from files, full chunks in all) for this prompt; the chunks
        not found are written."""
        h, loaded, full = self.seed, 0, len(prompt) // self.chunk
        for i in range(full):
            ids = prompt[i * self.chunk:(i + 1) * self.chunk]
            h = hashlib.sha256(h + json.dumps(ids).encode()).digest()
            path = self._path(h.hex())
            if path.exists():
                loaded += 1
                continue
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(".tmp")
            tmp.write_bytes(b"\0" * 4096)  # (a block's bytes: the size is what counts)
            os.replace(tmp, path)
        return loaded, full
