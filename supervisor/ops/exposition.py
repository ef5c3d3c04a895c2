"""The Prometheus text the exporter serves: the daemon's view of its engines (and of the
front proxy), as metric families.

Owns the views (`ExporterView`, `ProxyView`: frozen snapshots made by the state-owning
tasks) and their rendering; never a socket (`supervisor/ops/exporter.py` serves it).
Metric names follow Prometheus conventions under the prefix `vllm_supervisor_`: base
units, `_total` counters, one series per engine state; with named engines every engine
series carries `engine`. An unknown value is omitted, never 0. A gauge with a bad or
taken name is skipped and logged once.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import structlog
from prometheus_client import CollectorRegistry, ProcessCollector, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

from supervisor.front.continuable import REFUSALS
from supervisor.front.continuation import OUTCOMES
from supervisor.front.latency import KINDS, HistogramView

log = structlog.get_logger("supervisor.exporter")

PREFIX = "vllm_supervisor_"
STATES = ("STARTING", "RUNNING", "DRAINING", "STOPPING", "BACKOFF", "FATAL", "STOPPED")
_METRIC_NAME = re.compile(r"[a-zA-Z_:][a-zA-Z0-9_:]*")


@dataclass(frozen=True)
class ExporterView:
    """A frozen snapshot of what the exporter shows, made by the state-owning task."""

    state: str  # one of STATES
    ready: bool  # engine serving and not draining
    throttle_level: int
    restarts_by_reason: Mapping[str, int]
    trips_by_rule: Mapping[str, int]
    actions_by_kind: Mapping[str, int]
    last_decision_wall: float | None  # unix time of the last decision
    policy_paused: bool
    dry_run: bool
    engine_uptime_s: float | None
    gauges: Sequence[tuple[str, str, float | None]]  # (name, help, value); None: omitted
    proxy: ProxyView | None = None  # the front proxy's counters, when it runs
    engine_not_running_s: float = 0.0  # since the engine was last RUNNING; 0 while it is
    engine_startup_timeout_s: float | None = None  # its allowance to become healthy
    # with a standby configured: 1.0 while it is armed, 0.0 while not; None without one
    standby_ready: float | None = None
    # the KV cache in tokens, as each engine's core said at its start: the serving
    # engine's, and its standby's (what it carries of streams after a failover)
    kv_tokens: float | None = None
    standby_kv_tokens: float | None = None
    # with a weight cache configured: 1.0 while it answers healthy, 0.0 while not
    weight_cache_ready: float | None = None
    failovers: int = 0  # handovers to the standby
    oom_deaths: int = 0  # engines that died unasked while the kernel's OOM killer ran
    # with a KV tier configured (engine.kv_tier): its folder's block bytes at the last
    # look, its bound, and the bytes removed to keep it there; None without one
    kv_tier_bytes: float | None = None
    kv_tier_max_bytes: float | None = None
    kv_tier_removed_bytes: float | None = None
    kv_tier_store_refusals: float | None = None  # stores vLLM's tier refused (0.33+)
    last_failover_s: float | None = None  # the last one: fault seen to requests released
    # [fleet]: each router's URL -> whether this daemon is its worker; None: no routers
    fleet: Mapping[str, bool] | None = None
    # the daemon's event loop: its largest lag over the last minute, stalls since start
    # (supervisor/ops/looplag.py); None: not measured (a unit's own view)
    loop_lag_s: float | None = None
    loop_stalls: int | None = None
    # several engines (or named ones): each one's view, shown with an `engine` label; the
    # fields above then summarise them (state, ready) and `proxy` holds the shared
    # counters, each engine's `proxy` its own gate's numbers
    engines: Sequence[tuple[str, ExporterView]] = ()
    # each GPU of the engine (NVML's index) -> its readings (SignalWindow.gpu_devices'
    # keys), shown with a `gpu` label beside the engine-wide gpu_* series (their summary)
    gpus: Sequence[tuple[int, Mapping[str, Any]]] = ()
    # the golden check's comparisons by verdict ("passed", "mismatch"): docs/watchdog.md
    golden_checks: Mapping[str, int] = field(default_factory=dict)
    # while the engine starts: the seconds its past starts say are left (`status`'s
    # start.eta_s); None when not starting or nothing is known
    eta_s: float | None = None
    # what the serving engine can do that the daemon would use ("reset_prefix_cache",
    # "kv_reset", "sleeping_standby" with a sleeping standby configured): on or off, as
    # its start's probe of vLLM's development routes found; {} while unknown
    capabilities: Mapping[str, bool] = field(default_factory=dict)


@dataclass(frozen=True)
class ProxyView:
    responses_by_code: Mapping[str, int]
    rejections_by_reason: Mapping[str, int]
    in_flight: int
    held: int  # waiting at the gate
    connect_retries: int
    held_limit: int = 0  # the hold queue's length limit (proxy.hold_queue_max)
    kv_breaker_open: bool = False
    latency: Sequence[HistogramView] = ()  # what clients felt, by kind and model
    continuations: Mapping[str, int] = field(default_factory=dict)  # by outcome
    continuation_refusals: Mapping[str, int] = field(default_factory=dict)
    # with proxy.workers > 1: each worker's CPU seconds (its earlier processes included)
    # and how many times a worker was started again
    worker_cpu_s: Mapping[str, float] = field(default_factory=dict)
    worker_restarts: int | None = None


@dataclass
class BadNames:
    """What was already logged as skipped, so that each is logged once."""

    seen: set[tuple[str, str]] = field(default_factory=set)

    def once(self, event: str, **kv: object) -> None:
        key = (event, repr(sorted(kv.items())))
        if key not in self.seen:
            self.seen.add(key)
            log.warning(event, **kv)


Labelled = list[tuple[str | None, "ExporterView"]]  # (engine name or None, its view)


def _labels(views: Labelled, labels: Sequence[str]) -> list[str]:
    """A family's labels: `engine` leads them when the engines are named."""
    return (["engine"] if views[0][0] is not None else []) + list(labels)


def _gauge(name: str, helptext: str, views: Labelled,
           labels: Sequence[str] = ()) -> GaugeMetricFamily:
    return GaugeMetricFamily(PREFIX + name, helptext, labels=_labels(views, labels))


def _counter(name: str, helptext: str, views: Labelled,
             labels: Sequence[str] = ()) -> CounterMetricFamily:
    return CounterMetricFamily(PREFIX + name, helptext, labels=_labels(views, labels))


def _per_engine_gauges(specs: Sequence[tuple[str, str, Callable[[ExporterView], float | None]]],
                       views: Labelled) -> Iterator[GaugeMetricFamily]:
    """One family per (name, help, value) spec, a sample per engine; an unknown value is
    omitted, and a family unknown for every engine is left out."""
    for fname, helptext, get in specs:
        values = [(name, get(e)) for name, e in views]
        if all(x is None for _, x in values):
            continue
        fam = _gauge(fname, helptext, views)
        for name, x in values:
            if x is not None:
                fam.add_metric([name] if name is not None else [], float(x))
        yield fam


class _ViewCollector(Collector):
    def __init__(self, view: ExporterView, bad: BadNames) -> None:
        self.view = view
        self.bad = bad

    def collect(self) -> Iterator[Metric]:
        v = self.view
        views: Labelled = [(n, e) for n, e in v.engines] or [(None, v)]

        def lv(name: str | None, *rest: str) -> list[str]:
            return ([name] if name is not None else []) + list(rest)

        state = _gauge("engine_state",
                        "engine state: 1 for the current state, 0 for the others", views,
                        ["state"])
        for name, e in views:
            if e.state not in STATES:
                self.bad.once("exporter got an unknown engine state", state=e.state)
            for s in STATES:
                state.add_metric(lv(name, s), 1.0 if s == e.state else 0.0)
        yield state
        simple: list[tuple[str, str, Callable[[ExporterView], float | None]]] = [
            ("engine_ready", "1 while the engine serves and is not draining",
             lambda e: float(e.ready)),
            ("engine_uptime_seconds", "seconds since the engine became healthy",
             lambda e: e.engine_uptime_s),
            ("engine_not_running_seconds",
             "seconds since the engine was last RUNNING (0 while it is)",
             lambda e: e.engine_not_running_s),
            ("engine_startup_timeout_seconds",
             "the engine's allowance to become healthy (engine.startup_timeout_s)",
             lambda e: e.engine_startup_timeout_s),
            ("standby_ready", "with a standby configured: 1 while it is armed (loaded or "
             "asleep, and proven), 0 while it is not", lambda e: e.standby_ready),
            ("engine_kv_cache_tokens", "the serving engine's KV cache in tokens, as vLLM "
             "said at its start", lambda e: e.kv_tokens),
            ("standby_kv_cache_tokens", "the standby's KV cache in tokens, as vLLM said at "
             "its start: what it carries of streams after a failover",
             lambda e: e.standby_kv_tokens),
            ("weight_cache_ready", "with a weight cache configured: 1 while it answers "
             "healthy (engine starts map its weights), 0 while not (they load from disk)",
             lambda e: e.weight_cache_ready),
            ("last_failover_seconds", "the last handover to the standby: from the fault "
             "seen to the held requests released", lambda e: e.last_failover_s),
            ("kv_tier_bytes", "with a KV tier configured: the bytes of its block files "
             "at the last look (on tmpfs: host memory)", lambda e: e.kv_tier_bytes),
            ("kv_tier_max_bytes", "with a KV tier configured: its bound "
             "(engine.kv_tier_max_gib), oldest blocks removed past it",
             lambda e: e.kv_tier_max_bytes)]
        yield from _per_engine_gauges(simple, views)
        counts: list[tuple[str, str, str, Callable[[ExporterView], Mapping[str, int]]]] = [
                ("engine_restarts", "engine restarts, by reason", "reason",
                 lambda e: e.restarts_by_reason),
                ("policy_trips", "policy rule trips, by rule (dry-run included)", "rule",
                 lambda e: e.trips_by_rule),
                ("policy_actions", "policy actions carried out, by action", "action",
                 lambda e: e.actions_by_kind),
                ("golden_checks", "an engine's answers to the golden prompt compared with "
                 "its baseline, by verdict (a mismatch is never served)", "verdict",
                 lambda e: e.golden_checks)]
        for fname, helptext, label, get_counts in counts:
            counter = _counter(fname, helptext, views, [label])
            for name, e in views:
                for key, n in sorted(get_counts(e).items()):
                    counter.add_metric(lv(name, key), float(n))
            yield counter
        oom = _counter("engine_oom_deaths", "engines (serving or standby) that died "
                       "without being asked while the kernel's OOM killer ran: the host "
                       "out of memory", views)
        for name, e in views:
            oom.add_metric(lv(name), float(e.oom_deaths))
        yield oom
        if any(e.standby_ready is not None for _, e in views):
            failovers = _counter("failovers", "handovers of an engine's requests to its "
                                 "standby (a crash, a hang, a restart)", views)
            for name, e in views:
                if e.standby_ready is not None:
                    failovers.add_metric(lv(name), float(e.failovers))
            yield failovers
        if any(e.kv_tier_removed_bytes is not None for _, e in views):
            removed = _counter("kv_tier_removed_bytes", "block bytes removed from the KV "
                               "tier to keep it under its bound", views)
            for name, e in views:
                if e.kv_tier_removed_bytes is not None:
                    removed.add_metric(lv(name), e.kv_tier_removed_bytes)
            yield removed
        if any(e.kv_tier_store_refusals is not None for _, e in views):
            refused = _counter("kv_tier_store_refusals", "stores vLLM's KV tier refused, its "
                               "CPU part full (vLLM 0.33+: those blocks are computed again "
                               "after a fault)", views)
            for name, e in views:
                if e.kv_tier_store_refusals is not None:
                    refused.add_metric(lv(name), e.kv_tier_store_refusals)
            yield refused
        more: list[tuple[str, str, Callable[[ExporterView], float | None]]] = [
                ("throttle_level", "throttle level in force (0: none)",
                 lambda e: float(e.throttle_level)),
                ("policy_paused", "1 while the policy is paused",
                 lambda e: float(e.policy_paused)),
                ("policy_dry_run", "1 when the policy only reports what it would do",
                 lambda e: float(e.dry_run)),
                ("last_decision_timestamp_seconds", "unix time of the last policy decision",
                 lambda e: e.last_decision_wall)]
        yield from _per_engine_gauges(more, views)
        if any(e.capabilities for _, e in views):
            able = _gauge("engine_capability", "1 while the engine can do what the daemon "
                          "would use (a remedy in place, a sleeping standby), 0 while it "
                          "is off (status's `off` says why)", views, ["capability"])
            for name, e in views:
                for key, on in sorted(e.capabilities.items()):
                    able.add_metric(lv(name, key), float(on))
            yield able
        if v.proxy is not None:
            gates: Labelled = ([(n, e) for n, e in v.engines if e.proxy is not None]
                               or [(None, v)])
            yield from _proxy_metrics(v.proxy, gates)
        if v.fleet is not None:
            fleet = GaugeMetricFamily(
                PREFIX + "fleet_registered", "1 while this daemon is the router's worker "
                "(registered, and the router answers), 0 while not", labels=["router"])
            for router, registered in sorted(v.fleet.items()):
                fleet.add_metric([router], float(registered))
            yield fleet
        if v.loop_lag_s is not None:
            yield GaugeMetricFamily(
                PREFIX + "event_loop_lag_seconds", "the largest lateness of the daemon's "
                "event loop over the last minute (its timers run this late)", v.loop_lag_s)
        if v.loop_stalls is not None:
            yield CounterMetricFamily(
                PREFIX + "event_loop_stalls", "times the daemon's event loop ran 1 s or "
                "more late", v.loop_stalls)
        yield from self._gauges(views)
        yield from _gpu_devices(views)

    def _gauges(self, views: Labelled) -> Iterator[Metric]:
        # The fixed families above, and the sample names they make: a gauge must not
        # repeat one (a repeated family makes the whole exposition invalid).
        taken = {PREFIX + n for n in (
            "engine_state", "engine_ready", "engine_uptime_seconds", "throttle_level",
            "policy_paused", "policy_dry_run", "last_decision_timestamp_seconds",
            "proxy_in_flight", "proxy_held", "proxy_held_limit", "proxy_kv_breaker_open",
            "engine_not_running_seconds", "engine_startup_timeout_seconds", "standby_ready",
            "weight_cache_ready", "last_failover_seconds", "engine_capability",
            "kv_tier_bytes", "kv_tier_max_bytes",
            *(f[0] for f in GPU_DEVICE_FAMILIES))}
        for n in ("proxy_responses", "proxy_rejections", "proxy_connect_retries",
                  *(k.metric for k in KINDS)):
            taken |= {PREFIX + n, PREFIX + n + "_total", PREFIX + n + "_created",
                      PREFIX + n + "_bucket", PREFIX + n + "_count", PREFIX + n + "_sum"}
        for n in ("engine_restarts", "policy_trips", "policy_actions", "failovers",
                  "golden_checks", "kv_tier_removed_bytes", "kv_tier_store_refusals"):
            taken |= {PREFIX + n, PREFIX + n + "_total", PREFIX + n + "_created"}
        families: dict[str, GaugeMetricFamily] = {}
        for engine, view in views:
            seen: set[str] = set()
            for name, helptext, value in view.gauges:
                if not isinstance(name, str) or _METRIC_NAME.fullmatch(name) is None:
                    self.bad.once("exporter skips a gauge with a bad name", name=name)
                    continue
                if PREFIX + name in taken or name in seen:
                    self.bad.once("exporter skips a gauge whose name is taken", name=name)
                    continue
                seen.add(name)
                if value is None:
                    continue  # unknown: omitted, never 0
                try:
                    number = float(value)
                except (TypeError, ValueError):
                    self.bad.once("exporter skips a gauge whose value is not a number",
                                  name=name, value=repr(value))
                    continue
                fam = families.get(name)
                if fam is None:
                    fam = families[name] = _gauge(name, str(helptext),
                                                   views)
                fam.add_metric([engine] if engine is not None else [], number)
        yield from families.values()


# Per-GPU families: (name, help, the reading's key); with a `gpu` label (NVML's index)
GPU_DEVICE_FAMILIES = (
    ("gpu_device_temperature_celsius", "temperature of each engine GPU", "temperature_c"),
    ("gpu_device_slowdown_temperature_celsius", "each GPU's own slowdown threshold (NVML)",
     "slowdown_temperature_c"),
    ("gpu_device_slowdown_margin_celsius", "degrees below each GPU's slowdown threshold",
     "slowdown_margin_c"),
    ("gpu_device_power_watts", "power draw of each engine GPU", "power_w"),
    ("gpu_device_power_limit_watts", "enforced power limit of each engine GPU",
     "power_limit_w"),
    ("gpu_device_utilization_ratio", "utilisation of each engine GPU, 0..1",
     "utilization_ratio"),
    ("gpu_device_memory_used_bytes", "memory used on each engine GPU (every process)",
     "memory_used_bytes"),
    ("gpu_device_engine_memory_bytes", "memory of the engine's process tree on each GPU",
     "engine_memory_bytes"),
    ("gpu_device_thermal_throttled", "1 when NVML reports thermal slowdown on the GPU",
     "thermal_throttled"),
    ("gpu_device_power_capped", "1 when NVML reports a power cap or brake on the GPU",
     "power_capped"),
)


def _gpu_devices(views: Labelled) -> Iterator[Metric]:
    """Each engine's GPUs, a sample per (engine, gpu); unknown readings are omitted."""
    for fname, helptext, key in GPU_DEVICE_FAMILIES:
        rows = [(name, index, reading.get(key)) for name, e in views
                for index, reading in e.gpus]
        if all(value is None for _, _, value in rows):
            continue
        fam = _gauge(fname, helptext, views, ["gpu"])
        for name, index, value in rows:
            if value is not None:
                fam.add_metric(([name] if name is not None else []) + [str(index)],
                               float(value))
        yield fam


def _proxy_metrics(p: ProxyView, gates: Labelled) -> Iterator[Metric]:
    codes = CounterMetricFamily(PREFIX + "proxy_responses", "proxy answers, by status code",
                                labels=["code"])
    for code, n in sorted(p.responses_by_code.items()):
        codes.add_metric([code], float(n))
    yield codes
    rejected = CounterMetricFamily(PREFIX + "proxy_rejections",
                                   "requests the proxy refused, by reason", labels=["reason"])
    for reason, n in sorted(p.rejections_by_reason.items()):
        rejected.add_metric([reason], float(n))
    yield rejected
    # the admission gate's numbers: one gate per engine
    gauges: list[tuple[str, str, Callable[[ProxyView], float]]] = [
            ("proxy_in_flight", "requests at the engine", lambda g: float(g.in_flight)),
            ("proxy_held", "requests waiting at the gate", lambda g: float(g.held)),
            ("proxy_held_limit", "the most requests that may wait at the gate "
             "(hold_queue_max)", lambda g: float(g.held_limit)),
            ("proxy_kv_breaker_open", "1 while the KV breaker stops admission",
             lambda g: float(g.kv_breaker_open))]
    for fname, helptext, get in gauges:
        fam = _gauge(fname, helptext, gates)
        for name, e in gates:
            gate = e.proxy if name is not None else p
            assert gate is not None
            fam.add_metric([name] if name is not None else [], get(gate))
        yield fam
    yield CounterMetricFamily(PREFIX + "proxy_connect_retries",
                              "requests sent again after the engine refused the connection",
                              value=float(p.connect_retries))
    outcomes = CounterMetricFamily(
        PREFIX + "proxy_continuations", "streams the engine failed mid-answer, by how they "
        "ended (continued, resent, closed, refused, failed, client_gone)", labels=["outcome"])
    for outcome in OUTCOMES:
        outcomes.add_metric([outcome], float(p.continuations.get(outcome, 0)))
    yield outcomes
    refusals = CounterMetricFamily(
        PREFIX + "proxy_continuation_refusals", "broken streams not continued, by why "
        "(continuation would not be exact)", labels=["reason"])
    for reason in REFUSALS:
        refusals.add_metric([reason], float(p.continuation_refusals.get(reason, 0)))
    yield refusals
    if p.worker_restarts is not None:  # (the front door over several processes)
        cpu = CounterMetricFamily(
            PREFIX + "proxy_worker_cpu_seconds", "CPU time of each proxy worker process "
            "(user and system; its earlier processes included)", labels=["worker"])
        for worker, seconds in sorted(p.worker_cpu_s.items(), key=lambda kv: int(kv[0])):
            cpu.add_metric([worker], seconds)
        yield cpu
        yield CounterMetricFamily(PREFIX + "proxy_worker_restarts",
                                  "proxy workers started again after they ended",
                                  value=float(p.worker_restarts))
    for kind in KINDS:
        family = HistogramMetricFamily(PREFIX + kind.metric, kind.help, labels=["model"])
        for h in p.latency:
            if h.kind != kind.name:
                continue
            buckets = [(("+Inf" if le == float("inf") else f"{le:g}"), float(n))
                       for le, n in h.buckets]
            family.add_metric([v for _, v in h.labels], buckets, sum_value=h.sum)
        yield family


def render_metrics(view: ExporterView, bad: BadNames | None = None) -> bytes:
    """The Prometheus text exposition of a view. Raises on a view it cannot render."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_ViewCollector(view, bad if bad is not None else BadNames()))
    # the daemon's own health: process_resident_memory_bytes, process_cpu_seconds_total,
    # open fds (a few reads of /proc/self, in memory)
    ProcessCollector(registry=registry)
    return generate_latest(registry)
