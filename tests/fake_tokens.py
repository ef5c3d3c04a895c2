"""The fake engine's tokens (tests/fake_engine.py): deterministic, each a function of the
whole sequence before it (prompt included), so that a continuation (prompt + delivered
tokens as the prompt) yields what an uninterrupted answer would. A token's text is
"t<id> "; a string prompt's token ids are its characters'. Tests import these to know
what the fake engine answers. Stdlib only, as the fake engine: it runs under any
interpreter."""

from __future__ import annotations

from typing import Any


def prompt_ids(req: dict[str, Any], chat: bool) -> list[int]:
    """A prompt's token ids: given as ids, or a string's characters (a chat's messages
    with role markers, as a template would)."""
    if chat:
        text = "".join(f"<{m.get('role')}>{m.get('content')}" for m in req.get("messages") or ())
        return [ord(c) % 1000 for c in text + "<assistant>"]
    p = req.get("prompt", "")
    if isinstance(p, list) and p and isinstance(p[0], list):
        p = p[0]
    if isinstance(p, list):
        return [int(x) for x in p]
    if not isinstance(p, str):
        p = str(p)
    return [ord(c) % 1000 for c in p]


def kills(req: dict[str, Any], path: str, text: str) -> bool:
    """The prompt holds `text`: as a string, or as its token ids (a continuation)."""
    ids = prompt_ids(req, path == "/v1/chat/completions")
    want = [ord(c) % 1000 for c in text]
    return any(ids[i:i + len(want)] == want for i in range(len(ids) - len(want) + 1))


def logprobs_of(prompt: list[int], n: int, chat: bool, shift: int = 0) -> dict[str, Any]:
    """vLLM's logprobs of a greedy answer (`return_tokens_as_token_ids`), each chosen
    token 1.0 above its runner-up; `shift` answers other tokens (a broken engine)."""
    seq, rows = list(prompt), []
    for _ in range(n):
        tid = next_token(seq) + shift
        seq.append(tid)
        lp = -(0.1 + (tid % 7) * 0.3)
        rows.append((f"token_id:{tid}", lp, f"token_id:{tid + 1}", lp - 1.0))
    if chat:
        return {"content": [{"token": t, "logprob": lp, "bytes": None, "top_logprobs": [
            {"token": t, "logprob": lp, "bytes": None},
            {"token": t2, "logprob": lp2, "bytes": None}]} for t, lp, t2, lp2 in rows]}
    return {"tokens": [r[0] for r in rows], "token_logprobs": [r[1] for r in rows],
            "top_logprobs": [{t: lp, t2: lp2} for t, lp, t2, lp2 in rows],
            "text_offset": list(range(n))}


def next_token(seq: list[int]) -> int:
    """Deterministic in the whole sequence before it."""
    a = seq[-1] if seq else 0
    b = seq[-2] if len(seq) > 1 else 0
    return (31 * a + 7 * b + 13 * len(seq)) % 997 + 3


def usage(prompt: int, completion: int) -> dict[str, Any]:
    return {"prompt_tokens": prompt, "completion_tokens": completion,
            "total_tokens": prompt + completion}
