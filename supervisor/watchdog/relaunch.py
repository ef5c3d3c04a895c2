"""Engine arguments for a relaunch: throttle levels, the reduced batch, speculative tokens.

vLLM fixes `--max-num-seqs`, `--max-num-batched-tokens` and the number of speculative
tokens at start, so without admission control in front of it, a lasting throttle is a
drained relaunch with smaller values. One mechanism serves the throttle, the thermal
rule's reduced batch and the speculative-decoding rules: `overrides()` computes the
flags to replace, `apply()` puts them into the argument list. Pure.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Protocol


class BatchSettings(Protocol):
    """What a relaunch reads of `[throttle]` (`supervisor.settings.sections.ThrottleConfig`)."""

    @property
    def level_factors(self) -> list[float]: ...
    @property
    def max_num_seqs(self) -> int: ...
    @property
    def max_num_batched_tokens(self) -> int: ...
    @property
    def min_num_batched_tokens(self) -> int: ...
    @property
    def reduce_batch_factor(self) -> float: ...


SEQS = "--max-num-seqs"
BATCHED = "--max-num-batched-tokens"
SPEC = "--speculative-config"


def arg_value(args: Sequence[str], flag: str) -> str | None:
    """The value of `flag` in `args` (`--flag value` or `--flag=value`), last one wins."""
    value = None
    for i, a in enumerate(args):
        if a == flag and i + 1 < len(args):
            value = args[i + 1]
        elif a.startswith(flag + "="):
            value = a[len(flag) + 1:]
    return value


def apply(args: Sequence[str], overrides: dict[str, str | None]) -> list[str]:
    """`args` with each flag of `overrides` replaced (None: removed)."""
    out: list[str] = []
    skip = False
    for i, a in enumerate(args):
        if skip:
            skip = False
            continue
        flag = a.split("=", 1)[0]
        if flag in overrides:
            skip = "=" not in a and i + 1 < len(args)
            continue
        out.append(a)
    for flag, value in overrides.items():
        if value is not None:
            out += [flag, value]
    return out


def _int(value: str | None) -> int | None:
    return int(value) if value is not None and value.isdigit() else None


def spec_tokens(args: Sequence[str]) -> int | None:
    """num_speculative_tokens of `--speculative-config`; None without speculative decoding."""
    raw = arg_value(args, SPEC)
    if raw is None:
        return None
    try:
        n = json.loads(raw).get("num_speculative_tokens")
    except (ValueError, AttributeError):
        return None
    return n if isinstance(n, int) and not isinstance(n, bool) else None


def overrides(args: Sequence[str], cfg: BatchSettings, level: int, reduced: bool,
              spec: int | None) -> dict[str, str | None]:
    """The flags a relaunch replaces at this throttle level, reduced batch and number of
    speculative tokens; {} when everything is as configured."""
    out: dict[str, str | None] = {}
    seqs = _int(arg_value(args, SEQS)) or cfg.max_num_seqs
    batched = _int(arg_value(args, BATCHED)) or cfg.max_num_batched_tokens
    if level > 0:
        factor = cfg.level_factors[min(level, len(cfg.level_factors)) - 1]
        out[SEQS] = str(max(1, int(seqs * factor)))
        batched = int(batched * factor)
    if reduced:
        batched = int(batched * cfg.reduce_batch_factor)
    if level > 0 or reduced:
        out[BATCHED] = str(max(cfg.min_num_batched_tokens, batched))
    if spec is not None and spec != spec_tokens(args):
        if spec <= 0:
            out[SPEC] = None  # no speculative decoding at all
        else:
            doc = json.loads(arg_value(args, SPEC) or "{}")
            doc["num_speculative_tokens"] = spec
            out[SPEC] = json.dumps(doc, separators=(",", ":"))
    return out
