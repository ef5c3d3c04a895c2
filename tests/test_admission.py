"""The admission gate on its own: order, limits, throttle levels, the KV breaker, holds,
timeouts and a full queue. Real asyncio, no HTTP."""

from __future__ import annotations

import asyncio

import pytest

from supervisor.front.admission import Gate, GateLimits, Rejected
from supervisor.front.dispatch import (
    UNKNOWN_MODEL_LEN,
    Backend,
    Choice,
    acquire_any,
    model_len_of,
)


def run(coro):  # type: ignore[no-untyped-def]
    return asyncio.run(coro)


def gate(**limits: object) -> Gate:
    g = Gate(GateLimits(**limits))  # type: ignore[arg-type]
    g.release()
    return g


async def queued(g: Gate, n: int) -> None:
    """Until `n` requests wait at the gate (each new task has run to its wait): a
    condition, not a sleep that stands in for one; bounded."""
    for _ in range(1000):
        if g.waiting == n:
            return
        await asyncio.sleep(0)
    raise AssertionError(f"{g.waiting} requests waiting at the gate, not {n}")

def test_held_requests_go_in_arrival_order_when_released():
    async def go() -> list[int]:
        g = Gate(GateLimits(concurrency=10))  # held until released
        order: list[int] = []

        async def req(i: int) -> None:
            t = await g.acquire(1)
            order.append(i)
            assert t.held
            g.done(t)

        tasks = [asyncio.create_task(req(i)) for i in range(5)]
        await queued(g, 5)
        assert g.waiting == 5 and order == []
        g.release()
        await asyncio.gather(*tasks)
        return order

    assert run(go()) == [0, 1, 2, 3, 4]


def test_concurrency_limit_scales_with_the_throttle_level():
    g = gate(concurrency=8, level_factors=(0.5, 0.25))
    assert g.concurrency_limit == 8
    g.set_level(1)
    assert g.concurrency_limit == 4
    g.set_level(2)
    assert g.concurrency_limit == 2
    g.set_level(9)
    assert g.level == 2  # clamped to the top level


def test_a_slot_freed_admits_the_next_waiter():
    async def go() -> None:
        g = gate(concurrency=1)
        first = await g.acquire(1)
        waiter = asyncio.create_task(g.acquire(1))
        await queued(g, 1)
        assert not waiter.done() and g.waiting == 1
        g.done(first)
        second = await waiter
        assert g.in_flight == 1 and second.waited_s >= 0
        g.done(second)
        assert g.in_flight == 0

    run(go())


def test_token_budget_but_one_large_request_alone_always_fits():
    async def go() -> None:
        g = gate(concurrency=10, tokens=100)
        big = await g.acquire(500)  # alone: admitted
        blocked = asyncio.create_task(g.acquire(10))
        await queued(g, 1)
        assert not blocked.done()
        g.done(big)
        g.done(await blocked)

    run(go())


def test_a_request_over_the_whole_token_budget_counts_as_the_budget_not_more():
    """It runs alone, and holds the whole budget while it runs, not its own estimate:
    a budget raised meanwhile (a reload) admits others beside it at once."""
    async def go() -> None:
        g = gate(concurrency=10, tokens=100)
        huge = await g.acquire(10**12)
        assert huge.tokens == 100 and g.tokens_in_flight == 100
        g.set_limits(GateLimits(concurrency=10, tokens=1000))
        small = await asyncio.wait_for(g.acquire(10), 5)
        g.done(huge)
        g.done(small)
        assert g.tokens_in_flight == 0 and g.in_flight == 0

    run(go())


def test_an_estimate_is_bounded_by_the_engines_max_model_len_once_known():
    """vLLM answers at once (400) a request whose max_tokens runs past max_model_len:
    such a request holds no more of the budget than one sequence, and a request that
    asks 10**12 tokens goes beside the others instead of waiting for a drain, the
    others behind it with it."""
    async def go() -> None:
        b = Backend("e", gate(concurrency=10, tokens=1000), lambda: True,
                    "http://127.0.0.1:1")
        choice = Choice(b, b"{}", None)
        first = await b.gate.acquire(b.budget(100))
        assert b.budget(10**12) == UNKNOWN_MODEL_LEN  # unknown yet: a documented bound
        assert b.budget(900) == 900
        b.max_model_len = 512
        _, huge = await asyncio.wait_for(acquire_any([choice], 10**12), 5)
        _, behind = await asyncio.wait_for(acquire_any([choice], 50), 5)
        assert (huge.tokens, behind.tokens, b.gate.tokens_in_flight) == (512, 50, 662)
        for t in (first, huge, behind):
            b.gate.done(t)

    run(go())


def test_an_estimate_is_bounded_where_the_engine_never_says_its_max_model_len():
    """Issue 50, point 6: an engine that does not report max_model_len; a request asking
    10**12 tokens counted as the whole budget ran alone, and a request behind it waited
    as long as it ran. Bounded by UNKNOWN_MODEL_LEN, the one behind goes beside it."""
    async def go() -> None:
        b = Backend("e", gate(concurrency=10, tokens=UNKNOWN_MODEL_LEN + 1000),
                    lambda: True, "http://127.0.0.1:1")
        choice = Choice(b, b"{}", None)
        _, huge = await asyncio.wait_for(acquire_any([choice], 10**12), 5)
        _, behind = await asyncio.wait_for(acquire_any([choice], 50), 5)
        assert (huge.tokens, behind.tokens) == (UNKNOWN_MODEL_LEN, 50)
        assert (b.gate.in_flight, b.gate.tokens_in_flight) == (2, UNKNOWN_MODEL_LEN + 50)
        for t in (huge, behind):
            b.gate.done(t)

    run(go())


def test_max_model_len_is_read_from_the_engines_model_list():
    vllm = {"object": "list", "data": [
        {"id": "base", "object": "model", "max_model_len": 4096},
        {"id": "lora", "object": "model", "parent": "base", "max_model_len": 4096}]}
    assert model_len_of(vllm) == 4096
    assert model_len_of({"data": [{"id": "m"}]}) is None  # an engine that does not say
    assert model_len_of({"data": [{"max_model_len": True}, {"max_model_len": "9"}]}) is None
    assert model_len_of([]) is None and model_len_of({"data": 3}) is None


def test_kv_breaker_opens_at_high_and_closes_below_low():
    async def go() -> None:
        g = gate(kv_high=0.88, kv_low=0.80)
        g.set_kv_usage(0.9)
        assert g.breaker_open
        waiter = asyncio.create_task(g.acquire(1))
        await queued(g, 1)
        g.set_kv_usage(0.85)  # between the marks: still open
        assert not waiter.done()
        g.set_kv_usage(None)  # unknown changes nothing
        assert g.breaker_open
        g.set_kv_usage(0.79)
        g.done(await waiter)
        assert not g.breaker_open

    run(go())


def test_timeout_and_full_queue_reject_with_a_reason_and_free_their_place():
    async def go() -> None:
        g = Gate(GateLimits(max_wait_s=0.05, queue_max=1))
        g.hold("restart in progress")
        with pytest.raises(Rejected) as e:
            await g.acquire(1)
        assert e.value.reason == "hold_timeout" and "restart in progress" in str(e.value)
        assert g.waiting == 0  # the timed-out waiter left the queue
        waiter = asyncio.create_task(g.acquire(1))
        await queued(g, 1)
        with pytest.raises(Rejected) as e:
            await g.acquire(1)
        assert e.value.reason == "queue_full"
        with pytest.raises(Rejected):
            await waiter

    run(go())


def test_close_fails_waiters_and_new_requests_at_once():
    async def go() -> None:
        g = Gate(GateLimits(max_wait_s=60))
        waiter = asyncio.create_task(g.acquire(1))
        await queued(g, 1)
        g.close("the engine is FATAL")
        with pytest.raises(Rejected) as e:
            await waiter
        assert e.value.reason == "engine_down"
        with pytest.raises(Rejected):
            await g.acquire(1)
        g.release()
        g.done(await g.acquire(1))

    run(go())


def test_a_cancelled_waiter_leaves_the_queue():
    async def go() -> None:
        g = Gate(GateLimits(max_wait_s=60))
        waiter = asyncio.create_task(g.acquire(1))
        await queued(g, 1)
        waiter.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiter
        assert g.waiting == 0 and g.in_flight == 0

    run(go())


def test_wait_idle_returns_when_the_last_request_is_done_or_times_out():
    async def go() -> tuple[bool, bool, bool]:
        g = gate()
        assert await g.wait_idle(0.01)  # nothing in flight
        t = await g.acquire(1)
        timed_out = await g.wait_idle(0.02)
        waiter = asyncio.create_task(g.wait_idle(5))
        await asyncio.sleep(0)  # (the task reaches its wait in one step)
        g.done(t)
        return True, timed_out, await waiter

    assert run(go()) == (True, False, True)


def test_a_refusable_waiter_goes_elsewhere_once_the_engine_turns_unhealthy():
    """In a fleet a request no engine has died with waits for a busy engine, but not
    for a cold start: when the engine turns unhealthy it is refused (for the router to
    send elsewhere), while a stream's continuation (not refusable) keeps waiting."""
    async def main() -> None:
        g = Gate(GateLimits(concurrency=1, max_wait_s=30))
        g.release()
        g.unhealthy = None
        first = await g.acquire(1)  # the engine's one slot
        refusable = asyncio.ensure_future(g.acquire(1, refusable=True))
        kept = asyncio.ensure_future(g.acquire(1))
        await queued(g, 2)
        assert g.waiting == 2 and not refusable.done()
        g.hold("the engine is BACKOFF: crashed")
        g.unhealthy = "the engine is BACKOFF: crashed"
        with pytest.raises(Rejected) as e:
            await refusable
        assert e.value.reason == "engine_unavailable" and "try another" in str(e.value)
        assert g.waiting == 1 and not kept.done()
        with pytest.raises(Rejected):  # and a new one is refused at once
            await g.acquire(1, refusable=True)
        g.done(first)
        g.unhealthy = None
        g.release()
        g.done(await kept)

    asyncio.run(main())


def test_continuations_wait_ahead_of_new_requests_the_nearest_done_first():
    """After a failover the continued streams go before the requests held meanwhile, the
    one with the fewest tokens still to come first, ties in arrival order (issue 51)."""
    async def go() -> list[str]:
        g = Gate(GateLimits(concurrency=1))  # held until released
        order: list[str] = []

        async def req(name: str, to_go: int | None) -> None:
            t = await g.acquire(1, to_go=to_go)
            order.append(name)
            await asyncio.sleep(0)
            g.done(t)

        tasks = []
        for name, to_go in (("new1", None), ("cont200", 200), ("new2", None),
                            ("cont10", 10), ("cont200b", 200), ("cont0", 0)):
            tasks.append(asyncio.create_task(req(name, to_go)))
            await asyncio.sleep(0)
        assert g.waiting == 6
        g.release()
        await asyncio.gather(*tasks)
        return order

    assert run(go()) == ["cont0", "cont10", "cont200", "cont200b", "new1", "new2"]


def test_a_continuation_is_admitted_at_once_past_new_requests_that_wait():
    async def go() -> None:
        g = gate(concurrency=2, tokens=100)
        big = await g.acquire(90)
        waiting = asyncio.ensure_future(g.acquire(50))  # does not fit beside `big`
        await asyncio.sleep(0)
        assert g.waiting == 1
        # a new request that would fit still waits behind it (in order) ...
        assert g.admit_now(5) is None
        # ... a continuation goes now: it waits behind no new request
        cont = g.admit_now(5, to_go=3)
        assert cont is not None and g.in_flight == 2 and g.waiting == 1
        g.done(cont)
        g.done(big)
        g.done(await asyncio.wait_for(waiting, 5))

    run(go())


class Ticking:
    """A clock the test moves (the gate's `clock`)."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


async def saturated(max_wait_s: float) -> tuple[Ticking, Gate, list, list]:
    """A gate of one slot, taken, with 40 requests of 100 tokens waiting behind it: its
    clock, the gate, the tickets at the engine, the waiters' tasks."""
    clock = Ticking()
    g = Gate(GateLimits(concurrency=1, max_wait_s=max_wait_s), clock=clock)
    g.release()
    tickets = [g.admit_now(100)]
    tasks = [asyncio.create_task(g.acquire(100)) for _ in range(40)]
    await queued(g, 40)
    return clock, g, tickets, tasks


async def pace(clock: Ticking, g: Gate, tickets: list, tasks: list) -> None:
    """10 requests of 100 tokens end over 30 s (33 tokens/s), each admitting the next."""
    for _ in range(10):
        clock.now += 3.0
        g.done(tickets.pop())
        tickets.append(await tasks.pop(0))


def test_a_new_request_that_would_wait_past_the_hold_timeout_is_refused_at_once():
    """Issue 51: behind a thin standby, a queue it cannot serve within the hold timeout
    refuses a newcomer at once (503 over_capacity) instead of after the whole wait; a
    continued stream still waits ahead of it, never refused so."""
    async def go() -> None:
        clock, g, tickets, tasks = await saturated(max_wait_s=60.0)
        await pace(clock, g, tickets, tasks)
        assert g.waiting == 30
        guess = g.predicted_wait(100)
        assert guess is not None and guess[0] == pytest.approx(3100 / (1000 / 30))
        with pytest.raises(Rejected) as e:
            await g.acquire(100)
        assert e.value.reason == "over_capacity" and "93 s" in str(e.value)
        assert g.waiting == 30  # (it took no place)
        cont = asyncio.create_task(g.acquire(100, to_go=5))
        await queued(g, 31)
        assert not cont.done()  # a continuation waits (first), refused only by its timeout
        for t in [*tasks, cont]:
            t.cancel()
        await asyncio.gather(*tasks, cont, return_exceptions=True)

    run(go())


def test_no_refusal_before_the_pace_is_known_and_a_hold_measures_it_again():
    """A burst's first seconds (or an engine that ended too few requests) predict
    nothing: requests wait as before. After a hold (a handover: another engine may serve
    now) the pace is measured afresh."""
    async def go() -> None:
        clock, g, tickets, tasks = await saturated(max_wait_s=10.0)
        clock.now += 29.0  # waiting, but not a whole window yet: no guess
        assert g.predicted_wait(100) is None
        clock.now += 2.0  # a whole window, but nothing ended in it: no pace, no guess
        assert g.predicted_wait(100) is None
        await pace(clock, g, tickets, tasks)
        assert g.predicted_wait(100) is not None
        g.hold("a handover")
        g.release()  # (the one slot is taken: they all wait on)
        assert g.waiting == 30 and g.predicted_wait(100) is None
        late = asyncio.create_task(g.acquire(100))
        await queued(g, 31)
        assert not late.done()  # it waits: nothing measured yet after the hold
        for t in [*tasks, late]:
            t.cancel()
        await asyncio.gather(*tasks, late, return_exceptions=True)

    run(go())
