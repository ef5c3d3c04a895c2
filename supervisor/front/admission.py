"""Admission control in front of the engine: the live throttle, the hold, the KV breaker.

vLLM cannot change its batch limits at run time, so the daemon limits what reaches it:
at most `concurrency` requests and `tokens` estimated tokens in flight (both scaled down
by the throttle level), none while the gate is held (a drain, a restart, an engine not
serving), and none while the KV circuit breaker is open (usage at or above its high mark,
until it falls below the low mark). Requests that cannot go now wait in one bounded
queue, each for at most `max_wait_s`; a full queue or a wait past its deadline is a
rejection with a reason, which the proxy turns into 503 with Retry-After.

The queue is in arrival order, except for continuations (a stream that an engine's fault
or a drain cut, going on elsewhere): they wait ahead of every new request, the one with
the fewest tokens still to come first. After a failover every continued stream is sent
again with its prompt and what it has, into an empty prefix cache; new requests held
meanwhile would otherwise share that prefill and stretch every stream's gap (issue 51).

A new request that would wait past `max_wait_s` anyway is refused at once
(`over_capacity`), not after the whole wait: once requests have waited without a break
for RATE_WINDOW_S, the gate predicts a newcomer's wait from the tokens waiting ahead of it
and the tokens of the requests that ended in that window (the engine's measured pace
while saturated). A hold (a handover, a KV reset) begins the measure again: what serves
after it may be another engine. Continued streams are never refused so.

Owned by the event loop's thread: every method is synchronous except `acquire`, and none
blocks. The daemon's state-owning task calls hold/release/set_level/set_kv_usage; the
proxy's request handlers call acquire and done.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

# the pace a new request's wait is predicted from: requests must have waited this long
# without a break, and at least RATE_MIN_DONE ended in it (an idle engine's slow pace, or
# a burst's first seconds, predict nothing)
RATE_WINDOW_S = 30.0
RATE_MIN_DONE = 8


class Rejected(Exception):
    """The request cannot be admitted; `reason` is a label for metrics and the 503 body."""

    def __init__(self, reason: str, detail: str, *, waited_s: float = 0.0,
                 held: bool = False) -> None:
        super().__init__(detail)
        self.reason = reason
        self.waited_s = waited_s  # how long it waited before the refusal
        self.held = held  # it waited for a hold to end (a drain or restart)


@dataclass
class Ticket:
    tokens: int
    waited_s: float
    held: bool  # it waited for a hold to end (a drain or restart), not only for a slot


@dataclass
class _Waiter:
    tokens: int
    future: asyncio.Future[None]
    since: float
    held: bool = False
    refusable: bool = False  # sent elsewhere (503) once the engine is unhealthy (a fleet)
    to_go: int | None = None  # a continuation: the tokens still to come (None: new)


def _before(to_go: int | None, other: _Waiter) -> bool:
    """Whether a request arriving now with `to_go` goes before `other`, already waiting:
    a continuation before every new request, the one with fewer tokens to come first."""
    return to_go is not None and (other.to_go is None or to_go < other.to_go)


@dataclass
class GateLimits:
    concurrency: int = 256
    tokens: int = 0  # 0: no limit on tokens in flight
    level_factors: tuple[float, ...] = (0.75, 0.5, 0.25)
    queue_max: int = 1024
    max_wait_s: float = 300.0
    kv_high: float = 0.88
    kv_low: float = 0.80


@dataclass
class Gate:
    limits: GateLimits = field(default_factory=GateLimits)
    clock: Callable[[], float] = time.monotonic

    def __post_init__(self) -> None:
        self.level = 0
        self.held_reason: str | None = "engine not started"  # held until the daemon opens it
        self.closed_reason: str | None = None  # refusing at once: no engine will come
        # why a router should send this engine's requests elsewhere (`unhealthy`)
        self._unhealthy: str | None = "engine not started"
        self.breaker_open = False
        # while its engine starts: when it is expected to serve (monotonic; its unit
        # learns it from the past starts), for a refusal's Retry-After; None: unknown
        self.ready_at: float | None = None
        self.in_flight = 0
        self.tokens_in_flight = 0
        self._waiters: deque[_Waiter] = deque()
        self._idle = asyncio.Event()  # set while nothing is in flight
        self._idle.set()
        # the pace while requests wait (`predicted_wait`): since when they have waited
        # without a break, and the (time, tokens) of the requests ended since then
        self._waiting_since: float | None = None
        self._ended: deque[tuple[float, int]] = deque()

    # ---- the daemon's side ----------------------------------------------------------

    @property
    def unhealthy(self) -> str | None:
        """Why a router should send this engine's requests elsewhere (None: it serves, or
        will within a short wait: a handover, a KV reset); docs/fleet.md."""
        return self._unhealthy

    @unhealthy.setter
    def unhealthy(self, why: str | None) -> None:
        """Set by the daemon; waiters that may go elsewhere (in a fleet) go now."""
        self._unhealthy = why
        if why is None or not any(w.refusable for w in self._waiters):
            return
        for w in [w for w in self._waiters if w.refusable]:
            self._waiters.remove(w)
            if not w.future.done():
                w.future.set_exception(_unavailable(why, self.clock() - w.since, w.held))
        self._wake()  # (one of them may have been the head)

    def hold(self, reason: str) -> None:
        """New requests wait (in order) instead of going to the engine."""
        self.held_reason = reason
        self.closed_reason = None
        self._measure_again()

    def release(self) -> None:
        """Let waiting requests go, in arrival order, as limits allow."""
        self.held_reason = None
        self.closed_reason = None
        self._measure_again()
        self._wake()

    def _measure_again(self) -> None:
        """The pace measured so far says nothing of what serves next (`predicted_wait`)."""
        self._waiting_since = self.clock() if self._waiters else None
        self._ended.clear()

    def close(self, reason: str) -> None:
        """No engine is coming (FATAL, stopping): waiting and new requests fail at once."""
        self.closed_reason = reason
        self.held_reason = reason
        self.reject_all("engine_down", reason)

    def set_level(self, level: int) -> None:
        self.level = max(0, min(level, len(self.limits.level_factors)))
        self._wake()

    def set_limits(self, limits: GateLimits) -> None:
        """New limits from a reloaded config, in force at once: waiters that now fit go
        (those already waiting keep the wait they began with); the level is kept, within
        the new factors."""
        self.limits = limits
        self.set_level(self.level)

    def set_kv_usage(self, usage: float | None) -> None:
        if usage is None:
            return  # unknown: the breaker stays as it is
        if not self.breaker_open and usage >= self.limits.kv_high:
            self.breaker_open = True
        elif self.breaker_open and usage < self.limits.kv_low:
            self.breaker_open = False
            self._wake()

    def reject_all(self, reason: str, detail: str) -> int:
        """Fail every waiter now (the engine is gone for good, the daemon stops)."""
        n = 0
        while self._waiters:
            w = self._waiters.popleft()
            if not w.future.done():
                w.future.set_exception(Rejected(reason, detail))
                n += 1
        self._measure_again()
        return n

    # ---- limits ---------------------------------------------------------------------

    @property
    def factor(self) -> float:
        return 1.0 if self.level == 0 else self.limits.level_factors[self.level - 1]

    @property
    def concurrency_limit(self) -> int:
        return max(1, int(self.limits.concurrency * self.factor))

    @property
    def token_limit(self) -> int:
        return 0 if not self.limits.tokens else max(1, int(self.limits.tokens * self.factor))

    @property
    def waiting(self) -> int:
        return len(self._waiters)

    def _fits(self, tokens: int) -> bool:
        if self.held_reason is not None or self.breaker_open:
            return False
        if self.in_flight >= self.concurrency_limit:
            return False
        # one request alone always fits: a request larger than the budget is not starved
        limit = self.token_limit
        return not limit or self.in_flight == 0 or self.tokens_in_flight + tokens <= limit

    def _admit(self, tokens: int) -> None:
        self.in_flight += 1
        self.tokens_in_flight += tokens
        self._idle.clear()

    def _wake(self) -> None:
        while self._waiters:
            w = self._waiters[0]
            if w.future.done():  # timed out or cancelled meanwhile
                self._waiters.popleft()
                continue
            if not self._fits(w.tokens):
                return  # in order: nobody overtakes the head
            self._waiters.popleft()
            self._admit(w.tokens)
            w.future.set_result(None)
        self._measure_again()  # (nobody waits: the pace is measured afresh)

    def _forget_ended(self, now: float) -> None:
        """The requests that ended before the window are no part of the pace."""
        while self._ended and self._ended[0][0] < now - RATE_WINDOW_S:
            self._ended.popleft()

    def predicted_wait(self, tokens: int) -> tuple[float, float] | None:
        """How long a new request of `tokens` arriving now would wait, and the pace that
        says so (tokens a second), once requests have waited RATE_WINDOW_S without a
        break and at least RATE_MIN_DONE ended in that window; None before. The tokens
        are the gate's estimates, those waiting ahead and those that ended alike."""
        now = self.clock()
        if self._waiting_since is None or now - self._waiting_since < RATE_WINDOW_S:
            return None
        self._forget_ended(now)
        if len(self._ended) < RATE_MIN_DONE:
            return None
        pace = sum(t for _, t in self._ended) / RATE_WINDOW_S
        ahead = sum(w.tokens for w in self._waiters if not w.future.done())
        return (ahead + tokens) / pace, pace

    # ---- the proxy's side -----------------------------------------------------------

    def admit_now(self, tokens: int, refusable: bool = False,
                  to_go: int | None = None) -> Ticket | None:
        """`acquire` when it need not wait: a slot now, a Rejected raised, or None (the
        request would wait)."""
        if self.closed_reason is not None:
            raise Rejected("engine_down", self.closed_reason)
        if refusable and self._unhealthy is not None:
            raise _unavailable(self._unhealthy, 0.0, False)
        tokens = self._counted(tokens)
        if (not self._waiters or _before(to_go, self._waiters[0])) and self._fits(tokens):
            self._admit(tokens)
            return Ticket(tokens, 0.0, held=False)
        return None

    def _counted(self, tokens: int) -> int:
        # a request over the whole token budget runs alone (`_fits`); it counts as the
        # whole budget, not more (the proxy first bounds its estimate by the engine's
        # max_model_len where known: `dispatch.Backend.budget`)
        limit = self.token_limit
        return limit if limit and tokens > limit else tokens

    async def acquire(self, tokens: int, refusable: bool = False,
                      to_go: int | None = None) -> Ticket:
        """Wait (bounded) for a slot; raises Rejected. A `refusable` request (in a fleet,
        one no engine has died with) is refused while the engine is unhealthy, and when it
        turns unhealthy while the request waits, for the router to send it elsewhere.
        `to_go`: a continuation's tokens still to come (it waits ahead of new requests)."""
        t0 = self.clock()
        if (now := self.admit_now(tokens, refusable, to_go)) is not None:
            return now
        tokens = self._counted(tokens)
        if len(self._waiters) >= self.limits.queue_max:
            raise Rejected("queue_full", f"the hold queue is full ({self.limits.queue_max} "
                                         f"requests waiting)")
        if to_go is None and (guess := self.predicted_wait(tokens)) is not None \
                and guess[0] > self.limits.max_wait_s:
            raise Rejected("over_capacity", f"the engine would take this request in about "
                           f"{guess[0]:.0f} s, past the hold timeout "
                           f"({self.limits.max_wait_s:g} s): {len(self._waiters)} requests "
                           f"wait ahead, served at {guess[1]:.0f} tokens/s")
        w = _Waiter(tokens, asyncio.get_running_loop().create_future(), t0,
                    held=self.held_reason is not None, refusable=refusable, to_go=to_go)
        self._enqueue(w)
        try:
            await asyncio.wait_for(asyncio.shield(w.future), self.limits.max_wait_s)
        except TimeoutError:
            if w.future.done() and not w.future.cancelled() and w.future.exception() is None:
                return Ticket(tokens, self.clock() - t0, w.held)  # admitted at the deadline
            w.future.cancel()
            self._forget(w)
            why = self.held_reason or ("the KV cache is saturated" if self.breaker_open
                                       else "the engine is at its admission limit")
            raise Rejected("hold_timeout", f"waited {self.limits.max_wait_s:g} s: {why}",
                           waited_s=self.clock() - t0, held=w.held) from None
        except BaseException:
            # the client went away while waiting: give the slot back if it was granted
            if w.future.done() and not w.future.cancelled() and w.future.exception() is None:
                self.done(Ticket(tokens, 0.0, w.held))
            else:
                w.future.cancel()
                self._forget(w)
            raise
        return Ticket(tokens, self.clock() - t0, w.held)

    def _enqueue(self, w: _Waiter) -> None:
        """In its place: behind every waiter it does not go before (`_before`)."""
        if self._waiting_since is None:
            self._waiting_since = self.clock()
        if w.to_go is None:
            self._waiters.append(w)
            return
        at = next((i for i, other in enumerate(self._waiters) if _before(w.to_go, other)),
                  len(self._waiters))
        self._waiters.insert(at, w)

    def _forget(self, w: _Waiter) -> None:
        """A waiter that gave up leaves the queue at once: it holds no place and counts
        towards no limit."""
        with contextlib.suppress(ValueError):
            self._waiters.remove(w)
        self._wake()  # it may have been the head that held the others back

    def done(self, ticket: Ticket) -> None:
        self.in_flight -= 1
        self.tokens_in_flight -= ticket.tokens
        if self.in_flight == 0:
            self._idle.set()
        if self._waiting_since is not None:  # (the pace while requests wait)
            now = self.clock()
            self._ended.append((now, ticket.tokens))
            self._forget_ended(now)
        self._wake()

    async def wait_idle(self, timeout_s: float) -> bool:
        """Wait until no request is at the engine (a drain); False if the time ran out."""
        try:
            await asyncio.wait_for(self._idle.wait(), timeout_s)
        except TimeoutError:
            return False
        return True


def _unavailable(why: str, waited_s: float, held: bool) -> Rejected:
    return Rejected("engine_unavailable", f"not served on this host now ({why}): try another",
                    waited_s=waited_s, held=held)
