"""Derived signals: samples in, named values over time windows out.

The signals are named in `signal_list.py` (`SIGNALS`, the one list). `SignalWindow` is
fed by the daemon's state-owning task (metrics snapshots, the engine tree's RSS and CPU,
canary results, GPU readings) and computes the values at a given time. It holds
samples, never does I/O and never reads a clock.

Rates come from counter increases over `rate_window_s`, never from one scrape. A value
that cannot be known (no scrape yet, a series the engine does not export, a window not
yet covered, too few prefix-cache queries to mean anything) is None, never 0.

What operators call KV "fragmentation" is measured here as what it is: saturation
(`kv_cache_usage` with `requests_waiting` and `preemption_rate`), blocks held while
little runs (`kv_blocks_held`, `kv_blocks_per_running_request`), host memory growth
(`engine_rss_growth_bytes_per_h`) and prefix-cache collapse (`prefix_cache_hit_rate`
against its own trailing baseline).

Progress: `engine_stalled_s` is how long, between two scrapes, the engine's own counters
of steps and tokens stood still while it had work: its own gauges showed requests running
or waiting (waiting alone counts: captured wedges show nothing running and the queue
climbing), or the daemon itself had requests at it (through the proxy, its canary: a
stopped core's gauges freeze at their last value, which may be idle). Measured from the
scrape that first showed the current counters, or the first that showed work, to the
latest scrape: never more than what was seen. A step the feeder knows to be at work (a
new engine's proof, whose first requests compile what vLLM builds at first use, and
which judges itself with its own deadlines) counts as progress: a cold cache is not a
hang (issue 48).
"""

from __future__ import annotations

import dataclasses
import math
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from supervisor.watchdog import xid
from supervisor.watchdog.metrics import Snapshot
from supervisor.watchdog.signal_list import SIGNALS, Signals

if TYPE_CHECKING:
    from supervisor.watchdog.gpu import DeviceReading, GpuReading


# The host short of memory (PSI's `full avg10` at least this, hostmem.py): the engine's
# counters standing still then is the host's stall, not a hang of the engine, excused from
# `engine_stalled_s` for at most STARVED_EXCUSE_S in a row (a restart would free nothing
# its next start does not need again; past the excuse a stall is timed as any other)
STARVED_PCT = 10.0
STARVED_EXCUSE_S = 60.0



@dataclass(frozen=True)
class WindowConfig:
    rate_window_s: float = 60.0
    baseline_window_s: float = 3600.0
    rss_growth_window_s: float = 1800.0
    gpu_memory_growth_window_s: float = 1800.0
    min_prefix_queries: float = 2048.0  # tokens over the window for a hit rate to count
    min_spec_draft_tokens: float = 256.0
    slowdown_fallback_c: float = 85.0  # when NVML does not report the card's threshold
    gpu_stale_s: float = 30.0  # a GPU reading older than this is unknown


class _Growth:
    """A sparse series of one engine's memory (120 points over the window) and its growth
    per hour over a whole window: unknown until a window has passed, since an engine's
    memory grows while it starts and warms up, and that is not a leak. Only samples of an
    engine that serves (`settled`: proven, clients let in, no remedy of the daemon's
    under way) make points: a baseline taken while it loaded (a CPU engine's RSS from
    0.1 to 3.5 GB, a GPU engine's memory from nothing to its share) or while it slept
    read, one window later, as growth, and restarted every engine ~28 min after its
    start (issue 48's hour of healthy load found it)."""

    def __init__(self, window_s: float) -> None:
        self.window_s = window_s
        self._points: deque[tuple[float, int]] = deque()
        self.now: int | None = None

    def add(self, now: float, value: int, settled: bool = True) -> None:
        self.now = value
        if not settled:
            return
        if not self._points or now - self._points[-1][0] >= self.window_s / 120:
            self._points.append((now, value))
        while len(self._points) > 2 and self._points[1][0] <= now - self.window_s:
            self._points.popleft()

    def per_hour(self) -> float | None:
        if len(self._points) < 2:
            return None
        (t0, v0), (t1, v1) = self._points[0], self._points[-1]
        if t1 - t0 < self.window_s * 0.9:
            return None
        return (v1 - v0) / (t1 - t0) * 3600


@dataclass(frozen=True)
class _Gpu:
    at: float
    reading: GpuReading
    engine_bytes: int | None
    settled: bool = True  # taken while the engine served, no remedy under way


def unaccounted(held: float, snap: Snapshot, max_model_len: int | None) -> float | None:
    """KV blocks held beyond the most that the running requests can hold: each at most
    its max_model_len in blocks, and one more (a speculative lookahead's). vLLM's usage
    counts the blocks of running requests (a cached prefix's free blocks count as free,
    a preempted request gives its blocks back) and of those it deferred (a request
    waiting on its KV tier's load holds the blocks it loads into: counted as running
    here), so above 0 some blocks are held by no request: leaked, and a KV reset
    frees them. At or below 0 the load alone may hold them all (a saturation that a
    reset would only make every stream compute again). None where the block size, the
    running count or max_model_len is unknown."""
    if max_model_len is None or not snap.block_size or snap.requests_running is None:
        return None
    per_request = -(-max_model_len // snap.block_size) + 1
    return held - (snap.requests_running + (snap.requests_deferred or 0.0)) * per_request


def _rate(first: float | None, last: float | None, dt: float) -> float | None:
    if first is None or last is None or dt <= 0 or last < first:  # a reset: unknown
        return None
    return (last - first) / dt


def _rate_from_zero(first: float | None, last: float | None, dt: float) -> float | None:
    """`_rate` of a counter that vLLM's page shows only from its first count on (a
    labelled child of prometheus_client, as the KV tier's): absent at the window's start
    and present at its end, it counted from 0 in between."""
    return _rate(0.0 if first is None and last is not None else first, last, dt)


def histogram_quantile(q: float, first: Iterable[tuple[float, float]],
                       last: Iterable[tuple[float, float]]) -> float | None:
    """Prometheus' histogram_quantile over the increase between two cumulative bucket
    sets (upper bound -> count), with linear interpolation inside the bucket."""
    before = dict(first)
    buckets = sorted((le, count - before.get(le, 0.0)) for le, count in last)
    if not buckets or buckets[-1][0] != math.inf:
        return None
    total = buckets[-1][1]
    if total <= 0:
        return None
    rank = q * total
    prev_le, prev_count = 0.0, 0.0
    for le, count in buckets:
        if count >= rank:
            if le == math.inf:
                return prev_le  # in the open bucket: the highest finite bound
            width = count - prev_count
            return prev_le + (le - prev_le) * ((rank - prev_count) / width if width else 1.0)
        prev_le, prev_count = le, count
    return None


class SignalWindow:
    """Samples of one engine's life, and the signals they give. Reset at each spawn."""

    def __init__(self, cfg: WindowConfig) -> None:
        self.cfg = cfg
        self.reset()

    def reconfigure(self, cfg: WindowConfig) -> None:
        """Windows and thresholds from a reloaded config, in force at the next signal;
        the samples are kept (a longer window fills from here, a shorter one drops its
        oldest at the next sample)."""
        self.cfg = cfg
        self._rss.window_s = cfg.rss_growth_window_s
        self._gpu_mem.window_s = cfg.gpu_memory_growth_window_s

    def reset(self) -> None:
        self._snaps: deque[tuple[float, Snapshot]] = deque()
        self._prefix: deque[tuple[float, float, float]] = deque()  # t, queries, hits
        self._rss = _Growth(self.cfg.rss_growth_window_s)
        self._gpu_mem = _Growth(self.cfg.gpu_memory_growth_window_s)
        self._cpu_percent: float | None = None
        self._host_temperature_c: float | None = None
        self._host_memory_stall_percent: float | None = None
        self._starved_since: float | None = None  # first tree look of this starved spell
        self._gpu: _Gpu | None = None
        self.canary_failures = 0
        self.canary_latency_s: float | None = None
        # failed canaries no scrape could judge yet: (when the first began, how many)
        self._unjudged: tuple[float, int] | None = None
        # (GPU or None, code) of each XID since this engine started, for evidence
        self.xids: list[tuple[int | None, int]] = []
        self._xid_restart = 0
        self._xid_reset = 0
        self._moved_at: float | None = None  # scrape that first showed these counters
        self._demand_since: float | None = None  # first scrape of this run of demand
        self._stalled_s: float | None = None

    # ---- feeding ----------------------------------------------------------------------

    def add_metrics(self, now: float, snap: Snapshot, at_engine: int = 0,
                    working: bool = False) -> int:
        """A scrape; `at_engine` is how many requests the daemon itself has at the engine
        (through the proxy, its canary) as the scrape is taken; `working`: the engine is
        known to be at work on a step in flight (its proof's first steps, its tree busy),
        which counts as progress. Returns how many failed canaries that awaited a scrape
        it found hung (counted now: no progress since the first of them began)."""
        self._track_progress(now, snap, self._snaps[-1][1] if self._snaps else None,
                             at_engine, working)
        self._snaps.append((now, snap))
        hung = 0
        if self._unjudged is not None:
            since, n = self._unjudged
            self._unjudged = None
            if self.progressed_between(since, now) is False:
                self.canary_failures += n
                hung = n
        keep = self.cfg.rate_window_s * 1.5
        while self._snaps and self._snaps[0][0] < now - keep:
            self._snaps.popleft()
        q, h = snap.prefix_cache_queries_total, snap.prefix_cache_hits_total
        if q is not None and h is not None:
            # a sparse series for the hour-long baseline: one point per 1/60 of it
            if not self._prefix or now - self._prefix[-1][0] >= self.cfg.baseline_window_s / 60:
                self._prefix.append((now, q, h))
            keep = self.cfg.baseline_window_s + self.cfg.rate_window_s * 2
            while self._prefix and self._prefix[0][0] < now - keep:
                self._prefix.popleft()
        return hung

    def restart_progress_clock(self) -> None:
        """An in-place remedy of the daemon's own ended (a KV reset's sleep and wake: an
        engine's first sleep took 9.6-15.1 s on the H100): its pause is not the engine's
        stall. Progress is measured afresh from the next scrape."""
        self._moved_at = self._demand_since = self._stalled_s = None

    def _track_progress(self, now: float, snap: Snapshot, prev: Snapshot | None,
                        at_engine: int, working: bool) -> None:
        moved = _progress(snap)
        if moved is None or (snap.requests_running is None and snap.requests_waiting is None):
            self._moved_at = self._demand_since = self._stalled_s = None
            return
        if prev is None or _progress(prev) != moved or self._moved_at is None or working \
                or self._host_starved(now):
            self._moved_at = now
        if (snap.requests_running or 0) + (snap.requests_waiting or 0) + at_engine > 0:
            self._demand_since = now if self._demand_since is None else self._demand_since
            self._stalled_s = now - max(self._moved_at, self._demand_since)
        else:
            self._demand_since = None
            self._stalled_s = 0.0

    def add_tree(self, now: float, rss_bytes: int, cpu_percent: float | None,
                 host_temperature_c: float | None = None, settled: bool = True,
                 host_memory_stall_percent: float | None = None) -> None:
        """`settled`: the engine serves (its RSS a growth point, `_Growth`)."""
        self._rss.add(now, rss_bytes, settled)
        self._cpu_percent = cpu_percent
        self._host_temperature_c = host_temperature_c
        self._host_memory_stall_percent = pct = host_memory_stall_percent
        starved = pct is not None and pct >= STARVED_PCT
        if not starved:
            self._starved_since = None
        elif self._starved_since is None:
            self._starved_since = now

    def _host_starved(self, now: float) -> bool:
        """The host is short of memory, and has been for at most `STARVED_EXCUSE_S`: a
        stall of the engine's counters now is the host's (hostmem.py)."""
        return self._starved_since is not None and now - self._starved_since <= STARVED_EXCUSE_S

    def add_canary(self, ok: bool, latency_s: float | None, counted: bool | None,
                   started: float = 0.0) -> None:
        """A canary result. A failure is `counted` only when the engine made no progress
        meanwhile: a canary stuck behind a long queue on a busy engine is not a hang.
        None: no scrape during it could tell (an API server too busy to answer its
        page); the next scrape judges it, against the last one before `started`."""
        if ok:
            self.canary_failures = 0
            self.canary_latency_s = latency_s
            self._unjudged = None
        elif counted:
            self.canary_failures += 1
        elif counted is None:
            since, n = self._unjudged or (started, 0)
            self._unjudged = (min(since, started), n + 1)

    def add_gpu(self, now: float, reading: GpuReading, engine_pids: Iterable[int],
                classify: dict[int, str], settled: bool = True) -> None:
        """`classify` maps the reading's XID codes to their remedy ("restart", "reset",
        "reboot" or "info"); `settled`: the engine serves (its memory a growth point)."""
        pids = set(engine_pids)
        procs = reading.process_memory
        engine_bytes = (sum(b for p, b in procs.items() if p in pids)
                        if procs is not None else None)
        self._gpu = _Gpu(now, reading, engine_bytes, settled)
        if engine_bytes is not None:
            self._gpu_mem.add(now, engine_bytes, settled)
        for gpu, code in reading.xids_by_gpu():
            self.xids.append((gpu, code))
            rule = xid.rule_for(classify.get(code, "reset"))
            if rule == "xid_restart":
                self._xid_restart += 1
            elif rule == "xid_reset":
                self._xid_reset += 1

    def least_free_bytes(self, now: float, since: float) -> int | None:
        """The least memory free on any of the engine's GPUs in the last fresh reading,
        if it was taken at `since` or after, while the engine served with no remedy under
        way (its memory all taken: not in its warm-up's sleep, nor a KV reset's); None:
        no such reading, or one without the memory figures. A reading with no per-GPU
        part is one GPU's."""
        g = self._gpu
        if g is None or now - g.at > self.cfg.gpu_stale_s or g.at < since or not g.settled:
            return None
        parts = g.reading.devices or (g.reading,)
        free = [p.memory_total_bytes - p.memory_used_bytes for p in parts
                if p.memory_total_bytes is not None and p.memory_used_bytes is not None]
        return min(free) if len(free) == len(parts) else None

    def worst_gpu(self, now: float) -> DeviceReading | None:
        """The engine's GPU nearest its own slowdown threshold in the last fresh reading
        (None: no per-GPU reading, or a GPU's temperature unknown)."""
        g = self._gpu
        if g is None or now - g.at > self.cfg.gpu_stale_s or not g.reading.devices:
            return None
        fallback = self.cfg.slowdown_fallback_c
        margins = [(d.margin_c(fallback), d) for d in g.reading.devices]
        if any(m is None for m, _ in margins):
            return None
        return min(margins, key=lambda md: md[0] or 0.0)[1]

    def gpu_devices(self, now: float, engine_pids: Iterable[int]) -> list[dict[str, Any]]:
        """Each of the engine's GPUs in the last fresh reading, as plain data (status, the
        exporter, evidence): its readings and the memory of the engine's tree on it."""
        g = self._gpu
        if g is None or now - g.at > self.cfg.gpu_stale_s:
            return []
        pids = set(engine_pids)
        out = []
        for d in g.reading.devices:
            row = dataclasses.asdict(d)
            procs = row.pop("process_memory")
            row["engine_memory_bytes"] = (sum(b for p, b in procs.items() if p in pids)
                                          if procs is not None else None)
            row["slowdown_margin_c"] = d.margin_c(self.cfg.slowdown_fallback_c)
            row["xids"] = list(d.xids)
            out.append(row)
        return out

    def gpu_snapshot(self) -> dict[str, object] | None:
        """The last GPU reading, as plain data (for evidence), or None."""
        if self._gpu is None:
            return None
        return {"at_monotonic": self._gpu.at, "engine_bytes": self._gpu.engine_bytes,
                **dataclasses.asdict(self._gpu.reading)}

    def progressed_between(self, t0: float, t1: float) -> bool | None:
        """Did the engine's token counters move between two times (scrapes in [t0, t1],
        compared with the last one before t0)? None: no scrape in the interval, or none
        before it, to tell (a page that does not answer says nothing either way)."""
        base: Snapshot | None = None
        seen = False
        for at, snap in self._snaps:
            if at < t0:
                base = snap
                continue
            if at > t1:
                break
            if base is not None:
                seen = True
                if _progress(snap) != _progress(base):
                    return True
            base = snap
        return False if seen else None

    # ---- computing --------------------------------------------------------------------

    def _span(self, now: float) -> tuple[float, Snapshot, Snapshot] | None:
        """(seconds, first, last) for the rate window, once at least half of it is covered."""
        if len(self._snaps) < 2:
            return None
        start = now - self.cfg.rate_window_s
        first = next(((t, s) for t, s in self._snaps if t >= start), None)
        t_last, last = self._snaps[-1]
        if first is None or t_last - first[0] < self.cfg.rate_window_s / 2:
            return None
        return t_last - first[0], first[1], last

    def compute(self, now: float, *, metrics_age_s: float | None, staleness_s: float,
                scrape_failures_total: int, engine_uptime_s: float | None,
                max_model_len: int | None = None) -> Signals:
        out: Signals = dict.fromkeys(s.name for s in SIGNALS)
        snap = self._snaps[-1][1] if self._snaps else None
        if snap is not None:
            out["kv_cache_usage"] = snap.kv_cache_usage
            out["requests_running"] = snap.requests_running
            out["requests_waiting"] = snap.requests_waiting
            out["sleep_ops_in_flight"] = snap.sleep_ops_in_flight
            if snap.num_gpu_blocks is not None:
                out["kv_blocks_total"] = float(snap.num_gpu_blocks)
                if snap.kv_cache_usage is not None:
                    held = snap.kv_cache_usage * snap.num_gpu_blocks
                    out["kv_blocks_held"] = held
                    if snap.requests_running:
                        out["kv_blocks_per_running_request"] = held / snap.requests_running
                    out["kv_blocks_unaccounted"] = unaccounted(held, snap, max_model_len)
        span = self._span(now)
        if span is not None:
            dt, a, b = span
            out["preemption_rate"] = _rate(a.preemptions_total, b.preemptions_total, dt)
            out["generation_tokens_per_s"] = _rate(a.generation_tokens_total,
                                                   b.generation_tokens_total, dt)
            out["kv_tier_store_refusals_per_s"] = _rate_from_zero(
                a.kv_offload_refusals_total, b.kv_offload_refusals_total, dt)
            out["kv_tier_stored_bytes_per_s"] = _rate_from_zero(
                a.kv_offload_stored_bytes_total, b.kv_offload_stored_bytes_total, dt)
            out["kv_tier_loaded_bytes_per_s"] = _rate_from_zero(
                a.kv_offload_loaded_bytes_total, b.kv_offload_loaded_bytes_total, dt)
            out["prefix_cache_hit_rate"] = _ratio(
                a.prefix_cache_hits_total, b.prefix_cache_hits_total,
                a.prefix_cache_queries_total, b.prefix_cache_queries_total,
                self.cfg.min_prefix_queries)
            out["spec_decode_acceptance_rate"] = _ratio(
                a.spec_decode_accepted_tokens_total, b.spec_decode_accepted_tokens_total,
                a.spec_decode_draft_tokens_total, b.spec_decode_draft_tokens_total,
                self.cfg.min_spec_draft_tokens)
            if b.ttft_buckets:
                out["ttft_p99"] = histogram_quantile(0.99, a.ttft_buckets, b.ttft_buckets)
        if out["prefix_cache_hit_rate"] is None and snap is not None \
                and snap.prefix_cache_queries_total is None:
            out["prefix_cache_hit_rate"] = snap.prefix_cache_hit_rate_gauge  # older vLLM
        out["prefix_cache_hit_rate_baseline"] = self._prefix_baseline(now)
        rate, base = out["prefix_cache_hit_rate"], out["prefix_cache_hit_rate_baseline"]
        if rate is not None and base:
            out["prefix_cache_hit_rate_ratio"] = rate / base
        out["engine_rss_bytes"] = float(self._rss.now) if self._rss.now is not None else None
        out["engine_rss_growth_bytes_per_h"] = self._rss.per_hour()
        out["engine_cpu_percent"] = self._cpu_percent
        out["engine_uptime_s"] = engine_uptime_s
        out["host_temperature_c"] = self._host_temperature_c
        out["host_memory_stall_percent"] = self._host_memory_stall_percent
        self._gpu_signals(now, out)
        out["gpu_xid_restart_errors"] = float(self._xid_restart)
        out["gpu_xid_reset_errors"] = float(self._xid_reset)
        out["canary_failures"] = float(self.canary_failures)
        out["canary_latency_s"] = self.canary_latency_s
        out["metrics_age_s"] = metrics_age_s
        out["metrics_staleness_s"] = staleness_s
        out["engine_stalled_s"] = self._stalled_s
        out["scrape_failures_total"] = float(scrape_failures_total)
        return out

    def _prefix_baseline(self, now: float) -> float | None:
        """Hit rate over [now - baseline, now - rate window]: the engine's own past,
        excluding the window being judged. None for an engine that never had a hit."""
        end = now - self.cfg.rate_window_s
        pts = [p for p in self._prefix if now - self.cfg.baseline_window_s <= p[0] <= end]
        if len(pts) < 2:
            return None
        (_, q0, h0), (_, q1, h1) = pts[0], pts[-1]
        rate = _ratio(h0, h1, q0, q1, self.cfg.min_prefix_queries)
        return rate if rate else None

    def _gpu_signals(self, now: float, out: Signals) -> None:
        g = self._gpu
        if g is None or now - g.at > self.cfg.gpu_stale_s:
            return
        r = g.reading
        out["gpu_temperature_c"] = r.temperature_c
        slowdown = r.slowdown_temperature_c or self.cfg.slowdown_fallback_c
        out["gpu_slowdown_temperature_c"] = slowdown
        worst = self.worst_gpu(now)
        if worst is not None:  # each card against its own threshold: the nearest one
            out["gpu_slowdown_margin_c"] = worst.margin_c(self.cfg.slowdown_fallback_c)
        elif r.temperature_c is not None and not r.devices:
            out["gpu_slowdown_margin_c"] = slowdown - r.temperature_c
        out["gpu_power_w"] = r.power_w
        out["gpu_power_limit_w"] = r.power_limit_w
        if r.power_w is not None and r.power_limit_w:
            out["gpu_power_ratio"] = r.power_w / r.power_limit_w
        out["gpu_utilization"] = r.utilization_ratio
        out["gpu_memory_used_bytes"] = (float(r.memory_used_bytes)
                                        if r.memory_used_bytes is not None else None)
        out["engine_gpu_memory_bytes"] = (float(g.engine_bytes)
                                          if g.engine_bytes is not None else None)
        out["engine_gpu_memory_growth_bytes_per_h"] = self._gpu_mem.per_hour()
        out["gpu_thermal_throttled"] = _flag(r.thermal_throttled)
        out["gpu_power_capped"] = _flag(r.power_capped)


def _flag(v: bool | None) -> float | None:
    return None if v is None else float(v)


def _progress(s: Snapshot) -> tuple[float | None, float | None, float | None] | None:
    """The counters that move with every engine step (None: the engine exports none)."""
    p = (s.engine_steps_total, s.generation_tokens_total, s.prompt_tokens_total)
    return None if p == (None, None, None) else p


def _ratio(num0: float | None, num1: float | None, den0: float | None, den1: float | None,
           min_den: float) -> float | None:
    if None in (num0, num1, den0, den1):
        return None
    assert num0 is not None and num1 is not None and den0 is not None and den1 is not None
    dn, dd = num1 - num0, den1 - den0
    if dd < min_den or dn < 0:
        return None
    return dn / dd
