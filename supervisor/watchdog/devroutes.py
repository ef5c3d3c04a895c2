"""vLLM's development routes that the daemon relies on: which ones an engine serves, and
what their absence turns off, in the operator's words.

With VLLM_SERVER_DEV_MODE=1 vLLM's API server adds the routes the daemon's in-place
remedies use: `POST /reset_prefix_cache` (the ladder's first rung), `POST /sleep`, `POST
/wake_up` and `GET /is_sleeping` (the KV reset, the warm-up, the sleeping standby),
`POST /pause`, `POST /resume` and `GET /is_paused` (the KV reset without a sleep).
(`/collective_rpc` is one too: the daemon calls it only to empty a standby's pinned
host cache, engine/process/host_cache.py, and a refusal costs nothing but that.) An
engine may lack them: dev
mode forgotten, vLLM 0.33's Rust front end (`VLLM_USE_RUST_FRONTEND=1`, whose dev
routes are undocumented), another server in vLLM's place. `probe` asks an engine, once
its health check answers, which of them it serves; the pure functions below say what
is off because of it. Fetching only, bounded, and without side effects.

How it asks: `GET` on each route. `/is_sleeping` is a GET route and answers its state.
The others take POST only, and a GET on them is refused before any handler runs: 405
(Method Not Allowed) where the path is routed, 404 where it is not. Both of vLLM's front
ends answer so: the Python one (Starlette's router: a path matched with another method
is a 405) and the Rust one (axum's `MethodRouter` answers 405 for a method it lacks on a
routed path, and the router 404 for an unrouted one; seen on an H100 with vLLM 0.33,
where this probe found all four behind either front end: docs/gpu-validation.md). The
route table that vLLM's Python server logs at start (`Available routes are:`, summarised
by `engine/process/process.py`) was the other way: the Rust server prints no such table (the
0.33.0 `vllm-rs` binary has neither that text nor `Route:`), and a log says what was
registered, not what answers on the port. Any answer but those (a timeout, a 5xx, a 401)
is no verdict: the route is unknown, and the daemon goes by the configuration for it as
before (the remedy's first use finds out), rather than turning a remedy off for one slow
answer.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import httpx

from supervisor.ops.descriptors import exhausted

# the development routes the daemon calls, and the method it calls each with
ROUTES: dict[str, str] = {"/reset_prefix_cache": "POST", "/sleep": "POST",
                          "/wake_up": "POST", "/is_sleeping": "GET", "/pause": "POST",
                          "/resume": "POST", "/is_paused": "GET"}
PREFIX_RESET_ROUTES = ("/reset_prefix_cache",)
SLEEP_ROUTES = ("/sleep", "/wake_up", "/is_sleeping")
# (the prefix-cache reset checks, while paused, that no block is held: remedy.py)
PAUSE_ROUTES = ("/pause", "/resume", "/is_paused", "/reset_prefix_cache")
PROBE_TIMEOUT_S = 5.0  # each GET; they go together


@dataclass(frozen=True)
class DevRoutes:
    """What one engine answered: each route served (True), not served (False: 404) or
    unknown (None: no verdict, `errors` says what came instead)."""

    served: Mapping[str, bool | None] = field(default_factory=dict)
    errors: Mapping[str, str] = field(default_factory=dict)
    asleep: bool | None = None  # `/is_sleeping`'s answer

    def absent(self, routes: Sequence[str]) -> list[str]:
        """Those of `routes` the engine does not serve (404)."""
        return [r for r in routes if self.served.get(r) is False]

    def as_dict(self) -> dict[str, bool | None]:
        return {r: self.served.get(r) for r in ROUTES}


async def _ask(client: httpx.AsyncClient, base_url: str, route: str,
               timeout_s: float) -> tuple[bool | None, str | None, bool | None]:
    """(served, why unknown, asleep) for one route."""
    try:
        r = await client.get(base_url + route, timeout=timeout_s)
    except httpx.TimeoutException:
        return None, f"GET {route}: no answer within {timeout_s:g} s", None
    except (httpx.HTTPError, OSError) as exc:  # (httpx lets a bare OSError through)
        why = ("the daemon is out of file descriptors" if exhausted(exc)
               else f"{type(exc).__name__}: {exc}")
        return None, f"GET {route}: {why}", None
    if r.status_code == 404:
        return False, None, None
    if ROUTES[route] == "GET" and r.status_code == 200:
        if route != "/is_sleeping":
            return True, None, None
        try:
            value = r.json().get("is_sleeping")
        except (ValueError, AttributeError):
            value = None
        return True, None, value if isinstance(value, bool) else None
    if ROUTES[route] == "POST" and r.status_code == 405:  # routed, for POST only
        return True, None, None
    return None, f"GET {route}: HTTP {r.status_code}", None


async def probe(client: httpx.AsyncClient, base_url: str,
                timeout_s: float = PROBE_TIMEOUT_S) -> DevRoutes:
    """Which of `ROUTES` the engine at `base_url` serves. Never raises; bounded by
    `timeout_s` (the routes are asked together)."""
    answers = await asyncio.gather(*(_ask(client, base_url, r, timeout_s) for r in ROUTES))
    served = {r: a[0] for r, a in zip(ROUTES, answers, strict=True)}
    errors = {r: a[1] for r, a in zip(ROUTES, answers, strict=True) if a[1] is not None}
    return DevRoutes(served, errors, answers[list(ROUTES).index("/is_sleeping")][2])


def dev_mode(env: Mapping[str, str]) -> bool:
    return env.get("VLLM_SERVER_DEV_MODE") == "1"


def _not_served(absent: list[str], env: Mapping[str, str]) -> str:
    what = f"the engine does not serve {', '.join(absent)}"
    if not dev_mode(env):
        return f"{what}: VLLM_SERVER_DEV_MODE is not 1"
    return (f"{what} though VLLM_SERVER_DEV_MODE=1 (a front end without vLLM's "
            "development routes, such as VLLM_USE_RUST_FRONTEND=1's?)")


def _routes_off(routes: DevRoutes | None, needed: Sequence[str], env: Mapping[str, str],
                config_why: str) -> str | None:
    """Why `needed` are not all there: a route the probe found absent; else, short of a
    verdict on every one of them (not probed, or no answer), what the configuration
    says (`config_why` unless dev mode is on)."""
    if routes is not None:
        absent = routes.absent(needed)
        if absent:
            return _not_served(absent, env)
        if all(routes.served.get(r) is True for r in needed):
            return None
    return None if dev_mode(env) else config_why


def prefix_reset_off(routes: DevRoutes | None, env: Mapping[str, str]) -> str | None:
    """Why an engine started with `env` has no prefix-cache reset, or None when it has
    one. `routes` is what its probe found (None: not probed)."""
    return _routes_off(routes, PREFIX_RESET_ROUTES, env, "VLLM_SERVER_DEV_MODE is not 1 "
                       "(vLLM serves /reset_prefix_cache only then)")


def sleep_off(routes: DevRoutes | None, argv: Sequence[str],
              env: Mapping[str, str]) -> str | None:
    """Why an engine started with `argv` and `env` cannot sleep (no KV reset in place, no
    warm-up, no sleeping standby), or None when it should (an engine found asleep, or
    no front proxy to hold requests, are the caller's to judge)."""
    if not any(a == "--enable-sleep-mode" or a.startswith("--enable-sleep-mode=")
               for a in argv):
        return "the engine was not started with --enable-sleep-mode"
    return _routes_off(routes, SLEEP_ROUTES, env, "VLLM_SERVER_DEV_MODE is not 1 "
                       "(vLLM serves /sleep and /wake_up only then)")


def pause_off(routes: DevRoutes | None, env: Mapping[str, str]) -> str | None:
    """Why an engine started with `env` cannot be paused and resumed (no KV reset
    without a sleep; its vLLM version is the caller's to judge), or None when it can."""
    return _routes_off(routes, PAUSE_ROUTES, env, "VLLM_SERVER_DEV_MODE is not 1 "
                       "(vLLM serves /pause and /resume only then)")


def off(routes: DevRoutes | None, argv: Sequence[str],
        env: Mapping[str, str]) -> dict[str, str]:
    """What of the engine's own is off, and why: `prefix_reset`, `sleep`, `pause`."""
    out = {"prefix_reset": prefix_reset_off(routes, env),
           "sleep": sleep_off(routes, argv, env), "pause": pause_off(routes, env)}
    return {k: v for k, v in out.items() if v is not None}


def missing_asked(routes: DevRoutes, argv: Sequence[str],
                  env: Mapping[str, str]) -> list[str]:
    """The routes the configuration asks for that the engine does not serve: dev mode
    on, and the routes absent (sleep's only with --enable-sleep-mode)."""
    if not dev_mode(env):
        return []
    sleeps = sleep_off(None, argv, env) is None
    return routes.absent([*PREFIX_RESET_ROUTES, *(SLEEP_ROUTES if sleeps else ())])
