"""vLLM's own benchmark client (`vllm bench serve`'s request functions), one request per
argument, for tests that must see a stream as that client parses it. Runs under the
engine's interpreter (.venv-engine: the `vllm` package), never the supervisor's.

    python tests/vllm_bench_client.py URL MODEL BACKEND START_S:PROMPT:TOKENS ...

BACKEND is `openai` (/v1/completions) or `openai-chat`; each request starts START_S
seconds after the first. Prints one JSON list: per request, the client's own verdict
(success, error) and what it read (text, output tokens).
"""

from __future__ import annotations

import asyncio
import json
import sys

import aiohttp
from vllm.benchmarks.lib.endpoint_request_func import ASYNC_REQUEST_FUNCS, RequestFuncInput


async def one(session: aiohttp.ClientSession, url: str, model: str, backend: str,
              spec: str) -> dict[str, object]:
    start, prompt, tokens = spec.split(":", 2)
    await asyncio.sleep(float(start))
    out = await ASYNC_REQUEST_FUNCS[backend](RequestFuncInput(
        prompt=prompt, api_url=url, prompt_len=len(prompt), output_len=int(tokens),
        model=model, ignore_eos=True), session)
    return {"success": out.success, "error": out.error[-500:],
            "text": out.generated_text, "output_tokens": out.output_tokens}


async def main(url: str, model: str, backend: str, specs: list[str]) -> None:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as s:
        outs = await asyncio.gather(*(one(s, url, model, backend, x) for x in specs))
    print(json.dumps(outs))


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4:]))
