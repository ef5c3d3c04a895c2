"""Which engine a request goes to (supervisor/front/routing.py), as pure decisions, and the
proxy's use of them (where a request may go, and with which body), without a socket."""

from __future__ import annotations

import asyncio
import json

import pytest

from supervisor.front.admission import Gate, GateLimits, Rejected
from supervisor.front.dispatch import Backend, Choice, acquire_any, choices, read_request
from supervisor.front.exchange import ProxySettings
from supervisor.front.proxy import FrontProxy
from supervisor.front.routing import BackendView, Route, UnknownModel, route, served_models
from tests.harness import until


def e(name: str, *models: str, serving: bool = True, outstanding: int = 0,
      fallback: str | None = None) -> BackendView:
    return BackendView(name, models, serving, outstanding, fallback)


def test_a_model_goes_to_the_engine_that_serves_it() -> None:
    engines = [e("big", "llama-70b"), e("small", "llama-8b")]
    assert route("llama-8b", engines) == Route("small", "llama-8b")
    assert route("llama-70b", engines) == Route("big", "llama-70b")


def test_an_unknown_model_is_refused_with_the_models_there_are() -> None:
    engines = [e("big", "llama-70b", "llama"), e("small", "llama-8b", "llama")]
    with pytest.raises(UnknownModel) as exc:
        route("gpt-4", engines)
    assert exc.value.models == ("llama-70b", "llama", "llama-8b")
    assert "gpt-4" in str(exc.value) and "llama-8b" in str(exc.value)
    with pytest.raises(UnknownModel):
        route(["not", "a", "name"], engines)
    # a model served only by a down engine is still known: held, not refused
    assert route("llama-70b", [e("big", "llama-70b", serving=False)]) == \
        Route(None, "llama-70b")


def test_replicas_share_by_fewest_outstanding_and_the_first_on_a_tie() -> None:
    engines = [e("gpu0", "m", outstanding=5), e("gpu1", "m", outstanding=2),
               e("gpu2", "m", outstanding=2)]
    assert route("m", engines).engine == "gpu1"
    engines[1] = e("gpu1", "m", serving=False)
    assert route("m", engines).engine == "gpu2"


def test_a_request_is_held_only_while_no_engine_of_its_model_serves() -> None:
    engines = [e("gpu0", "m", serving=False), e("gpu1", "m", outstanding=100)]
    assert route("m", engines) == Route("gpu1", "m")  # a busy replica beats holding
    engines[1] = e("gpu1", "m", serving=False)
    assert route("m", engines) == Route(None, "m")


def test_a_down_engine_sends_its_models_to_its_fallback_under_the_fallbacks_name() -> None:
    engines = [e("big", "llama-70b", serving=False, fallback="small"),
               e("small", "llama-8b", "llama-8b-alias")]
    assert route("llama-70b", engines) == Route("small", "llama-8b", substituted=True)
    # the fallback's own traffic is its own
    assert route("llama-8b", engines) == Route("small", "llama-8b")


def test_no_fallback_while_the_primary_serves_or_when_the_fallback_is_down_too() -> None:
    up = [e("big", "m", fallback="small"), e("small", "s")]
    assert route("m", up) == Route("big", "m")
    both_down = [e("big", "m", serving=False, fallback="small"),
                 e("small", "s", serving=False)]
    assert route("m", both_down) == Route(None, "m")
    dangling = [e("big", "m", serving=False, fallback="gone")]
    assert route("m", dangling) == Route(None, "m")


def test_served_models_each_once_in_config_order() -> None:
    assert served_models([e("a", "x", "y"), e("b", "y", "z")]) == ["x", "y", "z"]


# ---- the proxy's use of it: where a request may go, with which body --------------------

def _proxy(*backends: tuple[str, tuple[str, ...], bool, str | None]) -> FrontProxy:
    proxy = FrontProxy(ProxySettings("127.0.0.1", 0, "http://127.0.0.1:1"))
    for name, models, serving, fallback in backends:
        gate = Gate(GateLimits())
        proxy.add_engine(Backend(name, gate, lambda s=serving: s, f"http://{name}", models,
                                 not models, fallback))
    return proxy


def _where(proxy: FrontProxy, model: object) -> list[tuple[str, object]]:
    body = json.dumps({"model": model, "prompt": "hi"}).encode()
    return [(c.backend.name, json.loads(c.body)["model"])
            for c in choices(proxy.backends, read_request(body), body)]


def test_one_engine_built_with_a_gate_and_no_names_takes_any_model() -> None:
    proxy = FrontProxy(ProxySettings("127.0.0.1", 0, "http://127.0.0.1:1"), Gate(GateLimits()))
    assert _where(proxy, "whatever") == [("default", "whatever")]


def test_the_proxy_sends_a_down_engines_model_to_its_fallback_under_its_name() -> None:
    proxy = _proxy(("big", ("llama-70b",), False, "small"), ("small", ("llama-8b",), True, None))
    assert _where(proxy, "llama-70b") == [("small", "llama-8b")]
    assert _where(proxy, "llama-8b") == [("small", "llama-8b")]


def test_a_held_request_may_go_to_any_engine_of_its_model_or_their_fallbacks() -> None:
    proxy = _proxy(("r1", ("m",), False, "fb"), ("r2", ("m",), False, None),
                   ("fb", ("small",), False, None))
    assert _where(proxy, "m") == [("r1", "m"), ("r2", "m"), ("fb", "small")]


def test_the_proxy_refuses_an_unknown_model_naming_the_models() -> None:
    proxy = _proxy(("a", ("m",), True, None), ("b", ("n",), True, None))
    with pytest.raises(UnknownModel, match="models: m, n"):
        _where(proxy, "x")


def _gates(n: int) -> list[Choice]:
    out = []
    for i in range(n):
        gate = Gate(GateLimits(max_wait_s=5))
        out.append(Choice(Backend(f"e{i}", gate, lambda: True, "http://x", ("m",)), b"", None))
    return out


def test_a_held_request_takes_the_first_gate_to_open_and_leaves_the_others_queues() -> None:
    async def main() -> None:
        cs = _gates(2)
        task = asyncio.ensure_future(acquire_any(cs, 10))
        await until(lambda: [c.backend.gate.waiting for c in cs] == [1, 1],
                    what="the request to wait at both gates")
        cs[1].backend.gate.release()
        choice, ticket = await task
        assert choice is cs[1] and ticket.held
        await until(lambda: [c.backend.gate.waiting for c in cs] == [0, 0],
                    what="its wait at the other gate cancelled")
        assert [c.backend.gate.in_flight for c in cs] == [0, 1]

    asyncio.run(main())


def test_slots_granted_to_a_request_that_went_elsewhere_or_away_are_given_back() -> None:
    async def main() -> None:
        cs = _gates(2)
        for c in cs:
            c.backend.gate.release()
        choice, _ = await acquire_any(cs, 10)  # both admit at once: one is kept
        await until(lambda: sum(c.backend.gate.in_flight for c in cs) == 1,
                    what="the slot it did not keep given back")
        assert choice.backend.gate.in_flight == 1
        held = _gates(2)
        task = asyncio.ensure_future(acquire_any(held, 10))
        await until(lambda: [c.backend.gate.waiting for c in held] == [1, 1],
                    what="the request to wait at both gates")
        task.cancel()  # the client went away while held
        with pytest.raises(asyncio.CancelledError):
            await task
        for c in held:
            c.backend.gate.release()
        # (a wait not yet cancelled when its gate opens is granted, then gives it back)
        await until(lambda: [(c.backend.gate.in_flight, c.backend.gate.waiting)
                             for c in held] == [(0, 0), (0, 0)],
                    what="no slot or wait left for the request that went away")

    asyncio.run(main())


def test_a_request_every_gate_refuses_gets_the_first_refusal() -> None:
    async def main() -> None:
        cs = _gates(2)
        for c in cs:
            c.backend.gate.close("the engine is FATAL")
        with pytest.raises(Rejected, match="FATAL"):
            await acquire_any(cs, 10)

    asyncio.run(main())
