"""The proxy's own guard rails over the server's (issue 33): a body the proxy cannot
read is the client's fault, answered 400, never a 500 with a traceback, never sent on."""

from __future__ import annotations

import asyncio

import aiohttp
from aiohttp import web
from structlog.testing import capture_logs

from tests.inprocess_proxy import proxy_to, scripted_upstream


def test_json_nested_too_deep_is_a_400_and_never_reaches_the_engine() -> None:
    reached: list[str] = []

    async def engine(request: web.Request) -> web.StreamResponse:
        reached.append(request.path)
        return web.json_response({})

    async def main() -> None:
        runner, url = await scripted_upstream(engine)
        proxy = await proxy_to(url)
        try:
            async with aiohttp.ClientSession() as s:
                body = b'{"model": "m", "prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
                with capture_logs() as logs:
                    async with s.post(f"http://127.0.0.1:{proxy.port}/v1/completions",
                                      data=body) as r:
                        assert r.status == 400
                        doc = await r.json()
                assert doc["error"]["type"] == "bad_json"
                assert not [e for e in logs if e.get("log_level") in ("error", "critical")]
                assert proxy.stats.rejections == {"bad_json": 1}
        finally:
            await proxy.close()
            await runner.cleanup()
        assert reached == []

    asyncio.run(main())
