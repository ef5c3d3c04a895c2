#!/bin/bash
# On the GPU machine: copy the background run's results, events and logs (scripts/gpu/go.sh)
# to $OUT every 5 s, for up to $1 seconds or until the run is done; then the logs' tails.
end=$(( $(date +%s) + $1 ))
while :; do
  mkdir -p $OUT
  cp /tmp/vs-gpu/results.jsonl /tmp/vs-gpu/events.jsonl $OUT/ 2>/dev/null
  cp /tmp/start.log /tmp/plan.log $OUT/ 2>/dev/null
  tail -c 300000 /tmp/vs-gpu/daemon.log > $OUT/daemon.log 2>/dev/null
  # a take-down's or failover's warning scrolls out of the tail under load: keep them all
  grep -E '"level": ?"(warning|error|critical)"|Traceback' /tmp/vs-gpu/daemon.log 2>/dev/null \
    | tail -c 2000000 > $OUT/daemon-warnings.log
  tail -c 200000 /tmp/meminfo.log > $OUT/meminfo.log 2>/dev/null
  [ -f /tmp/done ] && { echo DONE; break; }
  [ $(date +%s) -ge $end ] && break
  sleep 5
done
(dmesg -T 2>/dev/null || journalctl -k --no-pager 2>/dev/null) | grep -i -E 'oom|killed process|out of memory' | tail -40 > $OUT/kernel-oom.log
tail -5 /tmp/start.log /tmp/plan.log 2>/dev/null; nvidia-smi --query-gpu=memory.used --format=csv
