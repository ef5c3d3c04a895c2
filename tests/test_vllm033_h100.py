"""What the daemon reads of vLLM 0.33, from pages and logs taken on the H100 (issue 36,
docs/gpu-validation.md "vLLM 0.33"): tests/fixtures/vllm-0.33-h100/ holds an 8B-shaped
engine's start log and /metrics after one request, from disk and on a weight cache, the
`vllm preload` log and the Rust front end's start log, as the engines printed them."""

from __future__ import annotations

from pathlib import Path

import pytest

from supervisor.engine.process.enginelog import parse_engine_line, phase_of, route_of, weights_of
from supervisor.engine.process.process import version_of
from supervisor.watchdog.metrics import parse_metrics

FIX = Path(__file__).parent / "fixtures" / "vllm-0.33-h100"


def lines(name: str) -> list[str]:
    """Each line's message, as the daemon's reader of the engine's output takes it."""
    return [parse_engine_line(raw).message
            for raw in (FIX / name).read_text().splitlines() if raw.strip()]


def test_a_033_page_after_one_request() -> None:
    m = parse_metrics((FIX / "after-one-request.txt").read_text())
    assert m.engines == 1 and m.has_vllm_series
    assert (m.num_gpu_blocks, m.block_size) == (26314, 16)  # 421,024 tokens, as logged
    assert m.kv_cache_usage == 0.0 and m.requests_running == m.requests_waiting == 0.0
    assert m.prefix_cache_queries_total == 3.0 and m.generation_tokens_total == 8.0
    assert m.engine_steps_total is not None and m.ttft_count == 1.0
    # no sleep-mode call yet: unknown, never zero
    assert m.sleep_ops == () and m.sleep_ops_in_flight is None


def test_the_same_page_on_a_weight_cache() -> None:
    """Mapped weights change nothing the daemon reads: the KV cache sized alike."""
    disk = parse_metrics((FIX / "after-one-request.txt").read_text())
    cache = parse_metrics((FIX / "weight-cache-after-one-request.txt").read_text())
    assert cache.block_size == disk.block_size
    assert abs((cache.num_gpu_blocks or 0) - (disk.num_gpu_blocks or 0)) <= 1


@pytest.mark.parametrize("log", ["start-disk.log", "start-weight-cache.log"])
def test_a_033_start_goes_through_its_phases_in_order(log: str) -> None:
    seen: list[str] = []
    for message in lines(log):
        phase = phase_of(message)
        if phase is not None and (not seen or seen[-1] != phase):
            seen.append(phase)
    assert seen[0] == "initializing the engine"
    assert seen[-1] == "answering its first health check"
    for phase in ("loading the model", "compiling and warming up", "capturing CUDA graphs",
                  "sizing the KV cache", "starting the API server"):
        assert phase in seen, (phase, seen)
    assert seen.index("loading the model") < seen.index("starting the API server")


def test_the_version_and_the_development_routes_of_a_033_start() -> None:
    messages = lines("start-disk.log")
    assert "0.33.0" in {version_of(m) for m in messages}
    routes = {r for r in map(route_of, messages) if r}
    # VLLM_SERVER_DEV_MODE=1: what the daemon calls is in vLLM's own table
    assert {"/sleep", "/wake_up", "/is_sleeping", "/reset_prefix_cache"} <= routes
    assert {"/health", "/metrics", "/v1/completions"} <= routes


def test_where_the_weights_came_from() -> None:
    cached = [w for w in map(weights_of, lines("start-weight-cache.log")) if w]
    assert cached == ["cache: Mapped 324 tensors from the weight cache daemon "
                      "(zero_copy mode)"]
    assert not [w for w in map(weights_of, lines("start-disk.log")) if w]


def test_the_rust_front_end_logs_no_route_table() -> None:
    """`VLLM_USE_RUST_FRONTEND=1`: the dev routes are served (docs/gpu-validation.md's
    table) but not listed, so the daemon asks them (watchdog/devroutes.py)."""
    messages = lines("start-rust-frontend.log")
    assert not [r for r in map(route_of, messages) if r]
    assert "0.33.0" in {version_of(m) for m in messages}
