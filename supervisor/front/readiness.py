"""Whether the front door serves, as load balancers, routers and clients ask it: the
answers it gives itself (`/healthz`, `/readyz`, and vLLM's `/health` and `/ping`), and
why none of a request's engines will serve within a short wait (a fleet's refusal at
once, docs/fleet.md).

Reads the engines' gates (`Backend`, `supervisor/front/dispatch.py`) and never changes
one; no I/O.
"""

from __future__ import annotations

from collections.abc import Mapping

from supervisor.front.dispatch import Backend, Choice
from supervisor.front.messages import Response


def ready(backends: Mapping[str, Backend]) -> bool:
    """Every engine's models can be answered now: by the engine, or its fallback."""
    if not backends:
        return False
    serving = {n for n, b in backends.items() if b.serving()}
    return all(n in serving or b.fallback in serving for n, b in backends.items())


def unhealthy(backends: Mapping[str, Backend]) -> list[str]:
    """Why a router should not send requests here now, one line per engine whose
    models nothing else here answers; [] when every model is served now or within a
    short wait (docs/fleet.md)."""
    if not backends:
        return ["no engine"]
    ok = {n for n, b in backends.items() if b.unhealthy() is None}
    return [f"engine {n}: {b.unhealthy()}" for n, b in backends.items()
            if n not in ok and b.fallback not in ok]


def answer(path: str, backends: Mapping[str, Backend]) -> Response:
    """/healthz: the daemon runs. /readyz: every engine's models are served now (its
    gate open). vLLM's /health and /ping, which routers and clients probe: served now
    or within a short wait (a handover to the standby, a KV reset), else 503 naming
    why; never 200 for a frozen engine whose own /health still says 200."""
    if path == "/healthz":
        return Response(text="ok\n")
    if path == "/readyz":
        return Response(text="ready\n") if ready(backends) \
            else Response(status=503, text="not ready\n")
    problems = unhealthy(backends)
    if not problems:
        return Response(text="ready\n")
    return Response(status=503, text="not ready: " + "; ".join(problems)[:1000] + "\n")


def all_unhealthy(choices: list[Choice]) -> str | None:
    """Why none of these engines will serve within a short wait; None when one will. (An
    open KV breaker is no such reason: the engine serves, saturated, and a request held
    here is served as the cache frees, where one sent on may find every host as full.)"""
    whys = [c.backend.gate.unhealthy for c in choices]
    return None if any(w is None for w in whys) else "; ".join(
        f"{c.backend.name}: {w}" for c, w in zip(choices, whys, strict=True))
