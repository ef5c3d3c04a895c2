"""The checks of one engine's settings that read its vLLM arguments: the GPUs it is
pinned to and the standby it keeps (`supervisor/settings/config.py` runs them at every load and
reload). Each appends a sentence naming the key and the numbers to `problems`; none
reads a file or the machine.

The standby's memory (docs/standby.md): vLLM checks at start that
`--gpu-memory-utilization` of the whole card is free. An awake standby is started beside
the serving engine, so the two fractions must fit on the card together. A sleeping one
holds only its CUDA context and graphs once asleep (1.8 GiB for an 8B model on the H100,
4.75 GiB in a 72B case): when the two fit side by side it is started beside the serving
engine like an awake one; when they do not, it is started first, put to sleep, and the
serving engine beside it, which leaves no room to arm a new one after a failover until
the next cold start. An asymmetric pair (`standby_args`: a thinner standby) fits both
awake on the card: after a failover the full-size engine starts beside the thin one that
serves, and takes over again.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Protocol

from supervisor.watchdog.relaunch import apply, arg_value

# vLLM's parallel sizes: the GPUs an engine needs is their product
_PARALLEL = (("--tensor-parallel-size", "-tp"), ("--pipeline-parallel-size", "-pp"),
             ("--data-parallel-size", "-dp"))
# vLLM's default --gpu-memory-utilization
DEFAULT_GPU_SHARE = 0.9
# what two engines' --gpu-memory-utilization may add up to when both run on one card:
# the rest is for the driver and each process's CUDA context outside vLLM's budget
SIDE_BY_SIDE_MAX = 0.94
# what an asymmetric pair's two shares may add up to: both run awake, each holding
# 2.5-3.2 GiB beyond its share (CUDA context, graphs, warm-up) on an 80 GiB H100; 0.62 +
# 0.30 ran the thin one out of memory in its warm-up, 0.60 + 0.28 left 3 GiB free
# (docs/gpu-validation.md, 2026-11-26)
THIN_PAIR_MAX = 0.88
# the most a serving engine beside a sleeping standby may take (the standby keeps its
# CUDA context and graphs: 1.8 GiB of 80 for an 8B model, more for larger ones)
BESIDE_SLEEPING_MAX = 0.92
# the standby designs that keep it asleep (a snapshot's copies are restored asleep)
SLEEPING = ("sleep", "snapshot")


class CheckedEngine(Protocol):
    @property
    def command(self) -> list[str]: ...
    @property
    def args(self) -> list[str]: ...
    @property
    def env(self) -> dict[str, str]: ...
    @property
    def gpus(self) -> list[int]: ...
    @property
    def standby(self) -> str: ...
    @property
    def standby_args(self) -> list[str]: ...


def argv(engine: CheckedEngine) -> list[str]:
    """The engine's command line as the daemon starts it (flags may sit in either)."""
    return [*engine.command, *engine.args]


def standby_overrides(standby_args: list[str]) -> dict[str, str | None]:
    """`standby_args` as flags and their values (`--flag value` or `--flag=value`);
    ValueError naming the item that is neither."""
    out: dict[str, str | None] = {}
    i = 0
    while i < len(standby_args):
        a = standby_args[i]
        if not a.startswith("--") or a == "--":
            raise ValueError(f"{a!r} is not a flag (--flag value pairs)")
        if "=" in a:
            flag, value = a.split("=", 1)
            i += 1
        elif i + 1 < len(standby_args) and not standby_args[i + 1].startswith("--"):
            flag, value = a, standby_args[i + 1]
            i += 2
        else:
            raise ValueError(f"{a!r} has no value (--flag value pairs: a flag alone "
                             f"cannot replace the engine's)")
        out[flag] = value
    return out


def thinned(args: list[str], standby_args: list[str]) -> list[str]:
    """The engine's `args` as its standby runs them: each flag of `standby_args` in
    place of the engine's own (checked at load: `check_standby`)."""
    return apply(args, standby_overrides(standby_args)) if standby_args else list(args)


def standby_argv(engine: CheckedEngine) -> list[str]:
    """The standby's command line (`argv` with `standby_args` applied)."""
    return [*engine.command, *thinned(engine.args, engine.standby_args)]


def shares(engine: CheckedEngine) -> tuple[float, float]:
    """The serving engine's and its standby's `--gpu-memory-utilization` (vLLM's
    default where not given)."""
    def share(args: list[str]) -> float:
        got = gpu_share(args)
        return got if got is not None else DEFAULT_GPU_SHARE
    return share(argv(engine)), share(standby_argv(engine))


def gpu_share(args: list[str]) -> float | None:
    """`--gpu-memory-utilization` as the arguments give it; None when absent or not a
    number."""
    raw = arg_value(args, "--gpu-memory-utilization")
    try:
        return float(raw) if raw is not None else None
    except ValueError:
        return None


def side_by_side(engine: CheckedEngine) -> bool:
    """The engine and its standby can start on one card together (the standby beside
    the serving engine; a new one beside the engine that took over; with a thinner
    standby, the full-size engine beside the thin one that serves)."""
    serving, standby = shares(engine)
    return serving + standby <= SIDE_BY_SIDE_MAX


def check_pinning(key: str, engine: CheckedEngine, problems: list[str]) -> None:
    """`gpus` is what the engine gets (supervisor/engine/process/process.py's gpu_pinning): an
    environment that says otherwise, or more parallel ranks than GPUs, is refused."""
    if not engine.gpus:
        return
    named = [str(g) for g in engine.gpus]
    visible = engine.env.get("CUDA_VISIBLE_DEVICES")
    if visible is not None and [v.strip() for v in visible.split(",")] != named:
        problems.append(f"{key}.env.CUDA_VISIBLE_DEVICES: {visible!r} disagrees with "
                        f"{key}.gpus = {list(engine.gpus)}; the daemon gives the engine the "
                        f"GPUs of {key}.gpus: remove the variable or make them agree")
    order = engine.env.get("CUDA_DEVICE_ORDER")
    if order is not None and order != "PCI_BUS_ID":
        problems.append(f"{key}.env.CUDA_DEVICE_ORDER: {order!r}; with {key}.gpus the "
                        "daemon sets PCI_BUS_ID, the order NVML numbers GPUs in")
    sizes: list[str] = []
    need = 1
    for long, short in _PARALLEL:
        raw = next((v for flag in (long, long.replace("-", "_").replace("__", "--"), short)
                    if (v := arg_value(engine.args, flag)) is not None), None)
        if raw is not None and raw.isdigit() and int(raw) > 1:
            need *= int(raw)
            sizes.append(f"{long} {raw}")
    if need > len(engine.gpus):
        problems.append(f"{key}.args: {' x '.join(sizes)} = {need} GPUs, but {key}.gpus "
                        f"names {len(engine.gpus)} ({list(engine.gpus)})")


def check_standby(key: str, engine: CheckedEngine, problems: list[str]) -> None:
    """A standby the engine's arguments cannot keep: a sleeping one without vLLM's sleep
    mode, or one that does not fit on the card beside the serving engine."""
    if engine.standby == "none":
        if engine.standby_args:
            problems.append(f'{key}.standby_args: needs a standby ({key}.standby is "none")')
        return
    try:
        standby_overrides(engine.standby_args)
    except ValueError as e:
        problems.append(f"{key}.standby_args: {e}")
        return
    args = argv(engine)
    share = gpu_share(args)
    for where, line in ((f"{key}.args", args),
                        (f"{key}.standby_args", standby_argv(engine))):
        raw = arg_value(line, "--gpu-memory-utilization")
        if raw is not None and gpu_share(line) is None:
            problems.append(f"{where}: --gpu-memory-utilization {raw!r} is not a number")
            return
    if engine.standby_args and engine.standby == "snapshot":
        problems.append(f'{key}.standby_args: not with standby = "snapshot" (its copies '
                        f'are of the engine\'s own arguments)')
        return
    if engine.standby_args:
        _check_thin(key, engine, problems)
        return
    if engine.standby in SLEEPING:
        _check_sleep_mode(key, engine, problems)
        used = share if share is not None else DEFAULT_GPU_SHARE
        if used > BESIDE_SLEEPING_MAX:
            problems.append(f"{key}.args: --gpu-memory-utilization {used:g}"
                            f"{'' if share is not None else ' (vLLM default)'} leaves no "
                            f"room for the sleeping standby's CUDA context and graphs; "
                            f"at most {BESIDE_SLEEPING_MAX:g} with standby = "
                            f"\"{engine.standby}\"")
    elif share is not None and 2 * share > SIDE_BY_SIDE_MAX:
        # (an awake standby holds its share all the time; on CPU the flag is not given)
        problems.append(f"{key}.args: --gpu-memory-utilization {share:g} twice is "
                        f"{2 * share:g} of the card: an awake standby starts beside the "
                        f"serving engine and vLLM checks at start that its share is free; "
                        f"at most {SIDE_BY_SIDE_MAX / 2:g} each, or standby = \"sleep\"")


def _check_thin(key: str, engine: CheckedEngine, problems: list[str]) -> None:
    """An asymmetric pair: the full-size engine starts beside the thin standby that
    serves after a fault (both awake), so the two shares must fit on the card together,
    whatever the standby's mode."""
    serving, standby = shares(engine)
    named = gpu_share(argv(engine)) is not None or gpu_share(standby_argv(engine)) is not None
    if named and serving + standby > THIN_PAIR_MAX + 1e-9:  # (on CPU no share is given)
        problems.append(f"{key}.standby_args: the engine's --gpu-memory-utilization "
                        f"{serving:g} and the standby's {standby:g} make "
                        f"{serving + standby:.2f} of the card: after a failover the "
                        f"full-size engine starts beside the thin one that serves, both "
                        f"awake, each holding 2.5-3.2 GiB beyond its share; together at "
                        f"most {THIN_PAIR_MAX:g} (0.62 + 0.30 ran out of memory on an H100)")
    if engine.standby == "sleep":
        _check_sleep_mode(key, engine, problems)


def _check_sleep_mode(key: str, engine: CheckedEngine, problems: list[str]) -> None:
    args = argv(engine)
    if not any(a == "--enable-sleep-mode" or a.startswith("--enable-sleep-mode=")
               for a in args):
        problems.append(f'{key}.args: standby = "{engine.standby}" needs '
                        "--enable-sleep-mode (vLLM's sleep mode keeps the standby asleep)")
    if engine.env.get("VLLM_SERVER_DEV_MODE") != "1":
        problems.append(f'{key}.env.VLLM_SERVER_DEV_MODE: standby = "{engine.standby}" '
                        'needs "1" (vLLM serves /sleep and /wake_up only then)')


# ---- a daily window (`engine.rearm_window`) -------------------------------------------

_FORM = re.compile(r"^\s*(\d{1,2}):(\d{2})\s*-\s*(\d{1,2}):(\d{2})\s*$")


@dataclass(frozen=True)
class DailyWindow:
    """A daily window of the host's local time ("03:00-04:00"; "23:30-00:30" crosses
    midnight): parsed at load, asked whether a moment is inside it and on which day that
    window began (so that what is done once per window is done once)."""

    start_min: int  # minutes after local midnight
    end_min: int

    @classmethod
    def parse(cls, text: str) -> DailyWindow:
        """"HH:MM-HH:MM", or ValueError saying what is wrong."""
        m = _FORM.match(text)
        if m is None:
            raise ValueError(f"{text!r} is not HH:MM-HH:MM")
        h1, m1, h2, m2 = (int(g) for g in m.groups())
        if h1 > 23 or h2 > 23 or m1 > 59 or m2 > 59:
            raise ValueError(f"{text!r} is not a time of day (00:00 to 23:59)")
        if (h1, m1) == (h2, m2):
            raise ValueError(f"{text!r} is empty (it starts where it ends)")
        return cls(h1 * 60 + m1, h2 * 60 + m2)

    def occurrence(self, now: datetime) -> str | None:
        """The date the window around `now` began on (a window crossing midnight began
        the day before its early hours), or None outside it."""
        minute = now.hour * 60 + now.minute
        if self.start_min < self.end_min:
            inside = self.start_min <= minute < self.end_min
            began = now
        else:
            inside = minute >= self.start_min or minute < self.end_min
            began = now if minute >= self.start_min else now - timedelta(days=1)
        return began.date().isoformat() if inside else None
