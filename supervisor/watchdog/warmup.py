"""The warm-up: every path a client will take, asked once before a new engine serves.

A fresh vLLM builds some of what a request needs at its first use, not at its start:
the first request that asks for log-probabilities compiles a sampler helper into
torch's inductor cache (`vllm/v1/sample/ops/logprobs.py`, `--enforce-eager` or not);
sampling parameters, penalties and structured output have kernels and grammars of their
own; on GPUs a cold JIT cache builds kernels too. On a cold cache such a first step takes
many seconds, and while it runs the engine's counters stand still. Judged then, a healthy
engine looks hung (issue 48: the daemon killed one so on a fresh machine). So the proof
of every new engine process (its start, and a standby's before it sleeps) asks each path
here first, before the canary and the golden check, with no client at the engine and the
progress rule not yet judging it (engine/unit.py admits clients once the proof ends, and
restarts the progress clock then).

A path the engine does not serve (a model without a chat template, no structured output
backend: a 4xx) is noted and skipped; a 5xx too, noted (the golden check that follows
judges answers). Only silence fails the warm-up: no answer within what is left of the
budget, `timeout_s` for all the paths together.

Fetching only: what a failed warm-up means is the unit's to decide.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import httpx

from supervisor.ops.descriptors import raise_if_exhausted

LONG_PROMPT_MAX = 2048  # tokens of the long prefill at most (of max_model_len)
SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}},
          "required": ["ok"]}


@dataclass(frozen=True)
class Path:
    """One request a client might make first: its route and body."""

    name: str
    route: str
    body: dict[str, Any]


@dataclass
class Warmed:
    """What the warm-up found: each path's seconds and answer (`200`, `HTTP 400`, or an
    error), in order; `error` when one got no answer in time (the engine is not warm)."""

    took_s: float = 0.0
    paths: dict[str, dict[str, Any]] = field(default_factory=dict)
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None

    def doc(self) -> dict[str, Any]:
        return {"took_s": round(self.took_s, 3), "paths": self.paths, "error": self.error}

    def slowest(self) -> tuple[str, float] | None:
        timed = [(n, float(p["s"])) for n, p in self.paths.items()]
        return max(timed, key=lambda x: x[1], default=None)


def paths(model: str, prompt: str, max_model_len: int | None,
          token_id: int | None) -> list[Path]:
    """The requests that warm what clients use: log-probabilities on both routes (the
    prompt's too), streaming, sampling parameters with several choices and penalties,
    stop strings, structured output, and a long prefill (where the engine's
    max_model_len and a token id to fill it are known)."""
    c = {"model": model, "max_tokens": 4}
    chat = {**c, "messages": [{"role": "user", "content": prompt}]}
    out = [
        Path("logprobs", "/v1/completions",
             {**c, "prompt": prompt, "temperature": 0, "logprobs": 5, "prompt_logprobs": 1}),
        Path("chat_logprobs", "/v1/chat/completions",
             {**chat, "temperature": 0, "logprobs": True, "top_logprobs": 5}),
        Path("stream", "/v1/completions",
             {**c, "prompt": prompt, "stream": True, "logprobs": 1,
              "stream_options": {"include_usage": True}}),
        Path("sampling", "/v1/completions",
             {**c, "prompt": prompt, "n": 2, "temperature": 0.8, "top_p": 0.9, "top_k": 20,
              "min_p": 0.05, "seed": 7, "presence_penalty": 0.5, "frequency_penalty": 0.5,
              "repetition_penalty": 1.1}),
        Path("stop", "/v1/completions",
             {**c, "prompt": prompt, "max_tokens": 8, "stop": ["\n", "."],
              "temperature": 0.7}),
        Path("structured", "/v1/chat/completions",
             {**chat, "max_tokens": 16, "response_format": {
                 "type": "json_schema",
                 "json_schema": {"name": "warm_up", "schema": SCHEMA}}}),
    ]
    if max_model_len is not None and token_id is not None:
        n = max(1, min(LONG_PROMPT_MAX, max_model_len - 8))
        out.append(Path("long_prefill", "/v1/completions",
                        {**c, "prompt": [token_id] * n, "max_tokens": 2, "temperature": 0}))
    return out


async def engine_facts(client: httpx.AsyncClient, base_url: str, model: str, prompt: str,
                       timeout_s: float) -> tuple[int | None, int | None]:
    """The engine's max_model_len (its /v1/models) and one token id of the prompt (its
    /tokenize), each None where the engine does not say. Raises OutOfDescriptors."""
    length: int | None = None
    token: int | None = None
    try:
        r = await client.get(f"{base_url}/v1/models", timeout=timeout_s)
        for m in (r.json().get("data") or []) if r.status_code == 200 else []:
            if isinstance(m, dict) and m.get("id") == model:
                n = m.get("max_model_len")
                length = n if isinstance(n, int) and not isinstance(n, bool) and n > 8 \
                    else None
        r = await client.post(f"{base_url}/tokenize", timeout=timeout_s,
                              json={"model": model, "prompt": prompt,
                                    "add_special_tokens": False})
        tokens = r.json().get("tokens") if r.status_code == 200 else None
        if isinstance(tokens, list) and tokens and isinstance(tokens[-1], int):
            token = tokens[-1]
    except (httpx.HTTPError, OSError) as exc:
        raise_if_exhausted(exc)
    except (ValueError, AttributeError):
        pass
    return length, token


async def warm(client: httpx.AsyncClient, base_url: str, model: str, prompt: str,
               timeout_s: float, clock: Callable[[], float] = time.monotonic) -> Warmed:
    """Asks each path once, one after another (a compile is one engine step: alone it
    is what it is, not a batch's), within `timeout_s` for all. Raises OutOfDescriptors
    when the daemon could not ask."""
    t0 = clock()
    out = Warmed()

    def left() -> float:
        return timeout_s - (clock() - t0)

    length, token = await engine_facts(client, base_url, model, prompt,
                                       max(0.1, min(left(), 10.0)))
    for p in paths(model, prompt, length, token):
        if left() <= 0:
            out.error = f"{p.name}: no time left of the warm-up's {timeout_s:g} s"
            break
        began = clock()
        answer = await _ask(client, base_url, p, left())
        out.paths[p.name] = {"s": round(clock() - began, 3), "answer": answer}
        if answer == "timeout":
            out.error = (f"{p.name} ({p.route}): no answer within the warm-up's "
                         f"{timeout_s:g} s")
            break
    out.took_s = clock() - t0
    return out


async def _ask(client: httpx.AsyncClient, base_url: str, p: Path, timeout_s: float) -> str:
    """`200`, `HTTP <code>`, `timeout` or the error's name; a stream is read whole."""
    try:
        async with asyncio.timeout(timeout_s), \
                client.stream("POST", f"{base_url}{p.route}", json=p.body,
                              timeout=timeout_s) as r:
            async for _ in r.aiter_raw():
                pass
            return "200" if r.status_code == 200 else f"HTTP {r.status_code}"
    except (httpx.TimeoutException, TimeoutError):
        return "timeout"
    except (httpx.HTTPError, OSError) as exc:
        raise_if_exhausted(exc)
        return f"{type(exc).__name__}: {exc}"
