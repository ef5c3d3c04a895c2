"""The pair machine's world (tests/test_pair_machine.py, and the tests that start from one
of its shapes): the shapes of the pair (`MODES`: an awake standby, a sleeping one beside
the engine or first, an asymmetric pair, a weight cache, a snapshot standby) and a unit
of each (`world`), the card's memory as NVML reads it, the bounds the machine checks, the
bugs it knows, and one engine (`Proc`) and timer (`Timer`) as the effects log made
them."""

from __future__ import annotations

import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from supervisor.engine.process.process import EngineProcess
from supervisor.settings.engine_checks import THIN_PAIR_MAX
from tests.unit_world import FakeTimer, World

SLEEP_ENV = {"VLLM_SERVER_DEV_MODE": "1"}
# the three shapes of the pair: an awake standby; a sleeping one beside the engine (room
# for both: 0.45 of the card each); one with no room beside (vLLM's default 0.9), which
# starts first and sleeps before the engine starts beside it
MODES: dict[str, dict[str, Any]] = {
    "awake": {"standby": "awake", "args": []},
    "sleep_beside": {"standby": "sleep", "env": SLEEP_ENV,
                     "args": ["--enable-sleep-mode", "--gpu-memory-utilization", "0.45"]},
    "sleep_first": {"standby": "sleep", "env": SLEEP_ENV, "args": ["--enable-sleep-mode"]},
    # an asymmetric pair: a full-size engine (0.60) and a thin standby (0.28) fit awake
    # side by side, two full-size ones do not
    "thin": {"standby": "sleep", "env": SLEEP_ENV,
             "args": ["--enable-sleep-mode", "--gpu-memory-utilization", "0.60"],
             "standby_args": ["--gpu-memory-utilization", "0.28"]},
}
# an awake standby and a weight cache (`vllm preload`) beside both engines, in the third
# bay (a cache rules out sleep mode)
MODES["cached"] = {**MODES["awake"], "weight_cache": True}
# a standby kept as images (issue 49's route 3): on a full card the standby starts first,
# sleeps and is dumped; copies restored from its images (asleep from their start: room
# for one beside the serving engine) are the standby after
MODES["snapshot"] = {**MODES["sleep_first"], "standby": "snapshot", "criu": "criu"}
ROOM_BESIDE = {"awake": True, "sleep_beside": True, "sleep_first": False, "thin": True,
               "cached": True, "snapshot": False}
SLEEPING_MODES = ("sleep_first", "sleep_beside", "snapshot")
CARD = THIN_PAIR_MAX  # what an asymmetric pair's engines awake on one card may add up to


def share_of(argv: list[str] | tuple[str, ...]) -> float:
    """An engine's --gpu-memory-utilization (the last one given; vLLM's 0.9 if none)."""
    args = list(argv)
    if "--gpu-memory-utilization" not in args:
        return 0.9
    at = len(args) - 1 - args[::-1].index("--gpu-memory-utilization")
    return float(args[at + 1])


def world(tmp: Path, mode: str, standby_weights: str = "host") -> World:
    """A unit of this shape of the pair, fronted by the proxy (its gate in the loop);
    `standby_weights` "gpu": a sleeping standby's weights woken ahead where they fit."""
    engine = {k: (list(v) if isinstance(v, list) else dict(v) if isinstance(v, dict) else v)
              for k, v in MODES[mode].items()}
    if standby_weights != "host":
        engine["standby_weights"] = standby_weights
    return World(tmp, fronted=True, engine=engine)


# the card's memory as NVML reads it (`gpu_reads`): an engine holds its share once healthy
# (half of it while it starts), a sleeping one ASLEEP (and its weights, once woken alone)
GIB = 2**30
CARD_BYTES = 80 * GIB
ASLEEP_BYTES = GIB
BACKOFF_MAX_S = 8.0  # World's restart.backoff_max_s
DEADLINE_MAX_S = 10_000.0  # far above any stop budget of World's config
ANSWERS_TO_REST = 300  # answers fed to bring the pair to rest at the end of a run
# checks that fail on a bug found and kept as an xfail test: tolerated in the
# machine, so that it goes on looking for others (the bug's test, beside)
KNOWN_BUGS: dict[str, str] = {}  # none open now
# the unit's exceptions of a bug found and kept as an xfail test: (type, text in
# its message, functions its traceback passes through, in order); none open now
KNOWN_CRASHES: dict[str, tuple[type[Exception], str, tuple[str, ...]]] = {}


def known_crash(exc: Exception) -> str | None:
    frames = [f.name for f in traceback.extract_tb(exc.__traceback__)]
    for key, (kind, text, through) in KNOWN_CRASHES.items():
        if isinstance(exc, kind) and text in str(exc) and all(
                f in frames and frames.index(f) >= frames.index(through[0])
                for f in through):
            return key
    return None


@dataclass
class Proc:
    """One engine of the world, as the effects log and the events fed made it."""

    engine: EngineProcess
    bay: int
    watched: bool = False
    health_fed: bool = False  # its first health answered (ok or timed out)
    healthy: bool = False
    exited: bool = False
    exit_code: int | None = None
    core_lost: bool = False
    down_asked: bool = False
    down: bool = False  # its take-down ended: out of the world
    asleep: bool = False
    woken: bool = False  # woken at least once
    took_over: bool = False  # followed by the proxy as a standby that took over
    answered: bool = False  # a proof fed since its last health or wake
    proven: bool = False  # ... an ok one
    ever_proven: bool = False
    weights: bool = False  # asleep, its weights woken alone (`/wake_up?tags=weights`)
    card_free: bool = False  # being taken down, its memory on the card released

    @property
    def gen(self) -> int:
        return self.engine.generation

    @property
    def pid(self) -> int:
        return self.engine.pid

    @property
    def dead(self) -> bool:
        return self.exited or self.core_lost

    @property
    def alive(self) -> bool:
        """Up as far as the unit was told, and not being taken down."""
        return not self.dead and not self.down_asked and not self.down

    def __repr__(self) -> str:  # (short, for the failure messages)
        flags = [k for k in ("healthy", "exited", "core_lost", "down_asked", "asleep",
                             "woken", "took_over", "answered", "proven") if getattr(self, k)]
        return f"Proc(gen={self.gen}, pid={self.pid}, bay={self.bay}, {'|'.join(flags)})"


@dataclass
class Timer:
    fake: FakeTimer
    due: float
    fired: bool = False

    @property
    def live(self) -> bool:
        return not self.fired and not self.fake.cancelled
