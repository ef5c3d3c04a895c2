"""Build a tiny random-weight Llama with its own tokenizer, fully offline.

Run it with the ENGINE virtualenv's interpreter (it needs torch, transformers
and tokenizers; the supervisor's own environment has none of them):

    /path/to/engine-venv/bin/python scripts/build_tiny_model.py [OUTPUT_DIR]

OUTPUT_DIR defaults to ``models/tiny-llama``. The result is a directory that
``vllm serve OUTPUT_DIR`` serves on
CPU: hidden size 128, 2 attention heads and 1 KV head (head_dim 64; the CPU
attention kernel rejects head_dim 16), 2 layers, vocabulary 512, float32. The
tokenizer is a byte-level BPE trained here on a generated corpus, with a
simple chat template so ``/v1/chat/completions`` works too. The text it
produces is gibberish; the point is a real engine with real scheduling, KV
cache and metrics, not good answers.

The build is deterministic (fixed seeds), needs no network, and is safe to
rerun: it writes into a temporary directory and renames it into place, and
exits at once if OUTPUT_DIR already holds a config.json.
"""

import os

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"

import random  # noqa: E402
import shutil  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
from pathlib import Path  # noqa: E402

SEED = 1234
VOCAB_SIZE = 512
SPECIAL_TOKENS = ["<unk>", "<s>", "</s>", "<pad>"]
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ message['role'] }}: {{ message['content'] }}\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}assistant: {% endif %}"
)

SUBJECTS = ["the cat", "a dog", "the engine", "my friend", "the server", "a bird",
            "the model", "our team", "the queue", "a request", "the cache", "she", "he"]
VERBS = ["runs", "sees", "likes", "waits for", "answers", "builds", "reads",
         "finds", "moves", "holds", "sends", "restarts", "drains"]
OBJECTS = ["the ball", "a token", "the door", "some water", "the block", "a reply",
           "the page", "many tokens", "the light", "a small box", "the road"]
TAILS = ["", " today", " again", " quickly", " in the morning", " after lunch",
         " at night", " near the river", " without a word", " one more time"]


def make_corpus(lines: int = 4000) -> list[str]:
    """Generated English-ish sentences, plus digits and punctuation."""
    rng = random.Random(SEED)
    corpus = []
    for i in range(lines):
        s = f"{rng.choice(SUBJECTS)} {rng.choice(VERBS)} {rng.choice(OBJECTS)}{rng.choice(TAILS)}"
        s = s[0].upper() + s[1:] + rng.choice([".", "!", "?", ", and then it stops."])
        if i % 7 == 0:
            s += f" Number {rng.randint(0, 9999)}: user, assistant, system."
        corpus.append(s)
    return corpus


def build_tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(make_corpus(), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        unk_token="<unk>", bos_token="<s>", eos_token="</s>", pad_token="<pad>",
        model_max_length=2048,
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def build_model(tokenizer):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(SEED)
    config = LlamaConfig(
        vocab_size=VOCAB_SIZE,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=64,
        max_position_embeddings=2048,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=False,
        torch_dtype="float32",
    )
    model = LlamaForCausalLM(config).to(torch.float32).eval()
    model.generation_config.bos_token_id = tokenizer.bos_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    return model


def main(argv: list[str]) -> int:
    out = Path(argv[1] if len(argv) > 1 else "models/tiny-llama").resolve()
    if (out / "config.json").exists():
        print(f"{out} already holds a model (config.json); nothing to do")
        return 0
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        tokenizer = build_tokenizer()
        model = build_model(tokenizer)
        model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        tmp.chmod(0o755)  # mkdtemp makes it 0700
        for f in tmp.iterdir():
            f.chmod(0o644)
        if out.exists():  # an empty or partial directory without config.json
            shutil.rmtree(out)
        tmp.rename(out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    n = sum(p.numel() for p in model.parameters())
    print(f"built tiny Llama ({n} parameters, vocab {VOCAB_SIZE}) in {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
