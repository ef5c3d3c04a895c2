"""What vLLM 0.32-0.33 added, as the fake engine (tests/fake_engine.py) plays it: the
stack-dump watchdog of 0.33 (`--watchdog-config`, `vllm/utils/watch_dog.py`) and the
sleep-mode series of 0.32+ (`vllm/entrypoints/serve/dev/sleep/metrics.py`). Stdlib
only, as the fake engine: it runs under any interpreter."""

from __future__ import annotations

import contextlib
import faulthandler
import json
import os
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any


def watchdog_config(raw: str | None) -> dict[str, Any] | None:
    """vLLM 0.33's WatchdogConfig, checked as its config class does; exits 2 (as vLLM
    fails to start) on a value it would refuse."""
    if raw is None:
        return None
    try:
        doc = json.loads(raw)
    except ValueError:
        doc = None
    ok = isinstance(doc, dict) and set(doc) <= {"timeout", "check_interval", "dump_dir"} \
        and all(isinstance(doc.get(k, 1), int) and not isinstance(doc.get(k, 1), bool)
                and doc.get(k, 1) > 0 for k in ("timeout", "check_interval")) \
        and isinstance(doc.get("dump_dir", ""), str)
    if not ok:
        print(f"error: argument --watchdog-config: invalid WatchdogConfig {raw!r}",
              file=sys.stderr, flush=True)
        sys.exit(2)
    return {"timeout": 300, "check_interval": 10, "dump_dir": "", **doc}


class StackDumper:
    """vLLM's ThreadedWatchDog.dump_stack (vllm/utils/watch_dog.py), for this process:
    numbered dumps of all threads appended to its file."""

    def __init__(self, config: dict[str, Any], log: Callable[..., None],
                 name: str = "engine_0") -> None:
        self.log = log
        self.dir = config["dump_dir"]
        self.file = os.path.join(self.dir, f"VLLM_STACK_DUMP_for_{name}_{os.getpid()}.log")
        self.seq = 1
        faulthandler.enable(all_threads=True)
        log("INFO", f"[Watchdog]Started thread for {name} (pid={os.getpid()})",
            tag="EngineCore_DP0")

    def dump(self, reason: str) -> None:
        os.makedirs(self.dir, exist_ok=True)
        with open(self.file, "a") as f:
            f.write(f"\n>>> Call stack dump #{self.seq} at {time.ctime()} due to {reason}\n\n")
            f.flush()
            faulthandler.dump_traceback(file=f, all_threads=True)
            f.write("\n" + "=" * 64 + "\n")
        self.seq += 1
        self.log("INFO", f"[Watchdog]Dumped stack to {self.file} due to {reason}",
            tag="EngineCore_DP0")

    def watch_hang(self, hang_file: str | None, stop: threading.Event) -> None:
        """One dump each time the hang file appears (a stall, as the feed timeout sees it)."""
        hung = False
        while hang_file and not stop.wait(0.05):
            now = os.path.exists(hang_file)
            if now and not hung:
                self.dump("feed timeout")
            hung = now


SLEEP_BUCKETS = (0.01, 0.1, 1, 10, 30, 60, 120, 300, 600)  # vLLM's (dev/sleep/metrics.py)


class SleepModeMetrics:
    """vLLM's sleep_mode_operation_metrics() (`vllm/entrypoints/serve/dev/sleep/
    metrics.py`, 0.32 and 0.33): `record(op)` around each call, its failures observed
    too; `page()` the series as prometheus_client prints them ("" before the first)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.seconds: dict[str, list[float]] = {}
        self.in_flight: dict[str, int] = {}

    @contextlib.contextmanager
    def record(self, op: str) -> Iterator[None]:
        with self.lock:
            self.in_flight[op] = self.in_flight.get(op, 0) + 1
        t0 = time.perf_counter()
        try:
            yield
        finally:
            with self.lock:
                self.in_flight[op] -= 1
                self.seconds.setdefault(op, []).append(time.perf_counter() - t0)

    def page(self) -> str:
        with self.lock:
            return sleep_mode_series(self.seconds, self.in_flight)


def sleep_mode_series(ops: dict[str, list[float]], in_flight: dict[str, int]) -> str:
    """vLLM's sleep-mode histogram and gauge as prometheus_client prints them (labels
    sorted, `le` as a float), for the operations run so far ("" before the first)."""
    if not ops and not in_flight:
        return ""
    name = "vllm:sleep_mode_operation_duration_seconds"
    out = [f"# HELP {name} Duration of one sleep-mode operation.", f"# TYPE {name} histogram"]
    for op, seconds in sorted(ops.items()):
        for le in SLEEP_BUCKETS:
            n = sum(1 for x in seconds if x <= le)
            out.append(f'{name}_bucket{{le="{float(le)}",operation="{op}"}} {float(n)}')
        out.append(f'{name}_bucket{{le="+Inf",operation="{op}"}} {float(len(seconds))}')
        out.append(f'{name}_count{{operation="{op}"}} {float(len(seconds))}')
        out.append(f'{name}_sum{{operation="{op}"}} {sum(seconds)}')
    gauge = "vllm:sleep_mode_operations_in_flight"
    out += [f"# HELP {gauge} Sleep-mode operations currently awaited.",
            f"# TYPE {gauge} gauge"]
    out += [f'{gauge}{{operation="{op}"}} {float(n)}' for op, n in sorted(in_flight.items())]
    return "\n".join(out) + "\n"
