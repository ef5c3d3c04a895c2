"""The daemon's event loop.

uvloop (libuv) rather than the standard library's selector loop: the front proxy
spends its CPU in the loop's read, write and callback machinery, once per streamed
chunk, and on a host where the proxy shares cores with the engine that CPU comes out of
the engine. `make bench-proxy` measures both loops side by side (docs/benchmarks.md).
Subprocesses, signal handlers, pidfd readers and threads behave the same under both;
the whole test suite runs the daemon on uvloop.
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any, Literal, TypeVar

import uvloop

T = TypeVar("T")


def run(main: Coroutine[Any, Any, T], loop: Literal["uvloop", "asyncio"] = "uvloop") -> T:
    """Run `main` to completion on a new event loop of the given kind."""
    factory = uvloop.new_event_loop if loop == "uvloop" else asyncio.new_event_loop
    with asyncio.Runner(loop_factory=factory) as runner:
        return runner.run(main)
