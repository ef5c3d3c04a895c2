"""vLLM 0.33 on the lent GPU, run straight (no daemon): what issue 36 measures of it.

Not collected by pytest. Run on the GPU machine once vLLM 0.33 is staged in VLLM_SITE
(docs/gpu-validation.md, "vLLM 0.33"), each phase in the background where it outlasts a
10-minute call (`bg PHASE` starts it in its own session, `wait PHASE S` follows it):

    python3 tests/gpu_v033.py env        # what imports: torch, vLLM, the libraries found
    python3 tests/gpu_v033.py ckpt       # ~/ckpt8b: Llama-3.1-8B's shape with random weights
                                         # written out (16 GB of safetensors: bytes to load,
                                         # which `--load-format dummy` never reads)
    python3 tests/gpu_v033.py wcache [N] # cold starts of ckpt8b at 0.88: one to warm the
                                         # compile cache, N (3) from disk, then `vllm preload`
                                         # and N with `--load-format ipc_cache`; each start's
                                         # time to /health and vLLM's own load lines
    python3 tests/gpu_v033.py rustfe     # the dev endpoints the daemon uses, asked of the
                                         # Python front end and of VLLM_USE_RUST_FRONTEND=1
    python3 tests/gpu_v033.py bg wcache; python3 tests/gpu_v033.py wait wcache 540

Each phase prints `RESULT {json}` lines and appends them to $WORK/v033.jsonl; the engines'
logs, a /metrics scrape and the start log go to $OUT (fixtures for tests/fixtures).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from tests.gpu_shapes import make_m8b

WORK = Path(os.environ.get("WORK", "/tmp/vs-gpu"))
VLLM_SITE = os.environ.get("VLLM_SITE", str(Path.home() / "vllm-site"))
STAGED = Path.home() / "vllm-stage" / "model"
CKPT = Path.home() / "ckpt8b"
PORT = 8100
HEALTH_PORT = 8190
RESULTS = WORK / "v033.jsonl"
VLLM = [sys.executable, "-m", "vllm.entrypoints.cli.main"]


def result(phase: str, **values: Any) -> None:
    line = json.dumps({"phase": phase, **values})
    print("RESULT " + line, flush=True)
    WORK.mkdir(parents=True, exist_ok=True)
    with RESULTS.open("a") as f:
        f.write(line + "\n")
    to_out("v033.jsonl", RESULTS)


def to_out(name: str, path: Path, tail: int = 4 * 2**20) -> None:
    out = os.environ.get("OUT")
    if out and path.exists():
        with path.open("rb") as f:
            f.seek(max(0, path.stat().st_size - tail))
            (Path(out) / name).write_bytes(f.read())


def env_for(extra: dict[str, str] | None = None) -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": VLLM_SITE, "VLLM_SERVER_DEV_MODE": "1",
            "PYTHONUNBUFFERED": "1", **(extra or {})}


def http(method: str, path: str, body: Any = None, port: int = PORT,
         timeout: float = 30) -> tuple[int, str]:
    data = json.dumps(body).encode() if body is not None else (b"" if method == "POST" else None)
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data=data, method=method,
                                 headers={"content-type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return int(r.status), r.read(400).decode(errors="replace")
    except urllib.error.HTTPError as exc:
        return int(exc.code), exc.read(400).decode(errors="replace")
    except Exception as exc:  # refused, reset, timed out
        return -1, repr(exc)[:200]


def gpu_used_mib() -> dict[int, int]:
    out = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,used_memory",
                          "--format=csv,noheader,nounits"], capture_output=True, text=True)
    used = {}
    for line in out.stdout.splitlines():
        if "," in line:
            pid, mib = line.split(",")
            used[int(pid)] = int(mib)
    return used


class Engine:
    """One `vllm serve` (or `vllm preload`) in its own session, its log in WORK."""

    def __init__(self, tag: str, argv: list[str], env: dict[str, str]) -> None:
        self.tag, self.log = tag, WORK / f"{tag}.log"
        self.t0 = time.monotonic()
        self.proc = subprocess.Popen(argv, stdout=self.log.open("wb"),
                                     stderr=subprocess.STDOUT, env=env,
                                     start_new_session=True)

    def wait_health(self, port: int = PORT, timeout: float = 900) -> float:
        deadline = self.t0 + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                to_out(f"{self.tag}.log", self.log)
                raise AssertionError(f"{self.tag} exited {self.proc.returncode} before /health")
            if http("GET", "/health", port=port, timeout=2)[0] == 200:
                return round(time.monotonic() - self.t0, 2)
            time.sleep(0.25)
        raise AssertionError(f"{self.tag}: no /health 200 within {timeout} s")

    def lines(self, *patterns: str) -> dict[str, str]:
        """vLLM's own lines of the start (the first match of each pattern)."""
        text = self.log.read_text(errors="replace")
        found = {}
        for pat in patterns:
            m = re.search(pat, text)
            if m:
                found[pat] = m.group(0)[:300]
        return found

    def stop(self, timeout: float = 90) -> float:
        """SIGTERM to the group, SIGKILL after `timeout`; until the GPU lets go."""
        t0 = time.monotonic()
        try:
            os.killpg(self.proc.pid, signal.SIGTERM)
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(30)
        except ProcessLookupError:
            pass
        with contextlib.suppress(ProcessLookupError):  # what is left (the core, workers)
            os.killpg(self.proc.pid, signal.SIGKILL)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and self._group_on_gpu():
            time.sleep(0.5)
        return round(time.monotonic() - t0, 1)

    def _group_on_gpu(self) -> bool:
        pids = gpu_used_mib()
        for pid in pids:
            try:
                if os.getpgid(pid) == self.proc.pid:
                    return True
            except ProcessLookupError:
                continue
        return False


def phase_env() -> None:
    code = ("import torch, vllm, triton, sys; print(torch.__version__, torch.version.cuda, "
            "vllm.__version__, triton.__version__, torch.cuda.is_available(), "
            "torch.cuda.nccl.version(), torch.backends.cudnn.version()); "
            "import vllm.entrypoints.openai.api_server, flashinfer; print('imports ok')")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env=env_for(), timeout=300)
    result("env", rc=out.returncode, stdout=out.stdout[-2000:], stderr=out.stderr[-4000:])


def phase_ckpt() -> None:
    """Random weights of Llama-3.1-8B's shape, written the way a checkpoint is (bf16
    safetensors shards of about 5 GB, an index), with the staged tokenizer."""
    import torch
    from safetensors.torch import save_file

    t0 = time.monotonic()
    make_m8b(CKPT, STAGED, tie_word_embeddings=False)
    h, i, kv, layers, v = 4096, 14336, 8 * 128, 32, 128256
    shapes: list[tuple[str, tuple[int, ...]]] = [("model.embed_tokens.weight", (v, h))]
    for n in range(layers):
        p = f"model.layers.{n}."
        shapes += [(p + "self_attn.q_proj.weight", (h, h)),
                   (p + "self_attn.k_proj.weight", (kv, h)),
                   (p + "self_attn.v_proj.weight", (kv, h)),
                   (p + "self_attn.o_proj.weight", (h, h)),
                   (p + "mlp.gate_proj.weight", (i, h)), (p + "mlp.up_proj.weight", (i, h)),
                   (p + "mlp.down_proj.weight", (h, i)), (p + "input_layernorm.weight", (h,)),
                   (p + "post_attention_layernorm.weight", (h,))]
    shapes += [("model.norm.weight", (h,)), ("lm_head.weight", (v, h))]
    shards: list[dict[str, Any]] = [{}]
    size = 0
    for name, shape in shapes:
        n = 1
        for d in shape:
            n *= d
        if size + 2 * n > 5 * 10**9 and shards[-1]:
            shards.append({})
            size = 0
        shards[-1][name] = shape
        size += 2 * n
    weight_map, total = {}, 0
    for k, shard in enumerate(shards):
        fname = f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors"
        tensors = {}
        for name, shape in shard.items():
            t = torch.ones(shape, dtype=torch.bfloat16, device="cuda") if len(shape) == 1 \
                else torch.randn(shape, dtype=torch.bfloat16, device="cuda") * 0.02
            tensors[name] = t.cpu()
            total += t.numel() * 2
            weight_map[name] = fname
        save_file(tensors, str(CKPT / fname), metadata={"format": "pt"})
    (CKPT / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"total_size": total}, "weight_map": weight_map}))
    os.sync()
    result("ckpt", dir=str(CKPT), shards=len(shards), bytes=total,
           seconds=round(time.monotonic() - t0, 1))


LOAD_LINES = (r"Loading weights took [\d.]+ seconds", r"Model loading took [^\n]*",
              r"torch\.compile took [\d.]+ s[^\n]*", r"Graph capturing finished in [^\n]*",
              r"init engine \(profile, create kv cache, warmup model\) took [^\n]*",
              r"Available KV cache memory: [^\n]*", r"GPU KV cache size: [^\n]*",
              r"Weights are held outside this process[^\n]*", r"[^\n]*ipc_cache[^\n]*",
              r"[^\n]*[Ww]eight cache[^\n]*")
SERVE_ARGS = ["--served-model-name", "m8b", "--dtype", "bfloat16", "--max-model-len", "2048",
              "--gpu-memory-utilization", "0.88", "--port", str(PORT)]


def timed_start(tag: str, extra: list[str], scrape: bool = False) -> dict[str, Any]:
    eng = Engine(tag, [*VLLM, "serve", str(CKPT), *SERVE_ARGS, *extra], env_for())
    try:
        health_s = eng.wait_health()
        code, _ = http("POST", "/v1/completions", {"model": "m8b", "prompt": "hello",
                                                      "max_tokens": 8, "ignore_eos": True},
                          timeout=120)
        if scrape:
            with urllib.request.urlopen(f"http://127.0.0.1:{PORT}/metrics", timeout=10) as r:
                (WORK / f"{tag}-metrics.txt").write_bytes(r.read())
            to_out(f"{tag}-metrics.txt", WORK / f"{tag}-metrics.txt")
        mib = gpu_used_mib()
        return {"tag": tag, "health_s": health_s, "completion": code,
                "lines": eng.lines(*LOAD_LINES), "gpu_mib": mib}
    finally:
        stopped = eng.stop()
        to_out(f"{tag}.log", eng.log, tail=2**20)
        print(f"{tag}: stopped in {stopped} s", flush=True)


def phase_wcache(n: int = 3) -> None:
    """Cold starts of a real 8B checkpoint at 0.88, from disk and through the weight cache."""
    assert (CKPT / "model.safetensors.index.json").exists(), "run `ckpt` first"
    if os.environ.get("WCACHE_WARM", "1") == "1":  # fills the compile cache first
        result("wcache-warm", **timed_start("warm", [], scrape=False))
    disk = []
    for k in range(n):
        disk.append(timed_start(f"disk{k}", [], scrape=(k == 0)))
        result("wcache-disk", **disk[-1])
    sock = WORK / "wcache-sock"
    sock.mkdir(parents=True, exist_ok=True)
    pre = Engine("preload", [*VLLM, "preload", "--model", str(CKPT), "--dtype", "bfloat16",
                             "--max-model-len", "2048", "--weight-cache-socket-dir", str(sock),
                             "--weight-cache-health-port", str(HEALTH_PORT),
                             "--weight-cache-health-host", "127.0.0.1"], env_for())
    try:
        ready_s = pre.wait_health(port=HEALTH_PORT)
        result("wcache-preload", ready_s=ready_s, gpu_mib=gpu_used_mib(),
               lines=pre.lines(r"[^\n]*READY[^\n]*", r"[^\n]*GiB[^\n]*"))
        extra = ["--load-format", "ipc_cache", "--model-loader-extra-config",
                 json.dumps({"socket_dir": str(sock), "fallback": False})]
        ipc = []
        for k in range(n):
            ipc.append(timed_start(f"ipc{k}", extra, scrape=(k == 0)))
            result("wcache-ipc", **ipc[-1])
        health = http("GET", "/health", port=HEALTH_PORT)[0]
    finally:
        pre.stop()
        to_out("preload.log", pre.log, tail=2**20)
    result("wcache", n=n, cache_health_after=health,
           disk_health_s=[d["health_s"] for d in disk], ipc_health_s=[d["health_s"] for d in ipc],
           disk_median_s=statistics.median(d["health_s"] for d in disk),
           ipc_median_s=statistics.median(d["health_s"] for d in ipc),
           preload_ready_s=ready_s)


DEV_TABLE: list[tuple[str, str, Any]] = [
    ("GET", "/health", None), ("GET", "/v1/models", None), ("GET", "/version", None),
    ("GET", "/metrics", None), ("GET", "/is_sleeping", None),
    ("POST", "/reset_prefix_cache", None), ("POST", "/sleep?level=1", None),
    ("GET", "/is_sleeping", None), ("POST", "/wake_up", None), ("GET", "/is_sleeping", None),
    ("POST", "/collective_rpc", {"method": "get_model_config"}), ("GET", "/load", None),
    ("GET", "/server_info", None), ("POST", "/pause", None), ("GET", "/is_paused", None),
    ("POST", "/resume", None), ("PUT", "/sleep", None), ("GET", "/no_such_route", None)]


def phase_rustfe() -> None:
    """The endpoints the daemon uses, asked of each front end (the tiny model, eager)."""
    args = ["--served-model-name", "tiny", "--enforce-eager", "--enable-sleep-mode",
            "--gpu-memory-utilization", "0.3", "--max-model-len", "512", "--port", str(PORT)]
    table: dict[str, dict[str, Any]] = {}
    for tag, extra in (("python", {}), ("rust", {"VLLM_USE_RUST_FRONTEND": "1"})):
        eng = Engine(f"fe-{tag}", [*VLLM, "serve", str(STAGED), *args], env_for(extra))
        try:
            table[tag] = {"health_s": eng.wait_health(timeout=600)}
            gen = http("POST", "/v1/completions", {"model": "tiny", "prompt": "hi",
                                                   "max_tokens": 4, "ignore_eos": True})
            table[tag]["completion"] = gen[0]
            for method, path, body in DEV_TABLE:
                code, text = http(method, path, body)
                key = f"{method} {path}"
                while key in table[tag]:
                    key += "'"
                table[tag][key] = [code, text[:120] if path != "/metrics" else
                                   f"{text.count('vllm:')} vllm: series in the first 400 B"]
            import psutil
            table[tag]["tree"] = [p.name() for p in
                                  [psutil.Process(eng.proc.pid),
                                   *psutil.Process(eng.proc.pid).children(recursive=True)]]
        finally:
            eng.stop()
            to_out(f"fe-{tag}.log", eng.log, tail=2**20)
        result("rustfe-" + tag, **table[tag])
    result("rustfe", table=table)


def phase_bg(phase: str, *args: str) -> None:
    WORK.mkdir(parents=True, exist_ok=True)
    log = (WORK / f"bg-{phase}.out").open("ab")
    subprocess.Popen([sys.executable, __file__, phase, *args], stdout=log,
                     stderr=subprocess.STDOUT, start_new_session=True,
                     env={**os.environ, "OUT": ""})
    print(f"{phase} started in the background", flush=True)


def phase_wait(phase: str, seconds: str) -> None:
    """Follows a background phase for at most `seconds`; its output so far to $OUT."""
    out = WORK / f"bg-{phase}.out"
    deadline = time.monotonic() + float(seconds)
    done = f'RESULT {{"phase": "{phase}"'
    while time.monotonic() < deadline:
        text = out.read_text(errors="replace") if out.exists() else ""
        if done in text or "Traceback" in text:
            break
        time.sleep(5)
    text = out.read_text(errors="replace") if out.exists() else "(nothing yet)"
    print(text[-6000:])
    to_out(f"bg-{phase}.out", out)
    to_out("v033.jsonl", RESULTS)
    # at most 8 files come back a call: the fixtures' sources and the cache's own log
    for name in ("disk0-metrics.txt", "ipc0-metrics.txt", "disk0.log", "ipc0.log",
                 "preload.log"):
        to_out(name, WORK / name, tail=2**20)


if __name__ == "__main__":
    WORK.mkdir(parents=True, exist_ok=True)
    cmd, rest = sys.argv[1], sys.argv[2:]
    if cmd == "wcache":
        phase_wcache(int(rest[0]) if rest else 3)
    elif cmd == "bg":
        phase_bg(*rest)
    elif cmd == "wait":
        phase_wait(*rest)
    else:
        {"env": phase_env, "ckpt": phase_ckpt, "rustfe": phase_rustfe}[cmd]()
