"""Issue 49, route 4 ("exact sizing as the floor"): how much KV cache a protected engine
keeps when each engine of the pair is sized in bytes rather than in shares.

Not collected by pytest (no GPU in CI). On a lent GPU machine, after the stage calls of
docs/gpu-validation.md (vLLM only, raw engines, no daemon):

    python3 tests/gpu_kv_probe.py bytes [SERVING_FRACTION]   # 0.95
    python3 tests/gpu_kv_probe.py first

`bytes`: three raw vLLM engines of Llama-3.1-8B's shape (`--load-format dummy`, eager, sleep mode,
`--max-model-len 2048`), one after another on GPU 0:

1. `lone`: `--gpu-memory-utilization 0.88`, alone: its KV cache is the reference.
2. `serving`: the same flags and `--kv-cache-memory-bytes` = SERVING_FRACTION x the lone
   engine's KV bytes (vLLM then sizes the cache by the bytes; the share only gates its
   start-up check that share x the card is free).
3. `standby`: beside it, `--gpu-memory-utilization 0.01` (the check passes on any card)
   and `--kv-cache-memory-bytes` = what the card has left after its weights and the
   overhead each engine was measured to hold beyond its KV: does vLLM start it, and how
   much does it hold once asleep? Then the serving engine's tree is SIGKILLed and the
   standby woken: how long until it answers, with the KV cache it has.

`first`: both engines at 0.88 (the built `"sleep"` design, standby first): a standby
started alone and put to sleep, then the serving engine beside it; the serving engine's
tree SIGKILLed and the standby woken, with its whole KV cache.

Each step appends `RESULT {json}` to $WORK/results.jsonl (default /tmp/vs-kvprobe):
KV tokens and GiB from vLLM's own start lines, the card's memory in use (nvidia-smi) at
each point. Run it in the background (setsid) and poll.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from tests.gpu_shapes import STAGED, VLLM_SITE, ensure_m8b

WORK = Path(os.environ.get("WORK", "/tmp/vs-kvprobe"))
MODEL = Path.home() / "m8b"
GIB = 2**30
WEIGHTS_GIB = 14.99  # Llama-3.1-8B in bf16, as vLLM reports its model loading
ARGS = ["--served-model-name", "tiny-llama", "--load-format", "dummy", "--dtype", "bfloat16",
        "--max-model-len", "2048", "--enable-sleep-mode", "--enforce-eager"]
KV_LINES = {"kv_gib": r"Available KV cache memory: ([\d.]+) GiB",
            "kv_tokens": r"GPU KV cache size: ([\d,]+) tokens",
            "weights_gib": r"Model loading took ([\d.]+) GiB"}


def result(step: str, **values: Any) -> None:
    doc = {"step": step, "t": round(time.time(), 1), **values}
    print("RESULT " + json.dumps(doc), flush=True)
    with (WORK / "results.jsonl").open("a") as f:
        f.write(json.dumps(doc) + "\n")


def card() -> dict[str, int]:
    out = subprocess.run(["nvidia-smi", "--query-gpu=memory.used,memory.total",
                          "--format=csv,noheader,nounits", "-i", "0"],
                         capture_output=True, text=True, timeout=30).stdout.split(",")
    return {"used_mib": int(out[0]), "total_mib": int(out[1])}


class Engine:
    def __init__(self, name: str, port: int, extra: list[str],
                 wrap: list[str] | None = None) -> None:
        self.name, self.port = name, port
        self.log = WORK / f"{name}.log"
        env = {**os.environ, "PYTHONPATH": VLLM_SITE, "VLLM_SERVER_DEV_MODE": "1",
               "CUDA_VISIBLE_DEVICES": "0"}
        self.argv = [*(wrap or []), sys.executable, "-m", "vllm.entrypoints.openai.api_server",
                     "--model", str(MODEL), "--port", str(port), *ARGS, *extra]
        self.proc = subprocess.Popen(self.argv, stdout=self.log.open("wb"),
                                     stderr=subprocess.STDOUT, env=env,
                                     start_new_session=True)
        self.t0 = time.monotonic()

    def url(self, path: str) -> str:
        return f"http://127.0.0.1:{self.port}{path}"

    def wait_healthy(self, timeout: float = 420) -> float | None:
        """Seconds until /health answered, or None: the engine exited or took too long."""
        while time.monotonic() - self.t0 < timeout:
            if self.proc.poll() is not None:
                return None
            try:
                urllib.request.urlopen(self.url("/health"), timeout=2)
                return round(time.monotonic() - self.t0, 1)
            except OSError:
                time.sleep(1)
        return None

    def facts(self) -> dict[str, Any]:
        text = self.log.read_text(errors="replace")
        out: dict[str, Any] = {}
        for key, pattern in KV_LINES.items():
            m = re.findall(pattern, text)
            if m:
                out[key] = float(m[-1].replace(",", ""))
        return out

    def tail(self, n: int = 25) -> list[str]:
        return self.log.read_text(errors="replace").splitlines()[-n:]

    def post(self, path: str, timeout: float = 120) -> float:
        t = time.monotonic()
        req = urllib.request.Request(self.url(path), data=b"", method="POST")
        urllib.request.urlopen(req, timeout=timeout).read()
        return round(time.monotonic() - t, 3)

    def complete(self) -> float:
        t = time.monotonic()
        body = json.dumps({"model": "tiny-llama", "prompt": "hello", "max_tokens": 16,
                           "ignore_eos": True}).encode()
        req = urllib.request.Request(self.url("/v1/completions"), data=body,
                                     headers={"Content-Type": "application/json"})
        doc = json.loads(urllib.request.urlopen(req, timeout=120).read())
        assert doc["usage"]["completion_tokens"] == 16, doc
        return round(time.monotonic() - t, 3)

    def kill(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(60)


def released(before_mib: int, timeout: float = 60) -> dict[str, int]:
    """The card once the killed tree's memory is back (or after `timeout`)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        c = card()
        if c["used_mib"] < before_mib - 1024:
            return c
        time.sleep(0.5)
    return card()


def failover(serving: Engine, standby: Engine) -> None:
    """The serving engine's tree SIGKILLed, the sleeping standby woken and asked."""
    serving.complete()
    in_use = card()["used_mib"]
    t_kill = time.monotonic()
    serving.kill()
    gone = released(in_use)
    woke_s = standby.post("/wake_up")
    first_s = standby.complete()
    result("failover", serving_gone_s=round(time.monotonic() - t_kill - woke_s - first_s, 2),
           wake_s=woke_s, first_answer_s=first_s, card_after_kill=gone, **card(),
           **standby.facts())
    standby.kill()


def standby_first() -> None:
    standby = Engine("full_standby", 8111, ["--gpu-memory-utilization", "0.88"])
    up = standby.wait_healthy()
    result("full_standby", healthy_s=up, **standby.facts(), **card())
    if not up:
        return
    result("full_standby_asleep", sleep_s=standby.post("/sleep?level=1"), **card())
    serving = Engine("full_serving", 8112, ["--gpu-memory-utilization", "0.88"])
    up = serving.wait_healthy()
    result("full_serving", healthy_s=up, **serving.facts(), **card(),
           **({} if up else {"tail": serving.tail()}))
    if not up:
        standby.kill()
        return
    failover(serving, standby)


def main() -> None:
    mode = sys.argv[1] if len(sys.argv) > 1 else "bytes"
    WORK.mkdir(parents=True, exist_ok=True)
    ensure_m8b(MODEL)
    assert STAGED.exists()
    result("card", **card())
    if mode == "first":
        standby_first()
        return
    fraction = float(sys.argv[2]) if len(sys.argv) > 2 else 0.95

    lone = Engine("lone", 8101, ["--gpu-memory-utilization", "0.88"])
    up = lone.wait_healthy()
    result("lone", healthy_s=up, **lone.facts(), **card(),
           **({} if up else {"tail": lone.tail()}))
    ref = lone.facts()
    in_use = card()["used_mib"]
    lone.kill()
    result("lone_gone", **released(in_use))
    if not up or "kv_gib" not in ref:
        return

    kv_bytes = int(ref["kv_gib"] * GIB * fraction)
    serving = Engine("serving", 8102, ["--gpu-memory-utilization", "0.88",
                                       "--kv-cache-memory-bytes", str(kv_bytes)])
    up = serving.wait_healthy()
    c = card()
    result("serving", healthy_s=up, fraction=fraction, kv_bytes=kv_bytes, **serving.facts(),
           **c, **({} if up else {"tail": serving.tail()}))
    if not up:
        return
    overhead_gib = c["used_mib"] / 1024 - ref.get("weights_gib", WEIGHTS_GIB) - kv_bytes / GIB
    free_gib = (c["total_mib"] - c["used_mib"]) / 1024
    standby_kv = (free_gib - ref.get("weights_gib", WEIGHTS_GIB) - overhead_gib - 0.5) * GIB
    result("room", serving_overhead_gib=round(overhead_gib, 2), free_gib=round(free_gib, 2),
           standby_kv_gib=round(standby_kv / GIB, 2))
    if standby_kv < 0.25 * GIB:
        result("standby", started=False, why="no room beside the serving engine")
        standby_kv = 0.25 * GIB  # (tried all the same: what vLLM says)
    standby = Engine("standby", 8103, ["--gpu-memory-utilization", "0.01",
                                       "--kv-cache-memory-bytes", str(int(standby_kv))])
    up = standby.wait_healthy()
    awake = card()
    result("standby", healthy_s=up, **standby.facts(), **awake,
           **({} if up else {"tail": standby.tail()}))
    if not up:
        serving.kill()
        return
    slept_s = standby.post("/sleep?level=1")
    result("standby_asleep", sleep_s=slept_s, **card())
    failover(serving, standby)


if __name__ == "__main__":
    main()
