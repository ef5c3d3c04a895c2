"""Model shapes for the GPU runs, made from the staged tiny model's files (no weights:
vLLM's `--load-format dummy` gives real sizes with random weights)."""

from __future__ import annotations

import json
from pathlib import Path

STAGED = Path.home() / "vllm-stage" / "model"  # the tiny model, as staged
VLLM_SITE = str(Path.home() / "vllm-site")  # the staged vLLM, installed

VOCAB = 128256  # Llama-3.1-8B's
# Llama-3.1-8B's dimensions, over the tiny model's config
SHAPE_8B: dict[str, object] = dict(
    hidden_size=4096, intermediate_size=14336, num_attention_heads=32, num_key_value_heads=8,
    head_dim=128, num_hidden_layers=32, max_position_embeddings=8192, vocab_size=VOCAB,
    dtype="bfloat16", rope_parameters={"rope_theta": 500000.0, "rope_type": "default"})


def make_m8b(model: Path, staged: Path = STAGED, **shape: object) -> None:
    """An 8B-shaped Llama (`SHAPE_8B`, updated by `shape`) from the staged tiny model's
    files, for `--load-format dummy` or weights written beside it (as
    ../shared/tools/gpu-vllm/standby_probe.py makes it), with a tokenizer that decodes
    every one of its ids (`covering_tokenizer`)."""
    model.mkdir(parents=True, exist_ok=True)
    cfg = json.loads((staged / "config.json").read_text())
    cfg.update(SHAPE_8B, **shape)
    (model / "config.json").write_text(json.dumps(cfg, indent=1))
    for f in staged.iterdir():
        if f.name not in ("config.json", "model.safetensors", "tokenizer.json"):
            (model / f.name).write_bytes(f.read_bytes())
    tok = json.loads((staged / "tokenizer.json").read_text())
    covering = covering_tokenizer(tok, int(cfg["vocab_size"]))
    (model / "tokenizer.json").write_text(json.dumps(covering))


def ensure_m8b(model: Path) -> None:
    """`make_m8b`, unless `model` is one already with a tokenizer that covers its vocabulary
    (one made before `covering_tokenizer` is made again)."""
    try:
        cfg = json.loads((model / "config.json").read_text())
        tok = json.loads((model / "tokenizer.json").read_text())
        if len(tok["model"]["vocab"]) >= int(cfg["vocab_size"]):
            return
    except (OSError, ValueError, KeyError):
        pass
    make_m8b(model)


def covering_tokenizer(tok: dict, vocab_size: int) -> dict:
    """The tiny model's byte-level BPE tokenizer (512 ids) grown to `vocab_size` ids, each
    new one decoding to a word of its own (" w<id>"), as a real model's tokenizer decodes
    every id its model can sample.

    Without it, random weights sample ids the tokenizer does not know (99.6 % of them);
    they decode to nothing, so vLLM's incremental detokenizer (the tokenizers library's
    DecodeStream, primed with the prompt) never advances and decodes the whole prompt again
    at every token: with 128 streams of 4k-token prompts its API server answered nothing
    for 16-20 s at a time (docs/gpu-validation.md, "The silences were the test model's
    tokenizer"). The new ids have no merges, so text is still encoded with the 512 old
    ones: prompts keep their lengths."""
    vocab = tok["model"]["vocab"]
    taken = set(vocab.values()) | {t["id"] for t in tok.get("added_tokens", [])}
    for i in range(vocab_size):
        if i not in taken:
            vocab[f"\u0120w{i}"] = i  # "Ġ" is the byte-level alphabet's space
    return tok
