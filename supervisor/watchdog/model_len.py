"""The engine's max_model_len, asked once as it becomes healthy (`GET /v1/models`, which
vLLM answers with each model's `max_model_len`): the most tokens one request can hold,
so the most KV blocks the running requests can hold together
(`signals.unaccounted`). Fetching only, bounded, and never raising for what the engine
answers: an engine that does not say (not vLLM, an error, a timeout) has None."""

from __future__ import annotations

import httpx

from supervisor.front.dispatch import model_len_of

ASK_TIMEOUT_S = 5.0


async def ask(client: httpx.AsyncClient, base_url: str,
              timeout_s: float = ASK_TIMEOUT_S) -> int | None:
    """The smallest max_model_len the engine's /v1/models lists; None when it lists none
    or does not answer within `timeout_s` with a JSON document."""
    try:
        r = await client.get(f"{base_url}/v1/models", timeout=timeout_s)
        return model_len_of(r.json()) if r.status_code == 200 else None
    except (httpx.HTTPError, OSError, ValueError):
        return None
