"""A small stand-in for vLLM's API server, for fast, scriptable fault tests.

Takes vLLM's --host/--port/--shutdown-timeout (added by the daemon) and switches that
script a fault:
  --startup-delay S     listen only after S seconds (vLLM refuses connections until ready)
  --never-healthy       listen, but /health answers 503
  --crash-after S       exit by itself S seconds after becoming healthy
  --exit-code N         the code for --crash-after (default 0: vLLM can exit 0 unasked)
  --fail-boot           print an error and exit 1 at once
  --fail-boot-hang      print vLLM's "EngineCore failed to start." and never exit (nor
                        listen): a core whose workers hung on the way out
  --ignore-sigterm      ignore SIGTERM (only SIGKILL ends it)
  --child               fork a child in the same process group, titled VLLM::EngineCore
  --metrics-file PATH   serve /metrics from this file, read afresh on every request
  --gpu-mib N           that child holds N MiB of GPU memory (torch, CUDA), as EngineCore
                        does; the engine serves only once it is allocated
  --hold-mib N          that child holds N MiB of anonymous host memory, every page touched,
                        mapped with MADV_HUGEPAGE (as glibc.malloc.hugetlb=1 maps vLLM's
                        sleeping weights' backup): huge pages where the host's THP allows
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
                        requests running when it arrived to <pidfile dir>/sleeps, and
                        completions answer 503 while asleep; /metrics (without
                        --metrics-file) carries vLLM's vllm:num_requests_running (its
                        own count: a client gone is noticed at its stream's next token)
                        and vllm:num_requests_waiting (0); from its first sleep or
                        wake /metrics carries vLLM's (0.32+) sleep-mode series as its API
                        server prints them (less the `_created` stamps):
                        vllm:sleep_mode_operation_duration_seconds
                        {operation} (a histogram of each call's seconds) and
                        vllm:sleep_mode_operations_in_flight{operation}
  --vllm-version V      says "vLLM API server version V" as it starts and serves GET
                        /version; from 0.26 its sleep is vLLM's since then (`mode=abort`,
                        the default): the requests at it aborted (a stream ended with
                        finish_reason "abort", each counted in <pidfile dir>/sleep-aborts
                        and /aborts) and
                        completions arriving while it sleeps queued until its wake,
                        instead of the 503
  --wake-fails          POST /wake_up answers 500 (and the engine stays asleep)
                        (`POST /wake_up?tags=weights` wakes that memory alone, as vLLM's:
                        it sleeps on until `tags=kv_cache`; each wake's tags, or "all",
                        appended to <pidfile dir>/wakes)
  --weights-gib G       each sleep says, as vLLM's allocator does, that it backed up G GiB
  --worker-extension-cls C  with the daemon's (vllm_supervisor_worker.HostCache),
                        `POST /collective_rpc` of `vs_empty_host_cache` answers as its
                        one worker would ("emptied"), appended to <pidfile dir>/host-cache;
                        any other method answers 500, as vLLM's worker without it
  --dev-routes LIST     which of vLLM's development routes it serves with
                        VLLM_SERVER_DEV_MODE=1 (comma-separated paths; default "all":
                        /reset_prefix_cache, /sleep, /wake_up, /is_sleeping,
                        /collective_rpc, /pause, /resume, /is_paused; POST
                        /pause?mode=abort&clear_cache=true is vLLM 0.26+'s: the requests
                        at it aborted as by a 0.26+ sleep, new ones queued until POST
                        /resume, the number running as it arrived appended to <pidfile
                        dir>/pauses; "none": a front end without them, as vLLM 0.33's
                        Rust one may be). Without VLLM_SERVER_DEV_MODE=1 it serves none,
                        as vLLM. A GET of a POST-only one answers 405, of one not served
                        404, as vLLM's routers do
  --kv-leak             POST /reset_prefix_cache while paused answers {"success": false}
                        (blocks held that no abort frees, as vLLM answers then)
  --first-sleep-delay S the first sleep answers after S seconds, later ones at once (vLLM
                        pins the weights in host RAM at an engine's first sleep)
  --logprobs            a non-streamed answer carries vLLM-shaped logprobs when asked
  --first-logprobs-s S  the first request that asks for logprobs (any route) waits S
                        seconds first, and requests meanwhile wait with it, while a child
                        process burns a core (vLLM compiling its sampler helper on a
                        cold cache: g++ under its worker, issue 48); with
                        --first-logprobs-idle nothing burns (a hang in that step)
  --wrong-after-wake    ... of other tokens once it was woken (a wake that broke it)
  --spec-acceptance R   speculative decoding's counters on /metrics (2 draft tokens a
                        token generated, a share R accepted); --drafts-broken-after-wake
                        (or the wake fault file's "drafts"): none accepted once woken
  --others-beside K     /metrics carries vllm:generation_tokens_total; the first K
                        answers share their batch with another client's request (5 more
                        tokens counted, and other tokens answered)
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
answer would; a token's text is "t<id> ". A string prompt's token ids are its characters'
(tests/fake_tokens.py). The routes are tests/fake_engine_http.py's.
On SIGTERM it stops accepting and lets running requests finish for --shutdown-timeout,
as vLLM does. A client that goes away mid-stream is counted in <pidfile dir>/aborts;
the most requests ever running at once is written to <pidfile dir>/max-running.
Serves GET /health, /metrics, /v1/models (with vLLM's --max-model-len, when given,
listed as vLLM lists it), POST /v1/completions (one token) and, with
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
import json
import os
import signal
import sys
import threading
import time
from pathlib import Path

_LOG_LOCK = threading.Lock()


def log(level: str, msg: str, tag: str = "APIServer") -> None:
    """One line, whole: handler threads log at once (print writes the line and its end
    apart, and two threads' lines ran into one)."""
    stamp = time.strftime("%m-%d %H:%M:%S")
    with _LOG_LOCK:
        sys.stdout.write(f"({tag} pid={os.getpid()}) {level} {stamp} [fake_engine.py:1] {msg}\n")
        sys.stdout.flush()


def set_title(title: str) -> None:
    """The process's name as ps and psutil show it (Linux prctl PR_SET_NAME)."""
    import contextlib
    import ctypes

    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None).prctl(15, title.encode()[:15], 0, 0, 0)


def hold_host_memory(mib: int) -> object:
    """N MiB of private anonymous memory, MADV_HUGEPAGE, every page touched: the mapping,
    kept by the caller."""
    import mmap

    held = mmap.mmap(-1, mib << 20, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    held.madvise(mmap.MADV_HUGEPAGE)
    page = b"\1" * mmap.PAGESIZE
    for at in range(0, mib << 20, mmap.PAGESIZE):
        held[at:at + mmap.PAGESIZE] = page
    return held


def main() -> None:
    if sys.argv[1:2] == ["preload"]:  # `vllm preload`: the weight cache's stand-in
        sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
        from tests import fake_preload
        fake_preload.main(sys.argv[2:])
        return
    # what vLLM 0.32-0.33 added, and its API server, beside this file (on the path when
    # run as a script; put there too when run otherwise, as bench/host_cost_bench.py's
    # runpy does)
    here = str(Path(__file__).resolve().parent)
    if here not in sys.path:
        sys.path.insert(0, here)
    from fake_engine_033 import StackDumper, watchdog_config
    from fake_engine_http import FakeEngine, FakeServer

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
    p.add_argument("--fail-boot-hang", action="store_true")  # say so, then never exit
    p.add_argument("--ignore-sigterm", action="store_true")
    p.add_argument("--child", action="store_true")
    p.add_argument("--gpu-mib", type=int, default=0)
    p.add_argument("--hold-mib", type=int, default=0)
    p.add_argument("--metrics-file", default=None)
    p.add_argument("--hang-file", default=None)
    p.add_argument("--token-delay", type=float, default=0.01)
    p.add_argument("--first-token-delay", type=float, default=0)
    p.add_argument("--answer-delay", type=float, default=0)
    p.add_argument("--enable-sleep-mode", action="store_true")
    p.add_argument("--worker-extension-cls", default=None)
    p.add_argument("--wake-fails", action="store_true")
    p.add_argument("--vllm-version", default=None)
    p.add_argument("--dev-routes", default="all")
    p.add_argument("--kv-leak", action="store_true")
    p.add_argument("--first-sleep-delay", type=float, default=0)
    p.add_argument("--weights-gib", type=float, default=0)  # each sleep says it backed up
    p.add_argument("--logprobs", action="store_true")  # answers them (a greedy golden)
    p.add_argument("--first-logprobs-s", type=float, default=0)  # the first such request
    p.add_argument("--first-logprobs-idle", action="store_true")  # ... waits, burns nothing
    p.add_argument("--wrong-after-wake", action="store_true")  # other tokens once woken
    p.add_argument("--wake-fault-file", default=None)
    # speculative decoding's counters on /metrics: this share of draft tokens accepted;
    # none once a wake broke the drafts (--drafts-broken-after-wake, or the wake fault
    # file's "drafts")
    p.add_argument("--spec-acceptance", type=float, default=None)
    p.add_argument("--drafts-broken-after-wake", action="store_true")
    # the first K answers share their batch with another client's request: 5 more
    # tokens on vllm:generation_tokens_total (served with this flag) and other tokens
    # (a batch's kernels differ from a lone request's)
    p.add_argument("--others-beside", type=int, default=None)
    p.add_argument("--fault-file", default=None)
    p.add_argument("--die-on-prompt", default=None)
    p.add_argument("--die-answering", action="store_true")
    p.add_argument("--served-model-name", default="fake")  # the one name it answers to
    # vLLM's own flag: its /v1/models then lists it, as vLLM's always does
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--kv-tokens", type=int, default=65536)  # said at start, as vLLM's core
    # as vLLM: a request's non-zero priority is refused unless "priority"; each one taken
    # is logged (`request priority N`) for the tests
    p.add_argument("--scheduling-policy", default="fcfs")
    p.add_argument("--watchdog-config", default=None)  # vLLM 0.33's stack dumps
    # vLLM's KV offloading: an fs tier's folder is read and written (tests/fake_kv_tier.py)
    p.add_argument("--kv-transfer-config", default=None)
    # a prompt's chunks not found in the tier cost this long each before the first token
    p.add_argument("--chunk-compute-s", type=float, default=0.0)
    # a token's KV bytes in the tier's CPU part (Llama-3.1-8B's: 128 KiB)
    p.add_argument("--tier-token-bytes", type=int, default=128 << 10)
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
    if a.fail_boot_hang:  # vLLM's core failed, its workers hung on the way out (issue 52)
        log("ERROR", "EngineCore failed to start.", tag="EngineCore_DP0")
        # vLLM logs it with its traceback, whose frames can read like a start phase
        for frame in ("Traceback (most recent call last):",
                      '  File "vllm/model_executor/warmup/kernel_warmup.py", line 50, in '
                      "kernel_warmup", "    kernel_warmup(self)",
                      "RuntimeError: CUDA error: CUBLAS_STATUS_INTERNAL_ERROR"):
            log("ERROR", frame, tag="EngineCore_DP0")
        while True:
            time.sleep(3600)
    child_pid = None
    if a.child or a.gpu_mib or a.hold_mib:
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
            if a.hold_mib:
                held.append(hold_host_memory(a.hold_mib))
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

    engine = FakeEngine(a, child_pid, pidfile, log)  # what its handlers share
    stopping = engine.stopping
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
    if a.vllm_version:
        log("INFO", f"vLLM API server version {a.vllm_version}")
    log("INFO", "Starting to load model fake...", tag="EngineCore_DP0")
    if "--load-format" in sys.argv:  # (a weight cache's: tests/fake_preload.py)
        sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
        from tests.fake_preload import map_weights
        loaded = map_weights(sys.argv[1:], log)
        if pidfile:
            with open(os.path.join(os.path.dirname(pidfile), "loads"), "a") as f:
                f.write(f"{os.getpid()} {loaded}\n")
    time.sleep(a.startup_delay)
    log("INFO", f"GPU KV cache size: {a.kv_tokens:,} tokens, Maximum concurrency for 512 "
        f"tokens per request: {a.kv_tokens / 512:.2f}x", tag="EngineCore_DP0")
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
                           *engine.dev.items()):
        log("INFO", f"Route: {route}, Methods: {methods}")

    srv = FakeServer(engine)
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
    while engine.running[0] > 0 and time.monotonic() < drain_until:
        time.sleep(0.02)
    if child_pid:
        os.kill(child_pid, signal.SIGTERM)
        os.waitpid(child_pid, 0)
    sys.exit(0)


if __name__ == "__main__":
    main()
