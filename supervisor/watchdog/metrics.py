"""vLLM's Prometheus `/metrics` page, parsed into a snapshot. Pure: text in, values out.

Accepts the current metric names and their predecessors (`vllm:gpu_cache_usage_perc`
for `vllm:kv_cache_usage_perc`, the `vllm:gpu_prefix_cache_hit_rate` gauge beside the
prefix-cache counters). A series that is absent is unknown: its field is None, never 0
(`--disable-log-stats` removes every `vllm:*` series). With several engines (data
parallel), counts and counters are summed and the KV usage is the worst engine's.
Garbage raises `MetricsParseError`; the poller counts it and carries on.

vLLM's own timing of its sleep-mode operations (0.32+, `vllm/entrypoints/serve/dev/
sleep/metrics.py`): the histogram `vllm:sleep_mode_operation_duration_seconds` and the
gauge `vllm:sleep_mode_operations_in_flight`, both labelled `operation` (`sleep`,
`wake`, `release_kv_cache_memory`) and nothing else: the API server's own, registered at
its first sleep-mode call (a page before has neither) and never counted among the
engines. `sleep_op_seconds` turns two pages of one engine into the duration vLLM
measured for each operation in between.

The page is read line by line here rather than by prometheus_client's parser: a vLLM page
is 300-600 lines of which the daemon reads about twenty, and the full parse was 80 % of an
idle daemon's CPU with six engines (bench-host-cost). Every sample line is still checked
against the text format's grammar; only the lines of the series read get their labels and
value parsed (and the `engine` label of every `vllm:*` line, which counts the engines).
`tests/test_metrics.py` checks it against prometheus_client's parser on every fixture.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable
from dataclasses import dataclass, field


class MetricsParseError(ValueError):
    pass


SleepOps = tuple[tuple[str, float, float], ...]


@dataclass(frozen=True)
class Snapshot:
    kv_cache_usage: float | None = None  # 0..1
    requests_running: float | None = None
    requests_waiting: float | None = None
    # of those waiting, the ones vLLM deferred (a KV load or transfer, a LoRA budget; its
    # `num_requests_waiting_by_reason`, 0.26 on): a request waiting on its KV tier's load
    # already holds the blocks it loads into (None: the page has no reasons)
    requests_deferred: float | None = None
    preemptions_total: float | None = None
    prefix_cache_queries_total: float | None = None  # tokens
    prefix_cache_hits_total: float | None = None  # tokens
    prefix_cache_hit_rate_gauge: float | None = None  # releases before the counters
    prompt_tokens_total: float | None = None
    generation_tokens_total: float | None = None
    engine_steps_total: float | None = None  # engine iterations (iteration_tokens' count)
    spec_decode_draft_tokens_total: float | None = None
    spec_decode_accepted_tokens_total: float | None = None
    num_gpu_blocks: int | None = None  # from vllm:cache_config_info
    block_size: int | None = None
    # cumulative histogram of time to first token: upper bound (s) -> count, and count
    ttft_buckets: tuple[tuple[float, float], ...] = field(default=())
    ttft_count: float | None = None
    engines: int = 0  # how many distinct `engine` labels carried vllm:* series
    # vLLM's sleep-mode operations: (operation, how many, their seconds in all), those
    # the page has; and how many run now (None: no such series)
    sleep_ops: SleepOps = ()
    sleep_ops_in_flight: float | None = None
    # vLLM's KV offloading (0.33+; engine.kv_tier): blocks it could not store because its
    # CPU part had no room (its `cannot store chunks`), and the bytes it stored from the
    # GPU and loaded back into it
    kv_offload_refusals_total: float | None = None
    kv_offload_stored_bytes_total: float | None = None
    kv_offload_loaded_bytes_total: float | None = None

    @property
    def has_vllm_series(self) -> bool:
        return self.engines > 0


# snapshot field -> metric names that feed it, newest first
_SUMMED = {
    "requests_running": ("vllm:num_requests_running",),
    "requests_waiting": ("vllm:num_requests_waiting",),
    "preemptions_total": ("vllm:num_preemptions_total", "vllm:num_preemptions"),
    "prefix_cache_queries_total": ("vllm:prefix_cache_queries_total",
                                   "vllm:prefix_cache_queries"),
    "prefix_cache_hits_total": ("vllm:prefix_cache_hits_total", "vllm:prefix_cache_hits"),
    "prompt_tokens_total": ("vllm:prompt_tokens_total", "vllm:prompt_tokens"),
    "generation_tokens_total": ("vllm:generation_tokens_total", "vllm:generation_tokens"),
    "engine_steps_total": ("vllm:iteration_tokens_total_count",),
    "spec_decode_draft_tokens_total": ("vllm:spec_decode_num_draft_tokens_total",
                                       "vllm:spec_decode_num_draft_tokens"),
    "spec_decode_accepted_tokens_total": ("vllm:spec_decode_num_accepted_tokens_total",
                                          "vllm:spec_decode_num_accepted_tokens"),
    "kv_offload_refusals_total": ("vllm:kv_offload_allocation_failure_total",
                                  "vllm:kv_offload_allocation_failure"),
    "kv_offload_stored_bytes_total": ("vllm:kv_offload_store_bytes_total",
                                      "vllm:kv_offload_store_bytes"),
    "kv_offload_loaded_bytes_total": ("vllm:kv_offload_load_bytes_total",
                                      "vllm:kv_offload_load_bytes"),
}
_MAXED = {
    "kv_cache_usage": ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"),
    "prefix_cache_hit_rate_gauge": ("vllm:gpu_prefix_cache_hit_rate",),
}
_TTFT = "vllm:time_to_first_token_seconds"
_SLEEP_OP = "vllm:sleep_mode_operation_duration_seconds"
_SLEEP_IN_FLIGHT = "vllm:sleep_mode_operations_in_flight"
_WAITING_BY_REASON = "vllm:num_requests_waiting_by_reason"


# a sample line of the text format: name, labels, value, optional timestamp
# (timestamps in milliseconds, or seconds with a fraction as OpenMetrics writes them; no
# exemplars: the text format 0.0.4 that the poller asks for and vLLM serves has none)
_SAMPLE = re.compile(r"([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\}[ \t]*|[ \t]+)(\S+)"
                     r"(?:[ \t]+-?[0-9][0-9.eE+-]*)?[ \t]*")
_LABEL = re.compile(r'[ \t]*([a-zA-Z_][a-zA-Z0-9_]*)[ \t]*=[ \t]*"((?:[^"\\]|\\.)*)"[ \t]*(?:,|$)')
_ENGINE = re.compile(r'(?:^|,)[ \t]*engine[ \t]*=[ \t]*"([^"\\]*)"')
_UNESCAPE = {"\\\\": "\\", '\\"': '"', "\\n": "\n"}


def _wanted() -> frozenset[str]:
    names = {n for ns in (*_SUMMED.values(), *_MAXED.values()) for n in ns}
    return frozenset(names | {f"{_TTFT}_bucket", f"{_TTFT}_count", "vllm:cache_config_info",
                              f"{_SLEEP_OP}_count", f"{_SLEEP_OP}_sum", _SLEEP_IN_FLIGHT,
                              _WAITING_BY_REASON})


_WANTED = _wanted()


def _labels(raw: str | None) -> dict[str, str]:
    if not raw:
        return {}
    out: dict[str, str] = {}
    pos = 0
    while pos < len(raw):
        m = _LABEL.match(raw, pos)
        if m is None or m.end() == pos:
            raise MetricsParseError(f"not a Prometheus text page: bad labels {{{raw[:80]}}}")
        value = m.group(2)
        if "\\" in value:
            value = re.sub(r'\\[\\"n]', lambda e: _UNESCAPE[e.group(0)], value)
        out[m.group(1)] = value
        pos = m.end()
    return out


def _samples(text: str) -> Iterable[tuple[str, dict[str, str], float]]:
    """The samples of the series the daemon reads, and the `engine` label alone of the
    other `vllm:*` series; raises MetricsParseError on a line outside the format."""
    for line in text.split("\n"):  # (not splitlines: a label may hold U+2028)
        line = line.strip(" \t\r")
        if not line or line[0] == "#":
            continue
        m = _SAMPLE.fullmatch(line)
        if m is None:
            raise MetricsParseError(f"not a Prometheus text page: {line[:80]!r}")
        name, raw_labels, raw_value = m.groups()
        try:
            value = float(raw_value)
        except ValueError:
            raise MetricsParseError(
                f"not a Prometheus text page: {name} = {raw_value[:40]!r}") from None
        if name in _WANTED:
            yield name, _labels(raw_labels), value
        elif name.startswith("vllm:"):  # (counted among the engines, not read)
            e = _ENGINE.search(raw_labels or "")
            yield name, {"engine": e.group(1)} if e else {}, math.nan


def parse_metrics(text: str) -> Snapshot:
    values: dict[str, dict[str, float]] = {}  # metric name -> engine label -> value
    ttft: dict[float, float] = {}
    ttft_count: float | None = None
    engines: set[str] = set()
    blocks: int | None = None
    block_size: int | None = None
    ops: dict[str, list[float]] = {}  # operation -> [count, sum]
    in_flight: float | None = None
    deferred: float | None = None
    for name, labels, value in _samples(text):
        if not name.startswith("vllm:"):
            continue
        if name.startswith("vllm:sleep_mode_"):  # (the API server's: no engine label)
            if name == _SLEEP_IN_FLIGHT and not math.isnan(value):
                in_flight = (in_flight or 0.0) + value
            elif name in (f"{_SLEEP_OP}_count", f"{_SLEEP_OP}_sum"):
                pair = ops.setdefault(labels.get("operation", ""), [0.0, 0.0])
                pair[1 if name.endswith("_sum") else 0] += value
            continue
        engine = labels.get("engine", "0")
        engines.add(engine)
        if math.isnan(value):
            continue
        if name == f"{_TTFT}_bucket":
            le = float(labels.get("le", "nan"))
            ttft[le] = ttft.get(le, 0.0) + value
        elif name == f"{_TTFT}_count":
            ttft_count = (ttft_count or 0.0) + value
        elif name == _WAITING_BY_REASON:
            if labels.get("reason") == "deferred":
                deferred = (deferred or 0.0) + value
        elif name == "vllm:cache_config_info":
            blocks = _int_label(labels, "num_gpu_blocks_override") or _int_label(
                labels, "num_gpu_blocks")
            block_size = _int_label(labels, "block_size")
        else:
            # counters come as `x_total` from prometheus_client's parser whatever the
            # page's own spelling, so both spellings above are tried
            values.setdefault(name, {})[engine] = value

    fields: dict[str, float | None] = {}
    for key, names in _SUMMED.items():
        fields[key] = next((sum(values[n].values()) for n in names if n in values), None)
    for key, names in _MAXED.items():
        fields[key] = next((max(values[n].values()) for n in names if n in values), None)
    return Snapshot(**fields, num_gpu_blocks=blocks, block_size=block_size,
                    ttft_buckets=tuple(sorted(ttft.items())), ttft_count=ttft_count,
                    engines=len(engines),
                    sleep_ops=tuple((op, n, total) for op, (n, total) in sorted(ops.items())),
                    sleep_ops_in_flight=in_flight, requests_deferred=deferred)


def sleep_op_seconds(before: SleepOps | None, after: SleepOps | None) -> dict[str, float]:
    """The seconds vLLM measured for each sleep-mode operation between two pages of one
    engine (its histogram's sum increase over its count's: the mean, if several ran),
    by operation; {} when it cannot be told (a page unread, no such series after).

    An operation the page before lacks counts from zero there, and only there: vLLM
    registers the series at its API server's first sleep-mode call, so a page of the same
    engine read before without it means no such call had run yet; the page after having
    it proves that this vLLM exports it. A page not read is unknown, never zero."""
    if before is None or after is None:
        return {}
    was = {op: (n, total) for op, n, total in before}
    out = {}
    for op, n, total in after:
        n0, total0 = was.get(op, (0.0, 0.0))
        if n > n0:
            out[op] = (total - total0) / (n - n0)
    return out


def _int_label(labels: dict[str, str], key: str) -> int | None:
    raw = labels.get(key)
    if raw is None or not raw.isdigit():
        return None
    return int(raw)
