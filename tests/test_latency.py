"""Client latency at the proxy: bucketing, label bounding, and the exposition it makes;
the model names an engine serves, read from its arguments."""

from __future__ import annotations

import pytest
from prometheus_client.parser import text_string_to_metric_families

from supervisor.front.latency import KINDS, ClientLatency, Histogram
from supervisor.ops.exposition import ExporterView, ProxyView, render_metrics
from supervisor.settings.sections import EngineConfig


def test_a_value_on_a_bound_counts_in_that_bucket_and_cumulative_ends_with_inf() -> None:
    h = Histogram((0.1, 1.0))
    for v in (0.05, 0.1, 0.5, 1.0, 7.0):
        h.observe(v)
    assert h.cumulative() == [(0.1, 2), (1.0, 4), (float("inf"), 5)]
    assert h.n == 5 and h.total == pytest.approx(8.65)


def test_only_served_model_names_become_labels() -> None:
    lat = ClientLatency(["tiny-llama"])
    assert lat.label("tiny-llama") == "tiny-llama"
    for junk in ("x" * 10_000, "other-model", None, 7, ["tiny-llama"]):
        assert lat.label(junk) == "other"


def test_every_kind_renders_as_a_histogram_by_model_and_unused_kinds_stay_valid() -> None:
    lat = ClientLatency(["m"])
    lat.observe("ttft", "m", 0.3)
    lat.observe("ttft", "m", 42.0)
    lat.observe("stream_gap", "other", 0.02)
    view = ExporterView(
        state="RUNNING", ready=True, throttle_level=0, restarts_by_reason={},
        trips_by_rule={}, actions_by_kind={}, last_decision_wall=None, policy_paused=False,
        dry_run=False, engine_uptime_s=1.0, gauges=[],
        proxy=ProxyView(responses_by_code={}, rejections_by_reason={}, in_flight=0, held=0,
                        connect_retries=0, latency=lat.views()))
    text = render_metrics(view).decode()
    fams = {f.name: f for f in text_string_to_metric_families(text)}
    for kind in KINDS:
        assert fams["vllm_supervisor_" + kind.metric].type == "histogram"
    m = {(s.name, tuple(sorted(s.labels.items()))): s.value
         for f in fams.values() for s in f.samples}
    ttft = "vllm_supervisor_client_ttft_seconds"
    assert m[(ttft + "_count", (("model", "m"),))] == 2
    assert m[(ttft + "_sum", (("model", "m"),))] == pytest.approx(42.3)
    assert m[(ttft + "_bucket", (("le", "0.5"), ("model", "m")))] == 1
    assert m[(ttft + "_bucket", (("le", "60"), ("model", "m")))] == 2
    gap = "vllm_supervisor_client_stream_gap_seconds"
    assert m[(gap + "_bucket", (("le", "0.025"), ("model", "other")))] == 1


@pytest.mark.parametrize(("command", "args", "names"), [
    (["python", "-m", "vllm.entrypoints.openai.api_server"],
     ["--model", "models/tiny", "--served-model-name", "tiny", "tiny-alias", "--dtype", "f"],
     ("tiny", "tiny-alias")),
    (["python", "-m", "vllm.entrypoints.openai.api_server"], ["--model=org/m"], ("org/m",)),
    (["vllm", "serve", "models/tiny"], ["--max-model-len", "512"], ("models/tiny",)),
    (["vllm", "serve", "models/tiny"], ["--served-model-name=t"], ("t",)),
    (["vllm", "serve"], ["--port-less-flag"], ()),
])
def test_served_models_are_read_from_the_arguments_as_vllm_reads_them(
        command: list[str], args: list[str], names: tuple[str, ...]) -> None:
    assert EngineConfig(command=command, args=args).served_models() == names
