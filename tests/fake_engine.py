"""A small stand-in for vLLM's API server, for fast, scriptable fault tests.

Takes vLLM's --host/--port/--shutdown-timeout (added by the daemon) and switches that
script a fault:
  --startup-delay S     listen only after S seconds (vLLM refuses connections until ready)
  --never-healthy       listen, but /health answers 503
  --crash-after S       exit by itself S seconds after becoming healthy
  --exit-code N         the code for --crash-after (default 0: vLLM can exit 0 unasked)
  --fail-boot           print an error and exit 1 at once
  --ignore-sigterm      ignore SIGTERM (only SIGKILL ends it)
  --child               fork a child in the same process group, like VLLM::EngineCore
  --metrics-file PATH   serve /metrics from this file, read afresh on every request
  --gpu-mib N           that child holds N MiB of GPU memory (torch, CUDA), as EngineCore
                        does; the engine serves only once it is allocated
  --hang-file PATH      while PATH exists, completions hang (a frozen engine: /health
                        and /metrics still answer, as vLLM's do with EngineCore stopped)
  --token-delay S       seconds between streamed tokens (default 0.01)
  --enable-sleep-mode   with VLLM_SERVER_DEV_MODE=1, as vLLM: POST /sleep?level=1,
                        POST /wake_up, GET /is_sleeping; each sleep appends the number of
                        requests running at that moment to <pidfile dir>/sleeps, and
                        completions answer 503 while asleep
  --wake-fails          POST /wake_up answers 500 (and the engine stays asleep)
Completions honour "max_tokens" and "stream" (SSE, one chunk per token, then [DONE]).
On SIGTERM it stops accepting and lets running requests finish for --shutdown-timeout,
as vLLM does. A client that goes away mid-stream is counted in <pidfile dir>/aborts;
the most requests ever running at once is written to <pidfile dir>/max-running.
Serves GET /health, /metrics, /v1/models, POST /v1/completions (one token) and
/reset_prefix_cache (counted in $FAKE_ENGINE_PIDFILE's directory as prefix-resets).
Every request's method and raw target, as received, is appended to <pidfile dir>/requests.
Writes vLLM-shaped log lines, its pid (and the child's) to $FAKE_ENGINE_PIDFILE, its
environment, as JSON, to $FAKE_ENGINE_ENVFILE, and appends its argv as a JSON line to
$FAKE_ENGINE_ARGVFILE.
Stdlib only: it runs under any interpreter.
"""

from __future__ import annotations

import argparse
import http.server
import json
import os
import signal
import sys
import threading
import time


def log(level: str, msg: str, tag: str = "APIServer") -> None:
    stamp = time.strftime("%m-%d %H:%M:%S")
    print(f"({tag} pid={os.getpid()}) {level} {stamp} [fake_engine.py:1] {msg}", flush=True)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--shutdown-timeout", type=float, default=0)
    p.add_argument("--startup-delay", type=float, default=0)
    p.add_argument("--never-healthy", action="store_true")
    p.add_argument("--crash-after", type=float, default=None)
    p.add_argument("--exit-code", type=int, default=0)
    p.add_argument("--fail-boot", action="store_true")
    p.add_argument("--fail-boot-file", default=None)  # fail the boot while this file exists
    p.add_argument("--ignore-sigterm", action="store_true")
    p.add_argument("--child", action="store_true")
    p.add_argument("--gpu-mib", type=int, default=0)
    p.add_argument("--metrics-file", default=None)
    p.add_argument("--hang-file", default=None)
    p.add_argument("--token-delay", type=float, default=0.01)
    p.add_argument("--enable-sleep-mode", action="store_true")
    p.add_argument("--wake-fails", action="store_true")
    a, _engine_args = p.parse_known_args()  # the rest: engine flags, e.g. --max-num-seqs

    log("INFO", f"fake engine starting, args {sys.argv[1:]}")
    if a.fail_boot or (a.fail_boot_file and os.path.exists(a.fail_boot_file)):
        log("ERROR", "EngineCore failed to start: fake boot failure", tag="EngineCore_DP0")
        print("Traceback (most recent call last):\nRuntimeError: fake boot failure",
              file=sys.stderr, flush=True)
        sys.exit(1)
    child_pid = None
    if a.child or a.gpu_mib:
        ready_r, ready_w = os.pipe()
        child_pid = os.fork()
        if child_pid == 0:  # the "engine core": holds its memory, sleeps until killed
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            held = []  # referenced until the process dies, so the memory stays allocated
            if a.gpu_mib:
                import torch

                held.append(torch.empty(a.gpu_mib << 20, dtype=torch.uint8, device="cuda"))
                torch.cuda.synchronize()
            os.write(ready_w, b"1")
            while held is not None:
                time.sleep(3600)
        os.read(ready_r, 1)
    argvfile = os.environ.get("FAKE_ENGINE_ARGVFILE")
    if argvfile:
        with open(argvfile, "a") as f:
            f.write(json.dumps(sys.argv[1:]) + "\n")
    envfile = os.environ.get("FAKE_ENGINE_ENVFILE")
    if envfile:
        with open(envfile, "w") as f:
            json.dump(dict(os.environ), f)
    pidfile = os.environ.get("FAKE_ENGINE_PIDFILE")
    if pidfile:
        with open(pidfile, "a") as f:
            f.write(f"{os.getpid()}\n" + (f"{child_pid}\n" if child_pid else ""))

    stopping = threading.Event()
    sleep_mode = a.enable_sleep_mode and os.environ.get("VLLM_SERVER_DEV_MODE") == "1"
    asleep = threading.Event()
    lock = threading.Lock()
    running = [0, 0]  # now, most ever
    if a.ignore_sigterm:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    else:
        signal.signal(signal.SIGTERM, lambda *_: stopping.set())

    time.sleep(a.startup_delay)

    class Handler(http.server.BaseHTTPRequestHandler):
        def parse_request(self) -> bool:
            ok = super().parse_request()
            if ok and pidfile:
                with open(os.path.join(os.path.dirname(pidfile), "requests"), "a") as f:
                    f.write(f"{self.command} {self.path}\n")
            return ok

        def do_GET(self) -> None:
            code = 503 if a.never_healthy else 200
            body = b"{}" if self.path == "/health" else b'{"fake": true}'
            if self.path == "/v1/models":
                body = b'{"object": "list", "data": [{"id": "fake", "object": "model"}]}'
            if self.path == "/is_sleeping":
                code = 200 if sleep_mode else 404
                body = json.dumps({"is_sleeping": asleep.is_set()}).encode()
            if self.path == "/metrics":
                body = b"# fake engine: no metrics\n"
                if a.metrics_file:
                    with open(a.metrics_file, "rb") as f:
                        body = f.read()
            self.send_response(code)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_POST(self) -> None:
            length = int(self.headers.get("Content-Length") or 0)
            raw = self.rfile.read(length)
            if self.path == "/v1/completions" and asleep.is_set():
                body, code = b'{"error": "the engine is asleep"}', 503
            elif self.path == "/v1/completions":
                try:
                    req = json.loads(raw or b"{}")
                except ValueError:
                    req = {}
                with lock:
                    running[0] += 1
                    peak = max(running[1], running[0])
                    running[1] = peak
                if pidfile:
                    with open(os.path.join(os.path.dirname(pidfile), "max-running"), "w") as f:
                        f.write(str(peak))
                try:
                    while a.hang_file and os.path.exists(a.hang_file) and not stopping.is_set():
                        time.sleep(0.05)
                    if req.get("stream"):
                        self._stream(int(req.get("max_tokens") or 16))
                        return
                    time.sleep(a.token_delay * int(req.get("max_tokens") or 1))
                finally:
                    with lock:
                        running[0] -= 1
                body = json.dumps({"object": "text_completion", "model": "fake",
                                   "choices": [{"index": 0, "text": "x"}]}).encode()
                code = 200
            elif self.path == "/sleep?level=1" and sleep_mode:
                asleep.set()
                if pidfile:
                    with open(os.path.join(os.path.dirname(pidfile), "sleeps"), "a") as f:
                        f.write(f"{running[0]}\n")
                body, code = b"", 200
            elif self.path == "/wake_up" and sleep_mode:
                if not a.wake_fails:
                    asleep.clear()
                body, code = (b'{"error": "fake wake failure"}', 500) if a.wake_fails \
                    else (b"", 200)
            elif self.path == "/reset_prefix_cache" and pidfile:
                with open(os.path.join(os.path.dirname(pidfile), "prefix-resets"), "a") as f:
                    f.write("1\n")
                body, code = b'{"success": true}', 200
            else:
                body, code = b'{"error": "not found"}', 404
            self.send_response(code)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def _stream(self, tokens: int) -> None:
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.send_header("X-Fake-Engine", "1")
            self.end_headers()
            try:
                for i in range(tokens):
                    chunk = {"choices": [{"index": 0, "text": f"t{i} "}]}
                    self.wfile.write(f"data: {json.dumps(chunk)}\n\n".encode())
                    self.wfile.flush()
                    time.sleep(a.token_delay)
                self.wfile.write(b"data: [DONE]\n\n")
                self.wfile.flush()
            except (BrokenPipeError, ConnectionResetError):
                if pidfile:
                    with open(os.path.join(os.path.dirname(pidfile), "aborts"), "a") as f:
                        f.write("1\n")

        def log_message(self, *args: object) -> None:
            pass

    srv = http.server.ThreadingHTTPServer((a.host, a.port), Handler)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    log("INFO", f"Uvicorn running on http://{a.host}:{a.port}")
    deadline = time.monotonic() + a.crash_after if a.crash_after is not None else None
    while not stopping.is_set():
        if deadline is not None and time.monotonic() >= deadline:
            log("ERROR", "engine core died (fake crash)", tag="EngineCore_DP0")
            if child_pid:
                os.kill(child_pid, signal.SIGKILL)
            os._exit(a.exit_code)
        stopping.wait(0.05)
    log("INFO", f"shutting down (drain up to {a.shutdown_timeout:g} s)")
    srv.shutdown()
    srv.socket.close()  # new connections are refused from now, as vLLM's are
    drain_until = time.monotonic() + a.shutdown_timeout
    while running[0] > 0 and time.monotonic() < drain_until:
        time.sleep(0.02)
    if child_pid:
        os.kill(child_pid, signal.SIGTERM)
        os.waitpid(child_pid, 0)
    sys.exit(0)


if __name__ == "__main__":
    main()
