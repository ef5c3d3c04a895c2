"""vLLM's version as an engine or its package says it (`0.26.0`, `0.33.1rc1`,
`0.34.0+cu130`, `v0.27.0`), compared by its release: what the daemon does differently
by version (a flag an older vLLM refuses, a sleep that aborts by itself) asks here."""

from __future__ import annotations

import re

_RELEASE = re.compile(r"v?(?P<major>\d+)\.(?P<minor>\d+)")


def at_least(version: str | None, first: tuple[int, int]) -> bool:
    """Whether `version`'s major.minor is `first` or later. Unknown or unreadable: no."""
    m = _RELEASE.match(version or "")
    return m is not None and (int(m["major"]), int(m["minor"])) >= first
