"""Hypothesis's profiles for this suite (loaded by tests/conftest.py)."""

from __future__ import annotations

from hypothesis import settings

# Hypothesis: the suite (`make test`, CI) runs the same examples every time, so a change
# lands or not on its own merits and never on a draw; `make explore` runs the property
# tests and the state machines on fresh random draws, five times as many, to find new
# bugs (each one found becomes a regression test). No example database either way: a run
# does not depend on what an earlier one left behind.
settings.register_profile("suite", derandomize=True, database=None, print_blob=True)
settings.register_profile("explore", derandomize=False, database=None, print_blob=True,
                          max_examples=500)
settings.load_profile("suite")  # (`--hypothesis-profile=explore` overrides it)


def examples(n: int) -> int:
    """A property test's examples: `n`, five times as many under `make explore`."""
    return n * 5 if settings.default.max_examples >= 500 else n
