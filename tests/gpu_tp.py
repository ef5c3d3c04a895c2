"""A tensor-parallel engine on two GPUs under the daemon (issue 27), on a lent two-GPU machine.

Not collected by pytest (no GPU in CI). After the stage calls (`../shared/tools/gpu-vllm/stage`,
its parts in ~/vllm-stage, the supervisor's wheel and structlog/tenacity among its wheels; the
proxy's httptools too, unless vLLM's own uvicorn[standard] brought it):

    python3 tests/gpu_tp.py install     # vLLM -> ~/vllm-site, the daemon -> /tmp/sup-site, ~/m8b
    python3 tests/gpu_tp.py kill        # TP=2 8B-shaped engine (dummy weights) on gpus [0, 1]:
                                        # SIGKILL of VLLM::Worker_TP1 under `vllm bench serve`
                                        # through the proxy: tree gone, both GPUs released,
                                        # restarted, requests counted; per-GPU status

Prints `RESULT {json}` lines; results and logs go to $OUT.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from tests.gpu_shapes import make_m8b

HOME = Path.home()
OUT = Path(os.environ.get("OUT", "/tmp/out"))
STAGE = HOME / "vllm-stage"
SITE = HOME / "vllm-site"
SUP = "/tmp/sup-site"
M8B = HOME / "m8b"
WORK = Path("/tmp/vs-tp")
T0 = time.time()


def log(what: str, **kv: Any) -> None:
    print(json.dumps({"t": round(time.time() - T0, 2), "what": what, **kv}), flush=True)


def sh(cmd: str) -> str:
    return subprocess.run(cmd, shell=True, capture_output=True, text=True).stdout


def install() -> None:
    print(sh(f"cd {STAGE} && cat part* | tar x && rm -f part* && ls"))
    print(sh(f"python3 -m pip install -q --no-index --no-deps --no-compile --target {SITE} "
             f"$(ls {STAGE}/wheels/*.whl | grep -v -e vllm_supervisor -e structlog "
             f"-e tenacity) 2>&1 | tail -3"))
    print(sh(f"python3 -m pip install -q --no-index --no-deps --no-compile --target {SUP} "
             f"{STAGE}/wheels/vllm_supervisor*.whl {STAGE}/wheels/structlog*.whl "
             f"{STAGE}/wheels/tenacity*.whl $(ls {STAGE}/wheels/httptools*.whl 2>/dev/null) "
             f"2>&1 | tail -3"))
    make_m8b(M8B, STAGE / "model")
    print(sh("nvidia-smi --query-gpu=index,name,memory.used --format=csv"))


def title(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0].decode(
            errors="replace")[:40]
    except OSError:
        return "?"


def nvml_lists() -> dict[int, dict[int, str]]:
    """GPU index -> {pid: process title} from NVML's per-process lists."""
    import pynvml

    pynvml.nvmlInit()
    out: dict[int, dict[int, str]] = {}
    for i in range(pynvml.nvmlDeviceGetCount()):
        h = pynvml.nvmlDeviceGetHandleByIndex(i)
        procs = pynvml.nvmlDeviceGetComputeRunningProcesses(h)
        out[i] = {int(p.pid): title(int(p.pid)) for p in procs}
    pynvml.nvmlShutdown()
    return out


def status() -> dict[str, Any]:
    sys.path.insert(0, SUP)
    from supervisor.control.client import call

    st: dict[str, Any] = call(str(WORK / "run" / "control.sock"), "status", None,
                              timeout_s=10)
    return st


def wait(cond: Any, limit: float, what: str) -> Any:
    t = time.time()
    while time.time() - t < limit:
        try:
            v = cond()
            if v:
                return v
        except Exception:  # the daemon may not answer yet
            pass
        time.sleep(0.25)
    raise SystemExit(f"timed out waiting for {what}")


def daemon_config() -> str:
    engine = {
        "command": [sys.executable, "-m", "vllm.entrypoints.cli.main", "serve", str(M8B)],
        "args": ["--load-format", "dummy", "--served-model-name", "m", "--dtype", "bfloat16",
                 "--tensor-parallel-size", "2", "--gpu-memory-utilization", "0.5",
                 "--max-model-len", "2048", "--enforce-eager"],
        # (NVLink multicast stays off on the lent machines: KINDS.md)
        "env": {"PYTHONPATH": str(SITE), "VLLM_SERVER_DEV_MODE": "1",
                "NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
                "NVSHMEM_DISABLE_NVLS": "1"},
        "port": 8100, "gpus": [0, 1], "startup_timeout_s": 480, "drain_timeout_s": 10,
        "stop_grace_s": 10, "reap_timeout_s": 20, "gpu_release_timeout_s": 60}

    def v(x: Any) -> str:
        return json.dumps(x) if not isinstance(x, dict) else "{ " + ", ".join(
            f"{k} = {json.dumps(y)}" for k, y in x.items()) + " }"

    lines = ["[engine]", *(f"{k} = {v(x)}" for k, x in engine.items()),
             "[gpu]", 'sampler = "nvml"', "period_s = 1",
             "[proxy]", 'listen = "127.0.0.1:8000"',
             "[exporter]", 'listen = "127.0.0.1:9402"',
             "[control]", f'socket = "{WORK}/run/control.sock"',
             "[daemon]", f'runtime_dir = "{WORK}/run"',
             "[audit]", f'path = "{WORK}/events.jsonl"',
             "[log]", 'format = "json"', 'level = "info"']
    WORK.mkdir(parents=True, exist_ok=True)
    path = WORK / "config.toml"
    path.write_text("\n".join(lines) + "\n")
    return str(path)


def two() -> None:
    """Two engines, `gpus = [0]` and `gpus = [1]`: each engine's processes on its own GPU."""
    text = Path(daemon_config()).read_text()
    engine, rest = text.split("[gpu]", 1)
    engine = engine.replace('"--tensor-parallel-size", "2", ', "")
    a = engine.replace("[engine]", "[engines.a]").replace("gpus = [0, 1]", "gpus = [0]")
    b = engine.replace("[engine]", "[engines.b]").replace("gpus = [0, 1]", "gpus = [1]") \
        .replace("port = 8100", "port = 8101").replace('"m"', '"m2"')
    cfg = WORK / "two.toml"
    cfg.write_text(a + b + "[gpu]" + rest)
    env = {**os.environ, "PYTHONPATH": SUP, "PYTHONUNBUFFERED": "1"}
    with open(OUT / "daemon-two.log", "wb") as dlog:
        d = subprocess.Popen([sys.executable, "-m", "supervisor", "run", "--config", str(cfg)],
                             env=env, stdout=dlog, stderr=subprocess.STDOUT,
                             start_new_session=True)
        try:
            wait(lambda: all(e["serving"] for e in status()["engines"]), 300, "both serving")
            time.sleep(3)
            st = status()
            trees = {n: sorted(int(x) for x in sh(
                f"pgrep -g {os.getpgid(e['pid'])}").split()) for n, e in st["detail"].items()}
            log("RESULT two", nvml=nvml_lists(), trees=trees,
                gpus={n: [(g["index"], g["engine_memory_bytes"]) for g in e["gpus"]]
                      for n, e in st["detail"].items()})
        finally:
            d.send_signal(signal.SIGTERM)
            d.wait(120)
            log("stopped", rc=d.returncode, nvml=nvml_lists())


def kill() -> None:
    cfg = daemon_config()
    with open(OUT / "daemon.log", "wb") as dlog, open(OUT / "bench.log", "wb") as blog:
        _kill(cfg, dlog, blog)


def _kill(cfg: str, dlog: Any, blog: Any) -> None:
    env = {**os.environ, "PYTHONPATH": SUP, "PYTHONUNBUFFERED": "1"}
    d = subprocess.Popen([sys.executable, "-m", "supervisor", "run", "--config", cfg],
                         env=env, stdout=dlog, stderr=subprocess.STDOUT,
                         start_new_session=True)
    try:
        st = wait(lambda: (s := status())["state"] == "RUNNING" and s, 480, "RUNNING")
        log("serving", after_s=round(time.time() - T0, 1), pid=st["pid"])
        time.sleep(3)  # (a GPU sample after the start)
        st = status()
        lists = nvml_lists()
        log("per-GPU", gpus=st.get("gpus"), nvml=lists)
        bench = subprocess.Popen(
            [sys.executable, "-m", "vllm.entrypoints.cli.main", "bench", "serve",
             "--backend", "openai", "--base-url", "http://127.0.0.1:8000",
             "--endpoint", "/v1/completions", "--model", "m", "--tokenizer", str(M8B),
             "--dataset-name", "random", "--random-input-len", "32",
             "--random-output-len", "128", "--num-prompts", "600", "--max-concurrency",
             "32", "--ignore-eos", "--ready-check-timeout-sec", "0", "--save-result",
             "--result-dir", str(OUT)],
            env={**os.environ, "PYTHONPATH": str(SITE)}, stdout=blog,
            stderr=subprocess.STDOUT, start_new_session=True)
        wait(lambda: (status()["signals"].get("requests_running") or 0) >= 8, 180,
             "load running")
        old = [int(x) for x in sh(f"pgrep -g {os.getpgid(st['pid'])}").split()]
        tp1 = next(p for p in old if title(p).startswith("VLLM::Worker_TP1"))
        sig = signal.SIGSTOP if os.environ.get("SIG") == "STOP" else signal.SIGKILL
        killed = time.time()
        os.kill(tp1, sig)
        log(f"{sig.name} of VLLM::Worker_TP1", pid=tp1, old_tree=len(old))
        wait(lambda: not [p for p in old if Path(f"/proc/{p}").exists()], 120, "tree gone")
        gone_s = round(time.time() - killed, 2)
        wait(lambda: not {p for g in nvml_lists().values() for p in g} & set(old), 120,
             "both GPUs released")
        released_s = round(time.time() - killed, 2)
        st = wait(lambda: (s := status())["state"] == "RUNNING" and s["restarts"] >= 1 and s,
                  400, "serving again")
        back_s = round(time.time() - killed, 2)
        decisions = [json.loads(x) for x in (WORK / "events.jsonl").read_text().splitlines()
                     if '"decision"' in x or '"core_exit"' in x or '"exit"' in x]
        log("decisions", seen=[{k: e.get(k) for k in ("time", "event", "rule", "action",
                                                       "reason", "asked")} for e in decisions])
        log("restarted", tree_gone_s=gone_s, gpus_released_s=released_s, serving_again_s=back_s,
            last_exit=st.get("last_exit"), nvml=nvml_lists())
        bench.wait(420)
        res = sorted(OUT.glob("*.json"))
        doc = json.loads(res[-1].read_text()) if res else {}
        log("RESULT", completed=doc.get("completed"), failed=doc.get("failed"),
            total_output_tokens=doc.get("total_output_tokens"),
            p99_ttft_ms=doc.get("p99_ttft_ms"), tree_gone_s=gone_s,
            gpus_released_s=released_s, serving_again_s=back_s,
            status_gpus=[{k: g.get(k) for k in ("index", "engine_memory_bytes",
                                                 "temperature_c")} for g in st.get("gpus", [])])
    finally:
        try:
            with urllib.request.urlopen("http://127.0.0.1:9402/metrics", timeout=5) as r:
                (OUT / "exporter.txt").write_bytes(r.read())
        except OSError as exc:
            log("no exporter page", error=repr(exc))
        d.send_signal(signal.SIGTERM)
        try:
            d.wait(120)
        except subprocess.TimeoutExpired:
            os.killpg(d.pid, signal.SIGKILL)
        log("stopped", rc=d.returncode, nvml=nvml_lists())


if __name__ == "__main__":
    {"install": install, "kill": kill, "two": two}[sys.argv[1]]()
