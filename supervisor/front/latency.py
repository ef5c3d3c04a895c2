"""What clients felt at the front door: latency histograms by model, measured at the proxy.

vLLM's own histograms start when its engine sees a request, so the time a request spent
held through a restart, or queued at the admission gate, is invisible in them. These
start when the proxy has the request and stop when the client has the bytes:

- `ttft`: arrival at the proxy to the first chunk of a streamed answer written to the
  client (holding and queueing included);
- `stream_gap`: the gaps between the chunks of a streamed answer as written to the client
  (vLLM sends one SSE event per engine step, so about one token each; a chunk can carry
  several when the proxy reads behind);
- `duration`: arrival to the last byte, every forwarded request;
- `hold_wait`: time waiting at the gate for a hold to end (a drain, a restart);
- `admission_wait`: time waiting at the gate for a slot only (throttle, concurrency, KV
  breaker);
- `continuation_gap`: in a stream whose engine failed mid-answer, the client's last token
  before the fault to its first token from the continuation (`supervisor/front/continuation.py`).

The `model` label is the request's `model` when the engine serves it (its arguments
say which names), else `other`: a client cannot grow the label set.

Owned by the event loop's thread; `observe` is a bisect and two additions, nothing more.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

# Milliseconds to minutes: a token gap is a few ms, a TTFT through a cold restart minutes.
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
                   60.0, 120.0, 300.0, 600.0)
GAP_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0,
               10.0, 30.0, 60.0)
WAIT_BUCKETS = (0.001, 0.01, 0.05, 0.1, 0.5, 1.0, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0,
                600.0)
OTHER = "other"


@dataclass(frozen=True)
class Kind:
    name: str  # the exporter's family, after the prefix: vllm_supervisor_<metric>
    metric: str
    help: str
    buckets: tuple[float, ...]


KINDS: tuple[Kind, ...] = (
    Kind("ttft", "client_ttft_seconds",
         "arrival at the proxy to the first chunk of a streamed answer written to the "
         "client (holding and queueing included)", LATENCY_BUCKETS),
    Kind("stream_gap", "client_stream_gap_seconds",
         "gaps between the chunks of a streamed answer as written to the client (about "
         "one token each)", GAP_BUCKETS),
    Kind("duration", "client_request_duration_seconds",
         "arrival at the proxy to the last byte written to the client", LATENCY_BUCKETS),
    Kind("hold_wait", "client_hold_wait_seconds",
         "time a request waited at the gate for a hold to end (drain, restart)",
         WAIT_BUCKETS),
    Kind("admission_wait", "client_admission_wait_seconds",
         "time a request waited at the gate for a slot (throttle, concurrency, KV breaker)",
         WAIT_BUCKETS),
    Kind("continuation_gap", "client_continuation_gap_seconds",
         "the gap a client saw in a stream its engine failed: its last token before the "
         "fault to its first token from the continuation", WAIT_BUCKETS),
)
KIND_NAMES = tuple(k.name for k in KINDS)


@dataclass
class Histogram:
    bounds: tuple[float, ...]
    counts: list[int] = field(default_factory=list)  # per bucket, the last one +Inf
    total: float = 0.0
    n: int = 0

    def __post_init__(self) -> None:
        if not self.counts:
            self.counts = [0] * (len(self.bounds) + 1)

    def observe(self, value: float) -> None:
        self.counts[bisect_left(self.bounds, value)] += 1  # le: a value on a bound counts in it
        self.total += value
        self.n += 1

    def cumulative(self) -> list[tuple[float, int]]:
        """(upper bound, cumulative count) pairs, ending with (+Inf, n)."""
        out, running = [], 0
        for le, c in zip((*self.bounds, float("inf")), self.counts, strict=True):
            running += c
            out.append((le, running))
        return out


@dataclass(frozen=True)
class HistogramView:
    kind: str
    labels: tuple[tuple[str, str], ...]
    buckets: Sequence[tuple[float, int]]  # cumulative, ending with +Inf
    sum: float
    count: int


class ClientLatency:
    """One histogram per (kind, model)."""

    def __init__(self, models: Iterable[str] = ()) -> None:
        self.models = frozenset(models)
        self._h: dict[tuple[str, str], Histogram] = {}
        self._kinds = {k.name: k for k in KINDS}

    def label(self, model: object) -> str:
        return model if isinstance(model, str) and model in self.models else OTHER

    def histogram(self, kind: str, model_label: str) -> Histogram:
        h = self._h.get((kind, model_label))
        if h is None:
            h = self._h[(kind, model_label)] = Histogram(self._kinds[kind].buckets)
        return h

    def observe(self, kind: str, model_label: str, value: float) -> None:
        self.histogram(kind, model_label).observe(value)

    def views(self) -> list[HistogramView]:
        return [HistogramView(kind, (("model", model),), h.cumulative(), h.total, h.n)
                for (kind, model), h in sorted(self._h.items())]
