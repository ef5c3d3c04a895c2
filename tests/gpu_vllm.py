"""The GPU path against the real vLLM on a lent NVIDIA machine (docs/gpu-validation.md).

Not collected by pytest (no GPU in CI): run by hand on the GPU machine, in phases that fit
its 10-minute calls, the daemon living on between them in its own session:

    python3 tests/gpu_vllm.py start     # daemon up (installed from the project's wheel),
                                        # NVML in status and on the exporter
    python3 tests/gpu_vllm.py start awake  # the same, with an awake standby beside it
    python3 tests/gpu_vllm.py start sleep 0.42  # a sleeping standby, each engine at 0.42
    python3 tests/gpu_vllm.py kv-reset  # KV resets through sleep/wake under a small load
    python3 tests/gpu_vllm.py crash     # SIGKILL of the API server: orphan, release, restart
    python3 tests/gpu_vllm.py hang      # SIGSTOP of VLLM::EngineCore: detected and healed
    python3 tests/gpu_vllm.py continue kill late   # vLLM's own bench client through the
    python3 tests/gpu_vllm.py continue kill early  # proxy, 3000 prompts at 128 streams,
    python3 tests/gpu_vllm.py continue stop late   # EngineCore SIGKILLed / SIGSTOPped 5 s
    python3 tests/gpu_vllm.py continue restart late  # (or `vllm-supervisorctl restart`)
                                              # after 64 run, or as soon as all 128 are in
                                              # their first tokens: every stream whole,
                                              # four raw streams tapped (issues 12, 20)
    python3 tests/gpu_vllm.py throughput 1 8 32 256  # output tokens/s, proxy vs direct
    python3 tests/gpu_vllm.py kv-reset-streams 256 3000 3  # `vllm bench serve` at 256
                                        # streams, three KV resets during it, each 3 s after
                                        # the last ended (issue 35: `drain = "continue"`
                                        # pauses the streams instead of draining them)
    python3 tests/gpu_vllm.py rearm     # a cold restart that arms a sleeping standby again
                                        # (after a swap at 0.88 none fits beside: no_room)
    python3 tests/gpu_vllm.py start thin [0.60 [0.28]]  # an asymmetric pair (issue 35):
                                        # the engine at 0.60, `standby_args` a thin standby
                                        # at 0.28, `standby = "sleep"`, `drain = "continue"`
                                        # (0.62 + 0.30 does not fit an 80 GB H100 in the 8B
                                        # shape: docs/gpu-validation.md)
    python3 tests/gpu_vllm.py protected  # wait until protected again (the pair: RUNNING,
                                        # the thin standby ready and not serving, nothing
                                        # held); its status and the KV caches
    python3 tests/gpu_vllm.py kills 3   # `continue kill late` three times, each as soon as
                                        # protected again; each kill's time to protected
                                        # again (KILLS_BUDGET_S: no kill begun that would not
                                        # end within it, by the last one's length)
    python3 tests/gpu_vllm.py kill-twice 10  # the same load; a second SIGKILL (of the core
                                        # that serves then, the thin one) 10 s after the
                                        # first, while the full-size engine starts
    python3 tests/gpu_vllm.py plan kill-swapback  # a kill under 8000 prompts: the swap
                                        # back to the full-size engine under load too
    python3 tests/gpu_vllm.py kv-info   # each engine's KV cache: vLLM's own start lines
                                        # (from the daemon's log) and `vllm:cache_config_info`
    python3 tests/gpu_vllm.py plan kill kill kill restart kv-info kv-reset-streams \
        kill-twice stop                 # those steps in order, across calls: the same
                                        # command again goes on where the last call stopped
    MAX_MODEL_LEN=4608 python3 tests/gpu_vllm.py start thin  # (room for 4096-token prompts)
    python3 tests/gpu_vllm.py plan cost-none-1536 cost-kill-1536 cost-restart-1536 \
        cost-kvreset-1536               # issue 51: what a fault costs at a prompt length,
                                        # the no-fault run first (`phase_cost`, `cost_row`)
    SHAPE=8b KV_TIER=1 python3 tests/gpu_vllm.py plan cost-none-1536 cost-kill-1536 \
        tier-off cost-none-1536 cost-kill-1536  # the same with and without the KV tier in
                                        # one session (`tier-on`/`tier-off`: the daemon
                                        # stopped and started again as its last `start`)
    SHAPE=8b python3 tests/gpu_vllm.py start  # issue 49: the sleeping pair at 0.88, then
    python3 tests/gpu_vllm.py plan kv-reset cost-kill-32 backup-off kv-reset cost-kill-32
                                        # a kill of an engine that slept and woke (three
                                        # KV resets), with the daemon's sleep backup, then
                                        # with torch's default (`SLEEP_BACKUP=off`: the
                                        # operator's own environment)
    SHAPE=8b python3 tests/gpu_vllm.py start snapshot  # issue 49's route 3 in the daemon:
                                        # both at 0.88, `standby = "snapshot"` (the standby
                                        # started first, asleep, dumped to /tmp/vs-snap
                                        # by .tools/criu, carried; a copy restored as the
                                        # standby, the engine beside it); then `plan kv-info
                                        # kill kill kill restart kv-reset-streams stop`: each
                                        # fault re-armed by a copy (`protected_again`)
    python3 tests/gpu_vllm.py stop      # stopped; nothing left on the GPU

TP=2 (with SHAPE=8b, on nvidia-h100-x2): both engines `--tensor-parallel-size 2`, gpus 0 and 1.
SHAPE=8b (issue 35's setup): the model is ~/m8b, made from the staged tiny model's files
with Llama-3.1-8B's dimensions (`--load-format dummy`: real sizes, random weights), both
engines at `--gpu-memory-utilization 0.88` with torch.compile and CUDA graphs (no
--enforce-eager), `standby = "sleep"` (the standby starts first and sleeps, the engine
then starts beside it) and `drain = "continue"`; `start` alone takes 4-5 minutes cold.
`start thin`: the asymmetric pair (`engine.standby_args`), the engine at 0.60 and the thin
standby at 0.28 (both fit awake: the engine starts first, the standby beside it, asleep);
with it `continue` waits for "protected again" before the fault and times the fault to it.

PROXY_WORKERS=N: `start` runs the proxy over N processes (tests/gpu_plane.py measures it).
SNAP_ON_DISK=1: `start snapshot` keeps the images on the disk, not a tmpfs (host memory).
SPY=1: each KV reset of `kv-reset-streams` and `cost-kvreset-N` is recorded by py-spy in
the engine's API server and core for 8 s (`tests/gpu_spy.py`; WORK/spy-*.txt, the top
stacks in the reset's row).
The parts: this file is the command line, `plan` and `cost`; tests/gpu_daemon.py the
daemon under test (where it lives, `status`, waits, `RESULT` lines, `Timeline`);
tests/gpu_start.py `start`, `stop` and the restarts; tests/gpu_load.py the clients
(`bench`, `Tap`, `cost_row`); tests/gpu_faults.py the faults and their measures.
Environment: SUP_SITE (the supervisor's --target site), VLLM_SITE (vLLM's, kept apart:
vLLM's dependencies bring the PyPI package `supervisor`), MODEL (the staged model), OUT
(where results go). Each phase prints `RESULT {json}` and appends it to
$WORK/results.jsonl; failures raise.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

# (run as a script: the checkout's root, for `tests.`; tests.gpu_daemon then puts the
# installed wheel before it)
sys.path.append(str(Path(__file__).resolve().parent.parent))

from tests.gpu_daemon import (
    WORK,
    is_pair,
    protected_again,
    result,
    status,
    wait,
)
from tests.gpu_faults import (
    phase_continue,
    phase_crash,
    phase_hang,
    phase_hang_rpc,
    phase_kill_swapback,
    phase_kill_twice,
    phase_kills,
    phase_kv_reset,
    phase_kv_reset_streams,
    phase_throughput,
)
from tests.gpu_start import (
    phase_kv_info,
    phase_protected,
    phase_rearm,
    phase_restart_daemon,
    phase_start,
    phase_stop,
)

# a step's length as first guessed (s); once run, its last length
PLAN_GUESS_S = {"kill": 200.0, "restart": 200.0, "kv-reset-streams": 200.0,
                "tier-on": 330.0, "tier-off": 330.0, "backup-on": 330.0,
                "backup-off": 330.0, "kv-reset": 60.0,
                "kill-swapback": 300.0,
                "kill-twice": 480.0, "kv-info": 10.0, "stop": 60.0, "hang-rpc": 200.0}


# steps that stop the daemon (no wait for the pair to be protected first)
RESTARTS = ("stop", "tier-on", "tier-off", "backup-on", "backup-off")


def phase_plan(steps: list[str]) -> None:
    """Steps run in order across calls (the machine's calls last 10 minutes, and it is
    given back 30 s after one ends: no time to choose the next between calls). The same
    command again goes on where the last stopped: WORK/plan.json keeps the steps done and
    each step's last length (a plan of other steps begins afresh, the lengths kept); a
    step begins only if, by that length, it ends within CALL_BUDGET_S (default 560) of
    the call's start. With an asymmetric pair each step begins once it is protected
    again. A step that fails is recorded; the plan goes on only if the pair is protected
    again within 3 minutes, else it stops for good with the daemon's status and log tail
    (`plan-stopped`)."""
    budget = float(os.environ.get("CALL_BUDGET_S", "560"))
    t0 = time.monotonic()
    path = WORK / "plan.json"
    plan: dict[str, Any] = (json.loads(path.read_text()) if path.exists()
                            else {"done": [], "seconds": {}, "failed": {}})
    if plan.get("steps") != steps:  # another plan: only its lengths are kept, as guesses
        plan = {"steps": steps, "done": [], "seconds": plan["seconds"], "failed": {}}
    kills = 0
    for i, step in enumerate(steps):
        key = f"{i}:{step}"
        kills += step == "kill"
        if key in plan["done"]:
            continue
        if plan.get("stopped"):
            result("plan", stopped=plan["stopped"], next=key)
            return
        # (a restart's re-arm is a kill's: its guess the last kill's length until run)
        guess = plan["seconds"].get(step) or (step == "restart" and plan["seconds"].get("kill")
                                              ) or PLAN_GUESS_S.get(step, 300.0)
        left = budget - (time.monotonic() - t0)
        if guess * 1.05 + 15 > left:
            result("plan", next=key, left_s=round(left), guess_s=guess, done=plan["done"])
            return
        if step not in RESTARTS and is_pair(status()):
            wait(lambda: protected_again(status()), max(30.0, left - guess), "protected again")
        t1 = time.monotonic()
        error = None
        try:
            if step == "kill":
                phase_continue("kill", "late", tag=f"continue-kill-late-{kills}")
            elif step == "restart":
                phase_continue("restart", "late")
            elif step == "kill-swapback":
                phase_kill_swapback()
            elif step == "kill-twice":
                phase_kill_twice(10.0)
            elif step == "kv-reset-streams":
                phase_kv_reset_streams(256, 3000, 3)
            elif step == "kv-info":
                phase_kv_info()
            elif step == "hang-rpc":
                phase_hang_rpc()
            elif step == "stop":
                phase_stop()
            elif step.startswith("cost-"):
                phase_cost(*step.split("-")[1:])
            elif step == "kv-reset":
                phase_kv_reset()
            elif step in RESTARTS[1:]:
                phase_restart_daemon(*step.split("-"))
            else:
                raise ValueError(f"no step {step!r}")
        except Exception as exc:  # recorded; the plan goes on only if the pair is armed
            error = f"{type(exc).__name__}: {exc}"[:1000]
            plan["failed"][key] = error
        plan["seconds"][step] = round(time.monotonic() - t1, 1)
        plan["done"].append(key)
        path.write_text(json.dumps(plan))
        result("plan-step", step=key, seconds=plan["seconds"][step], error=error)
        if error and step not in ("kill-twice", "stop"):
            try:
                wait(lambda: protected_again(status()), 180, "protected again")
            except Exception as exc:
                plan["stopped"] = f"{key}: {error}; then {exc}"
                path.write_text(json.dumps(plan))
                st = status()
                result("plan-stopped", why=plan["stopped"], status=st)
                return
    result("plan", finished=True, done=plan["done"], failed=plan["failed"],
           seconds=plan["seconds"])


COST_PROMPTS = {"none": 600, "kill": 1200, "restart": 1200, "kvreset": 1200}


def phase_cost(fault: str, input_len: str) -> dict[str, Any]:
    """Issue 51's table, one cell: `vllm bench serve` at 128 streams of 256 tokens with
    `input_len`-token prompts through the daemon, and `fault` (none, kill, restart, or
    kvreset: one KV reset) 5 s after 64 run. Plan steps `cost-FAULT-LEN`, the no-fault
    run first at each length: `plan cost-none-1536 cost-kill-1536 ...`."""
    n = int(input_len)
    tier_before = (status().get("kv_tier") or {}).get("store_refusals_total")
    if fault == "kvreset":
        out = phase_kv_reset_streams(128, COST_PROMPTS["kvreset"], 1, input_len=n,
                                     tag=f"cost-kvreset-{n}")
    else:
        out = phase_continue(fault, "late", tag=f"cost-{fault}-{n}",
                             prompts=COST_PROMPTS[fault], input_len=n)
    # (what the clients waited for at the gate: which of the fault's cost is admission's)
    st = status()
    tier = st.get("kv_tier")
    # with a tier: the stores vLLM refused during the run (its CPU part full: those blocks
    # were computed again after the fault), and its rates over the last minute
    refused = (tier["store_refusals_total"] - (tier_before or 0)
               if tier and tier.get("store_refusals_total") is not None else None)
    result("cost", fault=fault, input_len=n, kv_tier=tier is not None,
           kv_tier_refused=refused,
           kv_tier_rates={k: v for k, v in st["signals"].items() if k.startswith("kv_tier")}
           if tier else None,
           **out["cost"], gate_waits=out.get("gate_waits"))
    return out


PLAIN = {"kv-reset": phase_kv_reset, "crash": phase_crash, "hang": phase_hang,
         "rearm": phase_rearm, "stop": phase_stop, "kv-info": phase_kv_info,
         "protected": phase_protected, "hang-rpc": phase_hang_rpc}  # (no arguments)
WITH_ARGS = ("continue", "throughput", "start", "plan", "kills", "kill-twice",
             "kv-reset-streams")


if __name__ == "__main__":
    if len(sys.argv) < 2 or sys.argv[1] not in (*PLAIN, *WITH_ARGS):
        print(__doc__, file=sys.stderr)
        sys.exit(f"unknown phase {sys.argv[1:2]}: one of {', '.join((*WITH_ARGS, *PLAIN))}")
    if sys.argv[1] == "continue":
        phase_continue(sys.argv[2], sys.argv[3] if len(sys.argv) > 3 else "late")
    elif sys.argv[1] == "throughput":
        phase_throughput([int(x) for x in sys.argv[2:]])
    elif sys.argv[1] == "start":
        phase_start(*sys.argv[2:5])
    elif sys.argv[1] == "plan":
        phase_plan(sys.argv[2:])
    elif sys.argv[1] == "kills":
        phase_kills(int(sys.argv[2]) if len(sys.argv) > 2 else 3)
    elif sys.argv[1] == "kill-twice":
        phase_kill_twice(float(sys.argv[2]) if len(sys.argv) > 2 else 10.0)
    elif sys.argv[1] == "kv-reset-streams":
        phase_kv_reset_streams(*(int(x) for x in sys.argv[2:5]))
    else:
        PLAIN[sys.argv[1]]()
