"""Which engine deaths a request is charged with (supervisor/front/quarantine.py): the
rule on its own, then the proxy in this process in front of a scripted engine that dies
whenever one prompt arrives, with the order of the suspects' lane forced. Fast: no
daemon, no engine."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import aiohttp
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

    async def handle(self, request: web.Request) -> web.StreamResponse:
        if request.path == "/health":
            return web.Response(status=503 if self.dead else 200)
        body = await request.read()
        killer = b"KILLER" in body
        self.seen.append((self.generation, "killer" if killer else "innocent", self.dead))
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


def test_the_next_suspect_sent_to_the_engine_its_predecessor_killed_is_not_charged_with_it(
        ) -> None:
    """An innocent request at the engine for two of a killer's deaths is a suspect, and
    queues behind the killer in the suspects' lane with its admission already granted:
    the killer kills the third start and is refused; the innocent, sent the moment the
    lane is free to that same dead start, is answered 500 by it. That death is not its
    own: it waits for the next start and is answered there (this race refused innocent
    streams now and then in the end-to-end test)."""

    async def main() -> None:
        gate = Gate(GateLimits(concurrency=100, max_wait_s=30))
        gate.release()
        engine = DyingEngine(gate)
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

        async def post(s: aiohttp.ClientSession, prompt: str) -> tuple[int, Any]:
            async with s.post(url, json={"model": "m", "prompt": prompt}) as r:
                return r.status, await r.json()

        try:
            async with aiohttp.ClientSession() as s:
                innocent = asyncio.create_task(post(s, "innocent"))
                for _ in range(500):  # at the engine before the killer
                    if engine.seen or innocent.done():
                        break
                    await asyncio.sleep(0.01)
                assert engine.seen, await innocent
                killed, refusal = await asyncio.wait_for(post(s, "KILLER"), 20)
                answered, answer = await asyncio.wait_for(innocent, 20)
        finally:
            await proxy.close()
            await runner.cleanup()
        assert killed == 502 and refusal["error"]["type"] == "kills_engine", refusal
        assert "3 of its deaths" in str(refusal["error"]["message"])
        assert answered == 200 and answer["choices"][0]["text"] == " hi", answer
        # the race this test forces: the innocent sent to the start the killer killed
        assert (3, "innocent", True) in engine.seen, engine.seen
        assert [g for g, who, _ in engine.seen if who == "killer"] == [1, 2, 3]
        assert proxy.stats.rejections.get("kills_engine") == 1

    asyncio.run(main())
