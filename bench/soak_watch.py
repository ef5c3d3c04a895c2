"""What `bench/healthy_soak.py` watches of the daemon, and the faults it injects.

`Watcher` reads `status` every 2 s (a thread) and keeps, per label of the run (a phase,
a phase with the CPU hog on), how near each default rule came: for each comparison of
its condition, the signal's worst value seen while the rest of its group held (the
largest `engine_stalled_s`, the largest `kv_cache_usage` while nothing ran...), and the
longest its condition held (`policy.rules[...].holding_s`).

`inject` sends one fault to the serving engine's tree and follows it until the engine
serves again: how it was detected (the first policy decision after it, or the first
state change out of RUNNING: a crash the process watch saw), when, and whether any
process of the old tree outlived it.
"""

from __future__ import annotations

import math
import os
import signal
import sys
import threading
import time
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

import psutil

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from supervisor.control.client import ControlClientError  # noqa: E402
from supervisor.watchdog.conditions import Condition, parse_condition  # noqa: E402
from supervisor.watchdog.rules import DEFAULT_RULES  # noqa: E402
from supervisor.watchdog.signal_list import SIGNAL_NAMES  # noqa: E402
from tests.harness import Daemon  # noqa: E402

CONDITIONS: dict[str, Condition] = {name: parse_condition(r.when, SIGNAL_NAMES)
                                    for name, r in DEFAULT_RULES.items()}


def wall(record: dict[str, Any]) -> float:
    return datetime.fromisoformat(str(record["time"])).timestamp()


@dataclass
class Near:
    """How near one rule came over one label of the run."""

    # (group, comparison) -> the signal's worst value seen, and its worst while the rest
    # of its group held
    worst: dict[tuple[int, int], float] = field(default_factory=dict)
    worst_if: dict[tuple[int, int], float] = field(default_factory=dict)
    holding_s: float = 0.0

    def text(self, rule: str) -> str:
        parts = []
        for gi, group in enumerate(CONDITIONS[rule].groups):
            for ci, c in enumerate(group):
                if c.op in ("==", "!="):
                    continue
                word = "max" if c.op in (">", ">=") else "min"
                part = f"`{c.signal}` {word} {_g(self.worst.get((gi, ci)))}"
                others = [str(o) for o in group if o is not c]
                if others:
                    part += (f" ({_g(self.worst_if.get((gi, ci)), 'never')} while "
                             f"{' and '.join(others)})")
                parts.append(part)
        return "; ".join(parts)

    def update(self, key: tuple[int, int], v: float, up: bool, others_hold: bool) -> None:
        for table, ok in ((self.worst, True), (self.worst_if, others_hold)):
            old = table.get(key)
            if ok and (old is None or (v > old if up else v < old)):
                table[key] = v


def _g(v: float | None, none: str = "unknown") -> str:
    return none if v is None else f"{v:.3g}"


class Watcher:
    """`status` every `period_s`; the worst of every rule's signals per label."""

    def __init__(self, d: Daemon, period_s: float = 2.0) -> None:
        self.d, self.period_s = d, period_s
        self.label = "start"
        self.near: dict[str, dict[str, Near]] = {}
        self.peaks: dict[str, dict[str, float]] = {}  # label -> every signal's largest
        self.samples: dict[str, int] = {}
        self.pids: set[int] = set()
        self.errors = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="watcher")

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(30)

    def _run(self) -> None:
        while not self._stop.wait(self.period_s):
            try:
                st = self.d.status()
            except (ControlClientError, OSError):
                self.errors += 1
                continue
            self.observe(self.label, st)

    def observe(self, label: str, st: dict[str, Any]) -> None:
        if st.get("pid"):
            self.pids.add(int(st["pid"]))
        sig: dict[str, float | None] = st.get("signals") or {}
        rules = (st.get("policy") or {}).get("rules") or {}
        self.samples[label] = self.samples.get(label, 0) + 1
        near = self.near.setdefault(label, {r: Near() for r in CONDITIONS})
        for rule, cond in CONDITIONS.items():
            n = near[rule]
            held = (rules.get(rule) or {}).get("holding_s")
            if held is not None:
                n.holding_s = max(n.holding_s, float(held))
            for gi, group in enumerate(cond.groups):
                for ci, c in enumerate(group):
                    v = sig.get(c.signal)
                    if v is None or math.isnan(v):
                        continue
                    n.update((gi, ci), float(v), c.op in (">", ">="),
                             all(o.holds(sig) for o in group if o is not c))
        peaks = self.peaks.setdefault(label, {})
        for name, v in sig.items():
            if isinstance(v, int | float) and not math.isnan(v):
                peaks[name] = max(peaks.get(name, v), float(v))

    def worst(self, labels: tuple[str, ...], rule: str) -> Near:
        """One rule's nearest approach over several labels together."""
        out = Near()
        for label in labels:
            n = self.near.get(label, {}).get(rule)
            if n is None:
                continue
            out.holding_s = max(out.holding_s, n.holding_s)
            for key, v in n.worst.items():
                c = CONDITIONS[rule].groups[key[0]][key[1]]
                out.update(key, v, c.op in (">", ">="), False)
            for key, v in n.worst_if.items():
                c = CONDITIONS[rule].groups[key[0]][key[1]]
                old = out.worst_if.get(key)
                if old is None or (v > old if c.op in (">", ">=") else v < old):
                    out.worst_if[key] = v
        return out

    def peak(self, labels: tuple[str, ...], name: str) -> float | None:
        """The largest value of a signal seen over several labels."""
        seen = [p[name] for lab in labels if name in (p := self.peaks.get(lab, {}))]
        return max(seen, default=None)


@dataclass
class Fault:
    """One injected fault and what followed it (monotonic `t_*`, wall `wall0`)."""

    kind: str
    at_s: float  # into its phase
    wall0: float = 0.0
    t0: float = 0.0
    t_back: float | None = None
    target: str = ""
    detected_by: str | None = None
    detect_s: float | None = None
    down_seen_s: float | None = None
    last_exit: str | None = None
    restarts: tuple[int, int] = (0, 0)
    leftovers: list[int] = field(default_factory=list)
    note: str = ""
    requests: dict[str, int] = field(default_factory=dict)

    @property
    def back_s(self) -> float | None:
        return None if self.t_back is None else self.t_back - self.t0


PREFIX = {"core_sigkill": "VLLM::EngineCor", "core_sigstop": "VLLM::EngineCor",
          "worker_sigstop": "VLLM::Worker"}
SIGNAL = {"core_sigkill": signal.SIGKILL, "core_sigstop": signal.SIGSTOP,
          "worker_sigstop": signal.SIGSTOP}


def serving(st: dict[str, Any]) -> bool:
    return bool(st["state"] == "RUNNING" and st["pid"] and st["admission"]["held"] is None)


def _status(d: Daemon) -> dict[str, Any] | None:
    try:
        return d.status()
    except (ControlClientError, OSError):
        return None


def inject(d: Daemon, f: Fault, recover_s: float) -> None:
    """Send `f` to the serving engine's tree; follow it until the engine serves again (a
    new pid, the gate open), at most `recover_s`."""
    st = d.status()
    pid = int(st["pid"])
    f.restarts = (int(st["restarts"]), int(st["restarts"]))
    root = psutil.Process(pid)
    procs = [root, *root.children(recursive=True)]
    targets = [p for p in procs if _name(p).startswith(PREFIX[f.kind])]
    if not targets:
        f.note = f"no {PREFIX[f.kind]} process in the tree ({[_name(p) for p in procs]})"
        return
    target = targets[0]
    f.target = f"{_name(target)} (pid {target.pid})"
    f.wall0, f.t0 = time.time(), time.monotonic()
    os.kill(target.pid, SIGNAL[f.kind])
    deadline = f.t0 + recover_s
    while time.monotonic() < deadline:
        now = _status(d)
        t = time.monotonic()
        if now is not None:
            if f.down_seen_s is None and (now["state"] != "RUNNING" or now["pid"] != pid):
                f.down_seen_s = t - f.t0
            if now["pid"] != pid and serving(now):
                f.t_back = t
                f.restarts = (f.restarts[0], int(now["restarts"]))
                f.last_exit = now.get("last_exit")
                break
        time.sleep(0.25)
    _detection(d, f)
    # the daemon proves the old tree gone before it starts the next: anything of it still
    # alive (a zombie is dead) is a leftover
    for p in procs:
        try:
            if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                f.leftovers.append(p.pid)
        except psutil.Error:
            pass
    if f.t_back is None:
        f.note = f"not serving again within {recover_s:g} s"


def _detection(d: Daemon, f: Fault) -> None:
    """The first policy decision after the fault, else the first state change out of
    RUNNING (a crash: the process watch)."""
    try:
        events = [e for e in d.events(2000) if wall(e) >= f.wall0 - 0.5]
    except (ControlClientError, OSError, ValueError) as exc:
        f.note = f"audit unreadable: {exc}"
        return
    decision = next((e for e in events if e["event"] == "decision"), None)
    left = next((e for e in events if e["event"] == "state" and e.get("from") == "RUNNING"),
                None)
    held = next((e for e in events if e["event"] == "decision_held_back"), None)
    if decision is not None and (left is None or wall(decision) <= wall(left)):
        f.detected_by = f"`{decision['rule']}` -> {decision['action']}"
        f.detect_s = wall(decision) - f.wall0
    elif left is not None:
        f.detected_by = f"process watch: {left.get('reason', '')}"[:90]
        f.detect_s = wall(left) - f.wall0
    if held is not None:
        f.note = (f.note + "; " if f.note else "") + (
            f"held back: `{held['rule']}` ({held.get('held_back')})")


def _name(p: psutil.Process) -> str:
    try:
        return str(p.name())
    except psutil.Error:
        return "?"


def window_counts(f: Fault, records: list[Any], grace_s: float = 10.0) -> dict[str, int]:
    """Outcomes of the requests in flight at the fault or started before the engine served
    again (`grace_s` after: what the restart released)."""
    end = (f.t_back if f.t_back is not None else f.t0 + 600) + grace_s
    out: dict[str, int] = {}
    for r in records:
        if r.t1 >= f.t0 and r.t0 <= end:
            out[r.outcome] = out.get(r.outcome, 0) + 1
    return out
