"""How long an engine's starts take, learned from its past ones (docs/lifecycle.md).

vLLM says nothing of how long its start will take (its start-up stages and remaining
time are a proposal, vllm#45551): 56 s to 5 minutes for an 8B engine on an H100
depending on its compile caches, minutes more after a version change. The daemon times
each start of an engine that became healthy, with the moment each phase of it began
(`enginelog.PHASES`), and keeps the last few per command line (less its place: host and
port) in a small JSON file beside the audit trail, so that they outlive the daemon. The
next start's expected length is the median of those; while it runs, the time left is
the median of what was left, in the past starts, after the phase it is in began, less
the time spent in it. The first start after a vLLM version change (the version read
from the engine's own log) is said to be cold: its compile caches are no use.
"""

from __future__ import annotations

import json
import os
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import structlog

from supervisor.watchdog.relaunch import apply

log = structlog.get_logger("supervisor")

KEEP = 10  # starts kept per command line


def start_key(argv: tuple[str, ...] | list[str]) -> str:
    """A start's command line less its place (the standby's port is not another start)."""
    return " ".join(apply(list(argv), {"--host": None, "--port": None}))


@dataclass(frozen=True)
class Expected:
    total_s: float  # the whole start, as the past ones took (median)
    left_s: float  # what is left of this one, from where it is
    cold: bool  # the first start after a version change: maybe much longer
    starts: int  # how many past starts say so


class StartTimes:
    def __init__(self, path: Path) -> None:
        self.path = path
        self._starts: dict[str, list[dict[str, Any]]] = {}
        try:
            doc = json.loads(path.read_text())
            if isinstance(doc, dict):
                self._starts = {k: [r for r in v if isinstance(r, dict)]
                                for k, v in doc.items() if isinstance(v, list)}
        except FileNotFoundError:
            pass
        except (OSError, ValueError) as exc:
            log.warning("past start times unreadable: learning anew", path=str(path),
                        error=str(exc))

    def record(self, argv: tuple[str, ...] | list[str], version: str | None,
               total_s: float, phases: list[tuple[str, float]]) -> None:
        """A start that ended healthy after `total_s`, each phase begun at its offset."""
        key = start_key(argv)
        past = self._starts.setdefault(key, [])
        past.append({"total_s": round(total_s, 2), "version": version,
                     "phases": [[p, round(at, 2)] for p, at in phases]})
        del past[:-KEEP]
        tmp = self.path.with_name(self.path.name + ".tmp")
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            tmp.write_text(json.dumps(self._starts))
            os.replace(tmp, self.path)
        except OSError as exc:  # (learning is a nicety: the start itself is fine)
            log.warning("start time not kept", path=str(self.path), error=str(exc))

    def cold(self, argv: tuple[str, ...] | list[str], version: str | None) -> bool:
        """This start runs another vLLM version than the last one recorded."""
        past = self._starts.get(start_key(argv)) or []
        return bool(past) and version is not None \
            and past[-1].get("version") not in (None, version)

    def expect(self, argv: tuple[str, ...] | list[str], version: str | None,
               elapsed_s: float, phase: str | None,
               phase_for_s: float | None) -> Expected | None:
        """What the past starts say of this one now; None without any."""
        past = self._starts.get(start_key(argv))
        if not past:
            return None
        totals = [float(r["total_s"]) for r in past if isinstance(r.get("total_s"), int | float)]
        if not totals:
            return None
        total = statistics.median(totals)
        left = max(0.0, total - elapsed_s)
        if phase is not None and phase_for_s is not None:
            after = [float(r["total_s"]) - float(at) for r in past
                     for p, at in r.get("phases") or () if p == phase]
            if after:
                left = max(0.0, statistics.median(after) - phase_for_s)
        return Expected(round(total, 1), round(left, 1), self.cold(argv, version),
                        len(totals))
