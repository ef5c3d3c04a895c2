"""The daemon's exporter over real sockets on 127.0.0.1: httpx for HTTP, raw streams for
garbage; the exposition parsed back with prometheus_client. Each test runs its own event
loop with asyncio.run; nothing sleeps to synchronise."""

from __future__ import annotations

import asyncio
import dataclasses
import socket
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine
from contextlib import asynccontextmanager
from typing import Any

import httpx
import pytest
from prometheus_client import CONTENT_TYPE_LATEST
from prometheus_client.parser import text_string_to_metric_families
from structlog.testing import capture_logs

from supervisor.ops.exporter import (
    MAX_HEAD,
    Exporter,
    ExporterError,
    parse_listen,
    parse_request_head,
)
from supervisor.ops.exposition import STATES, ExporterView

GUARD_S = 10.0  # a hang guard, not a timing assertion

VIEW = ExporterView(
    state="DRAINING", ready=False, throttle_level=2,
    restarts_by_reason={"crash": 3, "policy": 1},
    trips_by_rule={"kv_saturation": 4},
    actions_by_kind={"restart": 1, "throttle": 2},
    last_decision_wall=1_700_000_000.5, policy_paused=True, dry_run=False,
    engine_uptime_s=12.5,
    gauges=[("kv_cache_usage_ratio", "KV cache usage, 0-1", 0.75),
            ("gpu_temperature_celsius", "GPU temperature", None)])


def run(coro: Coroutine[Any, Any, None]) -> None:
    asyncio.run(asyncio.wait_for(coro, 60))


def fixed(view: ExporterView) -> Callable[[], Awaitable[ExporterView]]:
    async def get() -> ExporterView:
        return view
    return get


class Hanging:
    """A view callback that answers only once released, as a stuck state-owning task."""

    def __init__(self, view: ExporterView = VIEW) -> None:
        self.view = view
        self.calls = 0
        self.called = asyncio.Event()
        self.release = asyncio.Event()
        self.want = 1

    async def __call__(self) -> ExporterView:
        self.calls += 1
        if self.calls >= self.want:
            self.called.set()
        await self.release.wait()
        return self.view

    async def wait_calls(self, n: int) -> None:
        self.want = n
        if self.calls < n:
            self.called.clear()
            await asyncio.wait_for(self.called.wait(), GUARD_S)


@asynccontextmanager
async def serving(view: Callable[[], Awaitable[ExporterView]],
                  **kw: Any) -> AsyncIterator[Exporter]:
    exporter = Exporter("127.0.0.1:0", view, **kw)
    await exporter.start()
    try:
        yield exporter
    finally:
        await asyncio.wait_for(exporter.close(), GUARD_S)


async def get(exporter: Exporter, path: str, method: str = "GET") -> httpx.Response:
    async with httpx.AsyncClient(timeout=GUARD_S) as client:
        return await client.request(method, f"http://127.0.0.1:{exporter.port}{path}")


async def raw(exporter: Exporter, data: bytes) -> bytes:
    """Send bytes, read the answer until the server closes."""
    reader, writer = await asyncio.open_connection("127.0.0.1", exporter.port)
    try:
        writer.write(data)
        await writer.drain()
        return await asyncio.wait_for(reader.read(), GUARD_S)
    finally:
        writer.close()


async def read_or_reset(reader: asyncio.StreamReader) -> bytes:
    try:
        return await asyncio.wait_for(reader.read(), GUARD_S)
    except ConnectionResetError:
        return b""


def status_of(answer: bytes) -> int:
    return int(answer.split(b" ", 2)[1])


def samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


# ---- /metrics ------------------------------------------------------------------------

def test_metrics_shows_the_state_one_hot_counters_by_label_and_gauges() -> None:
    async def main() -> None:
        async with serving(fixed(VIEW)) as e:
            r = await get(e, "/metrics")
        assert r.status_code == 200
        assert r.headers["content-type"] == CONTENT_TYPE_LATEST
        assert r.headers["connection"] == "close"
        m = samples(r.text)
        p = "vllm_supervisor_"
        for s in STATES:
            assert m[(p + "engine_state", (("state", s),))] == (1.0 if s == "DRAINING" else 0.0)
        assert m[(p + "engine_ready", ())] == 0
        assert m[(p + "engine_uptime_seconds", ())] == 12.5
        assert m[(p + "engine_restarts_total", (("reason", "crash"),))] == 3
        assert m[(p + "engine_restarts_total", (("reason", "policy"),))] == 1
        assert m[(p + "policy_trips_total", (("rule", "kv_saturation"),))] == 4
        assert m[(p + "policy_actions_total", (("action", "restart"),))] == 1
        assert m[(p + "policy_actions_total", (("action", "throttle"),))] == 2
        assert m[(p + "throttle_level", ())] == 2
        assert m[(p + "policy_paused", ())] == 1
        assert m[(p + "policy_dry_run", ())] == 0
        assert m[(p + "last_decision_timestamp_seconds", ())] == 1_700_000_000.5
        assert m[(p + "kv_cache_usage_ratio", ())] == 0.75
        assert (p + "gpu_temperature_celsius", ()) not in m  # unknown: absent, not 0
        fams = {f.name: f for f in text_string_to_metric_families(r.text)}
        assert fams[p + "engine_restarts"].type == "counter"
        assert fams[p + "kv_cache_usage_ratio"].documentation == "KV cache usage, 0-1"

    run(main())


def test_metrics_omit_unknown_uptime_and_decision_time_and_keep_empty_counters_valid() -> None:
    view = dataclasses.replace(VIEW, state="STARTING", ready=False, engine_uptime_s=None,
                               last_decision_wall=None, restarts_by_reason={},
                               trips_by_rule={}, actions_by_kind={}, gauges=[])

    async def main() -> None:
        async with serving(fixed(view)) as e:
            r = await get(e, "/metrics")
        assert r.status_code == 200
        names = {s.name for f in text_string_to_metric_families(r.text) for s in f.samples}
        assert "vllm_supervisor_engine_uptime_seconds" not in names
        assert "vllm_supervisor_last_decision_timestamp_seconds" not in names
        assert not any(n.startswith("vllm_supervisor_engine_restarts") for n in names)
        m = samples(r.text)
        assert m[("vllm_supervisor_engine_state", (("state", "STARTING"),))] == 1

    run(main())


def test_metrics_skip_bad_gauges_and_log_each_once() -> None:
    view = dataclasses.replace(VIEW, gauges=[
        ("bad-name", "dash", 1.0),
        ("bad name!", "space", 1.0),
        ("9starts_with_digit", "digit", 1.0),
        ("engine_ready", "taken by a fixed family", 1.0),
        ("engine_restarts_total", "taken by a counter's samples", 1.0),
        ("not_a_number", "string value", "x"),  # type: ignore[list-item]
        ("good_one", "kept", 3.0),
        ("good_one", "repeated", 4.0),
    ])

    async def main() -> None:
        async with serving(fixed(view)) as e:
            with capture_logs() as logs:
                first = await get(e, "/metrics")
                second = await get(e, "/metrics")
        for r in (first, second):
            assert r.status_code == 200
            m = samples(r.text)
            assert m[("vllm_supervisor_good_one", ())] == 3.0
            assert m[("vllm_supervisor_engine_ready", ())] == 0
            names = {n for n, _ in m}
            assert "vllm_supervisor_not_a_number" not in names
            assert not any("bad" in n or "9starts" in n for n in names)
        skipped = [(x["event"], x["name"]) for x in logs if x["event"].startswith(
            "exporter skips")]
        assert sorted(skipped) == sorted([
            ("exporter skips a gauge with a bad name", "bad-name"),
            ("exporter skips a gauge with a bad name", "bad name!"),
            ("exporter skips a gauge with a bad name", "9starts_with_digit"),
            ("exporter skips a gauge whose name is taken", "engine_ready"),
            ("exporter skips a gauge whose name is taken", "engine_restarts_total"),
            ("exporter skips a gauge whose value is not a number", "not_a_number"),
            ("exporter skips a gauge whose name is taken", "good_one"),
        ])  # once each, over two scrapes
        assert all(x["log_level"] == "warning" for x in logs if x["event"].startswith(
            "exporter skips"))

    run(main())


def test_metrics_500_when_the_view_raises_and_200_when_it_answers_again() -> None:
    answers: list[ExporterView | Exception] = [RuntimeError("owner gone"), VIEW]

    async def view() -> ExporterView:
        a = answers.pop(0)
        if isinstance(a, Exception):
            raise a
        return a

    async def main() -> None:
        async with serving(view) as e:
            with capture_logs() as logs:
                failed = await get(e, "/metrics")
                ok = await get(e, "/metrics")
        assert failed.status_code == 500
        assert "RuntimeError: owner gone" in failed.text
        assert ok.status_code == 200
        events = [x["event"] for x in logs]
        assert events == ["exporter gets no view from the daemon",
                          "exporter gets views from the daemon again"]

    run(main())


def test_metrics_500_when_the_view_cannot_be_rendered() -> None:
    view = dataclasses.replace(VIEW, restarts_by_reason={"crash": "many"})  # type: ignore[dict-item]

    async def main() -> None:
        async with serving(fixed(view)) as e:
            with capture_logs():
                r = await get(e, "/metrics")
            assert r.status_code == 500
            assert r.text.startswith("cannot render metrics")
            assert (await get(e, "/healthz")).status_code == 200  # the server lives on

    run(main())


# ---- /healthz and /readyz ------------------------------------------------------------

def test_healthz_200_while_the_view_answers() -> None:
    async def main() -> None:
        async with serving(fixed(VIEW)) as e:
            r = await get(e, "/healthz")
        assert (r.status_code, r.text) == (200, "ok\n")

    run(main())


def test_healthz_503_when_the_view_does_not_answer_in_time() -> None:
    async def main() -> None:
        hanging = Hanging()
        async with serving(hanging, view_timeout_s=0.05) as e:
            with capture_logs():
                r = await get(e, "/healthz")
                ready = await get(e, "/readyz")
                scrape = await get(e, "/metrics")
        assert r.status_code == 503
        assert "no view within 0.05 s" in r.text
        assert ready.status_code == 503
        assert scrape.status_code == 500

    run(main())


def test_healthz_503_when_the_view_raises() -> None:
    async def view() -> ExporterView:
        raise RuntimeError("boom")

    async def main() -> None:
        async with serving(view) as e:
            with capture_logs():
                r = await get(e, "/healthz")
        assert r.status_code == 503

    run(main())


def test_healthz_503_when_the_owner_cancels_the_request() -> None:
    async def view() -> ExporterView:
        reply: asyncio.Future[ExporterView] = asyncio.get_running_loop().create_future()
        reply.cancel()  # as when the state-owning task is gone with its queue
        return await reply

    async def main() -> None:
        async with serving(view) as e:
            with capture_logs():
                r = await get(e, "/healthz")
        assert r.status_code == 503
        assert "cancelled" in r.text

    run(main())


def test_readyz_200_when_ready_and_503_with_the_state_when_not() -> None:
    async def main() -> None:
        async with serving(fixed(dataclasses.replace(VIEW, state="RUNNING",
                                                     ready=True))) as e:
            ready = await get(e, "/readyz")
        async with serving(fixed(VIEW)) as e:
            draining = await get(e, "/readyz")
            alive = await get(e, "/healthz")
        assert (ready.status_code, ready.text) == (200, "ready\n")
        assert (draining.status_code, draining.text) == (503, "not ready: DRAINING\n")
        assert "retry-after" not in draining.headers
        assert alive.status_code == 200  # draining is not dead
        async with serving(fixed(dataclasses.replace(VIEW, state="STARTING",
                                                     eta_s=41.2))) as e:
            starting = await get(e, "/readyz")
        # a starting engine: when its past starts say it will serve
        assert (starting.status_code, starting.text) == (
            503, "not ready: STARTING, ready in about 42 s\n")
        assert starting.headers["retry-after"] == "42"

    run(main())


# ---- HTTP: methods, paths, garbage, limits -------------------------------------------

def test_head_answers_the_headers_without_a_body() -> None:
    async def main() -> None:
        async with serving(fixed(VIEW)) as e:
            r = await get(e, "/metrics", "HEAD")
            answer = await raw(e, b"HEAD /readyz HTTP/1.1\r\nHost: x\r\n\r\n")
        assert r.status_code == 200
        assert int(r.headers["content-length"]) > 0 and r.content == b""
        head, _, body = answer.partition(b"\r\n\r\n")
        assert status_of(answer) == 503 and body == b""
        assert b"Content-Length: 20" in head  # len("not ready: DRAINING\n")

    run(main())


@pytest.mark.parametrize("method", ["POST", "PUT", "DELETE", "OPTIONS", "PATCH"])
def test_other_methods_405_with_allow(method: str) -> None:
    async def main() -> None:
        async with serving(fixed(VIEW)) as e:
            r = await get(e, "/metrics", method)
        assert r.status_code == 405
        assert r.headers["allow"] == "GET, HEAD"
        assert r.headers["connection"] == "close"

    run(main())


def test_a_request_with_a_body_the_server_does_not_read_still_gets_its_answer() -> None:
    async def main() -> None:
        async with serving(fixed(VIEW)) as e:
            body = b"x" * 50_000
            answer = await raw(e, b"POST /metrics HTTP/1.1\r\nContent-Length: 50000\r\n\r\n"
                               + body)
        assert status_of(answer) == 405

    run(main())


@pytest.mark.parametrize("path", ["/", "/metrics/", "/health", "/metrics.txt", "/favicon.ico"])
def test_unknown_paths_404(path: str) -> None:
    async def main() -> None:
        async with serving(fixed(VIEW)) as e:
            r = await get(e, path)
        assert r.status_code == 404

    run(main())


def test_query_strings_absolute_targets_bare_lf_and_leading_empty_lines_are_accepted() -> None:
    async def main() -> None:
        async with serving(fixed(VIEW)) as e:
            assert (await get(e, "/healthz?verbose=1")).status_code == 200
            for request in (b"GET http://127.0.0.1/healthz HTTP/1.1\r\n\r\n",
                            b"GET /healthz HTTP/1.0\nHost: x\n\n",
                            b"\r\n\r\nGET /healthz HTTP/1.1\r\n\r\n"):
                assert status_of(await raw(e, request)) == 200, request

    run(main())


@pytest.mark.parametrize("request_head", [
    b"GARBAGE\r\n\r\n",
    b"GET /metrics\r\n\r\n",
    b"GET /metrics HTTP/2.0\r\n\r\n",
    b"GET  /metrics HTTP/1.1\r\n\r\n",
    b"GET metrics HTTP/1.1\r\n\r\n",
    b"G(T /metrics HTTP/1.1\r\n\r\n",
    b"\xff\xfe /x HTTP/1.1\r\n\r\n",
    b"GET /metrics HTTP/1.1\r\nno colon here\r\n\r\n",
    b"GET /metrics HTTP/1.1\r\nHost: x\r\n folded: continuation\r\n\r\n",
    b"GET /metrics HTTP/1.1\r\nBad Name: x\r\n\r\n",
    b"GET /metrics HTTP/1.1\r\nX: a\rb\r\n\r\n",
    b"GET /metrics HTTP/1.1\r\nX: \x00\r\n\r\n",
    b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03\n\n",
])
def test_malformed_requests_400(request_head: bytes) -> None:
    async def main() -> None:
        async with serving(fixed(VIEW)) as e:
            answer = await raw(e, request_head)
        assert status_of(answer) == 400, answer
        assert b"Connection: close\r\n" in answer

    run(main())


@pytest.mark.parametrize("request_head", [
    b"GET /metrics HTTP/1.1\r\nX-Big: " + b"a" * MAX_HEAD + b"\r\n\r\n",  # one long line
    b"GET /metrics HTTP/1.1\r\nX: " + b"a" * 20000 + b"\r\n\r\n",
    b"GET /metrics HTTP/1.1\r\n" + b"X-Many: aaaaaaaaaaaaaaaaaaaaaaaa\r\n" * 300 + b"\r\n",
    b"a" * (MAX_HEAD + 100),  # no line end at all
    b"GET /" + b"m" * (MAX_HEAD + 100) + b" HTTP/1.1\r\n\r\n",
])
def test_request_head_over_8_kib_431(request_head: bytes) -> None:
    async def main() -> None:
        async with serving(fixed(VIEW)) as e:
            answer = await raw(e, request_head)
        assert status_of(answer) == 431, answer[:100]

    run(main())


def test_request_head_of_exactly_8_kib_is_served() -> None:
    start = b"GET /healthz HTTP/1.1\r\nX-Pad: "
    pad = MAX_HEAD - len(start) - len(b"\r\n\r\n")
    request = start + b"a" * pad + b"\r\n\r\n"
    assert len(request) == MAX_HEAD

    async def main() -> None:
        async with serving(fixed(VIEW)) as e:
            assert status_of(await raw(e, request)) == 200
            assert status_of(await raw(e, request[:-4] + b"a\r\n\r\n")) == 431

    run(main())


@pytest.mark.parametrize("sent", [b"", b"GET /metr", b"GET /metrics HTTP/1.1\r\nHost: x\r\n"])
def test_a_client_that_does_not_send_its_head_in_time_is_closed_without_an_answer(
        sent: bytes) -> None:
    async def main() -> None:
        async with serving(fixed(VIEW), head_timeout_s=0.05) as e:
            reader, writer = await asyncio.open_connection("127.0.0.1", e.port)
            writer.write(sent)
            await writer.drain()
            assert await asyncio.wait_for(reader.read(), GUARD_S) == b""
            writer.close()

    run(main())


def test_a_silent_client_does_not_hold_up_the_others() -> None:
    async def main() -> None:
        async with serving(fixed(VIEW), head_timeout_s=GUARD_S * 10) as e:
            reader, writer = await asyncio.open_connection("127.0.0.1", e.port)
            assert (await get(e, "/healthz")).status_code == 200
        # close() ends the silent connection in flight
        assert await read_or_reset(reader) == b""
        writer.close()

    run(main())


def test_a_client_that_closes_before_its_head_ends_leaves_the_server_serving() -> None:
    async def main() -> None:
        async with serving(fixed(VIEW)) as e:
            reader, writer = await asyncio.open_connection("127.0.0.1", e.port)
            writer.write(b"GET /metrics HTTP/1.1\r\n")
            writer.write_eof()
            assert await asyncio.wait_for(reader.read(), GUARD_S) == b""
            writer.close()
            assert (await get(e, "/healthz")).status_code == 200

    run(main())


def test_connections_over_the_limit_get_503_and_slots_come_back() -> None:
    async def main() -> None:
        hanging = Hanging()
        async with serving(hanging, max_connections=2) as e:
            held = [asyncio.create_task(raw(e, b"GET /healthz HTTP/1.1\r\n\r\n"))
                    for _ in range(2)]
            await hanging.wait_calls(2)  # both are inside the server, waiting on the view
            refused = await raw(e, b"GET /healthz HTTP/1.1\r\n\r\n")
            assert status_of(refused) == 503
            assert refused.endswith(b"too many connections\n")
            assert hanging.calls == 2  # the refused one never asked for a view
            hanging.release.set()
            for answer in await asyncio.gather(*held):
                assert status_of(answer) == 200
            # once the held connections are closed, a new one is served
            for _ in range(int(GUARD_S / 0.01)):
                if status_of(await raw(e, b"GET /healthz HTTP/1.1\r\n\r\n")) == 200:
                    break
                await asyncio.sleep(0.01)
            else:
                pytest.fail("no connection was served after the held ones closed")

    run(main())


def test_a_flood_past_twice_the_limit_is_reset_without_an_answer() -> None:
    async def main() -> None:
        hanging = Hanging()
        async with serving(hanging, max_connections=1, linger_s=GUARD_S) as e:
            held = asyncio.create_task(raw(e, b"GET /healthz HTTP/1.1\r\n\r\n"))
            await hanging.wait_calls(1)
            # the second is refused with 503 and lingers open (it never closes its side)
            r2, w2 = await asyncio.open_connection("127.0.0.1", e.port)
            assert (await asyncio.wait_for(r2.read(), GUARD_S)).startswith(b"HTTP/1.1 503")
            # the third finds two open: reset, no answer
            r3, w3 = await asyncio.open_connection("127.0.0.1", e.port)
            assert await read_or_reset(r3) == b""
            for w in (w2, w3):
                w.close()
            hanging.release.set()
            assert status_of(await held) == 200

    run(main())


def test_close_ends_connections_in_flight_and_stops_listening() -> None:
    async def main() -> None:
        hanging = Hanging()
        e = Exporter("127.0.0.1:0", hanging)
        await e.start()
        port = e.port
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"GET /healthz HTTP/1.1\r\n\r\n")
        await hanging.wait_calls(1)
        await asyncio.wait_for(e.close(), GUARD_S)
        assert await read_or_reset(reader) == b""
        writer.close()
        with pytest.raises(OSError):
            await asyncio.open_connection("127.0.0.1", port)

    run(main())


# ---- binding and the listen address --------------------------------------------------

def test_bind_failure_raises_exporter_error_naming_the_address() -> None:
    async def main() -> None:
        with socket.socket() as taken:
            taken.bind(("127.0.0.1", 0))
            taken.listen()
            listen = f"127.0.0.1:{taken.getsockname()[1]}"
            with pytest.raises(ExporterError, match=f"cannot listen on {listen}"):
                await Exporter(listen, fixed(VIEW)).start()

    run(main())


def test_a_bad_listen_address_raises_exporter_error_naming_it() -> None:
    async def main() -> None:
        with pytest.raises(ExporterError, match="nowhere:99999"):
            await Exporter("nowhere:99999", fixed(VIEW)).start()

    run(main())


def test_port_0_binds_one_port_and_reports_it() -> None:
    async def main() -> None:
        e = Exporter("localhost:0", fixed(VIEW))
        with pytest.raises(RuntimeError):
            _ = e.port
        await e.start()
        try:
            assert e.port > 0
            async with httpx.AsyncClient(timeout=GUARD_S) as client:
                r = await client.get(f"http://localhost:{e.port}/healthz")
            assert r.status_code == 200
        finally:
            await e.close()

    run(main())


@pytest.mark.parametrize(("listen", "expected"), [
    ("127.0.0.1:9400", ("127.0.0.1", 9400)),
    ("[::1]:9400", ("::1", 9400)),
    ("[::1]:0", ("::1", 0)),
    ("[::]:80", ("::", 80)),
    ("localhost:0", ("localhost", 0)),
    ("0.0.0.0:65535", ("0.0.0.0", 65535)),
    ("metrics-host.example:9402", ("metrics-host.example", 9402)),
])
def test_parse_listen_accepts(listen: str, expected: tuple[str, int]) -> None:
    assert parse_listen(listen) == expected


@pytest.mark.parametrize(("listen", "says"), [
    ("", "expected HOST:PORT"),
    ("9400", "expected HOST:PORT"),
    (":9400", "expected HOST:PORT"),
    ("127.0.0.1", "expected HOST:PORT"),
    ("127.0.0.1:", "expected HOST:PORT"),
    ("127.0.0.1:http", "expected HOST:PORT"),
    ("127.0.0.1:-1", "expected HOST:PORT"),
    ("127.0.0.1:\uff19\uff14", "expected HOST:PORT"),  # full-width digits
    (" 127.0.0.1:9400", "expected HOST:PORT"),
    ("127.0.0.1:65536", "out of range"),
    ("host:99999", "out of range"),
    ("::1:9400", "needs brackets"),
    ("[::1]", "expected HOST:PORT"),
    ("[::1:9400", "expected HOST:PORT"),
    ("[localhost]:9400", "not an IPv6 address"),
    ("http://127.0.0.1:9400", "expected HOST:PORT"),
])
def test_parse_listen_rejects_with_a_clear_message(listen: str, says: str) -> None:
    with pytest.raises(ValueError, match=says) as info:
        parse_listen(listen)
    assert repr(listen) in str(info.value)


# ---- the pure request-head parser ----------------------------------------------------

def test_parse_request_head_gives_method_and_path_without_query() -> None:
    assert parse_request_head([b"GET /metrics?x=1 HTTP/1.1", b"Host: a:1",
                               b"Accept:*/*"]) == ("GET", "/metrics")
    assert parse_request_head([b"HEAD http://h:9/readyz HTTP/1.0"]) == ("HEAD", "/readyz")
    assert parse_request_head([b"GET http://h HTTP/1.1"]) == ("GET", "/")
    assert parse_request_head([b"BREW /healthz HTTP/1.1"]) == ("BREW", "/healthz")


@pytest.mark.parametrize("lines", [[], [b"GET / HTTP/1.1", b""], [b"GET / HTTP/1.1 extra"]])
def test_parse_request_head_rejects(lines: list[bytes]) -> None:
    with pytest.raises(ValueError):
        parse_request_head(lines)
