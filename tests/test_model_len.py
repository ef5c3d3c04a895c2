"""`model_len.ask`: the engine's max_model_len from its /v1/models, and None for every
answer that does not say it (the daemon's test against a fake engine that does, over
real HTTP: tests/test_watchdog.py, `test_a_saturation_by_load_...`)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import httpx
import pytest

from supervisor.watchdog import model_len


def ask(handler: Callable[[httpx.Request], httpx.Response]) -> int | None:
    async def go() -> int | None:
        async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as client:
            return await model_len.ask(client, "http://engine", 1.0)

    return asyncio.run(go())


def models(*entries: object) -> Callable[[httpx.Request], httpx.Response]:
    def handler(request: httpx.Request) -> httpx.Response:
        assert (request.method, request.url.path) == ("GET", "/v1/models")
        return httpx.Response(200, json={"object": "list", "data": list(entries)})
    return handler


def test_the_smallest_length_listed_is_the_engines():
    # (a LoRA adapter is listed with its base's length; a smaller one bounds them all)
    assert ask(models({"id": "m", "max_model_len": 4608},
                      {"id": "lora", "max_model_len": 2048})) == 2048


@pytest.mark.parametrize("handler", [
    models({"id": "m"}),  # not said
    models({"id": "m", "max_model_len": "4608"}),
    models({"id": "m", "max_model_len": True}),
    models({"id": "m", "max_model_len": 0}),
    lambda r: httpx.Response(500, json={"data": [{"max_model_len": 4608}]}),
    lambda r: httpx.Response(200, text="<html>not JSON</html>"),
    lambda r: httpx.Response(200, json=["a list"]),
])
def test_an_answer_that_does_not_say_it_is_none(handler):
    assert ask(handler) is None


def test_no_answer_is_none():
    def handler(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectTimeout("no answer", request=request)

    assert ask(handler) is None
