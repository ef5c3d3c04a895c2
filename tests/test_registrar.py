"""The registrar against scripted routers (httpx.MockTransport): what it calls and when,
its retries, its bounds, its log lines. The real vllm-router: tests/test_fleet.py."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

import httpx
import pytest
import structlog

from supervisor.fleet.registrar import Registrar
from supervisor.fleet.router import url_problem
from tests.harness import until

ME = "http://127.0.0.1:8000"
R = "http://127.0.0.1:30000"


@dataclass
class Settings:
    routers: list[str] = field(default_factory=lambda: [R])
    check_interval_s: float = 0.2
    request_timeout_s: float = 0.5
    retry_initial_s: float = 0.05
    retry_max_s: float = 0.2


class ScriptedRouter:
    """vllm-router's worker API as 0.1.17 answers it, with switches for faults."""

    def __init__(self) -> None:
        self.workers: list[str] = []
        self.calls: list[str] = []
        self.down = False  # connections refused
        self.hang = False  # no answer

    async def __call__(self, request: httpx.Request) -> httpx.Response:
        self.calls.append(f"{request.method} {request.url.path}")
        if self.down:
            raise httpx.ConnectError("connection refused", request=request)
        if self.hang:
            await asyncio.sleep(3600)
        url = request.url.params.get("url")
        if request.url.path == "/list_workers":
            return httpx.Response(200, json={"urls": list(self.workers)})
        if request.url.path == "/add_worker":
            if url in self.workers:
                return httpx.Response(400, text=f"Worker {url} already exists")
            self.workers.append(url)
            return httpx.Response(200, text=f"Successfully added worker: {url}")
        if request.url.path == "/remove_worker":
            if url in self.workers:
                self.workers.remove(url)
            return httpx.Response(200, text=f"Successfully removed worker: {url}")
        return httpx.Response(404)


def registrar(router: ScriptedRouter, why_not: Any) -> Registrar:
    client = httpx.AsyncClient(transport=httpx.MockTransport(router))
    return Registrar(Settings(), ME, why_not, client=client)


def test_it_joins_when_serving_leaves_when_not_and_rejoins_a_router_that_forgot() -> None:
    async def main() -> None:
        router = ScriptedRouter()
        why: list[str | None] = ["the engine is STARTING"]
        reg = registrar(router, lambda: why[0])
        reg.start()
        await until(lambda: "POST /remove_worker" in router.calls)  # (a previous run's entry)
        assert reg.registered() == {R: False} and router.workers == []
        why[0] = None
        await until(lambda: router.workers == [ME])
        assert reg.registered() == {R: True}
        router.workers.clear()  # the router restarted
        await until(lambda: router.workers == [ME])
        why[0] = "drain requested by operator"
        await until(lambda: router.workers == [])
        assert reg.registered() == {R: False}
        await reg.leave(1.0)
        await reg.close(1.0)

    with structlog.testing.capture_logs() as logs:
        asyncio.run(main())
    said = [(e["event"], e.get("why")) for e in logs]
    assert said == [("out of router", "the engine is STARTING"),
                    ("registered with router", "serving"),
                    ("registered with router", "the router had forgotten this daemon"),
                    ("out of router", "drain requested by operator")]


def test_a_router_that_is_down_is_retried_with_backoff_and_logged_once() -> None:
    async def main() -> ScriptedRouter:
        router = ScriptedRouter()
        router.down = True
        reg = registrar(router, lambda: None)
        reg.start()
        await asyncio.sleep(1.0)
        tries = len(router.calls)
        assert 3 <= tries <= 30, tries  # backed off (0.05 s doubling to 0.2 s), not spun
        assert reg.registered() == {R: False}
        router.down = False
        await until(lambda: router.workers == [ME])
        await reg.leave(1.0)
        assert router.workers == []
        await reg.close(1.0)
        return router

    with structlog.testing.capture_logs() as logs:
        asyncio.run(main())
    events = [e["event"] for e in logs]
    assert events.count("router unreachable") == 1
    assert "connection refused" in next(e["error"] for e in logs
                                        if e["event"] == "router unreachable")
    assert events[-2:] == ["registered with router", "out of router"]


def test_leaving_a_router_that_hangs_takes_its_bound_and_no_more() -> None:
    async def main() -> float:
        router = ScriptedRouter()
        reg = registrar(router, lambda: None)
        reg.start()
        await until(lambda: router.workers == [ME])
        router.hang = True
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        await reg.leave(0.3)
        took = loop.time() - t0
        await reg.close(0.3)
        return took

    with structlog.testing.capture_logs() as logs:
        took = asyncio.run(main())
    assert took < 1.0
    assert any(e["event"] == "could not leave router" for e in logs), logs


@pytest.mark.parametrize("url,problem", [
    ("http://10.0.0.5:30000", None),
    ("https://router.internal:443", None),
    ("http://10.0.0.5:30000/", "trailing '/'"),
    ("http://10.0.0.5", "no port"),
    ("10.0.0.5:30000", "expected http"),
    ("http://10.0.0.5:30000/v1", "nothing after"),
    ("ftp://10.0.0.5:21", "expected http"),
])
def test_router_and_worker_urls_are_refused_with_the_reason(url: str,
                                                            problem: str | None) -> None:
    why = url_problem(url)
    assert (why is None) if problem is None else (why is not None and problem in why)
