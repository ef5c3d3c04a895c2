"""Which streamed requests can be continued token-exact, and how each is sent so that it
can be (`plan`): the rules that refuse one (`refusal`, with the reasons as the exporter's
labels) and the body asking for vLLM's token ids. What a continuation then does with the
stream is `supervisor/front/continuation.py`'s.

Pure: no I/O, no clock.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

CONTINUABLE = ("/v1/completions", "/v1/chat/completions")
# Why a stream was not continued.
REFUSALS = ("several_choices", "beam_search", "echo", "logprobs", "structured_output",
            "stop_strings", "penalties", "logits_processors", "tools", "multimodal",
            "prompt_form", "several_prompts", "no_model", "parser_output", "no_token_ids",
            "too_many_faults", "kills_engine")
_STRUCTURED = ("guided_json", "guided_regex", "guided_choice", "guided_grammar",
               "guided_decoding_backend", "guided_whitespace_pattern", "structured_outputs",
               "json_schema")


_UNREAD = object()


@dataclass(frozen=True)
class Plan:
    """A streamed generation request, read once: the body sent upstream and what a
    continuation needs from the original."""

    path: str
    chat: bool
    doc: dict[str, Any]  # the client's body, parsed
    body: bytes  # what goes upstream: the client's, plus return_token_ids when continuable
    client_token_ids: bool  # the client asked for token ids: they stay in its chunks
    max_tokens: int | None
    min_tokens: int
    refused: str | None  # why it cannot be continued; None: it can


def plan(path: str, body: bytes, doc: object = _UNREAD) -> Plan | None:
    """The plan for a streamed completion or chat request (`doc`: the body already
    parsed, if it was); None for anything else (it is forwarded as it is, and a
    non-streamed answer is sent again whole when the engine fails before answering)."""
    if path not in CONTINUABLE:
        return None
    if doc is _UNREAD:
        try:
            doc = json.loads(body)
        except ValueError:
            return None
    if not isinstance(doc, dict) or doc.get("stream") is not True:
        return None
    chat = path == "/v1/chat/completions"
    max_tokens = doc.get("max_completion_tokens") if chat else None
    if max_tokens is None:
        max_tokens = doc.get("max_tokens")
    min_tokens = doc.get("min_tokens") or 0
    if (max_tokens is not None and not _count(max_tokens)) or not _count(min_tokens):
        return None  # the engine answers 400 itself
    client_ids = doc.get("return_token_ids") is True
    refused = refusal(doc, chat)
    if refused is None and not client_ids:
        body = with_token_ids(body, doc)
    return Plan(path, chat, doc, body, client_ids, max_tokens, min_tokens, refused)


def with_token_ids(body: bytes, doc: dict[str, Any]) -> bytes:
    """The client's body asking for token ids too: the key put before the client's own
    (its bytes untouched, not encoded again) where the body is the object `doc` was
    parsed from and does not name the key; else `doc` encoded with it."""
    if "return_token_ids" not in doc and doc:
        start = body.lstrip(b" \t\r\n")
        if start[:1] == b"{":
            return b'{"return_token_ids":true,' + start[1:]
    return json.dumps({**doc, "return_token_ids": True}, separators=(",", ":")).encode()


def _count(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0


def refusal(doc: dict[str, Any], chat: bool) -> str | None:
    """Why a request cannot be continued exactly, as a metric label; None if it can."""
    if _more_than_one(doc.get("n")) or _more_than_one(doc.get("best_of")):
        return "several_choices"
    if doc.get("use_beam_search"):
        return "beam_search"
    if doc.get("echo"):
        return "echo"
    if any(doc.get(k) not in (None, False, 0) for k in
           ("logprobs", "top_logprobs", "prompt_logprobs")):
        return "logprobs"
    if doc.get("return_tokens_as_token_ids"):
        return "logprobs"
    if any(doc.get(k) is not None for k in _STRUCTURED):
        return "structured_output"
    rf = doc.get("response_format")
    if rf is not None and not (isinstance(rf, dict) and rf.get("type") in (None, "text")):
        return "structured_output"
    if doc.get("stop"):
        return "stop_strings"
    if doc.get("presence_penalty") or doc.get("frequency_penalty"):
        return "penalties"
    if doc.get("logits_processors"):
        return "logits_processors"
    if chat:
        if doc.get("tools") and doc.get("tool_choice") != "none":
            return "tools"
        if doc.get("mm_processor_kwargs") or not _text_only(doc.get("messages")):
            return "multimodal"
    else:
        if doc.get("prompt_embeds") is not None or doc.get("suffix"):
            return "prompt_form"
        if not _one_prompt(doc.get("prompt")):
            return "several_prompts"
    if not isinstance(doc.get("model"), str):
        return "no_model"
    return None


def _more_than_one(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v > 1


def _one_prompt(p: object) -> bool:
    if isinstance(p, str):
        return True
    if isinstance(p, list) and p:
        if all(isinstance(x, int) and not isinstance(x, bool) for x in p):
            return True  # one prompt of token ids
        return len(p) == 1 and _one_prompt(p[0])
    return False


def _text_only(messages: object) -> bool:
    if not isinstance(messages, list):
        return False
    for m in messages:
        if not isinstance(m, dict):
            return False
        content = m.get("content")
        if isinstance(content, list) and any(
                not isinstance(part, dict) or part.get("type") != "text" for part in content):
            return False
    return True
