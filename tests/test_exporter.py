"""The daemon's exporter over real sockets: the exposition parsed back with
prometheus_client, readiness, liveness, and bad HTTP input."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Awaitable, Callable
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from supervisor.exporter import Exporter, ExporterError, ExporterView, parse_listen

VIEW = ExporterView(
    state="RUNNING", ready=True, throttle_level=1,
    restarts_by_reason={"crash": 2, "policy": 1}, trips_by_rule={"kv_saturation": 3},
    actions_by_kind={"throttle": 1}, last_decision_wall=1795000000.5, policy_paused=False,
    dry_run=False, engine_uptime_s=12.5,
    gauges=[("kv_cache_usage_ratio", "KV usage", 0.97), ("gpu_temperature_celsius", "t", None),
            ("bad name!", "x", 1.0)])


def serve(view: Callable[[], Awaitable[ExporterView]],
          client: Callable[[int], Awaitable[Any]], **kw: Any) -> Any:
    async def go() -> Any:
        ex = Exporter("127.0.0.1:0", view, **kw)
        await ex.start()
        try:
            return await client(ex.port)
        finally:
            await ex.close()
    return asyncio.run(go())


async def fixed() -> ExporterView:
    return VIEW


async def get(port: int, path: str, method: str = "GET") -> httpx.Response:
    async with httpx.AsyncClient() as c:
        return await c.request(method, f"http://127.0.0.1:{port}{path}", timeout=5)


async def raw(port: int, data: bytes, read: bool = True) -> bytes:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(data)
    await writer.drain()
    out = await asyncio.wait_for(reader.read(), 5) if read else b""
    writer.close()
    return out


def samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def test_metrics_exposition_parses_back_with_the_values():
    r = serve(fixed, lambda p: get(p, "/metrics"))
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    m = samples(r.text)
    assert m[("vllm_supervisor_engine_state", (("state", "RUNNING"),))] == 1
    assert m[("vllm_supervisor_engine_state", (("state", "FATAL"),))] == 0
    assert m[("vllm_supervisor_engine_restarts_total", (("reason", "crash"),))] == 2
    assert m[("vllm_supervisor_policy_trips_total", (("rule", "kv_saturation"),))] == 3
    assert m[("vllm_supervisor_policy_actions_total", (("action", "throttle"),))] == 1
    assert m[("vllm_supervisor_throttle_level", ())] == 1
    assert m[("vllm_supervisor_engine_uptime_seconds", ())] == 12.5
    assert m[("vllm_supervisor_last_decision_timestamp_seconds", ())] == 1795000000.5
    assert m[("vllm_supervisor_kv_cache_usage_ratio", ())] == 0.97
    assert not any(k[0].startswith("vllm_supervisor_gpu_") for k in m)  # unknown: absent
    assert not any("bad" in k[0] for k in m)  # a bad name is skipped, not a 500


def test_readyz_follows_the_view_and_healthz_the_owner():
    async def draining() -> ExporterView:
        return ExporterView(**{**VIEW.__dict__, "state": "DRAINING", "ready": False})

    assert serve(fixed, lambda p: get(p, "/readyz")).status_code == 200
    r = serve(draining, lambda p: get(p, "/readyz"))
    assert r.status_code == 503 and r.text == "not ready: DRAINING\n"
    assert serve(draining, lambda p: get(p, "/healthz")).text == "ok\n"


def test_a_stuck_owner_fails_healthz_and_metrics_without_hanging():
    async def stuck() -> ExporterView:
        await asyncio.sleep(3600)
        raise AssertionError

    async def both(p: int) -> tuple[int, int]:
        return (await get(p, "/healthz")).status_code, (await get(p, "/metrics")).status_code

    assert serve(stuck, both, view_timeout_s=0.2) == (503, 500)


def test_a_failing_view_is_a_500_not_a_crash():
    async def broken() -> ExporterView:
        raise RuntimeError("boom")

    async def twice(p: int) -> tuple[int, int]:
        return (await get(p, "/metrics")).status_code, (await get(p, "/healthz")).status_code

    assert serve(broken, twice) == (500, 503)


def test_http_errors_for_paths_methods_and_garbage():
    async def all_of(p: int) -> list[Any]:
        return [
            (await get(p, "/nope")).status_code,
            (await get(p, "/metrics", "POST")).status_code,
            (await get(p, "/metrics", "HEAD")).content,
            await raw(p, b"GARBAGE\r\n\r\n"),
            await raw(p, b"GET /metrics HTTP/1.1\r\nX: " + b"a" * 20000 + b"\r\n\r\n"),
            await raw(p, b"\xff\xfe /x HTTP/1.1\r\n\r\n"),
        ]

    nope, post, head, garbage, big, binary = serve(fixed, all_of)
    assert nope == 404 and post == 405 and head == b""
    assert garbage.startswith(b"HTTP/1.1 400") and binary.startswith(b"HTTP/1.1 400")
    assert big.startswith(b"HTTP/1.1 431")


def test_a_silent_client_is_closed_and_others_still_served():
    async def go(p: int) -> tuple[bytes, int]:
        reader, writer = await asyncio.open_connection("127.0.0.1", p)
        served = (await get(p, "/healthz")).status_code  # not blocked by the silent one
        closed = await asyncio.wait_for(reader.read(), 5)  # the server gives up on it
        writer.close()
        return closed, served

    closed, served = serve(fixed, go, head_timeout_s=0.3)
    assert closed == b"" and served == 200


def test_connections_over_the_limit_get_503():
    async def go(p: int) -> bytes:
        holders = [await asyncio.open_connection("127.0.0.1", p) for _ in range(2)]
        await asyncio.sleep(0.1)  # let the server accept them
        extra = await raw(p, b"GET /healthz HTTP/1.1\r\n\r\n")
        for _, w in holders:
            w.close()
        return extra

    assert serve(fixed, go, max_connections=2, head_timeout_s=5).startswith(b"HTTP/1.1 503")


def test_bind_failure_names_the_address():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]

        async def go() -> None:
            await Exporter(f"127.0.0.1:{port}", fixed).start()

        with pytest.raises(ExporterError, match=f"127.0.0.1:{port}"):
            asyncio.run(go())


@pytest.mark.parametrize(("listen", "expected"), [
    ("127.0.0.1:9402", ("127.0.0.1", 9402)), ("[::1]:0", ("::1", 0)),
    ("localhost:80", ("localhost", 80)),
])
def test_parse_listen(listen, expected):
    assert parse_listen(listen) == expected


@pytest.mark.parametrize("listen", ["9402", ":9402", "host:", "host:99999", "host:x"])
def test_parse_listen_refuses(listen):
    with pytest.raises(ValueError, match="expected HOST:PORT"):
        parse_listen(listen)
