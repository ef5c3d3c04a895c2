"""What the front door keeps of its requests: its settings, its counters, and one record
per client request (`Exchange`), shared by the proxy (`supervisor/front/proxy.py`) and
the streams it continues (`supervisor/front/streams.py`)."""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass, field

from supervisor.front.continuation import Transcript
from supervisor.front.deadlines import Deadline
from supervisor.front.dispatch import Backend


@dataclass
class ProxyStats:
    """Counters for the exporter; the proxy's handlers update them on the loop's thread."""

    responses: dict[str, int] = field(default_factory=dict)  # status code -> count
    rejections: dict[str, int] = field(default_factory=dict)  # reason -> count
    retried_connects: int = 0
    continuations: dict[str, int] = field(default_factory=dict)  # outcome -> streams
    refusals: dict[str, int] = field(default_factory=dict)  # why not continued -> streams

    def continued(self, outcome: str, refused: str | None = None) -> None:
        self.continuations[outcome] = self.continuations.get(outcome, 0) + 1
        if refused is not None:
            self.refusals[refused] = self.refusals.get(refused, 0) + 1

    def count(self, status: int) -> None:
        self.responses[str(status)] = self.responses.get(str(status), 0) + 1

    def reject(self, reason: str) -> None:
        self.rejections[reason] = self.rejections.get(reason, 0) + 1


@dataclass
class ProxySettings:
    listen_host: str
    listen_port: int
    upstream: str  # http://127.0.0.1:8100
    max_body_bytes: int = 16 << 20
    max_header_bytes: int = 16 << 10
    # the server's guard rails ([proxy] in settings/sections.py says each one)
    max_connections: int = 4096
    header_timeout_s: float = 60.0
    body_timeout_s: float = 60.0
    send_timeout_s: float = 60.0
    idle_timeout_s: float = 75.0
    max_buffered_bytes: int = 256 << 20
    retry_after_s: int = 5
    extra_routes: tuple[str, ...] = ()
    connect_timeout_s: float = 5.0
    idle_read_timeout_s: float = 600.0  # between two chunks of an answer
    models: tuple[str, ...] = ()  # the names the engine serves: the latency labels
    # other names may be served too (LoRA adapters): an unknown name goes to the engine
    models_open: bool = False
    continuation: bool = True  # continue streams the engine fails mid-answer
    continue_timeout_s: float = 300.0  # the longest a broken stream waits for an engine
    max_continuations: int = 3  # per request
    stall_timeout_s: float = 0.0  # a continuable stream's, between tokens (0: none)
    request_timeout_s: float = 0.0  # from a request's arrival to its end (0: none)
    # those two for a model or an engine, the model's first (front/deadlines.py)
    deadlines: Mapping[str, Deadline] = field(default_factory=dict)
    keepalive_s: float = 10.0  # keep-alive lines to a waiting stream, this often
    # in a fleet ([fleet] routers): a new request whose engines will not serve within a
    # short wait (a cold start, a backoff, a drain, FATAL: their /health says 503) is
    # refused at once, 503 with Retry-After, for the router to send it to another host;
    # alone, the proxy holds it. Streams in flight are continued here either way.
    refuse_when_unhealthy: bool = False


@dataclass
class Exchange:
    """One client request as the proxy saw it: for the latency histograms and its one
    access line."""

    arrived: float
    model: object = None
    resp: object = None  # the client's answer, once begun (a deadline ends it)
    status: int | None = None  # None: no answer (cut, or the client went away early)
    held_s: float = 0.0
    queued_s: float = 0.0
    stream: bool = False
    first_chunk_at: float | None = None
    events: int = 0  # SSE data events written (about one token each)
    tail: bytes = b""  # the answer's last bytes, where its usage is
    outcome: str = "ok"
    tokens: int = 0  # the token budget's estimate, for the gate
    last_write_at: float = 0.0  # bytes of any kind (keep-alive lines too)
    last_data_at: float = 0.0  # answer bytes
    gap_from: float | None = None  # a broken stream's last answer bytes, until it goes on
    # its continuations: when the last one's answer began (its headers), and the longest
    # wait from such a beginning to its first answer bytes, or to its break when it broke
    # before them (the engine's re-prefill and queue, apart from the hold before it)
    continued_at: float | None = None
    resumed_s: float = 0.0
    transcript: Transcript | None = None  # a continuable stream's record
    backend: Backend | None = None  # the engine it was sent to (a continuation stays there)
    # the engine start it went to last, and when it was sent there
    sent_to: tuple[Backend, int, float] | None = None
    # the engine starts that failed it while they had it (supervisor/front/quarantine.py)
    died_at: set[tuple[str, int]] = field(default_factory=set)
    at_engine: bool = False  # sent, and not yet answered or failed there
    # its deadlines, the model's or its engine's or the proxy's (0: none)
    request_timeout_s: float = 0.0
    stall_timeout_s: float = 0.0
    # its engine's streams were paused (a KV reset, a drained restart with continue)
    # before its answer began: its request was cut there, to go again once it serves
    cut_by_pause: bool = False

    def resumed(self, now: float) -> None:
        """Its continuation's wait ended at `now`: its first answer bytes came, or it broke
        before them (counted too: a stream paused again before its first token waited
        that long at the engine). Once per continuation."""
        if self.continued_at is not None:
            self.resumed_s = max(self.resumed_s, now - self.continued_at)
            self.continued_at = None

    def sent(self, backend: Backend) -> None:
        self.left()
        self.sent_to = (backend, generation := backend.generation(), time.monotonic())
        backend.arrive(generation)
        self.at_engine = True

    def left(self) -> None:
        """No longer at the engine it was sent to: answered, failed, or given up."""
        if self.at_engine and self.sent_to is not None:
            self.sent_to[0].leave(self.sent_to[1])
            self.at_engine = False

    def engine_failed(self) -> bool:
        """The engine it was last sent to went while it had it: one death per start, and
        only when it was sent there before anyone saw that start fail (a request sent to
        an engine already seen dying, as the next suspect in its lane is, was not part
        of its death). Whether it was sent before: False, it met a death already known."""
        if self.sent_to is None:
            return False
        backend, generation, at = self.sent_to
        if at > backend.failed(generation, time.monotonic()):
            return False
        self.died_at.add((backend.name, generation))
        return True

    @property
    def deaths(self) -> int:
        return len(self.died_at)
