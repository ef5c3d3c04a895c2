"""The canary: a tiny generation with a deadline, the one probe a frozen engine fails.

`/health` keeps answering 200 while `VLLM::EngineCore` is stopped, and `/metrics`
freezes; a one-token completion that must come back within its deadline does not lie.
It asks for 1-2 tokens at a configured period, so it never weighs on serving. Fetching
only: the daemon decides what a failure means (a canary stuck behind a long queue on an
engine that still makes progress is not a hang). A canary the daemon could not even send
(out of file descriptors itself) raises `OutOfDescriptors`: that is no outcome at all,
never a failure of the engine's.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import httpx

from supervisor.ops.descriptors import raise_if_exhausted


@dataclass(frozen=True)
class CanaryOutcome:
    ok: bool
    latency_s: float
    error: str | None = None


async def find_model(client: httpx.AsyncClient, base_url: str, timeout_s: float) -> str | None:
    """The first model the engine's /v1/models lists, or None. Raises OutOfDescriptors
    when the daemon could not ask."""
    try:
        r = await client.get(f"{base_url}/v1/models", timeout=timeout_s)
        data = r.json().get("data") if r.status_code == 200 else None
        if isinstance(data, list) and data and isinstance(data[0], dict):
            model = data[0].get("id")
            return model if isinstance(model, str) else None
    except (httpx.HTTPError, OSError) as exc:
        raise_if_exhausted(exc)
        return None
    except (ValueError, AttributeError):
        return None
    return None


async def probe(client: httpx.AsyncClient, base_url: str, model: str, prompt: str,
                max_tokens: int, timeout_s: float) -> CanaryOutcome:
    """One completion of `max_tokens` tokens, which must come back within `timeout_s`.
    Raises OutOfDescriptors when the daemon could not send it."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
    t0 = time.monotonic()
    try:
        r = await client.post(f"{base_url}/v1/completions", json=body, timeout=timeout_s)
    except httpx.TimeoutException:
        return CanaryOutcome(False, time.monotonic() - t0, f"no answer within {timeout_s:g} s")
    except (httpx.HTTPError, OSError) as exc:  # (httpx lets a bare OSError through)
        raise_if_exhausted(exc)
        return CanaryOutcome(False, time.monotonic() - t0, f"{type(exc).__name__}: {exc}")
    latency = time.monotonic() - t0
    if r.status_code != 200:
        return CanaryOutcome(False, latency, f"HTTP {r.status_code}: {r.text[:200]}")
    try:
        choices = r.json()["choices"]
        ok = isinstance(choices, list) and len(choices) > 0
    except (ValueError, KeyError, TypeError):
        ok = False
    return CanaryOutcome(ok, latency, None if ok else f"malformed answer: {r.text[:200]}")
