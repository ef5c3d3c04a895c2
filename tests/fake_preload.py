"""A small stand-in for `vllm preload` (vLLM 0.31+'s weight cache), for the weight
cache's component tests, and the engine's side of it for tests/fake_engine.py.

`tests/fake_engine.py preload ARGS` runs `main`: the launcher and one "rank" per
--tensor-parallel-size (default 1), each a forked child in the launcher's process group
that listens on a Unix socket in --weight-cache-socket-dir named as vLLM names it
(`vllm_weight_cache_<md5 of its GPU's UUID>.sock`; the GPUs here are `GPU-fake-<rank>`),
and the launcher's GET /health on --weight-cache-health-host/--weight-cache-health-port:
503 until every rank listens, 200 then, 503 again once one has exited, as vLLM's. The
launcher exits once every rank has (their worst code), or on SIGTERM after terminating
them. Switches (the rest of vLLM's engine arguments are accepted and ignored):
  --load-delay S        the ranks listen only after S seconds (loading the weights)
  --fail-boot-file P    while P exists: vLLM's error on a host without CUDA, exit 1
  --rank-dies-after S   rank 0 exits S seconds after it listens; the launcher stays
Writes its pid and its ranks' to <dir of $FAKE_ENGINE_PIDFILE>/preload.pids and its argv
as a JSON line to preload.argv there.

`map_weights` is the engine's `--load-format ipc_cache` loader: it asks rank 0 for the
model's weights ("get_state MODEL"; a rank of another model answers a mismatch), says
where they came from as vLLM does ("Mapped N tensors from the weight cache daemon
(zero_copy mode)", or "Weight cache unusable (...); falling back to disk loading"), and
then watches the rank: when it exits, the engine says so and serves on (with zero copy,
the CUDA driver keeps the mapped weights alive). The two speak one line a request:
theirs, not vLLM's pickle. Stdlib only.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import http.server
import json
import os
import select
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable

from supervisor.watchdog.relaunch import arg_value  # (the repo root is on the path: fake_engine.py)

TENSORS = 291  # (Llama-3.1-8B's parameter count, as vLLM would map them)


def socket_name(rank: int) -> str:
    return f"vllm_weight_cache_{hashlib.md5(f'GPU-fake-{rank}'.encode()).hexdigest()}.sock"


def _log(level: str, msg: str, tag: str = "MainProcess") -> None:
    stamp = time.strftime("%m-%d %H:%M:%S")
    print(f"({tag} pid={os.getpid()}) {level} {stamp} [preload.py:1] {msg}", flush=True)


def _rank(rank: int, model: str, sockets: str, delay: float, dies_after: float | None,
          ready_w: int) -> None:
    """One rank: loads (waits), listens, answers; never returns."""
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    time.sleep(delay)
    path = os.path.join(sockets, socket_name(rank))
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(path)
    os.chmod(path, 0o600)
    server.listen()
    _log("INFO", f"Weight cache target daemon rank {rank} serving on {path}",
         tag=f"vllm-weight-cache-target-{rank}")
    os.write(ready_w, b"1")
    if dies_after is not None:
        threading.Timer(dies_after, os._exit, args=(3,)).start()
    watchers: list[socket.socket] = []  # held open for as long as this rank lives
    while True:
        conn, _ = server.accept()
        request = conn.makefile("r").readline().split()
        if request[:1] == ["get_state"]:
            asked = request[1] if len(request) > 1 else ""
            conn.sendall(f"ok {TENSORS}\n".encode() if asked == model
                         else b"mismatch ['checkpoint']\n")
        elif request[:1] == ["watch"]:
            conn.sendall(b"ok\n")
            watchers.append(conn)
            continue
        else:
            conn.sendall(b"error unknown command\n")
        conn.close()


def main(argv: list[str]) -> None:
    p = argparse.ArgumentParser(prog="fake preload")
    p.add_argument("--model", required=True)
    p.add_argument("--weight-cache-socket-dir", required=True)
    p.add_argument("--weight-cache-health-host", default="0.0.0.0")
    p.add_argument("--weight-cache-health-port", type=int, default=None)
    p.add_argument("--tensor-parallel-size", type=int, default=1)
    p.add_argument("--load-delay", type=float, default=0.0)
    p.add_argument("--fail-boot-file", default=None)
    p.add_argument("--rank-dies-after", type=float, default=None)
    a, _rest = p.parse_known_args(argv)
    pidfile = os.environ.get("FAKE_ENGINE_PIDFILE")
    here = os.path.dirname(pidfile) if pidfile else None
    if here:
        with open(os.path.join(here, "preload.argv"), "a") as f:
            f.write(json.dumps(argv) + "\n")
    if a.fail_boot_file and os.path.exists(a.fail_boot_file):
        print("Traceback (most recent call last):\nvllm.model_executor.model_loader."
              "weight_cache.protocol.UnsupportedPlatformForIPCError: platform 'cpu' does "
              "not support CUDA IPC weight sharing", file=sys.stderr, flush=True)
        sys.exit(1)
    os.makedirs(a.weight_cache_socket_dir, mode=0o700, exist_ok=True)
    ready_r, ready_w = os.pipe()
    ranks: dict[int, int | None] = {}  # pid -> exit code (None: alive)
    for rank in range(a.tensor_parallel_size):
        pid = os.fork()
        if pid == 0:
            try:
                _rank(rank, a.model, a.weight_cache_socket_dir, a.load_delay,
                      a.rank_dies_after if rank == 0 else None, ready_w)
            finally:
                os._exit(1)
        ranks[pid] = None
    if here:
        with open(os.path.join(here, "preload.pids"), "a") as f:
            f.write("".join(f"{x}\n" for x in (os.getpid(), *ranks)))
    ready = threading.Event()
    stopping = threading.Event()

    def healthy() -> bool:
        return ready.is_set() and all(code is None for code in ranks.values())

    if a.weight_cache_health_port is not None:
        _serve_health(a.weight_cache_health_host, a.weight_cache_health_port, healthy)

    def stop(*_: object) -> None:
        stopping.set()
        for pid, code in ranks.items():
            if code is None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGTERM)

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    os.close(ready_w)  # (the ranks hold it)
    got = 0
    while got < len(ranks) and not stopping.is_set() and not _reap(ranks):
        readable, _, _ = select.select([ready_r], [], [], 0.05)
        if readable:
            got += len(os.read(ready_r, 16))
    if got >= len(ranks) and all(code is None for code in ranks.values()):
        ready.set()
        _log("INFO", f"===== Weight cache daemon READY: node 0/1 serving {len(ranks)} local "
             f"rank(s) x 1 role(s) in {a.weight_cache_socket_dir} =====")
    while any(code is None for code in ranks.values()):  # (as vLLM joins every rank)
        time.sleep(0.05)
        for pid in _reap(ranks):
            _log("ERROR" if not stopping.is_set() else "INFO",
                 f"Weight cache daemon rank (pid {pid}) exited with {ranks[pid]}")
    sys.exit(max(c if c is not None and c > 0 else 0 for c in ranks.values()))


def _reap(ranks: dict[int, int | None]) -> list[int]:
    """The ranks that exited since the last look (their codes noted)."""
    gone = []
    for pid, code in ranks.items():
        if code is None:
            with contextlib.suppress(ChildProcessError):
                done, status = os.waitpid(pid, os.WNOHANG)
                if done:
                    ranks[pid] = os.waitstatus_to_exitcode(status)
                    gone.append(pid)
    return gone


def _serve_health(host: str, port: int, healthy: Callable[[], bool]) -> None:
    class Health(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            code = 200 if self.path == "/health" and healthy() else (
                503 if self.path == "/health" else 404)
            self.send_response(code)
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, *args: object) -> None:
            pass

    srv = http.server.ThreadingHTTPServer((host, port), Health)
    threading.Thread(target=srv.serve_forever, daemon=True).start()


# ---- the engine's side: `--load-format ipc_cache` --------------------------------------


def model_of(argv: list[str]) -> str:
    model = arg_value(argv, "--model")
    if model is None and "serve" in argv and argv.index("serve") + 1 < len(argv):
        model = argv[argv.index("serve") + 1]
    return model or "fake"


class _Mismatch(Exception):
    """The cache holds other weights (vLLM: `CacheConfigMismatchError`)."""


def map_weights(argv: list[str], log: Callable[..., None]) -> str:
    """Where the engine's weights come from: "cache" (mapped from the weight cache) or
    "disk"; exits 1 when the cache is asked for without a fallback and does not answer."""
    if arg_value(argv, "--load-format") != "ipc_cache":
        return "disk"
    extra = json.loads(arg_value(argv, "--model-loader-extra-config") or "{}")
    path = os.path.join(extra.get("socket_dir", ""), socket_name(0))
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.settimeout(5.0)
            s.connect(path)
            s.sendall(f"get_state {model_of(argv)}\n".encode())
            answer = s.makefile("r").readline().strip().split(maxsplit=1)
        if answer[:1] != ["ok"]:
            raise _Mismatch(f"WeightCacheKey mismatch on fields: {' '.join(answer[1:])}")
        tensors = int(answer[1])
    except (OSError, ValueError, IndexError, _Mismatch) as exc:
        why = str(exc) if isinstance(exc, _Mismatch) \
            else f"Cannot connect to weight cache daemon at {path}: {exc}"
        if not extra.get("fallback", True):
            log("ERROR", f"Weight cache unavailable: {why}", "EngineCore_DP0")
            sys.exit(1)
        log("WARNING", f"Weight cache unusable ({why}); falling back to disk loading",
            "EngineCore_DP0")
        return "disk"
    log("INFO", f"Mapped {tensors} tensors from the weight cache daemon "
        f"({extra.get('mode', 'zero_copy')} mode)", "EngineCore_DP0")
    _watch(path, log)
    return "cache"


def _watch(path: str, log: Callable[..., None]) -> None:
    """As vLLM's loader: one connection held open; its end is the cache's exit."""
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        conn.connect(path)
        conn.sendall(b"watch\n")
        conn.recv(3)
    except OSError:
        conn.close()
        return

    def wait() -> None:
        with conn, contextlib.suppress(OSError):
            while conn.recv(1):
                pass
        log("WARNING", f"Weight cache daemon at {path} exited. This engine keeps serving: "
            "the CUDA driver keeps its mapped weights alive until the engine exits.",
            "EngineCore_DP0")

    threading.Thread(target=wait, daemon=True).start()
