"""A request's deadlines: the proxy's, an engine's or a model's (issue 37, point 2).

`proxy.request_timeout_s` (from a request's arrival to its end) and
`proxy.stall_timeout_s` (a continuable stream's longest wait for a token from a live
engine) hold for every request unless `[proxy.deadlines.NAME]` says otherwise, NAME a
model's name as clients ask for it or an engine's name: a 70B model's answers may take
minutes where an 8B's take seconds. For each of the two keys the model's table wins,
then the engine's (the engine the request is routed to first), then `[proxy]`'s; 0 is
no deadline. Pure: the config builds the tables (`build`), the proxy asks `for_request`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from supervisor.settings.schema import named_tables

KEYS = {"request_timeout_s": 86400.0, "stall_timeout_s": 3600.0}  # each one's upper bound


@dataclass(frozen=True)
class Deadline:
    """One name's deadlines; None: the next one's (the engine's, then the proxy's)."""

    request_timeout_s: float | None = None
    stall_timeout_s: float | None = None


def build(prefix: str, table: Any, problems: list[str]) -> dict[str, Deadline]:
    """`[proxy.deadlines.NAME]` tables; every problem one line naming its key."""
    out: dict[str, Deadline] = {}
    for name, key, raw in named_tables(prefix, table, problems):
        values: dict[str, float] = {}
        for k, v in raw.items():
            if k not in KEYS:
                problems.append(f"{key}.{k}: unknown key (known keys: {', '.join(KEYS)})")
            elif isinstance(v, int | float) and not isinstance(v, bool) \
                    and 0 <= v <= KEYS[k]:
                values[k] = float(v)
            else:
                problems.append(f"{key}.{k}: expected a number of seconds from 0 to "
                                f"{KEYS[k]:g} (0: none), got {v!r}")
        if not raw:
            problems.append(f"{key}: expected at least one of {', '.join(KEYS)}")
        out[name] = Deadline(**values)
    return out


def for_request(named: Mapping[str, Deadline], model: object, engine: str | None,
                request_timeout_s: float, stall_timeout_s: float) -> tuple[float, float]:
    """(request_timeout_s, stall_timeout_s) for a request of `model` routed to `engine`:
    the model's, else the engine's, else the proxy's, key by key."""
    tables = [named[n] for n in (model, engine) if isinstance(n, str) and n in named]
    request = next((t.request_timeout_s for t in tables
                    if t.request_timeout_s is not None), request_timeout_s)
    stall = next((t.stall_timeout_s for t in tables if t.stall_timeout_s is not None),
                 stall_timeout_s)
    return request, stall
