"""The fake engine's API server (tests/fake_engine.py sets it going): its routes, as
vLLM's answer them, and what they share (`FakeEngine`): the development routes served,
sleep and wake, speculative decoding's counters, the requests and streams in flight and
the faults they are to meet. tests/fake_engine.py's docstring tells what each flag does.
Imported by the fake engine run as a script (its own folder on the path). Stdlib only:
it runs under any interpreter.
"""

from __future__ import annotations

import argparse
import http.server
import json
import os
import re
import select
import signal
import socket
import threading
import time
from collections.abc import Callable
from typing import Any, cast

from fake_engine_033 import SleepModeMetrics
from fake_kv_tier import FakeTier
from fake_tokens import kills, logprobs_of, next_token, prompt_ids, usage


class FakeEngine:
    """The state the fake engine's handler threads share, and the faults they meet."""

    def __init__(self, a: argparse.Namespace, child_pid: int | None, pidfile: str | None,
                 log: Callable[..., None]) -> None:
        self.a, self.child_pid, self.pidfile, self.log = a, child_pid, pidfile, log
        self.stopping = threading.Event()
        # vLLM's development routes: only with VLLM_SERVER_DEV_MODE=1, and those
        # --dev-routes names; each path and the method it takes
        dev = {"/reset_prefix_cache": "POST", "/sleep": "POST", "/wake_up": "POST",
               "/is_sleeping": "GET", "/collective_rpc": "POST", "/pause": "POST",
               "/resume": "POST", "/is_paused": "GET"}
        if os.environ.get("VLLM_SERVER_DEV_MODE") != "1" or a.dev_routes == "none":
            dev = {}
        elif a.dev_routes != "all":
            dev = {r: m for r, m in dev.items() if r in a.dev_routes.split(",")}
        self.dev = dev
        self.sleep_mode = a.enable_sleep_mode and "/sleep" in dev
        self.asleep = threading.Event()
        self.awake = threading.Event()  # (asleep's opposite: what queued requests wait on)
        self.awake.set()
        # what a sleep put to sleep and no wake has brought back yet (vLLM's allocator
        # tags: a wake may ask for some, `/wake_up?tags=weights`; it is awake once none)
        self.asleep_tags: set[str] = set()
        # vLLM 0.26+: a sleep aborts what is at the engine and queues new requests
        m = re.match(r"(\d+)\.(\d+)", a.vllm_version or "")
        self.sleep_aborts = m is not None and (int(m[1]), int(m[2])) >= (0, 26)
        self.sleeps = 0  # how many sleeps began: a stream begun before one is aborted
        self.paused = threading.Event()  # (a pause: as a 0.26+ sleep, without the sleep)
        self.slept_once = threading.Event()
        self.wrong = threading.Event()  # a wake broke it: other tokens from then on
        self.drafts_broken = threading.Event()  # a wake zeroed its draft model
        self.spec = [0.0, 0.0]  # speculative decoding's draft tokens, and those accepted
        self.generated = 0  # tokens generated (with --others-beside: on /metrics)
        self.answered = 0  # non-streamed answers given
        self.sleep_metrics = SleepModeMetrics()  # vLLM's (0.32+) count of sleeps, wakes
        self.lock = threading.Lock()
        self.running = [0, 0]  # now, most ever
        self.streams: set[int] = set()  # the streams in flight (their threads' ids)
        self.faulted: dict[int, str] = {}  # stream -> the fault it is to meet
        self.dying = threading.Event()
        self.logprobs_built = threading.Event()  # --first-logprobs-s: built once
        self.building = threading.Lock()
        # vLLM's fs KV tier, faked
        self.tier = FakeTier.from_config(a.kv_transfer_config, a.tier_token_bytes)

    def prefill(self, prompt: list[int]) -> None:
        """The prompt before its first token: with a KV tier, its chunks found there
        loaded and the others computed (`--chunk-compute-s` each), said in a line."""
        if self.tier is None:
            return
        with self.lock:  # (its counters: /metrics reads them)
            loaded, full, refused = self.tier.take(prompt)
        self.log("INFO", f"KV tier: {loaded} of {full} chunks loaded from files",
                 tag="EngineCore_DP0")
        if refused:  # (vLLM's words, at the scheduler's line)
            self.log("WARNING", "Request fake: cannot store chunks", tag="EngineCore_DP0")
        time.sleep((full - loaded) * self.a.chunk_compute_s)

    def build_logprobs_helper(self) -> None:
        """--first-logprobs-s: the first request that asks for logprobs builds what they
        need, as vLLM compiles its sampler helper on a cold cache: a child process burns a
        core for that long (a compiler under the worker), or with --first-logprobs-idle
        nothing burns (a step that hangs); requests that come meanwhile wait for it."""
        with self.building:
            if self.logprobs_built.is_set():
                return
            s = self.a.first_logprobs_s
            if self.a.first_logprobs_idle:
                time.sleep(s)
            else:
                import subprocess
                import sys

                subprocess.run([sys.executable, "-c",
                                "import time\nt = time.monotonic() + float(__import__('sys')"
                                ".argv[1])\nwhile time.monotonic() < t: pass", str(s)],
                               check=False)
            self.logprobs_built.set()

    def drafted(self, n: int) -> None:
        """n tokens generated: 2 drafted for each, a share --spec-acceptance accepted."""
        a = self.a
        if a.spec_acceptance is not None:
            with self.lock:
                self.spec[0] += 2 * n
                self.spec[1] += 0 if self.drafts_broken.is_set() else 2 * n * a.spec_acceptance

    def fault_for(self, me: int) -> str | None:
        """The fault this stream meets now, if any (the fault file read once)."""
        a = self.a
        with self.lock:
            kind = ""
            if a.fault_file and os.path.exists(a.fault_file):
                with open(a.fault_file) as f:
                    kind = f.read().strip()
            # (empty: the test's write_text made the file and has not written it yet; read
            # then, it was once taken for no fault, and the engine never died)
            if kind:
                os.unlink(a.fault_file)
                for sid in self.streams:
                    self.faulted[sid] = kind
                if kind == "die":
                    threading.Thread(target=self.die_soon, daemon=True).start()
            return self.faulted.pop(me, None)

    def stall_until_gone(self, conn: socket.socket, limit_s: float = 120.0) -> None:
        """Nothing more sent until the client closes the connection (or the engine
        stops, or `limit_s`)."""
        until = time.monotonic() + limit_s
        while time.monotonic() < until and not self.stopping.is_set():
            readable, _, _ = select.select([conn], [], [], 0.1)
            if readable and not conn.recv(1, socket.MSG_PEEK):
                return

    @staticmethod
    def gone_within(conn: socket.socket, seconds: float) -> bool:
        """Waits `seconds`, or less if the client closes the connection first (as vLLM
        cancels a request whose client went away, its answer not begun): whether it did."""
        until = time.monotonic() + seconds
        while (left := until - time.monotonic()) > 0:
            readable, _, _ = select.select([conn], [], [], min(left, 0.05))
            if readable and not conn.recv(1, socket.MSG_PEEK):
                return True
        return False

    def die_soon(self) -> None:
        self.dying.set()
        time.sleep(0.5)
        self.exit_now()

    def exit_now(self) -> None:
        self.log("ERROR", "engine core died (fake fault)", tag="EngineCore_DP0")
        if self.child_pid:
            os.kill(self.child_pid, signal.SIGKILL)
        os._exit(1)


class FakeServer(http.server.ThreadingHTTPServer):
    """The engine's API server on --host/--port: each request a thread of `Handler`,
    all of them sharing `engine`."""

    def __init__(self, engine: FakeEngine) -> None:
        self.engine = engine
        super().__init__((engine.a.host, engine.a.port), Handler)


class Handler(http.server.BaseHTTPRequestHandler):
    """vLLM's routes, as the fake engine answers them."""

    began = 0  # the engine's sleeps when its completion was let in (one since: aborted)

    @property
    def engine(self) -> FakeEngine:
        return cast(FakeServer, self.server).engine

    def parse_request(self) -> bool:
        e = self.engine
        ok = super().parse_request()
        if ok and e.pidfile:
            with open(os.path.join(os.path.dirname(e.pidfile), "requests"), "a") as f:
                f.write(f"{self.command} {self.path}\n")
        return ok

    def do_GET(self) -> None:
        e = self.engine
        code = 503 if e.a.never_healthy or e.dying.is_set() else 200
        body = b"{}" if self.path == "/health" else b'{"fake": true}'
        if self.path == "/version" and e.a.vllm_version:
            body = json.dumps({"version": e.a.vllm_version}).encode()
        if self.path == "/v1/models":
            listed: dict[str, object] = {"id": e.a.served_model_name, "object": "model"}
            if e.a.max_model_len is not None:
                listed["max_model_len"] = e.a.max_model_len
            body = json.dumps({"object": "list", "data": [listed]}).encode()
        route = self.path.partition("?")[0]
        if route in ("/reset_prefix_cache", "/sleep", "/wake_up", "/is_sleeping",
                     "/collective_rpc", "/pause", "/resume", "/is_paused"):
            # (a development route: as vLLM routes it; 0.26+ says it sleeps while paused)
            code = 404 if route not in e.dev else 405 if e.dev[route] == "POST" else 200
            body = json.dumps({"is_sleeping": e.asleep.is_set() or e.paused.is_set()}
                              if route == "/is_sleeping" else
                              {"is_paused": e.paused.is_set()}).encode() \
                if code == 200 else b'{"detail": "refused"}'
        if self.path == "/metrics":
            body = b"# fake engine: no metrics\n"
            if e.a.spec_acceptance is not None:
                with e.lock:
                    body = ("vllm:spec_decode_num_draft_tokens_total{engine=\"0\"} "
                            f"{e.spec[0]}\nvllm:spec_decode_num_accepted_tokens_total"
                            f"{{engine=\"0\"}} {e.spec[1]}\n").encode()
            if e.a.others_beside is not None:
                with e.lock:
                    body += (f"vllm:generation_tokens_total{{engine=\"0\"}} "
                             f"{e.generated}\n").encode()
            if e.a.metrics_file:
                with open(e.a.metrics_file, "rb") as f:
                    body = f.read()
            if e.sleep_mode and not e.a.metrics_file:
                # vLLM's own count of the requests at it (those a KV reset waits out)
                with e.lock:
                    running = e.running[0]
                body += (f"vllm:num_requests_running{{engine=\"0\",model_name=\""
                         f"{e.a.served_model_name}\"}} {running}\n"
                         f"vllm:num_requests_waiting{{engine=\"0\",model_name=\""
                         f"{e.a.served_model_name}\"}} 0\n").encode()
            if e.tier is not None and not e.a.metrics_file:
                with e.lock:
                    body += e.tier.page(e.a.served_model_name).encode()
            series = e.sleep_metrics.page().encode()  # (the API server's, at the end)
            if series:
                body += (b"" if body.endswith(b"\n") else b"\n") + series
        self.send_response(code)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_POST(self) -> None:
        e = self.engine
        length = int(self.headers.get("Content-Length") or 0)
        raw = self.rfile.read(length)
        try:
            req = json.loads(raw or b"{}")
        except ValueError:
            req = {}
        req = req if isinstance(req, dict) else {}
        generate = self.path in ("/v1/completions", "/v1/chat/completions")
        if generate and e.a.die_on_prompt and kills(req, self.path, e.a.die_on_prompt):
            print("ERROR EngineCore encountered a fatal error (a request killed it)",
                  flush=True)
            if not e.a.die_answering:
                time.sleep(0.3)
                os._exit(1)
            threading.Timer(0.3, os._exit, args=(1,)).start()
        if generate and e.dying.is_set():
            body, code = b'{"error": {"message": "EngineDeadError", "code": 500}}', 500
        elif generate and e.asleep.is_set() and not e.sleep_aborts:
            body, code = b'{"error": "the engine is asleep"}', 503
        elif generate and req.get("priority", 0) and e.a.scheduling_policy != "priority":
            # as vLLM's request schema documents it: "Any priority other than 0 will raise
            # an error if the served model does not use priority scheduling"
            body, code = json.dumps({"error": {
                "message": "Got priority {} but Priority scheduling is not enabled.".format(
                    req["priority"]), "type": "BadRequestError", "code": 400}}).encode(), 400
        elif generate and req.get("model", e.a.served_model_name) != e.a.served_model_name:
            # as vLLM answers a model it does not serve
            body, code = json.dumps({"error": {
                "message": f"The model `{req['model']}` does not exist.",
                "type": "NotFoundError", "code": 404}}).encode(), 404
        elif generate:
            if req.get("priority"):
                e.log("INFO", f"request priority {req['priority']}")  # (a whole line)
            while True:  # (vLLM 0.26+ queues what arrives while it sleeps)
                with e.lock:
                    if e.awake.is_set() or e.stopping.is_set():
                        e.running[0] += 1
                        peak = max(e.running[1], e.running[0])
                        e.running[1] = peak
                        self.began = e.sleeps  # (a sleep from now on aborts it)
                        break
                e.awake.wait(0.05)
            if e.pidfile:
                with open(os.path.join(os.path.dirname(e.pidfile), "max-running"), "w") as f:
                    f.write(str(peak))
            try:
                while e.a.hang_file and os.path.exists(e.a.hang_file) and not e.stopping.is_set():
                    time.sleep(0.05)
                if req.get("logprobs") and e.a.first_logprobs_s and not e.logprobs_built.is_set():
                    e.build_logprobs_helper()
                if req.get("stream"):
                    self._stream(req, chat=self.path == "/v1/chat/completions")
                    return
                if e.gone_within(self.connection,
                               e.a.token_delay * int(req.get("max_tokens") or 1)):
                    if e.pidfile:  # (aborted: nothing answered, as vLLM does)
                        with open(os.path.join(os.path.dirname(e.pidfile), "aborts"),
                                  "a") as f:
                            f.write("1\n")
                    self.close_connection = True
                    return
            finally:
                with e.lock:
                    e.running[0] -= 1
            n = int(req.get("max_tokens") or 16)
            e.drafted(n)
            with e.lock:
                e.answered += 1
                shared = e.answered <= (e.a.others_beside or 0)
                e.generated += n + (5 if shared else 0)
            choice: dict[str, Any] = {"index": 0, "text": "x"}
            if e.a.logprobs and req.get("logprobs"):
                choice["logprobs"] = logprobs_of(
                    prompt_ids(req, self.path == "/v1/chat/completions"), n,
                    self.path == "/v1/chat/completions",
                    shift=1 if e.wrong.is_set() or shared else 0)
            body = json.dumps({"object": "text_completion", "model": e.a.served_model_name,
                               "choices": [choice],
                               "usage": {"prompt_tokens": 1, "completion_tokens": n,
                                         "total_tokens": n + 1}}).encode()
            code = 200
        elif self.path.startswith("/sleep") and "/sleep" in e.dev and not e.sleep_mode:
            # (vLLM without --enable-sleep-mode: the engine refuses)
            body, code = b'{"error": "sleep mode is not enabled"}', 500
        elif self.path in ("/sleep?level=1", "/sleep?level=1&mode=abort") and e.sleep_mode:
            with e.lock:
                running = e.running[0]
                e.sleeps += 1  # (0.26+: the streams begun before it end at their next token)
                if e.sleep_aborts:
                    e.awake.clear()
            if e.pidfile:  # (what a sleep meets as it arrives: vLLM would lose them)
                with open(os.path.join(os.path.dirname(e.pidfile), "sleeps"), "a") as f:
                    f.write(f"{running}\n")
            with e.sleep_metrics.record("sleep"):
                if not e.slept_once.is_set():
                    e.slept_once.set()
                    time.sleep(e.a.first_sleep_delay)
                time.sleep(0.02)  # (vLLM's own sleep takes its time, too)
            with e.lock:
                e.asleep_tags = {"weights", "kv_cache"}
            e.asleep.set()
            if e.a.weights_gib:  # (vLLM's allocator says what it backed up: its weights)
                e.log("INFO", f"CuMemAllocator: sleep freed {e.a.weights_gib + 1:.2f} GiB "
                      f"memory in total, of which {e.a.weights_gib:.2f} GiB is backed up in "
                      "CPU and the rest 1.00 GiB is discarded directly.", tag="EngineCore_DP0")
            body, code = b"", 200
        elif (self.path == "/wake_up" or self.path.startswith("/wake_up?tags=")) \
                and e.sleep_mode and "/wake_up" in e.dev:
            tags = [t.removeprefix("tags=") for t in self.path.partition("?")[2].split("&")
                    if t]
            if e.pidfile:  # (each wake asked, in order: which memory it asked back)
                with open(os.path.join(os.path.dirname(e.pidfile), "wakes"), "a") as f:
                    f.write(f"{','.join(tags) or 'all'}\n")
            fault = ""
            if e.a.wake_fault_file and os.path.exists(e.a.wake_fault_file):
                with open(e.a.wake_fault_file) as f:
                    fault = f.read().strip()
            fails = e.a.wake_fails or fault == "fail"
            with e.sleep_metrics.record("wake"):
                time.sleep(0.01)
            with e.lock:
                if not fails:
                    e.asleep_tags -= set(tags) if tags else e.asleep_tags
                awake = not fails and not e.asleep_tags
            if awake:
                e.asleep.clear()
                e.awake.set()
                if e.a.wrong_after_wake or fault == "wrong":
                    e.wrong.set()
                if e.a.drafts_broken_after_wake or fault == "drafts":
                    e.drafts_broken.set()
            body, code = (b'{"error": "fake wake failure"}', 500) if fails \
                else (b"", 200)
        elif self.path == "/collective_rpc" and self.path in e.dev:
            method = req.get("method")
            if method == "vs_empty_host_cache" \
                    and e.a.worker_extension_cls == "vllm_supervisor_worker.HostCache":
                if e.pidfile:
                    with open(os.path.join(os.path.dirname(e.pidfile), "host-cache"),
                              "a") as f:
                        f.write("emptied\n")
                body, code = b'{"results": [{"emptied": true, "seconds": 0.01}]}', 200
            else:
                body, code = json.dumps({"error": f"AttributeError: 'Worker' object has "
                                         f"no attribute {method!r}"}).encode(), 500
        elif self.path == "/pause?mode=abort&clear_cache=true" and "/pause" in e.dev:
            # vLLM 0.26+'s: every request at it aborted (a stream at its next token), new
            # ones queued until the resume, the caches cleared
            with e.lock:
                running = e.running[0]
                e.sleeps += 1
                e.awake.clear()
            e.paused.set()
            if e.pidfile:  # (what a pause met as it arrived)
                with open(os.path.join(os.path.dirname(e.pidfile), "pauses"), "a") as f:
                    f.write(f"{running}\n")
            body, code = b'{"status": "paused"}', 200
        elif self.path == "/resume" and "/resume" in e.dev:
            e.paused.clear()
            if not e.asleep.is_set():
                e.awake.set()
            body, code = b'{"status": "resumed"}', 200
        elif self.path == "/reset_prefix_cache" and e.pidfile and self.path in e.dev:
            with open(os.path.join(os.path.dirname(e.pidfile), "prefix-resets"), "a") as f:
                f.write("1\n")
            # (--kv-leak: blocks held that no abort frees, as vLLM answers then)
            leak = e.a.kv_leak and e.paused.is_set()
            body, code = b'{"success": %s}' % (b"false" if leak else b"true"), 200
        else:
            body, code = b'{"error": "not found"}', 404
        self.send_response(code)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def _stream(self, req: dict[str, Any], chat: bool) -> None:
        """A vLLM-shaped SSE answer, one chunk per token; the fault file honoured."""
        e = self.engine
        me = threading.get_ident()
        prompt = prompt_ids(req, chat)
        tokens = int(req.get("max_tokens") or req.get("max_completion_tokens") or 16)
        so = req.get("stream_options") or {}
        ids = bool(req.get("return_token_ids"))
        head: dict[str, Any] = {"id": f"{'chatcmpl' if chat else 'cmpl'}-fake{me % 100000}",
                "object": "chat.completion.chunk" if chat else "text_completion",
                "created": int(time.time()), "model": e.a.served_model_name}
        time.sleep(e.a.answer_delay)
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("X-Fake-Engine", "1")
        self.end_headers()
        with e.lock:
            e.streams.add(me)

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
            e.prefill(prompt)
            time.sleep(e.a.first_token_delay)
            for i in range(tokens):
                if (e.sleep_aborts or e.paused.is_set()) and e.sleeps != self.began:
                    # (a sleep of 0.26+, or a pause, aborted it)
                    if e.pidfile:
                        with open(os.path.join(os.path.dirname(e.pidfile), "sleep-aborts"),
                                  "a") as f:
                            f.write("1\n")
                    send({**head, "choices": [{"index": 0, "text": "", "logprobs": None,
                                               "finish_reason": "abort"}]})
                    self.wfile.write(b"data: [DONE]\n\n")
                    self.wfile.flush()
                    raise ConnectionResetError("aborted by the engine's sleep")
                fault = e.fault_for(me)
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
                    e.exit_now()
                if fault == "stall":  # alive, healthy, and no more tokens: until its
                    e.stall_until_gone(self.connection)  # client goes (vLLM aborts)
                    raise ConnectionResetError("the client went during a stall")
                tok = next_token(seq)
                seq.append(tok)
                e.drafted(1)
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
                time.sleep(e.a.token_delay)
            if so.get("include_usage"):
                send({**head, "choices": [], "usage": usage(len(prompt), tokens)})
            self.wfile.write(b"data: [DONE]\n\n")
            self.wfile.flush()
        except (BrokenPipeError, ConnectionResetError):
            if e.pidfile:
                with open(os.path.join(os.path.dirname(e.pidfile), "aborts"), "a") as f:
                    f.write("1\n")
        finally:
            with e.lock:
                e.streams.discard(me)
                e.faulted.pop(me, None)

    def log_message(self, *args: object) -> None:
        pass
