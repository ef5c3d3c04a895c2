#!/bin/bash
# On a lent GPU machine (docs/gpu-validation.md): install the staged vLLM (~/vllm-stage's
# parts, one call each before) and the supervisor's wheel (.whl/, carried), then run
# `tests/gpu_vllm.py start` and `plan` in the background, in their own session, so that
# no call's limit ends them; `scripts/gpu/poll.sh` then brings their results back.
# .whl/ holds the daemon's wheel and its own dependencies the image lacks (structlog,
# tenacity, httptools, sniffio, uvloop, psutil, py-spy, nvidia-ml-py, prometheus-client,
# for cp312): the daemon sees /tmp/sup-site only, not the stage's ~/vllm-site. The plan's
# budget (CALL_BUDGET_S) is 1500 s unless given: no call's limit bounds it here.
#   bash scripts/gpu/go.sh "snapshot 0.85" "kill kill kill restart stop" SHAPE=8b STANDBY_WEIGHTS=gpu
set -e
cd ~/vllm-stage && cat part* | tar x && python3 -m pip install -q --no-index --no-deps --no-compile --target ~/vllm-site wheels/*.whl
cd - >/dev/null
python3 -m pip install -q --no-index --no-deps --target /tmp/sup-site .whl/*.whl
rm -rf /tmp/r1 && cp -r $PWD /tmp/r1 && cd /tmp/r1
START="$1"; PLAN="$2"; shift 2
rm -f /tmp/done  # (a second run on the same machine: `stop` first, then this again)
# the host's memory every 2 s, for two hours at most (a core that dies unasked: was it the OOM killer?)
setsid nohup sh -c 'i=0; while [ $i -lt 3600 ]; do i=$((i+1)); echo "$(date +%s) $(grep -E "^(MemAvailable|Shmem):" /proc/meminfo | tr -s " " | tr "\n" " ")"; sleep 2; done' > /tmp/meminfo.log 2>&1 < /dev/null &
env CALL_BUDGET_S=1500 "$@" setsid nohup sh -c "python3 tests/gpu_vllm.py start $START > /tmp/start.log 2>&1; python3 tests/gpu_vllm.py plan $PLAN > /tmp/plan.log 2>&1; echo DONE > /tmp/done" > /dev/null 2>&1 < /dev/null &
echo started
