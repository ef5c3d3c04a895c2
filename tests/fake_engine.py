"""A small stand-in for vLLM's API server, for fast, scriptable fault tests.

Takes vLLM's --host/--port/--shutdown-timeout (added by the daemon) and switches that
script a fault:
  --startup-delay S     listen only after S seconds (vLLM refuses connections until ready)
  --never-healthy       listen, but /health answers 503
  --crash-after S       exit by itself S seconds after becoming healthy
  --exit-code N         the code for --crash-after (default 0: vLLM can exit 0 unasked)
  --fail-boot           print an error and exit 1 at once
  --ignore-sigterm      ignore SIGTERM (only SIGKILL ends it)
  --child               fork a child in the same process group, titled VLLM::EngineCore
  --metrics-file PATH   serve /metrics from this file, read afresh on every request
  --gpu-mib N           that child holds N MiB of GPU memory (torch, CUDA), as EngineCore
                        does; the engine serves only once it is allocated
  --hang-file PATH      while PATH exists, completions hang (a frozen engine: /health
                        and /metrics still answer, as vLLM's do with EngineCore stopped)
  --watchdog-config J   vLLM 0.33's stack-dump watchdog ({"timeout": T, "check_interval":
                        C, "dump_dir": D}; T and C whole seconds above 0, else it refuses
                        to start, as vLLM's config check does): the "engine core" (the
                        --child, else this process) appends a dump of all its threads'
                        stacks to D/VLLM_STACK_DUMP_for_engine_0_<its pid>.log in vLLM's
                        format when the hang file appears (its stall; not T seconds later,
                        so that a test does not race the daemon's own deadline), and when
                        SIGTERM reaches it
  --token-delay S       seconds between streamed tokens (default 0.01)
  --answer-delay S      seconds before a stream's answer begins, its headers included (vLLM's
                        API server answering late under load; default 0)
  --first-token-delay S seconds before a stream's first token (its prefill; default 0):
                        a fault meets a stream that has sent nothing yet
  --enable-sleep-mode   with VLLM_SERVER_DEV_MODE=1, as vLLM: POST /sleep?level=1,
                        POST /wake_up, GET /is_sleeping; each sleep appends the number of
                        requests running at that moment to <pidfile dir>/sleeps, and
                        completions answer 503 while asleep; from its first sleep or
                        wake /metrics carries vLLM's (0.32+) sleep-mode series as its API
                        server prints them (less the `_created` stamps):
                        vllm:sleep_mode_operation_duration_seconds
                        {operation} (a histogram of each call's seconds) and
                        vllm:sleep_mode_operations_in_flight{operation}
  --wake-fails          POST /wake_up answers 500 (and the engine stays asleep)
  --dev-routes LIST     which of vLLM's development routes it serves with
                        VLLM_SERVER_DEV_MODE=1 (comma-separated paths; default "all":
                        /reset_prefix_cache, /sleep, /wake_up, /is_sleeping,
                        /collective_rpc; "none": a front end without them, as vLLM 0.33's
                        Rust one may be). Without VLLM_SERVER_DEV_MODE=1 it serves none,
                        as vLLM. A GET of a POST-only one answers 405, of one not served
                        404, as vLLM's routers do
  --first-sleep-delay S the first sleep answers after S seconds, later ones at once (vLLM
                        pins the weights in host RAM at an engine's first sleep)
  --logprobs            a non-streamed answer carries vLLM-shaped logprobs when asked
  --wrong-after-wake    ... of other tokens once it was woken (a wake that broke it)
  --spec-acceptance R   speculative decoding's counters on /metrics (2 draft tokens a
                        token generated, a share R accepted); --drafts-broken-after-wake
                        (or the wake fault file's "drafts"): none accepted once woken
  --wake-fault-file PATH  while PATH exists, a wake does what it says: "fail" (as
                        --wake-fails) or "wrong" (as --wrong-after-wake, from that wake on)
  --die-on-prompt TEXT  a completion whose prompt holds TEXT (as text or as its token ids,
                        as a continuation sends it) gets no answer: the engine
                        exits 1 0.3 s after it arrives (a request that kills vLLM)
  --die-answering       ... answered as any other until then (its first tokens sent)
  --fault-file PATH     when PATH appears, it is read and removed, and every stream in
                        flight at that moment meets the fault it names: "cut" (the
                        connection closed mid-answer), "error" (vLLM's error event, then
                        [DONE]), "die" (the error event; then /health answers 503 and
                        completions 500 for 0.5 s, then the engine exits 1), "exit" (the
                        engine exits 1 at once), "stall" (no more tokens, the engine
                        healthy, until the client goes)
Completions and chat completions honour "max_tokens" and "stream" (SSE, vLLM-shaped
chunks, one per token, finish_reason "length" on the last, then [DONE]), and
"return_token_ids", "stream_options" (include_usage, continuous_usage_stats). Tokens are
deterministic: each is a function of the whole sequence before it (prompt included), so
a continuation (prompt + delivered tokens as the prompt) yields what an uninterrupted
answer would; a token's text is "t<id> ". A string prompt's token ids are its characters'.
On SIGTERM it stops accepting and lets running requests finish for --shutdown-timeout,
as vLLM does. A client that goes away mid-stream is counted in <pidfile dir>/aborts;
the most requests ever running at once is written to <pidfile dir>/max-running.
Serves GET /health, /metrics, /v1/models, POST /v1/completions (one token) and, with
VLLM_SERVER_DEV_MODE=1, /reset_prefix_cache (counted in $FAKE_ENGINE_PIDFILE's directory
as prefix-resets); any other GET answers 200.
`preload ARGS` runs a stand-in for `vllm preload` instead (tests/fake_preload.py), and
`--load-format ipc_cache --model-loader-extra-config JSON` maps the weights from it,
appending "<pid> cache" (or "disk") to <pidfile dir>/loads.
Every request's method and raw target, as received, is appended to <pidfile dir>/requests.
Writes vLLM-shaped log lines, its pid (and the child's) to $FAKE_ENGINE_PIDFILE, its
environment, as JSON, to $FAKE_ENGINE_ENVFILE, and appends its argv as a JSON line to
$FAKE_ENGINE_ARGVFILE. With VLLM_CACHE_ROOT, each start appends a line to
$VLLM_CACHE_ROOT/torch_compile_cache/fake/starts.log (what vLLM compiled, kept there).
Stdlib only: it runs under any interpreter.
"""

from __future__ import annotations

import argparse
import http.server
import json
import os
import select
import signal
import socket
import sys
import threading
import time
from pathlib import Path
from typing import Any


def log(level: str, msg: str, tag: str = "APIServer") -> None:
    stamp = time.strftime("%m-%d %H:%M:%S")
    print(f"({tag} pid={os.getpid()}) {level} {stamp} [fake_engine.py:1] {msg}", flush=True)


def set_title(title: str) -> None:
    """The process's name as ps and psutil show it (Linux prctl PR_SET_NAME)."""
    import contextlib
    import ctypes

    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None).prctl(15, title.encode()[:15], 0, 0, 0)


def main() -> None:
    if sys.argv[1:2] == ["preload"]:  # `vllm preload`: the weight cache's stand-in
        sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
        from tests import fake_preload
        fake_preload.main(sys.argv[2:])
        return
    # (run as a script, its own folder is on the path: what vLLM 0.32-0.33 added)
    from fake_engine_033 import SleepModeMetrics, StackDumper, watchdog_config

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
    p.add_argument("--first-token-delay", type=float, default=0)
    p.add_argument("--answer-delay", type=float, default=0)
    p.add_argument("--enable-sleep-mode", action="store_true")
    p.add_argument("--wake-fails", action="store_true")
    p.add_argument("--dev-routes", default="all")
    p.add_argument("--first-sleep-delay", type=float, default=0)
    p.add_argument("--logprobs", action="store_true")  # answers them (a greedy golden)
    p.add_argument("--wrong-after-wake", action="store_true")  # other tokens once woken
    p.add_argument("--wake-fault-file", default=None)
    # speculative decoding's counters on /metrics: this share of draft tokens accepted;
    # none once a wake broke the drafts (--drafts-broken-after-wake, or the wake fault
    # file's "drafts")
    p.add_argument("--spec-acceptance", type=float, default=None)
    p.add_argument("--drafts-broken-after-wake", action="store_true")
    p.add_argument("--fault-file", default=None)
    p.add_argument("--die-on-prompt", default=None)
    p.add_argument("--die-answering", action="store_true")
    p.add_argument("--served-model-name", default="fake")  # the one name it answers to
    p.add_argument("--watchdog-config", default=None)  # vLLM 0.33's stack dumps
    a, _engine_args = p.parse_known_args()  # the rest: engine flags, e.g. --max-num-seqs
    watchdog = watchdog_config(a.watchdog_config)
    if watchdog is not None and watchdog["dump_dir"]:
        log("INFO", f"[Watchdog]Start with timeout={watchdog['timeout']} check_interval="
            f"{watchdog['check_interval']} dump_dir={watchdog['dump_dir']}",
            tag="EngineCore_DP0")
    else:
        watchdog = None

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
            set_title("VLLM::EngineCore")  # (comm keeps 15 bytes, as for vLLM's)
            if watchdog is not None:  # it dumps its stacks at a stall and at SIGTERM
                core = StackDumper(watchdog, log)

                def dumped_and_gone(*_: object) -> None:
                    core.dump("SIGTERM")
                    os._exit(0)
                signal.signal(signal.SIGTERM, dumped_and_gone)
                threading.Thread(target=core.watch_hang, args=(a.hang_file, threading.Event()),
                                 daemon=True).start()
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
    # vLLM's development routes: only with VLLM_SERVER_DEV_MODE=1, and those --dev-routes
    # names; each path and the method it takes
    dev = {"/reset_prefix_cache": "POST", "/sleep": "POST", "/wake_up": "POST",
           "/is_sleeping": "GET", "/collective_rpc": "POST"}
    if os.environ.get("VLLM_SERVER_DEV_MODE") != "1" or a.dev_routes == "none":
        dev = {}
    elif a.dev_routes != "all":
        dev = {r: m for r, m in dev.items() if r in a.dev_routes.split(",")}
    sleep_mode = a.enable_sleep_mode and "/sleep" in dev
    asleep = threading.Event()
    slept_once = threading.Event()
    wrong = threading.Event()  # a wake broke it: other tokens from then on
    drafts_broken = threading.Event()  # a wake zeroed its draft model: nothing accepted
    spec = [0.0, 0.0]  # speculative decoding's draft tokens, and those accepted
    sleep_metrics = SleepModeMetrics()  # vLLM's (0.32+) count of its sleep and wake calls

    def drafted(n: int) -> None:
        """n tokens generated: 2 drafted for each, a share --spec-acceptance accepted."""
        if a.spec_acceptance is not None:
            with lock:
                spec[0] += 2 * n
                spec[1] += 0 if drafts_broken.is_set() else 2 * n * a.spec_acceptance
    lock = threading.Lock()
    running = [0, 0]  # now, most ever
    streams: set[int] = set()  # the streams in flight (their threads' ids)
    faulted: dict[int, str] = {}  # stream -> the fault it is to meet
    dying = threading.Event()

    def fault_for(me: int) -> str | None:
        """The fault this stream meets now, if any (the fault file read once)."""
        with lock:
            if a.fault_file and os.path.exists(a.fault_file):
                with open(a.fault_file) as f:
                    kind = f.read().strip()
                os.unlink(a.fault_file)
                for sid in streams:
                    faulted[sid] = kind
                if kind == "die":
                    threading.Thread(target=die_soon, daemon=True).start()
            return faulted.pop(me, None)

    def stall_until_gone(conn: socket.socket, limit_s: float = 120.0) -> None:
        """Nothing more sent until the client closes the connection (or the engine
        stops, or `limit_s`)."""
        until = time.monotonic() + limit_s
        while time.monotonic() < until and not stopping.is_set():
            readable, _, _ = select.select([conn], [], [], 0.1)
            if readable and not conn.recv(1, socket.MSG_PEEK):
                return

    def gone_within(conn: socket.socket, seconds: float) -> bool:
        """Waits `seconds`, or less if the client closes the connection first (as vLLM
        cancels a request whose client went away, its answer not begun): whether it did."""
        until = time.monotonic() + seconds
        while (left := until - time.monotonic()) > 0:
            readable, _, _ = select.select([conn], [], [], min(left, 0.05))
            if readable and not conn.recv(1, socket.MSG_PEEK):
                return True
        return False

    def die_soon() -> None:
        dying.set()
        time.sleep(0.5)
        exit_now()

    def exit_now() -> None:
        log("ERROR", "engine core died (fake fault)", tag="EngineCore_DP0")
        if child_pid:
            os.kill(child_pid, signal.SIGKILL)
        os._exit(1)
    core = StackDumper(watchdog, log) if watchdog is not None and not child_pid else None
    if core is not None:  # no child: this process is the engine core that dumps
        threading.Thread(target=core.watch_hang, args=(a.hang_file, stopping),
                         daemon=True).start()

    def sigterm(*_: object) -> None:
        if core is not None:
            core.dump("SIGTERM")
        stopping.set()
    if a.ignore_sigterm:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    else:
        signal.signal(signal.SIGTERM, sigterm)

    # vLLM's start, as it tells it: a phase line, then the wait, then its route table
    log("INFO", "Starting to load model fake...", tag="EngineCore_DP0")
    if "--load-format" in sys.argv:  # (a weight cache's: tests/fake_preload.py)
        sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
        from tests.fake_preload import map_weights
        loaded = map_weights(sys.argv[1:], log)
        if pidfile:
            with open(os.path.join(os.path.dirname(pidfile), "loads"), "a") as f:
                f.write(f"{os.getpid()} {loaded}\n")
    time.sleep(a.startup_delay)
    log("INFO", "init engine (profile, create kv cache, warmup model) took "
        f"{a.startup_delay:.2f} s", tag="EngineCore_DP0")
    cache_root = os.environ.get("VLLM_CACHE_ROOT")
    if cache_root:  # as vLLM keeps what it compiled: one line a start, kept across starts
        compiled = Path(cache_root) / "torch_compile_cache" / "fake" / "starts.log"
        compiled.parent.mkdir(parents=True, exist_ok=True)
        with compiled.open("a") as f:
            f.write(f"{os.getpid()} compiled for {a.served_model_name}\n")
    log("INFO", "Available routes are:")
    for route, methods in (("/health", "GET"), ("/metrics", "GET"), ("/v1/models", "GET"),
                           ("/v1/completions", "POST"), ("/v1/chat/completions", "POST"),
                           *dev.items()):
        log("INFO", f"Route: {route}, Methods: {methods}")

    class Handler(http.server.BaseHTTPRequestHandler):
        def parse_request(self) -> bool:
            ok = super().parse_request()
            if ok and pidfile:
                with open(os.path.join(os.path.dirname(pidfile), "requests"), "a") as f:
                    f.write(f"{self.command} {self.path}\n")
            return ok

        def do_GET(self) -> None:
            code = 503 if a.never_healthy or dying.is_set() else 200
            body = b"{}" if self.path == "/health" else b'{"fake": true}'
            if self.path == "/v1/models":
                body = json.dumps({"object": "list", "data": [
                    {"id": a.served_model_name, "object": "model"}]}).encode()
            route = self.path.partition("?")[0]
            if route in ("/reset_prefix_cache", "/sleep", "/wake_up", "/is_sleeping",
                         "/collective_rpc"):  # (a development route: as vLLM routes it)
                code = 404 if route not in dev else 405 if dev[route] == "POST" else 200
                body = json.dumps({"is_sleeping": asleep.is_set()}).encode() \
                    if code == 200 else b'{"detail": "refused"}'
            if self.path == "/metrics":
                body = b"# fake engine: no metrics\n"
                if a.spec_acceptance is not None:
                    with lock:
                        body = ("vllm:spec_decode_num_draft_tokens_total{engine=\"0\"} "
                                f"{spec[0]}\nvllm:spec_decode_num_accepted_tokens_total"
                                f"{{engine=\"0\"}} {spec[1]}\n").encode()
                if a.metrics_file:
                    with open(a.metrics_file, "rb") as f:
                        body = f.read()
                series = sleep_metrics.page().encode()  # (the API server's, at the end)
                if series:
                    body += (b"" if body.endswith(b"\n") else b"\n") + series
            self.send_response(code)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_POST(self) -> None:
            length = int(self.headers.get("Content-Length") or 0)
            raw = self.rfile.read(length)
            try:
                req = json.loads(raw or b"{}")
            except ValueError:
                req = {}
            req = req if isinstance(req, dict) else {}
            generate = self.path in ("/v1/completions", "/v1/chat/completions")
            if generate and a.die_on_prompt and kills(req, self.path, a.die_on_prompt):
                print("ERROR EngineCore encountered a fatal error (a request killed it)",
                      flush=True)
                if not a.die_answering:
                    time.sleep(0.3)
                    os._exit(1)
                threading.Timer(0.3, os._exit, args=(1,)).start()
            if generate and dying.is_set():
                body, code = b'{"error": {"message": "EngineDeadError", "code": 500}}', 500
            elif generate and asleep.is_set():
                body, code = b'{"error": "the engine is asleep"}', 503
            elif generate and req.get("model", a.served_model_name) != a.served_model_name:
                # as vLLM answers a model it does not serve
                body, code = json.dumps({"error": {
                    "message": f"The model `{req['model']}` does not exist.",
                    "type": "NotFoundError", "code": 404}}).encode(), 404
            elif generate:
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
                        self._stream(req, chat=self.path == "/v1/chat/completions")
                        return
                    if gone_within(self.connection,
                                   a.token_delay * int(req.get("max_tokens") or 1)):
                        if pidfile:  # (aborted: nothing answered, as vLLM does)
                            with open(os.path.join(os.path.dirname(pidfile), "aborts"),
                                      "a") as f:
                                f.write("1\n")
                        self.close_connection = True
                        return
                finally:
                    with lock:
                        running[0] -= 1
                n = int(req.get("max_tokens") or 16)
                drafted(n)
                choice: dict[str, Any] = {"index": 0, "text": "x"}
                if a.logprobs and req.get("logprobs"):
                    choice["logprobs"] = logprobs_of(
                        prompt_ids(req, self.path == "/v1/chat/completions"), n,
                        self.path == "/v1/chat/completions",
                        shift=1 if wrong.is_set() else 0)
                body = json.dumps({"object": "text_completion", "model": a.served_model_name,
                                   "choices": [choice],
                                   "usage": {"prompt_tokens": 1, "completion_tokens": n,
                                             "total_tokens": n + 1}}).encode()
                code = 200
            elif self.path.startswith("/sleep") and "/sleep" in dev and not sleep_mode:
                # (vLLM without --enable-sleep-mode: the engine refuses)
                body, code = b'{"error": "sleep mode is not enabled"}', 500
            elif self.path == "/sleep?level=1" and sleep_mode:
                with sleep_metrics.record("sleep"):
                    if not slept_once.is_set():
                        slept_once.set()
                        time.sleep(a.first_sleep_delay)
                    time.sleep(0.02)  # (vLLM's own sleep takes its time, too)
                asleep.set()
                if pidfile:
                    with open(os.path.join(os.path.dirname(pidfile), "sleeps"), "a") as f:
                        f.write(f"{running[0]}\n")
                body, code = b"", 200
            elif self.path == "/wake_up" and sleep_mode and "/wake_up" in dev:
                fault = ""
                if a.wake_fault_file and os.path.exists(a.wake_fault_file):
                    with open(a.wake_fault_file) as f:
                        fault = f.read().strip()
                fails = a.wake_fails or fault == "fail"
                with sleep_metrics.record("wake"):
                    time.sleep(0.01)
                if not fails:
                    asleep.clear()
                    if a.wrong_after_wake or fault == "wrong":
                        wrong.set()
                    if a.drafts_broken_after_wake or fault == "drafts":
                        drafts_broken.set()
                body, code = (b'{"error": "fake wake failure"}', 500) if fails \
                    else (b"", 200)
            elif self.path == "/reset_prefix_cache" and pidfile and self.path in dev:
                with open(os.path.join(os.path.dirname(pidfile), "prefix-resets"), "a") as f:
                    f.write("1\n")
                body, code = b'{"success": true}', 200
            else:
                body, code = b'{"error": "not found"}', 404
            self.send_response(code)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def _stream(self, req: dict[str, Any], chat: bool) -> None:
            """A vLLM-shaped SSE answer, one chunk per token; the fault file honoured."""
            me = threading.get_ident()
            prompt = prompt_ids(req, chat)
            tokens = int(req.get("max_tokens") or req.get("max_completion_tokens") or 16)
            so = req.get("stream_options") or {}
            ids = bool(req.get("return_token_ids"))
            head: dict[str, Any] = {"id": f"{'chatcmpl' if chat else 'cmpl'}-fake{me % 100000}",
                    "object": "chat.completion.chunk" if chat else "text_completion",
                    "created": int(time.time()), "model": a.served_model_name}
            time.sleep(a.answer_delay)
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.send_header("X-Fake-Engine", "1")
            self.end_headers()
            with lock:
                streams.add(me)

            def send(doc: dict[str, Any]) -> None:
                self.wfile.write(f"data: {json.dumps(doc)}\n\n".encode())
                self.wfile.flush()

            try:
                seq = list(prompt)
                if chat:
                    first: dict[str, Any] = {**head, "choices": [{"index": 0, "delta": {
                        "role": "assistant", "content": ""}, "logprobs": None,
                        "finish_reason": None}]}
                    if ids:
                        first["prompt_token_ids"] = prompt
                    send(first)
                time.sleep(a.first_token_delay)
                for i in range(tokens):
                    fault = fault_for(me)
                    if fault == "cut":
                        self.connection.shutdown(socket.SHUT_RDWR)
                        return
                    if fault in ("error", "die"):
                        send({"error": {"message": "EngineCore encountered an issue. See "
                                        "stack trace (above) for the root cause.",
                                        "type": "InternalServerError", "code": 500}})
                        self.wfile.write(b"data: [DONE]\n\n")
                        return
                    if fault == "exit":
                        exit_now()
                    if fault == "stall":  # alive, healthy, and no more tokens: until its
                        stall_until_gone(self.connection)  # client goes (vLLM aborts)
                        raise ConnectionResetError("the client went during a stall")
                    tok = next_token(seq)
                    seq.append(tok)
                    drafted(1)
                    last = i == tokens - 1
                    choice: dict[str, Any] = {"index": 0, "logprobs": None,
                                    "finish_reason": "length" if last else None}
                    if chat:
                        choice["delta"] = {"content": f"t{tok} "}
                    else:
                        choice.update(text=f"t{tok} ", stop_reason=None)
                        if ids and i == 0:
                            choice["prompt_token_ids"] = prompt
                    if ids:
                        choice["token_ids"] = [tok]
                    chunk: dict[str, Any] = {**head, "choices": [choice]}
                    if so.get("continuous_usage_stats"):
                        chunk["usage"] = usage(len(prompt), i + 1)
                    send(chunk)
                    time.sleep(a.token_delay)
                if so.get("include_usage"):
                    send({**head, "choices": [], "usage": usage(len(prompt), tokens)})
                self.wfile.write(b"data: [DONE]\n\n")
                self.wfile.flush()
            except (BrokenPipeError, ConnectionResetError):
                if pidfile:
                    with open(os.path.join(os.path.dirname(pidfile), "aborts"), "a") as f:
                        f.write("1\n")
            finally:
                with lock:
                    streams.discard(me)
                    faulted.pop(me, None)

        def log_message(self, *args: object) -> None:
            pass

    srv = http.server.ThreadingHTTPServer((a.host, a.port), Handler)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    log("INFO", f"Uvicorn running on http://{a.host}:{a.port}")
    deadline = time.monotonic() + a.crash_after if a.crash_after is not None else None
    while not stopping.is_set():
        if deadline is not None and time.monotonic() >= deadline:
            # (the child is left to the daemon's group kill: the exit alone is the news)
            log("ERROR", "engine core died (fake crash)", tag="EngineCore_DP0")
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


def prompt_ids(req: dict[str, Any], chat: bool) -> list[int]:
    """A prompt's token ids: given as ids, or a string's characters (a chat's messages
    with role markers, as a template would)."""
    if chat:
        text = "".join(f"<{m.get('role')}>{m.get('content')}" for m in req.get("messages") or ())
        return [ord(c) % 1000 for c in text + "<assistant>"]
    p = req.get("prompt", "")
    if isinstance(p, list) and p and isinstance(p[0], list):
        p = p[0]
    if isinstance(p, list):
        return [int(x) for x in p]
    if not isinstance(p, str):
        p = str(p)
    return [ord(c) % 1000 for c in p]


def kills(req: dict[str, Any], path: str, text: str) -> bool:
    """The prompt holds `text`: as a string, or as its token ids (a continuation)."""
    ids = prompt_ids(req, path == "/v1/chat/completions")
    want = [ord(c) % 1000 for c in text]
    return any(ids[i:i + len(want)] == want for i in range(len(ids) - len(want) + 1))


def logprobs_of(prompt: list[int], n: int, chat: bool, shift: int = 0) -> dict[str, Any]:
    """vLLM's logprobs of a greedy answer (`return_tokens_as_token_ids`), each chosen
    token 1.0 above its runner-up; `shift` answers other tokens (a broken engine)."""
    seq, rows = list(prompt), []
    for _ in range(n):
        tid = next_token(seq) + shift
        seq.append(tid)
        lp = -(0.1 + (tid % 7) * 0.3)
        rows.append((f"token_id:{tid}", lp, f"token_id:{tid + 1}", lp - 1.0))
    if chat:
        return {"content": [{"token": t, "logprob": lp, "bytes": None, "top_logprobs": [
            {"token": t, "logprob": lp, "bytes": None},
            {"token": t2, "logprob": lp2, "bytes": None}]} for t, lp, t2, lp2 in rows]}
    return {"tokens": [r[0] for r in rows], "token_logprobs": [r[1] for r in rows],
            "top_logprobs": [{t: lp, t2: lp2} for t, lp, t2, lp2 in rows],
            "text_offset": list(range(n))}


def next_token(seq: list[int]) -> int:
    """Deterministic in the whole sequence before it."""
    a = seq[-1] if seq else 0
    b = seq[-2] if len(seq) > 1 else 0
    return (31 * a + 7 * b + 13 * len(seq)) % 997 + 3


def usage(prompt: int, completion: int) -> dict[str, Any]:
    return {"prompt_tokens": prompt, "completion_tokens": completion,
            "total_tokens": prompt + completion}


if __name__ == "__main__":
    main()
