"""Each benchmark owns one marked section of docs/benchmarks.md and rewrites only that."""

from __future__ import annotations

import time
from pathlib import Path


def write_section(path: Path, name: str, text: str) -> None:
    begin, end = f"<!-- {name}:begin -->", f"<!-- {name}:end -->"
    block = f"{begin}\n{text.rstrip()}\n{end}\n"
    old = path.read_text() if path.exists() else "# Benchmarks\n\n"
    if begin in old and end in old:
        head, rest = old.split(begin, 1)
        new = head + block + rest.split(end, 1)[1].lstrip("\n")
    else:
        new = old.rstrip() + "\n\n" + block
    path.write_text(new)


class OutOfTime(Exception):
    """A bench run's global deadline has passed."""


class Clock:
    """A bench run's global deadline: every wait is bounded by what is left of it."""

    def __init__(self, minutes: float) -> None:
        self.deadline = time.monotonic() + minutes * 60

    def left(self, cap: float) -> float:
        rest = self.deadline - time.monotonic()
        if rest <= 0:
            raise OutOfTime("the run's deadline has passed")
        return min(cap, rest)
