"""The GPU runs' 8B shape has a tokenizer that decodes every id its model samples.

The staged tiny model's tokenizer has 512 ids; an 8B-shaped model with random weights
samples from 128,256. Unknown ids decode to nothing, so vLLM's incremental detokenizer
(tokenizers' DecodeStream, primed with the prompt) never advanced and decoded the whole
prompt again at every token: its API server answered nothing for 16-20 s at a time under
4k-token prompts, and every long-prompt fault measured on the GPU carried that stall
(docs/gpu-validation.md, 2026-12-01). Checked with the engine's own `tokenizers`.
"""

from __future__ import annotations

import json
import subprocess
import textwrap

import pytest

from tests.gpu_shapes import VOCAB, covering_tokenizer
from tests.harness import ROOT

ENGINE_PY = ROOT / ".venv-engine" / "bin" / "python"
TINY = ROOT / "models" / "tiny-llama" / "tokenizer.json"

# One DecodeStream per tokenizer, primed with a 4,096-token prompt of the tiny ids, then
# 256 ids sampled from the 8B vocabulary: how many steps gave no text, and what the
# prompt's text encodes back to.
PROBE = textwrap.dedent("""
    import json, random, sys
    from tokenizers import Tokenizer
    from tokenizers.decoders import DecodeStream
    random.seed(7)
    prompt = [random.randrange(4, 512) for _ in range(4096)]
    sampled = [random.randrange(0, int(sys.argv[3])) for _ in range(256)]
    out = {}
    for name in ("tiny", "covering"):
        tok = Tokenizer.from_file(sys.argv[1 if name == "tiny" else 2])
        ds = DecodeStream(ids=prompt, skip_special_tokens=True)
        steps = [ds.step(tok, i) for i in sampled]
        text = tok.decode(prompt)
        out[name] = {"vocab": tok.get_vocab_size(), "none": sum(s is None for s in steps),
                     "words": sum(s == f" w{i}" for s, i in zip(steps, sampled)),
                     "reencoded_max_id": max(tok.encode(text).ids)}
    print(json.dumps(out))
""")


@pytest.mark.e2e  # needs .venv-engine (the engine's tokenizers)
def test_the_8b_shapes_tokenizer_decodes_every_sampled_id(tmp_path):
    covering = tmp_path / "tokenizer.json"
    covering.write_text(json.dumps(covering_tokenizer(json.loads(TINY.read_text()), VOCAB)))
    run = subprocess.run([str(ENGINE_PY), "-c", PROBE, str(TINY), str(covering), str(VOCAB)],
                         capture_output=True, text=True, timeout=120, check=True)
    got = json.loads(run.stdout)
    # the fault this guards against: with the tiny tokenizer the stream never advances
    assert got["tiny"]["vocab"] == 512 and got["tiny"]["none"] >= 250
    # with the covering one every sampled id past the tiny ones is a word of its own
    assert got["covering"]["vocab"] == VOCAB and got["covering"]["none"] == 0
    assert got["covering"]["words"] >= 250  # (the few ids under 512 decode as before)
    # the new ids have no merges: text still encodes with the tiny ids, so the bench's
    # prompts keep their lengths
    assert got["covering"]["reencoded_max_id"] < 512
