"""Rule conditions: a tiny expression language over named signals. Pure.

    kv_cache_usage >= 0.95 and requests_waiting > 0 or metrics_staleness_s >= 30

A condition is comparisons (`signal op number`, op one of >= > <= < == !=) joined by
`and` and `or`, `and` binding tighter; no parentheses (a rule that needs them is two
rules). Numbers may use exponents (`2e9`). A comparison on an unknown signal (None) is
false, so an engine that does not export a series never trips a rule on it, and a
`clear_when` on it never clears one.
"""

from __future__ import annotations

import math
import operator
import re
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass

_OPS: dict[str, Callable[[float, float], bool]] = {
    ">=": operator.ge, ">": operator.gt, "<=": operator.le, "<": operator.lt,
    "==": operator.eq, "!=": operator.ne,
}
_COMPARISON = re.compile(r"^\s*([a-z_][a-z0-9_]*)\s*(>=|<=|==|!=|>|<)\s*"
                         r"([-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?)\s*$")


@dataclass(frozen=True)
class Comparison:
    signal: str
    op: str
    value: float

    def holds(self, signals: Mapping[str, float | None]) -> bool:
        v = signals.get(self.signal)
        return v is not None and not math.isnan(v) and _OPS[self.op](v, self.value)

    def __str__(self) -> str:
        return f"{self.signal} {self.op} {self.value:g}"


@dataclass(frozen=True)
class Condition:
    """Disjunction of conjunctions: any group whose comparisons all hold."""

    groups: tuple[tuple[Comparison, ...], ...]
    text: str

    def holds(self, signals: Mapping[str, float | None]) -> bool:
        return any(all(c.holds(signals) for c in g) for g in self.groups)

    @property
    def signals(self) -> tuple[str, ...]:
        seen: dict[str, None] = {}
        for g in self.groups:
            for c in g:
                seen.setdefault(c.signal)
        return tuple(seen)


def parse_condition(text: str, known: Collection[str]) -> Condition:
    """Parse `text`; ValueError names the bad part (an unknown signal, a bad comparison)."""
    if not text.strip():
        raise ValueError("empty condition")
    groups = []
    for alternative in re.split(r"\s+or\s+", text.strip()):
        comparisons = []
        for part in re.split(r"\s+and\s+", alternative):
            m = _COMPARISON.match(part)
            if m is None:
                raise ValueError(f"cannot read {part.strip()!r}: expected "
                                 f"'signal OP number' with OP one of {' '.join(_OPS)}")
            name, op, number = m.groups()
            if name not in known:
                raise ValueError(f"unknown signal {name!r}")
            comparisons.append(Comparison(name, op, float(number)))
        groups.append(tuple(comparisons))
    return Condition(tuple(groups), " ".join(text.split()))
