"""A fast synthetic OpenAI-style upstream for the proxy benchmark (aiohttp).

POST /v1/completions answers at once: a small JSON completion, or with "stream": true
`max_tokens` SSE chunks (`data: {...}\\n\\n`, default 200) written as fast as the socket
takes them, then `data: [DONE]`; shaped as vLLM's: `finish_reason` "length" on the last
chunk and, with "return_token_ids", vLLM 0.32's own chunk, key for key: `prompt_token_ids`
(the prompt's in the first, null after) and `token_ids` in each (what the proxy's stream
continuation reads). Nothing is computed per request
beyond parsing the body, so what a benchmark measures through it is the path, not the
engine.

Paced, as vLLM sends (`?step_ms=N` on the request, or `--step-ms N` for every stream):
one engine step every N ms, and at each step every open stream of that step gets one
event, written by one ticker per step straight to the streams (no task wakes per
stream), so each event leaves in its own write, as vLLM's do.

    .venv/bin/python bench/synthetic_upstream.py --port 0   # prints "LISTENING <port>"
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import signal
import sys
import time
from dataclasses import dataclass, field

from aiohttp import web

COMPLETION = json.dumps({
    "id": "cmpl-bench", "object": "text_completion", "created": 0, "model": "synthetic",
    "choices": [{"index": 0, "text": " hello", "logprobs": None, "finish_reason": "length"}],
    "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
}).encode()
CHUNK = b"data: " + json.dumps({
    "id": "cmpl-bench", "object": "text_completion", "created": 0, "model": "synthetic",
    "choices": [{"index": 0, "text": " tok", "logprobs": None, "finish_reason": None}],
}).encode() + b"\n\n"
DONE = b"data: [DONE]\n\n"
LAST = CHUNK.replace(b'"finish_reason": null', b'"finish_reason": "length"')


@functools.lru_cache(maxsize=4096)
def _with_ids_at(i: int, first: bool, last: bool) -> bytes:
    # key for key as vLLM 0.32 writes it (tests/fixtures/vllm-0.32-cpu-sse/completions.txt)
    choice = {"index": 0, "text": " tok", "logprobs": None,
              "finish_reason": "length" if last else None, "stop_reason": None,
              "prompt_token_ids": [1, 2, 3, 4] if first else None,
              "token_ids": [1000 + i]}
    return b"data: " + json.dumps({
        "id": "cmpl-bench", "object": "text_completion", "created": 0, "model": "synthetic",
        "choices": [choice]}, separators=(",", ":")).encode() + b"\n\n"


def _with_ids(i: int, n: int) -> bytes:
    # encoded once each: the upstream's own JSON work stays out of what is measured, as
    # for the plain chunks above
    return _with_ids_at(i % 1000, i == 0, i == n - 1)


@dataclass
class Paced:
    """One paced stream: its answer, how many events it has left to get."""

    resp: web.StreamResponse
    n: int
    with_ids: bool
    done: asyncio.Future[None]
    sent: int = 0


@dataclass
class Ticker:
    """One engine step of `step_s`: each step, one event to every open stream of it."""

    step_s: float
    streams: list[Paced] = field(default_factory=list)
    task: asyncio.Task[None] | None = None

    async def run(self) -> None:
        due = time.monotonic()
        while self.streams:
            due += self.step_s
            await asyncio.sleep(max(0.0, due - time.monotonic()))
            due = max(due, time.monotonic() - self.step_s)  # (late: no catch-up burst)
            for s in list(self.streams):
                try:
                    await s.resp.write(self.event(s))
                    s.sent += 1
                    if s.sent == s.n:
                        await s.resp.write(DONE)
                except (ConnectionError, RuntimeError) as exc:  # (the client went)
                    self.streams.remove(s)
                    if not s.done.done():
                        s.done.set_exception(exc)
                    continue
                if s.sent == s.n:
                    self.streams.remove(s)
                    if not s.done.done():  # (not cancelled: its client still here)
                        s.done.set_result(None)
        self.task = None

    @staticmethod
    def event(s: Paced) -> bytes:
        if s.with_ids:
            return _with_ids(s.sent, s.n)
        return LAST if s.sent == s.n - 1 else CHUNK


TICKERS: dict[float, Ticker] = {}
STEP_MS = web.AppKey("step_ms", float)


async def paced(resp: web.StreamResponse, n: int, with_ids: bool, step_s: float) -> None:
    ticker = TICKERS.setdefault(step_s, Ticker(step_s))
    stream = Paced(resp, n, with_ids, asyncio.get_running_loop().create_future())
    ticker.streams.append(stream)
    if ticker.task is None:
        ticker.task = asyncio.get_running_loop().create_task(ticker.run())
    await stream.done


async def completions(request: web.Request) -> web.StreamResponse:
    body = await request.read()
    doc = json.loads(body) if body else {}
    if not doc.get("stream"):
        return web.Response(body=COMPLETION, content_type="application/json")
    n = doc.get("max_tokens", 200)
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream",
                                       "Cache-Control": "no-cache"})
    await resp.prepare(request)
    step_ms = float(request.query.get("step_ms", request.app[STEP_MS]))
    if step_ms > 0:
        await paced(resp, n, bool(doc.get("return_token_ids")), step_ms / 1000)
        await resp.write_eof()
        return resp
    if not doc.get("return_token_ids"):
        for _ in range(n - 1):
            await resp.write(CHUNK)
        await resp.write(LAST)
    else:
        for i in range(n):
            await resp.write(_with_ids(i, n))
    await resp.write(DONE)
    await resp.write_eof()
    return resp


async def serve(host: str, port: int, step_ms: float = 0) -> None:
    app = web.Application()
    app[STEP_MS] = step_ms
    app.router.add_post("/v1/completions", completions)
    runner = web.AppRunner(app, handle_signals=False, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, host, port, backlog=1024)
    await site.start()
    server = site._server  # the bound port when asked for port 0
    bound = server.sockets[0].getsockname()[1] if server is not None else port
    print(f"LISTENING {bound}", flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    await runner.cleanup()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=0)
    ap.add_argument("--step-ms", type=float, default=0,
                    help="pace every stream: one event each step (0: back to back)")
    ap.add_argument("--uvloop", action="store_true", help="on uvloop (the paced bench)")
    args = ap.parse_args()
    if args.uvloop:
        import uvloop
        uvloop.run(serve(args.host, args.port, args.step_ms))
    else:
        asyncio.run(serve(args.host, args.port, args.step_ms))
    return 0


if __name__ == "__main__":
    sys.exit(main())
