"""Model shapes for the GPU runs, made from the staged tiny model's files (no weights:
vLLM's `--load-format dummy` gives real sizes with random weights)."""

from __future__ import annotations

import json
from pathlib import Path

STAGED = Path.home() / "vllm-stage" / "model"  # the tiny model, as staged
VLLM_SITE = str(Path.home() / "vllm-site")  # the staged vLLM, installed


def make_m8b(model: Path) -> None:
    """An 8B-shaped Llama (Llama-3.1-8B's dimensions) from the staged tiny model's files,
    for `--load-format dummy` (as ../shared/tools/gpu-vllm/standby_probe.py makes it)."""
    model.mkdir(parents=True, exist_ok=True)
    cfg = json.loads((STAGED / "config.json").read_text())
    cfg.update(hidden_size=4096, intermediate_size=14336, num_attention_heads=32,
               num_key_value_heads=8, head_dim=128, num_hidden_layers=32,
               max_position_embeddings=8192, vocab_size=128256, dtype="bfloat16",
               rope_parameters={"rope_theta": 500000.0, "rope_type": "default"})
    (model / "config.json").write_text(json.dumps(cfg, indent=1))
    for f in STAGED.iterdir():
        if f.name not in ("config.json", "model.safetensors"):
            (model / f.name).write_bytes(f.read_bytes())
