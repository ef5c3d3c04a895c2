"""End-to-end: the daemon supervising the real vLLM CPU engine with the tiny model.

Slow (each engine start is 40-80 s on two cores), so one daemon serves the first four
tests in order, and one more is started for the SIGKILL test. `make test` builds
.venv-engine and models/tiny-llama first; without them these tests fail, not skip.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path

import httpx
import psutil
import pytest

from tests.harness import ROOT, Daemon, alive, cache_env, free_port, run_caches, wait_for

pytestmark = pytest.mark.e2e

ENGINE_PY = ROOT / ".venv-engine" / "bin" / "python"
ENGINE_VLLM = ROOT / ".venv-engine" / "bin" / "vllm"
MODEL = ROOT / "models" / "tiny-llama"
START_TIMEOUT = 300.0
NGRAM = '{"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 3}'
DEV_ROUTES = ("/reset_prefix_cache", "/sleep", "/wake_up", "/is_sleeping", "/pause",
              "/resume", "/is_paused")


def vllm_config(tmp: Path) -> dict[str, dict[str, object]]:
    if not ENGINE_PY.exists() or not (MODEL / "config.json").exists():
        pytest.fail("the real engine is not set up: run `bash scripts/setup.sh all`")
    import tempfile

    return {
        "engine": {
            # as the demo (config.toml) starts it
            "command": [str(ENGINE_VLLM), "serve", str(MODEL)],
            "args": ["--served-model-name", "tiny-llama",
                     "--max-model-len", "512", "--dtype", "float32", "--enforce-eager"],
            # every compile and JIT cache empty at the run's start and shared by its
            # engines (what a start learns of the model is not learned again by each
            # daemon's fresh state directory), never the machine's; the daemon's own
            # folder is tested by test_sigkill_of_daemon_leaves_no_engine_process, an
            # engine's first start with nothing compiled by tests/test_e2e_cold.py
            "env": {"VLLM_CPU_KVCACHE_SPACE": "1", **cache_env(run_caches())},
            "port": free_port(), "startup_timeout_s": START_TIMEOUT,
            "drain_timeout_s": 5.0, "stop_grace_s": 15.0, "reap_timeout_s": 15.0,
            "health_interval_s": 0.25,
        },
        "daemon": {"runtime_dir": tempfile.mkdtemp(prefix="vs-", dir="/tmp")},
        "audit": {"path": str(tmp / "events.jsonl")},
        "log": {"format": "json", "level": "info"},
        "exporter": {"listen": f"127.0.0.1:{free_port()}"},
        "gpu": {"sampler": "off"},
        "proxy": {"enabled": False},  # these tests talk to the engine's own port
    }


def complete(port: int, prompt: str = "hello there") -> str:
    """A completion of 8 tokens, generated (ignore_eos: an early end would be the random
    model's, not the engine's); its text."""
    r = httpx.post(f"http://127.0.0.1:{port}/v1/completions", timeout=60,
                   json={"model": "tiny-llama", "prompt": prompt, "max_tokens": 8,
                         "ignore_eos": True})
    assert r.status_code == 200, r.text
    body = r.json()
    choice = body["choices"][0]
    assert (choice["finish_reason"], body["usage"]["completion_tokens"]) == ("length", 8), body
    assert isinstance(choice["text"], str) and choice["text"], body
    return str(choice["text"])


def tree(pid: int | None) -> list[psutil.Process]:
    # (psutil.Process(None) is this test process: a state without an engine must fail
    # here, not count pytest's own children as the engine's)
    assert isinstance(pid, int), f"no engine process (pid {pid!r})"
    root = psutil.Process(pid)
    return [root, *root.children(recursive=True)]


def shm_queues(procs: list[psutil.Process]) -> dict[str, int]:
    """vLLM's message queues' files (Python's SharedMemory, /dev/shm/psm_*) these
    processes hold open, with their sizes."""
    out = {}
    for p in procs:
        fds = Path(f"/proc/{p.pid}/fd")
        for fd in fds.iterdir():
            target = os.readlink(fd)
            if target.startswith("/dev/shm/psm_"):
                out[target] = os.stat(fd).st_size
    return out


def ts(record: dict[str, object]) -> float:
    return datetime.fromisoformat(str(record["timestamp"])).timestamp()


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Daemon, dict]]:
    tmp = tmp_path_factory.mktemp("e2e")
    cfg = vllm_config(tmp)
    # speculative decoding (n-gram drafts: no draft model to build), so that the golden
    # check compares the share of drafts accepted across the restart below too
    cfg["engine"]["args"] += ["--speculative-config", NGRAM]
    # (an answer long enough to draft more than golden.MIN_DRAFT_TOKENS: the tiny model's
    # greedy answer repeats, and n-gram drafts then land)
    cfg["canary"] = {"golden_tokens": 32}
    # the proxy on (these tests still talk to the engine's own port): every start is then
    # proven before it serves, the golden check with it
    cfg["proxy"] = {"enabled": True, "listen": f"127.0.0.1:{free_port()}"}
    d = Daemon(tmp, cfg)
    try:
        yield d, cfg
    finally:
        seen = getattr(d, "seen_pids", [])
        d.close()
        for pid in alive(seen):  # never expected: the tests assert the trees are gone
            os.kill(pid, signal.SIGKILL)


def test_daemon_starts_the_engine_and_a_completion_is_served(served):
    d, cfg = served
    st = d.wait_state("RUNNING", START_TIMEOUT)
    port = cfg["engine"]["port"]
    assert complete(port)  # (8 tokens generated: complete() checks them)
    procs = tree(st["pid"])
    names = [p.name() for p in procs]
    assert any(n.startswith("VLLM::EngineCor") for n in names), names
    assert all(os.getpgid(p.pid) == st["pid"] for p in procs)  # its own process group
    assert st["engine"]["processes"] >= 3
    d.seen_pids = [p.pid for p in procs]  # type: ignore[attr-defined]
    # the engine's /metrics are scraped into status: the completion's tokens show up
    sig = wait_for(lambda: (s := d.status()["signals"])["kv_blocks_total"] and s,
                   30, "a scrape of the engine's /metrics")
    # the first start's golden answers recorded (its proof, before it serves the proxy):
    # the baseline the restart below is compared with
    wait_for(lambda: d.status()["golden"]["baselines"] == 1, 120,
             "the golden baseline of the first start")
    assert sig["kv_cache_usage"] is not None and sig["metrics_age_s"] < 10
    # its max_model_len, asked of its /v1/models once healthy, bounds the blocks its
    # running requests can hold: none is held beyond them (nothing leaked)
    assert sig["kv_blocks_unaccounted"] is not None and sig["kv_blocks_unaccounted"] <= 0
    # vLLM's development routes, probed at its start: without VLLM_SERVER_DEV_MODE the
    # real engine serves none (a GET of each answered 404), so both in-place rungs are
    # off from the start, each saying why (supervisor/watchdog/devroutes.py)
    st = d.status()
    assert st["dev_routes"] == dict.fromkeys(DEV_ROUTES, False), st["dev_routes"]
    assert st["off"] == {
        "reset_prefix_cache": "the engine does not serve /reset_prefix_cache: "
                              "VLLM_SERVER_DEV_MODE is not 1",
        "kv_reset": "the engine was not started with --enable-sleep-mode; no pause either: "
                    "the engine does not serve /pause, /resume, /is_paused, "
                    "/reset_prefix_cache: VLLM_SERVER_DEV_MODE is not 1"}, st["off"]
    assert sig["requests_waiting"] == 0
    assert sig["engine_rss_bytes"] > 200 << 20  # API server, engine core and worker
    # its KV cache as its core said ("CPU KV cache size: 1,048,576 tokens" on this build)
    assert st["engine"]["kv_tokens"] > 0, st["engine"]
    # engine lines are relayed as structured events with vLLM's process tag kept
    recs = d.log_records()
    assert any(r.get("source") == "engine" and r.get("proc") == "APIServer" for r in recs)
    assert any(r.get("source") == "engine" and str(r.get("proc", "")).startswith("EngineCore")
               for r in recs)


def test_sigkill_of_engine_core_is_detected_and_the_engine_serves_again(served):
    d, cfg = served
    st = d.status()
    old = tree(st["pid"])
    core = next(p for p in old if p.name().startswith("VLLM::EngineCor"))
    queues = shm_queues(old)  # a SIGKILL leaves them (only their creator unlinks them)
    print("the tree's message queues in /dev/shm:", queues)
    killed_at = time.time()
    core.send_signal(signal.SIGKILL)
    # the start's expected length, learned from the first one, as status says it
    expected = wait_for(lambda: (d.status()["start"] or {}).get("expected_s"),
                        START_TIMEOUT, "the restart's expected length in status")
    st = d.wait_state("RUNNING", START_TIMEOUT, extra=lambda s: s["restarts"] == 1)
    runs = [r for r in d.log_records() if r.get("to") == "RUNNING"]
    first, took = (float(r["reason"].split(" after ")[1].split(" s")[0])
                   for r in (runs[0], runs[-1]))
    print(f"start ETA: expected {expected} s, the second start took {took} s "
          f"({abs(expected - took) / took:.0%} off)")
    # what the ETA is made of, not how close a noisy machine comes to it: the one start
    # before this one, as its RUNNING line logged it (how far off it was is printed)
    assert len(runs) == 2 and abs(expected - first) <= 0.11, (expected, first)
    gone = [p.pid for p in old]
    assert alive(gone) == [], "a process of the old tree survived"
    # removed by the take-down, once the tree was gone (engine/process/shm_files.py)
    assert queues and [q for q in queues if Path(q).exists()] == [], queues
    assert complete(cfg["engine"]["port"])  # served again, 8 tokens
    recs = d.log_records()
    # the core's death is the crash, seen at once (a pidfd on it), before the API server
    # that outlives it by seconds exits
    exited = next(r for r in recs if r.get("event") == "engine core exited")
    backoff = next(r for r in recs if r.get("to") == "BACKOFF")
    reaped = next(r for r in recs if r.get("event") == "engine tree reaped")
    restarted = [r for r in recs if r.get("to") == "RUNNING"][-1]
    timings = {
        "core_death_seen_after_kill_s": round(ts(exited) - killed_at, 3),
        "daemon_action_after_it_s": round(ts(backoff) - ts(exited), 3),
        "reap_s": reaped["duration_s"],
        "kill_to_serving_again_s": round(ts(restarted) - killed_at, 3),
    }
    print("crash timings:", json.dumps(timings))
    (d.tmp / "crash-timings.json").write_text(json.dumps(timings))
    d.seen_pids = gone + [p.pid for p in tree(st["pid"])]  # type: ignore[attr-defined]


def test_status_and_events_show_what_happened(served):
    d, _ = served
    st = json.loads(d.ctl("status", "--json").stdout)
    assert st["state"] == "RUNNING" and st["restarts"] == 1
    assert st["last_decision"]["action"] == "start"
    assert st["last_exit"].startswith(("lost its core", "exited with code", "killed by"))
    r = d.ctl("events", "--json", "-n", "100")
    assert r.returncode == 0
    events = [json.loads(line) for line in r.stdout.splitlines()]
    transitions = [(e["from"], e["to"]) for e in events if e["event"] == "state"]
    assert ("RUNNING", "BACKOFF") in transitions
    assert ("BACKOFF", "STARTING") in transitions
    # the crash as the audit trail has it: the core's death, once (its API server's exit
    # follows, as the daemon takes the tree down)
    crash = [e for e in events if e["event"] == "core_exit"]
    assert len(crash) == 1 and crash[0]["core_pid"] and crash[0]["pid"]
    # each start's engine probed anew (a relaunch may change what it serves)
    probed = [e for e in d.events(5000) if e["event"] == "dev_routes"]
    assert [e["pid"] for e in probed][-1] == st["pid"] and len(probed) == 2, probed
    assert all(set(e["off"]) == {"prefix_reset", "sleep", "pause"} for e in probed)
    # the golden check across the restart: the same tokens, and speculative decoding's
    # drafts accepted as at the first start (a wake or restart that broke the drafts
    # would keep the tokens and lose this)
    recorded = [e for e in d.events(5000) if e["event"] == "golden_recorded"]
    assert len(recorded) == 1 and recorded[0]["acceptance"] > 0, recorded
    # (its proof, warm-up first, may still run: the test asked the engine's own port)
    golden = wait_for(lambda: (g := d.status()["golden"])["last"]["pid"] == st["pid"] and g,
                      START_TIMEOUT, "the restarted engine's golden check")
    assert golden["passed"] >= 1 and golden["mismatches"] == 0, golden
    last = golden["last"]
    assert last["verdict"] == "ok" and last["acceptance"] > 0.5 * last["baseline_acceptance"]
    print("golden check across the restart:", json.dumps(last))


def test_ctl_stop_leaves_no_process_and_exits_zero(served):
    d, _ = served
    seen = list(getattr(d, "seen_pids", []))
    seen += [p.pid for p in tree(d.status()["pid"])]
    r = d.ctl("stop", timeout=120)
    assert r.returncode == 0, r.stderr
    assert d.wait_exit(60) == 0
    assert alive(seen) == []
    assert not Path(d.socket).exists()


def test_sigkill_of_daemon_leaves_no_engine_process(tmp_path):
    cfg = vllm_config(tmp_path)
    for name in ("VLLM_CACHE_ROOT", "TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR"):
        del cfg["engine"]["env"][name]  # the daemon's own (engine.compile_cache)
    d = Daemon(tmp_path, cfg)
    seen: list[int] = []
    try:
        st = d.wait_state("RUNNING", START_TIMEOUT)
        seen = [p.pid for p in tree(st["pid"])]
        # its compile cache is the daemon's, under the state directory, in a folder of
        # the vLLM version installed in the engine's venv, and what vLLM keeps there is
        # measured (the other tests' engines share vLLM's default one: warm starts)
        version = subprocess.run(
            [str(ENGINE_PY), "-c",
             "import importlib.metadata as m; print(m.version('vllm'))"],
            capture_output=True, text=True, timeout=60).stdout.strip()
        cache = wait_for(lambda: (c := d.status()["compile_cache"]) and c["bytes"] and c,
                         30, "the engine's compile cache measured")
        assert cache["vllm_version"] == version and version.startswith("0.")
        assert cache["dir"] == str(tmp_path / "vllm-cache" / "default" / version)
        # torch inductor's and Triton's caches beside vLLM's, in the same folder
        env = psutil.Process(st["pid"]).environ()
        assert env["VLLM_CACHE_ROOT"] == cache["dir"]
        assert env["TORCHINDUCTOR_CACHE_DIR"] == cache["dir"] + "/inductor"
        assert env["TRITON_CACHE_DIR"] == cache["dir"] + "/triton"
        print("compile cache:", json.dumps(cache))
        os.kill(d.pid, signal.SIGKILL)
        d.proc.wait(5)
        wait_for(lambda: alive(seen) == [], 10, "the engine tree to die with the daemon")
    finally:
        d.close()
        for pid in alive(seen):
            os.kill(pid, signal.SIGKILL)
