"""An engine's weight cache as command lines: the `vllm preload` that keeps the engine's
weights (`engine.weight_cache`, docs/weight-cache.md), the arguments that make an engine
map them, and the checks of both (`supervisor/settings/config.py` runs them at every load and
reload). Pure: text in, text out; nothing here reads a file or the machine.

vLLM (0.31 and later) ships `vllm preload`: one process per local GPU rank holds the
model's processed weights in GPU memory and hands CUDA IPC handles to engines started
with `--load-format ipc_cache`, over Unix sockets in `--weight-cache-socket-dir` (named
from each GPU's UUID). The cache fingerprints what it holds (`WeightCacheKey` in vLLM's
`weight_cache/protocol.py`: the checkpoint's safetensors headers, else the model path;
the architecture; tensor, pipeline and data parallel sizes and ranks; dtype;
quantization and its config; the RoPE parameters; the KV cache dtype and the layers it
skips; the revision; vLLM's version; expert parallelism and its placement; the MoE and
linear kernel backends), and an engine whose fingerprint differs loads from disk. So the
flags that feed the fingerprint (and those the model's config needs to be read at all)
are copied from the engine's arguments to the cache's (`SHAPING`, `SWITCHES`); anything
else goes in `engine.weight_cache_args`. A `--config FILE` of the engine is not read.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Protocol

from supervisor.settings import engine_checks

# flags copied with their value (the short forms are vLLM's own)
SHAPING: dict[str, str] = {
    "-tp": "--tensor-parallel-size", "-pp": "--pipeline-parallel-size",
    "-dp": "--data-parallel-size", "-dpl": "--data-parallel-size-local",
    "-q": "--quantization", "-sc": "--speculative-config",
    **{f: f for f in (
        "--tensor-parallel-size", "--pipeline-parallel-size", "--data-parallel-size",
        "--data-parallel-size-local", "--quantization", "--quantization-config",
        "--speculative-config", "--tokenizer", "--revision", "--code-revision",
        "--dtype", "--hf-config-path", "--config-format", "--hf-overrides",
        "--download-dir", "--max-model-len", "--kv-cache-dtype",
        "--expert-placement-strategy", "--moe-backend", "--linear-backend",
        "--kernel-config")}}
# ... with every value up to the next flag (vLLM's list-valued flags)
SHAPING_LISTS = frozenset({"--kv-cache-dtype-skip-layers"})
# flags copied alone (no value)
SWITCHES: dict[str, str] = {
    "-ep": "--enable-expert-parallel",
    **{f: f for f in ("--trust-remote-code", "--no-trust-remote-code",
                      "--enable-expert-parallel", "--no-enable-expert-parallel")}}
# what the daemon sets on an engine with a weight cache, and on the cache itself
ENGINE_FLAGS = ("--load-format", "--model-loader-extra-config")
CACHE_FLAGS = ("--model", "--weight-cache-socket-dir", "--weight-cache-health-host",
               "--weight-cache-health-port", *ENGINE_FLAGS)
HEALTH_HOST = "127.0.0.1"  # the cache's /health: loopback only (vLLM's default is 0.0.0.0)
# vLLM's socket name in the directory: vllm_weight_cache_<md5 of the GPU's UUID, 32 hex>
# with `_draft` for a speculative draft's group, `.sock`; a Unix socket's path is at
# most 107 bytes (108 with its NUL)
SOCKET_NAME_LEN = len("vllm_weight_cache_") + 32 + len("_draft") + len(".sock")
SOCKET_PATH_MAX = 107


class CachedEngine(engine_checks.CheckedEngine, Protocol):
    @property
    def weight_cache(self) -> bool: ...
    @property
    def weight_cache_command(self) -> list[str]: ...
    @property
    def weight_cache_args(self) -> list[str]: ...


def _name(token: str) -> str:
    """A flag as vLLM reads it: `--flag=value` is `--flag`, `--a_b` is `--a-b`."""
    name = token.split("=", 1)[0]
    return "--" + name[2:].replace("_", "-") if name.startswith("--") else name


def has_flag(argv: list[str], flag: str) -> bool:
    return any(a.startswith("-") and _name(a) == flag for a in argv)


def model_of(command: list[str], args: list[str]) -> str | None:
    """The model the engine serves, as vLLM reads it: `--model M`, else `serve M`."""
    argv = [*command, *args]
    found = None
    for i, a in enumerate(argv):
        if _name(a) == "--model":
            found = a.split("=", 1)[1] if "=" in a else (
                argv[i + 1] if i + 1 < len(argv) else None)
    if found is not None:
        return found
    if "serve" in argv:
        rest = argv[argv.index("serve") + 1:]
        if rest and not rest[0].startswith("-"):
            return rest[0]
    return None


def cli_prefix(command: list[str]) -> list[str] | None:
    """The argv that runs vLLM's command line, read from the engine's: what precedes
    `serve`, or the interpreter of the older module form (`python -m
    vllm.entrypoints.openai.api_server`) on vLLM's CLI module; None when neither."""
    if "serve" in command:
        return command[:command.index("serve")] or None
    for i, a in enumerate(command[:-1]):
        if a == "-m" and command[i + 1] == "vllm.entrypoints.openai.api_server":
            return [*command[:i], "-m", "vllm.entrypoints.cli.main"]
    return None


def shaping(argv: list[str]) -> list[str]:
    """The flags of `argv` that shape the weights (`SHAPING`, `SHAPING_LISTS`,
    `SWITCHES`), with their values, in their order, each in vLLM's long spelling."""
    out: list[str] = []
    i = 0
    while i < len(argv):
        a = argv[i]
        name = _name(a) if a.startswith("-") else ""
        if name in SWITCHES:
            out.append(SWITCHES[name])
        elif name in SHAPING:
            if "=" in a:
                out.append(f"{SHAPING[name]}={a.split('=', 1)[1]}")
            elif i + 1 < len(argv):
                out += [SHAPING[name], argv[i + 1]]
                i += 1
        elif name in SHAPING_LISTS:
            out.append(a)
            while "=" not in a and i + 1 < len(argv) and not argv[i + 1].startswith("-"):
                out.append(argv[i + 1])
                i += 1
        i += 1
    return out


def socket_dir(runtime_dir: str, engine: str) -> str:
    """The folder of an engine's cache sockets, the daemon's own (mode 0700)."""
    return str(Path(runtime_dir) / f"wc-{engine}")


def preload_argv(engine: CachedEngine, sockets: str, port: int | str) -> list[str]:
    """The cache's command line: vLLM's CLI, `preload`, the model, the flags that shape
    the weights as the engine gives them, the operator's own, then the socket folder
    and the health port (or the place where its spawn puts the one it picks).
    ValueError when the engine's settings do not say them (refused at load: `check`)."""
    prefix = list(engine.weight_cache_command) or cli_prefix(engine.command)
    model = model_of(engine.command, engine.args)
    if prefix is None or model is None:
        raise ValueError("the engine's command does not say how to run vLLM or which model")
    return [*prefix, "preload", "--model", model,
            *shaping([*engine.command, *engine.args]),
            *engine.weight_cache_args, "--weight-cache-socket-dir", sockets,
            "--weight-cache-health-host", HEALTH_HOST,
            "--weight-cache-health-port", str(port)]


def load_args(sockets: str) -> tuple[str, ...]:
    """What an engine's start adds to map the cache's weights: vLLM's `ipc_cache` loader
    on the daemon's socket folder, zero copy, and a load from disk should the cache not
    answer or hold other weights (vLLM's own fallback)."""
    extra = {"socket_dir": sockets, "mode": "zero_copy", "fallback": True}
    return ("--load-format", "ipc_cache", "--model-loader-extra-config",
            json.dumps(extra, separators=(",", ":")))


def check(key: str, engine: CachedEngine, problems: list[str]) -> None:
    """A weight cache the engine's settings cannot keep: no model or way to run vLLM's
    CLI to read, flags the daemon sets itself, or sleep mode (vLLM's `ipc_cache` loader:
    sleep mode's weight offloading must not be used with the zero-copy weights, and the
    daemon's sleeping standby, its warm-up sleep and its KV reset all sleep the engine)."""
    if not engine.weight_cache:
        for k in ("weight_cache_command", "weight_cache_args"):
            if getattr(engine, k):
                problems.append(f"{key}.{k}: needs {key}.weight_cache = true")
        return
    lines = [(f"{key}.args", engine_checks.argv(engine))]
    if engine.standby_args:
        lines.append((f"{key}.standby_args", engine_checks.standby_argv(engine)))
    for where, line in lines:
        for flag in ENGINE_FLAGS:
            if has_flag(line, flag):
                problems.append(f"{where}: {flag} is set by the daemon with "
                                f"{key}.weight_cache (ipc_cache while the cache answers, "
                                "vLLM's default otherwise); remove it")
        if has_flag(line, "--enable-sleep-mode"):
            problems.append(f"{where}: --enable-sleep-mode cannot be used with "
                            f"{key}.weight_cache: the engine maps the cache's weights "
                            "(zero copy) and vLLM's sleep mode must not offload them; the "
                            "daemon's KV reset and warm-up sleep would (a restart, cheaper "
                            "with the cache, takes the KV reset's place)")
    if engine.standby == "sleep":
        problems.append(f'{key}.standby: "sleep" cannot be used with {key}.weight_cache '
                        "(vLLM's sleep mode must not offload weights mapped from the "
                        'cache); "awake" can: both engines map the cache\'s one copy')
    if model_of(engine.command, engine.args) is None:
        problems.append(f"{key}.weight_cache: the model cannot be read from {key}.command "
                        f"and {key}.args (`serve MODEL` or `--model MODEL`), and the "
                        "cache's `vllm preload` needs it")
    if not engine.weight_cache_command and cli_prefix(engine.command) is None:
        problems.append(f"{key}.weight_cache_command: required: {key}.command is neither "
                        "`... serve MODEL` nor `python -m vllm.entrypoints.openai."
                        "api_server`; give the argv that runs vLLM's command line, "
                        'e.g. ["/opt/vllm/bin/vllm"]')
    for flag in CACHE_FLAGS:
        if has_flag(engine.weight_cache_args, flag):
            problems.append(f"{key}.weight_cache_args: {flag} is set by the daemon")


def check_socket_dir(key: str, sockets: str, problems: list[str]) -> None:
    """vLLM names its sockets in the folder: the folder's path must leave them room."""
    room = SOCKET_PATH_MAX - SOCKET_NAME_LEN - 1
    if len(sockets.encode()) > room:
        problems.append(f"daemon.runtime_dir: {key}.weight_cache's sockets go in {sockets} "
                        f"({len(sockets.encode())} bytes), and vLLM's socket names need "
                        f"that folder to be at most {room} bytes long (a Unix socket's "
                        f"path is at most {SOCKET_PATH_MAX}): a shorter runtime_dir or "
                        "engine name")
