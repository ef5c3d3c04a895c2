"""The messages between the daemon and its proxy workers: one frozen dataclass per kind,
each way, and the protocol's version (`supervisor/plane/codec.py` writes and reads them).

Each end first says `Hello(PROTOCOL, SCHEMA)`; the other refuses the link when the
version is not its own, or the digest of every kind's fields and types (`SCHEMA`: the
settings and limits defined in `front/` included, so that a field added there is caught
even where nobody raised PROTOCOL) is not (a worker started from code upgraded under a
running daemon, say). After
it, per request: `Acquire` -> `Granted` or `Refused`, then `Done` (or `Cancel`); a
suspect's `Lane` -> `Laned`, then `Unlane`. The engines' state goes to the workers as it
changes (`State`), their counters to the daemon (`Stats`). A change here that a peer of
the last version would misread raises PROTOCOL.

Never trusted at the daemon: a worker parses the internet's bytes, so what it sends is
read as data of these types and nothing else (no pickle across this line), and one that
does not read is that worker's fault (`supervisor/plane/pool.py` ends and restarts it).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

from supervisor.front.admission import GateLimits
from supervisor.front.exchange import ProxySettings
from supervisor.front.latency import KINDS
from supervisor.plane.codec import Decoder, schema

PROTOCOL = 2  # 2: `Acquire.to_go`

BUCKETS = {k.name: len(k.buckets) + 1 for k in KINDS}  # counts per histogram, +Inf's too


@dataclass(frozen=True)
class Hello:
    """The first message each way: the protocol this end speaks, and the digest of its
    kinds (`codec.schema`)."""

    KIND: ClassVar[str] = "hello"
    protocol: int
    schema: str


# ---- what the daemon tells a worker of its engines -------------------------------------

@dataclass(frozen=True)
class EngineState:
    """An engine as a worker mirrors it (`pool.engine_state` writes it, `mirror.apply`
    reads it): where it listens, what it serves, its start, its gate."""

    name: str
    upstream: str
    models: tuple[str, ...]
    models_open: bool
    priority_scheduling: bool  # continuations are sent ahead (`--scheduling-policy`)
    fallback: str | None
    generation: int
    ready: bool
    failure_seen: tuple[tuple[int, float], ...]  # (engine start, first seen failing)
    cleared: tuple[tuple[int, float], ...]  # (engine start, a generation it served from)
    limits: GateLimits
    level: int
    held_reason: str | None
    closed_reason: str | None
    unhealthy: str | None
    breaker_open: bool
    ready_at: float | None
    in_flight: int
    waiting: int


# ---- the daemon to a worker -------------------------------------------------------------

@dataclass(frozen=True)
class Init:
    KIND: ClassVar[str] = "init"
    settings: ProxySettings
    engines: tuple[EngineState, ...]


@dataclass(frozen=True)
class Granted:
    """A slot for request `id`, counted at engine start `generation`."""

    KIND: ClassVar[str] = "granted"
    TAG: ClassVar[int] = 2  # (packed: one a request)
    id: int
    tokens: int
    waited_s: float
    held: bool
    generation: int


@dataclass(frozen=True)
class Laned:
    """Request `id` may go through its engine's suspect lane."""

    KIND: ClassVar[str] = "laned"
    id: int


@dataclass(frozen=True)
class Refused:
    KIND: ClassVar[str] = "refused"
    id: int
    reason: str
    detail: str
    waited_s: float
    held: bool


@dataclass(frozen=True)
class State:
    KIND: ClassVar[str] = "state"
    engines: tuple[EngineState, ...]


@dataclass(frozen=True)
class Pause:
    """Pause the streams of `engine` (a hold is on: they go on after it)."""

    KIND: ClassVar[str] = "pause"
    engine: str


@dataclass(frozen=True)
class Settings:
    KIND: ClassVar[str] = "settings"
    settings: ProxySettings


@dataclass(frozen=True)
class Report:
    """Send your counters now (a scrape's); the answer names `asked`."""

    KIND: ClassVar[str] = "report"
    asked: int


@dataclass(frozen=True)
class Stop:
    KIND: ClassVar[str] = "stop"


ToWorker = Init | Granted | Laned | Refused | State | Pause | Settings | Report | Stop


# ---- a worker to the daemon ---------------------------------------------------------------

@dataclass(frozen=True)
class Ready:
    KIND: ClassVar[str] = "ready"
    pid: int


@dataclass(frozen=True)
class Acquire:
    """A slot at `engine`'s gate for request `id` (answered `Granted` or `Refused`)."""

    KIND: ClassVar[str] = "acquire"
    TAG: ClassVar[int] = 1  # (packed: one a request)
    id: int
    tokens: int
    refusable: bool
    to_go: int  # a continuation's tokens still to come (`Gate.acquire`); -1: a new request
    engine: str  # (last: the packed form's string)

    def problem(self) -> str | None:
        if self.tokens < 0:
            return "tokens: below 0"
        return "to_go: below -1" if self.to_go < -1 else None


@dataclass(frozen=True)
class Done:
    """Request `id`'s slot is given back."""

    KIND: ClassVar[str] = "done"
    TAG: ClassVar[int] = 3  # (packed: one a request)
    id: int


@dataclass(frozen=True)
class Cancel:
    """Request `id` no longer waits (`granted`: a slot came meanwhile: given back)."""

    KIND: ClassVar[str] = "cancel"
    id: int
    granted: bool


@dataclass(frozen=True)
class Lane:
    KIND: ClassVar[str] = "lane"
    id: int
    engine: str


@dataclass(frozen=True)
class Unlane:
    KIND: ClassVar[str] = "unlane"
    id: int


@dataclass(frozen=True)
class Failed:
    """Engine start `generation` failed a request, first seen at `now` (monotonic)."""

    KIND: ClassVar[str] = "failed"
    engine: str
    generation: int
    now: float


@dataclass(frozen=True)
class Served:
    """Engine start `generation` served a generation sent at `sent_at` to its end."""

    KIND: ClassVar[str] = "served"
    engine: str
    generation: int
    sent_at: float


@dataclass(frozen=True)
class HistogramCounts:
    """One of a worker's latency histograms (`front/latency.py`): counts per bucket."""

    kind: str
    label: str
    counts: tuple[int, ...]
    total: float
    n: int

    def __post_init__(self) -> None:
        if self.kind not in BUCKETS:
            raise ValueError("a histogram of no known kind")
        if len(self.counts) != BUCKETS[self.kind]:
            raise ValueError(f"a {self.kind} histogram of {len(self.counts)} buckets, "
                             f"not {BUCKETS[self.kind]}")


@dataclass(frozen=True)
class Counters:
    """A worker's counters and histograms, as the daemon adds them up (`pool.added`)."""

    responses: dict[str, int] = field(default_factory=dict)
    rejections: dict[str, int] = field(default_factory=dict)
    continuations: dict[str, int] = field(default_factory=dict)
    refusals: dict[str, int] = field(default_factory=dict)
    retried_connects: int = 0
    cpu_s: float = 0.0
    latency: tuple[HistogramCounts, ...] = ()


def _sum(a: dict[str, int], b: dict[str, int]) -> dict[str, int]:
    return {k: a.get(k, 0) + b.get(k, 0) for k in {*a, *b}}


def added(a: Counters, b: Counters) -> Counters:
    """Two workers' counters and histograms as one (the daemon's sum)."""
    hist = {(h.kind, h.label): h for h in a.latency}
    for h in b.latency:
        if (h0 := hist.get((h.kind, h.label))) is not None:
            h = HistogramCounts(h.kind, h.label, tuple(
                x + y for x, y in zip(h0.counts, h.counts, strict=True)),
                h0.total + h.total, h0.n + h.n)
        hist[(h.kind, h.label)] = h
    return Counters(_sum(a.responses, b.responses), _sum(a.rejections, b.rejections),
                    _sum(a.continuations, b.continuations), _sum(a.refusals, b.refusals),
                    a.retried_connects + b.retried_connects, a.cpu_s + b.cpu_s,
                    tuple(hist.values()))


@dataclass(frozen=True)
class Stats:
    """A worker's counters: its own report (`asked` None) or the answer to `Report`."""

    KIND: ClassVar[str] = "stats"
    counters: Counters
    asked: int | None


ToDaemon = Ready | Acquire | Done | Cancel | Lane | Unlane | Failed | Served | Stats

HELLO = Decoder([Hello])
_TO_WORKER = (Init, Granted, Laned, Refused, State, Pause, Settings, Report, Stop)
_TO_DAEMON = (Ready, Acquire, Done, Cancel, Lane, Unlane, Failed, Served, Stats)
TO_WORKER = Decoder(_TO_WORKER)
# (a worker has no number that is not finite to send: refused)
TO_DAEMON = Decoder(_TO_DAEMON, finite=True)
SCHEMA = schema([Hello, *_TO_WORKER, *_TO_DAEMON])
HELLO_NOW = Hello(PROTOCOL, SCHEMA)  # (what this end says first)
