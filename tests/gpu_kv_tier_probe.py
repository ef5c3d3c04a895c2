"""Issue 51, route "keep the KV across the fault": does a KV tier that outlives the engine
spare the standby the re-prefill of every continued stream?

Not collected by pytest (no GPU in CI). vLLM's multi-tier offloading (0.32 and later:
`OffloadingConnector` with `TieringOffloadingSpec`, a CPU primary tier in host memory and an
`fs` secondary tier that every computed block is cascaded to) writes each block to a file
named by its content hash; a second engine configured with the same `root_dir` finds them.
The CPU build refuses it ("CPU Offloading is currently only supported on CUDA-alike and
XPU GPUs"), so this runs on a lent GPU machine with vLLM 0.33 staged
(tests/gpu_requirements_033.txt, docs/gpu-validation.md), raw engines, no daemon:

    WORK=/tmp/vs-tier [TIER_CHUNK=256] [TIER_THREADS=16] [TIER_DISK=1] \
        python3 tests/gpu_kv_tier_probe.py [STREAMS] [PROMPT_TOKENS]   # 128 1536

Two engines of Llama-3.1-8B's shape (`--load-format dummy`, eager, sleep mode) on GPU 0,
both with the tier (`root_dir` on /dev/shm, PYTHONHASHSEED the same: one hash seed):
A (0.45) serving, B (0.40) the standby, started beside it and put to sleep. Steps, each
appending `RESULT {json}` to $WORK/results.jsonl:

1. `serve`: STREAMS random prompts of PROMPT_TOKENS token ids sent to A at once, 128 tokens
   out each (their ids kept): the streams a fault interrupts.
2. `fault`: A's tree SIGKILLed the moment the last answer came (a crash does not wait for
   the tier's writes); the files the tier holds then.
3. `continued`: B woken, and every stream sent to it as the proxy continues one (its
   prompt and the tokens it had, `max_tokens` 1: each answer's seconds are its time to
   first token): the re-prefill with the tier. B's tier counters (chunk queries and hits
   per tier, bytes read) and its prefix-cache hits.
4. `fresh`: the same number of prompts of the same lengths that no engine has seen, sent
   to B the same way: the re-prefill without the tier's help (its miss baseline).

The number the issue wants is `continued.last_s` against `fresh.last_s`: the seconds until
the last continued stream has its first token, with and without the tier.
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
os.environ.setdefault("WORK", "/tmp/vs-tier")
os.environ["PYTHONHASHSEED"] = "0"  # every engine the same block hashes (the tier's doc)
from tests.gpu_kv_probe import MODEL, WORK, Engine, card, result
from tests.gpu_shapes import STAGED, ensure_m8b

ROOT = Path("/dev/shm/vs-kv-tier")
OUT_TOKENS = 128
CHUNK = int(os.environ.get("TIER_CHUNK", "0"))  # TIER_CHUNK=256: 32 MiB files in this shape
READERS = int(os.environ.get("TIER_THREADS", "16"))  # the fs tier's read (and write) threads
GIB = 2**30


def tier_args(cpu_gib: int) -> list[str]:
    extra: dict[str, Any] = {
        "spec_name": "TieringOffloadingSpec", "cpu_bytes_to_use": cpu_gib * GIB,
        "secondary_tiers": [{"type": "fs", "root_dir": str(ROOT), "n_read_threads": READERS,
                             "n_write_threads": READERS}]}
    if CHUNK:  # tokens per offloaded chunk (a file each); default the GPU's block (16)
        extra["block_size"] = CHUNK
    return ["--kv-transfer-config", json.dumps({
        "kv_connector": "OffloadingConnector", "kv_role": "kv_both",
        "kv_connector_extra_config": extra})]


def complete(engine: Engine, prompt: list[int], max_tokens: int) -> dict[str, Any]:
    t = time.monotonic()
    body = json.dumps({"model": "tiny-llama", "prompt": prompt, "max_tokens": max_tokens,
                       "ignore_eos": True, "return_token_ids": True}).encode()
    req = urllib.request.Request(engine.url("/v1/completions"), data=body,
                                 headers={"Content-Type": "application/json"})
    try:
        doc = json.loads(urllib.request.urlopen(req, timeout=600).read())
    except Exception as e:  # (a probe: what failed is the result)
        return {"s": round(time.monotonic() - t, 3), "error": repr(e)[:200]}
    choice = doc["choices"][0]
    return {"s": round(time.monotonic() - t, 3), "ids": choice.get("token_ids") or [],
            "out": doc["usage"]["completion_tokens"]}


def at_once(engine: Engine, prompts: list[list[int]], max_tokens: int) -> list[dict[str, Any]]:
    """Every prompt sent at the same moment, each on its own thread."""
    answers: list[dict[str, Any]] = [{} for _ in prompts]

    def one(i: int) -> None:
        answers[i] = complete(engine, prompts[i], max_tokens)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(900)
    return answers


def summary(answers: list[dict[str, Any]], took: float) -> dict[str, Any]:
    s = sorted(a["s"] for a in answers if "s" in a)
    return {"wall_s": round(took, 2), "failed": sum("error" in a for a in answers),
            "median_s": s[len(s) // 2] if s else None,
            "p99_s": s[min(len(s) - 1, int(len(s) * 0.99))] if s else None,
            "last_s": s[-1] if s else None,
            **({"first_error": next(a["error"] for a in answers if "error" in a)}
               if any("error" in a for a in answers) else {})}


def counters(engine: Engine) -> dict[str, float]:
    """The tier's and the prefix cache's counters on the engine's /metrics, summed by name
    and tier label."""
    text = urllib.request.urlopen(engine.url("/metrics"), timeout=30).read().decode()
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("#") or not re.match(r"vllm:(kv_offload|prefix_cache|"
                                                r"external_prefix_cache|prompt_tokens_)", line):
            continue
        name, _, value = line.rpartition(" ")
        tier = re.search(r'tier="([^"]+)"', name)
        key = name.split("{")[0] + (f"[{tier.group(1)}]" if tier else "")
        if key.endswith(("_bucket", "_created")):
            continue
        try:
            out[key] = out.get(key, 0.0) + float(value)
        except ValueError:
            continue
    return out


def delta(after: dict[str, float], before: dict[str, float]) -> dict[str, float]:
    return {k: round(v - before.get(k, 0.0), 3) for k, v in after.items()
            if v != before.get(k, 0.0)}


def tier_files() -> dict[str, float]:
    files = [p for p in ROOT.rglob("*.bin")] if ROOT.exists() else []
    return {"files": len(files),
            "gib": round(sum(p.stat().st_size for p in files) / GIB, 2)}


def main() -> None:
    streams = int(sys.argv[1]) if len(sys.argv) > 1 else 128
    prompt_tokens = int(sys.argv[2]) if len(sys.argv) > 2 else 1536
    WORK.mkdir(parents=True, exist_ok=True)
    ensure_m8b(MODEL)
    assert STAGED.exists()
    # the streams' blocks, at 128 KiB a token in this shape, all go to the fs tier; the CPU
    # tier (a /dev/shm file of its own per engine) is the way in and out, half as large
    need_gib = streams * (prompt_tokens + OUT_TOKENS) * 128 / 2**20
    cpu_gib = max(4, int(need_gib / 2))
    shm = shutil.disk_usage("/dev/shm")
    global ROOT
    if os.environ.get("TIER_DISK") == "1" or shm.free / GIB < need_gib * 1.2 + 2 * cpu_gib:
        ROOT = WORK / "kv-tier"  # (asked for, or no room in memory: the disk)
    result("card", streams=streams, prompt_tokens=prompt_tokens, cpu_gib=cpu_gib,
           chunk_tokens=CHUNK or 16, threads=READERS,
           need_gib=round(need_gib, 1), shm_free_gib=round(shm.free / GIB, 1),
           root=str(ROOT), **card())
    shutil.rmtree(ROOT, ignore_errors=True)

    a = Engine("tier_a", 8121, ["--gpu-memory-utilization", "0.45", *tier_args(cpu_gib)])
    up = a.wait_healthy(600)
    result("a", healthy_s=up, **a.facts(), **card(), **({} if up else {"tail": a.tail()}))
    if not up:
        return
    a_regions = set(Path("/dev/shm").glob("vllm_offload_*"))  # A's CPU tier, left at a kill
    b = Engine("tier_b", 8122, ["--gpu-memory-utilization", "0.40", *tier_args(cpu_gib)])
    up = b.wait_healthy(600)
    result("b", healthy_s=up, **b.facts(), **card(), **({} if up else {"tail": b.tail()}))
    if not up:
        a.kill()
        return
    result("b_asleep", sleep_s=b.post("/sleep?level=1"), **card())

    rnd = random.Random(51)
    prompts = [[rnd.randrange(10, 500) for _ in range(prompt_tokens)] for _ in range(streams)]
    t = time.monotonic()
    served = at_once(a, prompts, OUT_TOKENS)
    took = time.monotonic() - t
    a.kill()  # the moment the last answer came: what the tier has written is all there is
    result("serve", **summary(served, took), out_tokens=sum(x.get("out", 0) for x in served),
           ids_returned=sum(bool(x.get("ids")) for x in served))
    for f in a_regions:  # (as the daemon removes a dead engine's: its memory back)
        f.unlink(missing_ok=True)
    result("fault", **tier_files(), a_regions=len(a_regions), **card())

    woke = b.post("/wake_up")
    before = counters(b)
    continued = [p + x.get("ids", []) for p, x in zip(prompts, served, strict=True)]
    t = time.monotonic()
    again = at_once(b, continued, 1)
    took = time.monotonic() - t
    mid = counters(b)
    result("continued", wake_s=woke, **summary(again, took), tokens=sum(map(len, continued)),
           counters=delta(mid, before))

    fresh = [[rnd.randrange(10, 500) for _ in range(len(p))] for p in continued]
    t = time.monotonic()
    cold = at_once(b, fresh, 1)
    took = time.monotonic() - t
    result("fresh", **summary(cold, took), counters=delta(counters(b), mid),
           **tier_files())
    b.kill()
    shutil.rmtree(ROOT, ignore_errors=True)
    for name in ("tier_a", "tier_b"):
        subprocess.run(["cp", str(WORK / f"{name}.log"), os.environ.get("OUT", "/tmp")],
                       check=False)


if __name__ == "__main__":
    main()
