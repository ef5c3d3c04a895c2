"""Which engine deaths a request is charged with (supervisor/front/quarantine.py): the
rule on its own, then the proxy in this process in front of a scripted engine that dies
whenever one prompt arrives, with the order of the suspects' lane forced. Fast: no
daemon, no engine."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from supervisor.front.admission import Gate, GateLimits
from supervisor.front.dispatch import Backend
from supervisor.front.exchange import Exchange, ProxySettings
from supervisor.front.proxy import FrontProxy

COMPLETION = json.dumps({
    "id": "cmpl-1", "object": "text_completion", "created": 0, "model": "m",
    "choices": [{"index": 0, "text": " hi", "logprobs": None, "finish_reason": "length"}],
    "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}}).encode()


def _backend(generation: list[int]) -> Backend:
    return Backend("e", Gate(GateLimits()), lambda: True, "http://127.0.0.1:1",
                   generation=lambda: generation[0])


def test_a_death_counts_for_the_requests_sent_before_it_was_seen_not_after() -> None:
    gen = [1]
    backend = _backend(gen)
    killer, beside, late = Exchange(0.0), Exchange(0.0), Exchange(0.0)
    killer.sent(backend)
    beside.sent(backend)
    killer.engine_failed()  # the first sign of start 1's death
    beside.engine_failed()  # at the engine before that sign: its death too
    late.sent(backend)  # sent to start 1 once it was seen failing
    late.engine_failed()
    assert (killer.deaths, beside.deaths, late.deaths) == (1, 1, 0)
    killer.engine_failed()  # the same start again: one death per start
    assert killer.deaths == 1
    gen[0] = 2  # the next start: late is there before anyone saw it fail
    late.sent(backend)
    late.engine_failed()
    assert late.deaths == 1 and late.died_at == {("e", 2)}


class DyingEngine:
    """An engine that dies whenever a prompt holding KILLER arrives, and this test's
    stand-in for its unit: the gate held from the death, a new start `restart_s` later.
    While dead it answers 500 and its /health 503, as vLLM does between its core's death
    and its own exit. An innocent request takes `work_s`; one the engine dies under is
    answered 500 0.1 s after the death, and so is an innocent sent to the dead engine,
    so that the killer's failure is always seen first and it queues ahead of them."""

    def __init__(self, gate: Gate, restart_s: float = 0.5, work_s: float = 0.4) -> None:
        self.gate, self.restart_s, self.work_s = gate, restart_s, work_s
        self.generation = 1
        self.dead = False
        self.died = asyncio.Event()
        self.seen: list[tuple[int, str, bool]] = []  # (start, who, dead on arrival)
        self.arrived = asyncio.Condition()  # notified with each request that arrives

    async def handle(self, request: web.Request, body: bytes | None = None
                     ) -> web.StreamResponse:
        if request.path == "/health":
            return web.Response(status=503 if self.dead else 200)
        body = await request.read() if body is None else body
        killer = b"KILLER" in body
        async with self.arrived:
            self.seen.append((self.generation, "killer" if killer else "innocent",
                              self.dead))
            self.arrived.notify_all()
        if self.dead:
            if not killer:
                await asyncio.sleep(0.1)
            return web.Response(status=500, text="engine dead")
        if killer:
            self._die()
            return web.Response(status=500, text="engine dead")
        died = self.died
        try:
            await asyncio.wait_for(died.wait(), self.work_s)
        except TimeoutError:
            return web.Response(body=COMPLETION, content_type="application/json")
        await asyncio.sleep(0.1)
        return web.Response(status=500, text="engine dead")

    def _die(self) -> None:
        self.dead = True
        self.died.set()
        self.gate.hold("engine died")
        asyncio.get_running_loop().call_later(self.restart_s, self._restart)

    def _restart(self) -> None:
        self.generation += 1
        self.dead = False
        self.died = asyncio.Event()
        self.gate.release()


Post = Callable[[str], Awaitable[tuple[int, Any]]]


@contextlib.asynccontextmanager
async def behind(engine_of: Callable[[Gate], DyingEngine]) -> AsyncIterator[
        tuple[DyingEngine, FrontProxy, Post]]:
    """The proxy in this process in front of the engine `engine_of` makes, with its gate;
    and a POST of a completion with a prompt, answered (status, JSON)."""
    gate = Gate(GateLimits(concurrency=100, max_wait_s=30))
    gate.release()
    engine = engine_of(gate)
    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", engine.handle)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    upstream = f"http://127.0.0.1:{runner.addresses[0][1]}"
    proxy = FrontProxy(ProxySettings("127.0.0.1", 0, upstream))
    proxy.add_engine(Backend("default", gate, lambda: True, upstream, models_open=True,
                             generation=lambda: engine.generation))
    await proxy.start()
    url = f"http://127.0.0.1:{proxy.port}/v1/completions"
    try:
        async with aiohttp.ClientSession() as s:

            async def post(prompt: str) -> tuple[int, Any]:
                async with s.post(url, json={"model": "m", "prompt": prompt}) as r:
                    return r.status, await r.json()

            yield engine, proxy, post
    finally:
        await proxy.close()
        await runner.cleanup()


async def at_engine(engine: DyingEngine, task: asyncio.Task[tuple[int, Any]]) -> None:
    """Until `task`'s request is at the engine (bounded by the caller)."""
    async with engine.arrived:
        await engine.arrived.wait_for(lambda: bool(engine.seen) or task.done())
    assert engine.seen, await task


def test_the_next_suspect_sent_to_the_engine_its_predecessor_killed_is_not_charged_with_it(
        ) -> None:
    """An innocent request at the engine for two of a killer's deaths is a suspect, and
    queues behind the killer in the suspects' lane with its admission already granted:
    the killer kills the third start and is refused; the innocent, sent the moment the
    lane is free to that same dead start, is answered 500 by it. That death is not its
    own: it waits for the next start and is answered there (this race refused innocent
    streams now and then in the end-to-end test)."""

    async def main() -> None:
        async with behind(DyingEngine) as (engine, proxy, post):
            innocent = asyncio.create_task(post("innocent"))
            await asyncio.wait_for(at_engine(engine, innocent), 20)  # before the killer
            killed, refusal = await asyncio.wait_for(post("KILLER"), 20)
            answered, answer = await asyncio.wait_for(innocent, 20)
        assert killed == 502 and refusal["error"]["type"] == "kills_engine", refusal
        assert "3 of its deaths" in str(refusal["error"]["message"])
        assert answered == 200 and answer["choices"][0]["text"] == " hi", answer
        # the race this test forces: the innocent sent to the start the killer killed
        assert (3, "innocent", True) in engine.seen, engine.seen
        assert [g for g, who, _ in engine.seen if who == "killer"] == [1, 2, 3]
        assert proxy.stats.rejections.get("kills_engine") == 1

    asyncio.run(main())


class SpuriousEngine(DyingEngine):
    """A DyingEngine that, still healthy, fails the first request holding SPURIOUS:
    `drop` closes its connection unanswered (its keep-alive timer, or a worker gone),
    `blip` answers it 500 and its next /health 503 (a moment's overload). Asked again,
    that request is answered at once."""

    def __init__(self, gate: Gate, how: str) -> None:
        super().__init__(gate, work_s=2.0)
        self.how = how
        self.spurious = 0
        self.blip = False

    async def handle(self, request: web.Request) -> web.StreamResponse:
        if request.path == "/health" and self.blip:
            self.blip = False
            return web.Response(status=503)
        if request.path == "/health":
            return await super().handle(request)
        body = await request.read()
        if b"SPURIOUS" not in body:
            return await super().handle(request, body)
        self.spurious += 1
        if self.spurious > 1:
            return web.Response(body=COMPLETION, content_type="application/json")
        if self.how == "blip":
            self.blip = True
            return web.Response(status=500, text="overloaded")
        assert request.transport is not None
        request.transport.abort()
        return web.Response()  # (to a connection already gone: never written)


@pytest.mark.parametrize("how", ["drop", "blip"])
def test_a_failure_seen_at_a_healthy_engine_start_does_not_spare_the_killer_its_death(
        how: str) -> None:
    """A request fails at a start that still serves (`how`), and is answered when sent
    again; then a killer arrives, beside an innocent that was there first. Had that
    failure counted as the start's first sign of death, the killer, sent after it, would
    not be charged with the death it causes: one death short at each turn, it kills a
    fourth start, running beside the innocent while the innocent, a suspect by then, ran
    alone in the suspects' lane; the innocent's third death refused it as `kills_engine`
    (one run in eight of the end-to-end test on a loaded machine). A drop by a start that
    still serves is no failure of it; a start that answered a generation sent after a
    failure of it was seen was not dying then (`Backend.served`)."""

    async def main() -> None:
        async with behind(lambda gate: SpuriousEngine(gate, how)) as (engine, proxy, post):
            innocent = asyncio.create_task(post("innocent"))
            await asyncio.wait_for(at_engine(engine, innocent), 20)
            assert (await asyncio.wait_for(post("SPURIOUS"), 20))[0] == 200
            killed, refusal = await asyncio.wait_for(post("KILLER"), 20)
            answered, answer = await asyncio.wait_for(innocent, 20)
        assert answered == 200 and answer["choices"][0]["text"] == " hi", answer
        assert killed == 502 and refusal["error"]["type"] == "kills_engine", refusal
        assert "3 of its deaths" in str(refusal["error"]["message"])
        assert [g for g, who, _ in engine.seen if who == "killer"] == [1, 2, 3]
        assert proxy.stats.rejections == {"kills_engine": 1}

    asyncio.run(main())
