"""Which engine a request goes to, and its slot there: the front door's side of routing
(`supervisor/front/routing.py` holds the pure rule it applies).

Owns the engines as the proxy sees them (`Backend`: address, model names, gate, whether
it serves now), what a request asks for (`read_request`), the engines it may go to with
the body for each (`choices`: a fallback gets its own model name), and the wait for the
first of their gates to admit it (`acquire_any`). No sockets: the proxy does the I/O.
"""

from __future__ import annotations

import asyncio
import functools
import json
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import structlog

from supervisor.front import routing
from supervisor.front.admission import GateLimits, Rejected, Ticket

log = structlog.get_logger("supervisor.proxy")

# The longest sequence an engine is taken to hold when it does not say (its /v1/models
# lists no max_model_len): a request's estimate counts at most this much of the token
# budget. 32,768 is the context most served models are run at; a longer real sequence is
# under-counted by the rest, as any estimate past the budget already is (one request
# over the whole budget counts as the budget: `admission.Gate._counted`).
UNKNOWN_MODEL_LEN = 32_768


class EngineGate(Protocol):
    """What the front door reads of an engine's gate, and asks of it: the daemon's
    `admission.Gate`, or a proxy worker's mirror of it (`supervisor/plane/mirror.py`)."""

    @property
    def limits(self) -> GateLimits: ...
    @property
    def held_reason(self) -> str | None: ...
    @property
    def unhealthy(self) -> str | None: ...
    @property
    def breaker_open(self) -> bool: ...
    @property
    def ready_at(self) -> float | None: ...
    @property
    def in_flight(self) -> int: ...

    async def acquire(self, tokens: int, refusable: bool = False,
                      to_go: int | None = None) -> Ticket: ...

    def done(self, ticket: Ticket) -> None: ...


@dataclass
class Backend:
    """One engine behind the front door: where it listens, what it serves, its own gate,
    and whether it serves now (its unit's view: running and its gate open)."""

    name: str
    gate: EngineGate
    ready: Callable[[], bool]
    upstream: str  # http://127.0.0.1:8100
    models: tuple[str, ...] = ()
    models_open: bool = False  # LoRA, or no names known: any model name may be served
    fallback: str | None = None  # the engine that takes its models while it is down
    # it runs `--scheduling-policy priority`: continuations are sent with a priority
    # ahead of new requests (`continuation.CONTINUED_FIRST`)
    priority_scheduling: bool = False
    # which start of the engine this is (its unit's generation): a request counts one
    # death per engine start it was at, however many ways that engine failed it
    generation: Callable[[], int] = lambda: 0
    # when the front door first saw each recent start fail a request (monotonic s): a
    # death is counted only for the requests sent to that start before then
    failure_seen: dict[int, float] = field(default_factory=dict)

    # the requests at each engine start now (sent, not yet answered or failed): what a
    # swap to the standby waits for before the old engine is taken down
    at: dict[int, int] = field(default_factory=dict)

    # the longest sequence the engine takes (`max_model_len` in vLLM's /v1/models), once
    # learned; and the engine start it was last asked of (the proxy asks once a start)
    max_model_len: int | None = None
    max_model_len_asked: int | None = None

    def budget(self, tokens: int) -> int:
        """A request's share of the token budget here: its estimate, but never more than
        one sequence of this engine can hold. vLLM refuses (400, at once) a request whose
        max_tokens runs past max_model_len, so no request holds more KV cache than that:
        a max_tokens of 10**12 counted as such would make every request behind it wait
        for a full drain, for a request the engine answers at once. An engine that does
        not say its max_model_len (not vLLM, or its /v1/models unanswered) is taken to
        hold `UNKNOWN_MODEL_LEN` (issue 50: such a request, counted as the whole budget,
        held an ordinary one behind it for as long as it ran)."""
        n = self.max_model_len
        return min(tokens, UNKNOWN_MODEL_LEN if n is None else n)

    def follow(self, upstream: str, models: tuple[str, ...], models_open: bool,
               priority_scheduling: bool = False) -> None:
        """Its engine, being started, listens at `upstream` and serves these names (and
        schedules by priority or not, as its arguments say)."""
        if upstream != self.upstream:
            log.info("proxy upstream follows the engine", engine=self.name,
                     upstream=upstream, was=self.upstream)
        self.upstream, self.models = upstream, models
        self.models_open = models_open or not models
        self.priority_scheduling = priority_scheduling

    def arrive(self, generation: int) -> None:
        self.at[generation] = self.at.get(generation, 0) + 1

    def leave(self, generation: int) -> None:
        n = self.at.get(generation, 0) - 1
        if n > 0:
            self.at[generation] = n
        else:
            self.at.pop(generation, None)

    def failed(self, generation: int, now: float) -> float:
        """Start `generation` failed a request at `now`: when its failure was first seen."""
        first = self.failure_seen.setdefault(generation, now)
        if len(self.failure_seen) > 8:  # only the last starts matter
            del self.failure_seen[min(self.failure_seen)]
        return first

    def served(self, generation: int, sent_at: float) -> None:
        """Start `generation` answered a generation sent to it at `sent_at`, to its end:
        it was alive and serving after then. A failure of it seen before `sent_at` was
        no death (a connection it dropped, a 5xx while its /health was slow to answer):
        forgotten, or the requests sent to it since, the one that kills it among them,
        would never be charged with its real death (quarantine.py: a killer left with a
        death uncounted kills once more, and an innocent beside it in the suspects' lane
        is refused). Never the case of a start that is dying: it completes nothing."""
        first = self.failure_seen.get(generation)
        if first is not None and sent_at > first:
            del self.failure_seen[generation]

    def serving(self) -> bool:
        return self.ready() and not self.gate.breaker_open

    def unhealthy(self) -> str | None:
        """Why a router should send this engine's requests elsewhere; None: it serves
        now or within a short wait (docs/fleet.md)."""
        if self.gate.breaker_open:
            return "its KV-cache breaker is open"
        return self.gate.unhealthy

    def view(self) -> routing.BackendView:
        return routing.BackendView(self.name, self.models, self.serving(),
                                  self.gate.in_flight, self.fallback)


@dataclass(frozen=True)
class Choice:
    """An engine a request may go to, with the body (and its parse) to send it there."""

    backend: Backend
    body: bytes
    doc: object


@dataclass(frozen=True)
class RequestFacts:
    tokens: int  # the token budget's estimate
    model: object  # the body's "model", whatever it is (None when absent)
    doc: object = None  # the body, parsed (None when it is not JSON)


def read_request(body: bytes) -> RequestFacts:
    """The body parsed once: prompt tokens (about 4 characters each) plus max_tokens, a
    cheap, safe over-estimate for the token budget, and the model asked for.
    Unparseable bodies count as their length / 4, with no model."""
    try:
        doc = json.loads(body) if body else {}
    except ValueError:
        return RequestFacts(len(body) // 4, None)
    if not isinstance(doc, dict):
        return RequestFacts(len(body) // 4, None, doc)
    prompt = doc.get("prompt", doc.get("messages", doc.get("input", "")))
    text = prompt if isinstance(prompt, str) else json.dumps(prompt)
    out = doc.get("max_tokens", doc.get("max_completion_tokens", 16))
    out = out if isinstance(out, int) and not isinstance(out, bool) and out > 0 else 16
    return RequestFacts(len(text) // 4 + out, doc.get("model"), doc)


def model_len_of(doc: object) -> int | None:
    """The engine's max_model_len from its /v1/models answer (vLLM lists it with each
    model, LoRA adapters with their base's): the smallest listed; None when none is."""
    data = doc.get("data") if isinstance(doc, dict) else None
    lengths = [e["max_model_len"] for e in data if isinstance(e, dict)
               and isinstance(e.get("max_model_len"), int)
               and not isinstance(e["max_model_len"], bool) and e["max_model_len"] > 0] \
        if isinstance(data, list) else []
    return min(lengths) if lengths else None


def choices(backends_by_name: dict[str, Backend], facts: RequestFacts,
            body: bytes) -> list[Choice]:
    """Where this request may go (supervisor/front/routing.py): one engine serving its model
    now; or, when none does, every engine of its model and their fallbacks, in order,
    to be held until the first of them admits it. A fallback gets the body with its
    own model name. Raises UnknownModel."""
    backends = list(backends_by_name.values())
    if not backends:
        raise routing.UnknownModel(facts.model, [])
    if len(backends) == 1 and (facts.model is None or backends[0].models_open):
        return [Choice(backends[0], body, facts.doc)]  # one engine: no choice to make
    model = facts.model
    if model is None:  # vLLM's own rule: the first model; here the first engine's
        model = backends[0].models[0] if backends[0].models else None
        if model is None:
            return [Choice(backends[0], body, facts.doc)]
    try:
        r = routing.route(model, [b.view() for b in backends])
    except routing.UnknownModel:
        open_ = [b for b in backends if b.models_open]
        if not open_:
            raise
        return [Choice(open_[0], body, facts.doc)]  # a LoRA adapter's name, perhaps
    if r.engine is not None:
        return [_choice(backends_by_name[r.engine], r.model if r.substituted else None,
                        facts, body)]
    own = [b for b in backends if model in b.models]
    out = [Choice(b, body, facts.doc) for b in own]
    for b in own:
        fb = backends_by_name.get(b.fallback) if b.fallback else None
        if fb is not None and fb.models and all(c.backend is not fb for c in out):
            out.append(_choice(fb, fb.models[0], facts, body))
    return out


def _choice(backend: Backend, model: str | None, facts: RequestFacts,
            body: bytes) -> Choice:
    if model is None or not isinstance(facts.doc, dict):
        return Choice(backend, body, facts.doc)
    doc = {**facts.doc, "model": model}
    return Choice(backend, json.dumps(doc).encode(), doc)


async def acquire_any(choices: list[Choice], tokens: int,
                      refusable: bool = False) -> tuple[Choice, Ticket]:
    """A slot at the first of these engines' gates to admit the request (one engine:
    its gate). Raises Rejected once every gate has refused it. Every other slot granted
    meanwhile is given back, even when the caller is cancelled (the client went away)."""
    if len(choices) == 1:
        b = choices[0].backend
        return choices[0], await b.gate.acquire(b.budget(tokens), refusable)
    tasks: dict[asyncio.Future[Ticket], Choice] = {
        asyncio.ensure_future(c.backend.gate.acquire(c.backend.budget(tokens), refusable)): c
        for c in choices}
    pending: set[asyncio.Future[Ticket]] = set(tasks)
    refused: list[Rejected] = []
    won: asyncio.Future[Ticket] | None = None
    kept = False
    try:
        while pending and won is None:
            done, pending = await asyncio.wait(pending,
                                               return_when=asyncio.FIRST_COMPLETED)
            for t in done:
                exc = t.exception()
                if exc is None and won is None:
                    won = t
                elif isinstance(exc, Rejected):
                    refused.append(exc)
                elif exc is not None:
                    raise exc
        if won is None:
            raise refused[0]
        kept = True
        return tasks[won], won.result()
    finally:
        for t, c in tasks.items():
            if kept and t is won:
                continue
            t.cancel()  # (a gate cancelled while it waits takes its slot back itself)
            t.add_done_callback(functools.partial(_give_back, c))


def _give_back(choice: Choice, t: asyncio.Future[Ticket]) -> None:
    """A slot granted to a request that went elsewhere (or away) goes back."""
    if not t.cancelled() and t.exception() is None:
        choice.backend.gate.done(t.result())
