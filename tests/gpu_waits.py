"""What the clients of one GPU harness run waited for at the daemon's gate, from the
exporter's own histograms read before and after it (`tests/gpu_vllm.py`): the waits of
new requests for a slot (`client_admission_wait_seconds`: the throttle, the concurrency
cap, the token budget that follows a thin standby's KV cache), for a hold to end
(`client_hold_wait_seconds`: a drain, a restart, a failover), and the gaps of continued
streams (`client_continuation_gap_seconds`). Series of every label set are summed; the
quantiles are the upper bounds of the buckets they fall in.
"""

from __future__ import annotations

import math
import re
from typing import Any

PREFIX = "vllm_supervisor_"
FAMILIES = ("client_admission_wait_seconds", "client_hold_wait_seconds",
            "client_continuation_gap_seconds")
SERIES = tuple(PREFIX + f for f in FAMILIES)  # the exporter's lines to read
_LE = re.compile(r'le="([^"]+)"')


def _bound(le: str) -> float:
    return math.inf if le == "+Inf" else float(le)


def wait_summary(before: dict[str, float], after: dict[str, float]) -> dict[str, Any]:
    """Per family: how many waited in between, their mean, and their p50, p99 and
    largest as bucket bounds (None where none waited). `before`/`after`: exporter lines,
    name with labels -> value."""
    out: dict[str, Any] = {}
    for fam in FAMILIES:
        name = PREFIX + fam
        count = total = 0.0
        cumulative: dict[float, float] = {}
        for key, value in after.items():
            delta = value - before.get(key, 0.0)
            base = key.split("{", 1)[0]
            if base == name + "_count":
                count += delta
            elif base == name + "_sum":
                total += delta
            elif base == name + "_bucket" and (m := _LE.search(key)):
                le = _bound(m.group(1))
                cumulative[le] = cumulative.get(le, 0.0) + delta
        if count <= 0:
            out[fam] = {"count": 0}
            continue
        bounds = sorted(cumulative)

        def quantile(q: float, bounds: list[float] = bounds,
                     cumulative: dict[float, float] = cumulative,
                     count: float = count) -> float | None:
            for b in bounds:
                if cumulative[b] >= q * count:
                    return None if math.isinf(b) else b
            return None

        out[fam] = {"count": int(count), "mean_s": round(total / count, 3),
                    "p50_le_s": quantile(0.5), "p99_le_s": quantile(0.99),
                    "max_le_s": quantile(1.0)}
    return out
