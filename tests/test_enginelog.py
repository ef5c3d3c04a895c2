"""vLLM's log lines (verbatim from the vLLM 0.32 CPU engine) parsed into fields."""

from __future__ import annotations

import pytest

from supervisor.engine.enginelog import parse_engine_line

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
