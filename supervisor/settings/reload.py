"""When a reloaded config's changes take effect: every key is applied now, at the engine's
next start, or only when the daemon restarts, and the reload says which.

Owns the table below and nothing else. A key is put under "now" only where the daemon
really reads the new value from then on (the live readers and the rebuilt copies are in
`EngineUnit.handle_reloaded`); `tests/test_reload.py` checks that every config key has
exactly one answer, so a new key cannot be reported as applied by default.

Pure: no I/O, no clock.
"""

from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass

from supervisor.settings.config import Config

NOW = "applied_now"
NEXT_START = "next_engine_start"
DAEMON_RESTART = "next_daemon_start"

# Prefix -> when, the most specific first; a key matches its first prefix.
WHEN: tuple[tuple[str, str], ...] = (
    # the engine's argv, environment and timeouts are read when it is spawned; the proxy's
    # upstream and model names follow the engine at each start
    # the proxy's routes follow a reloaded fallback at once (the host re-registers them)
    ("engine.fallback", NOW),
    ("engine.rearm_window", NOW),  # read at each tick
    # the weight cache is started, restarted or taken down at once (an engine maps it
    # at its next start); a change of the engine's own keys that shape its weights
    # restarts the cache too (EngineUnit.reconfigure)
    ("engine.weight_cache", NOW),
    ("engine.weight_cache_command", NOW),
    ("engine.weight_cache_args", NOW),
    # the KV tier's keeper reads its bound at each look; a new folder is taken at once
    # too, but the engines are given it (and the chunk size, the CPU tier) at their
    # next start, until which the old folder is kept as well
    ("engine.kv_tier_max_gib", NOW),
    # read at each tick: "gpu" wakes a ready standby's weights ahead from then on; "host"
    # replaces a standby whose weights are on the card (they cannot sleep again)
    ("engine.standby_weights", NOW),
    ("engine.", NEXT_START),
    # the poller takes its settings when it starts with an engine
    ("metrics.", NEXT_START),
    # the canary's task starts with the engine; its timing and prompt are read each probe
    ("canary.enabled", NEXT_START),
    ("canary.", NOW),
    # the sampler (NVML or a file) is built once, when the daemon starts
    ("gpu.sampler", DAEMON_RESTART),
    ("gpu.file", DAEMON_RESTART),
    ("gpu.", NOW),
    ("signals.", NOW),  # the signal window is reconfigured, its samples kept
    ("throttle.", NOW),  # the gate's level factors; the next relaunch's limits
    ("policy.", NOW),
    ("restart.", NOW),
    ("evidence.log_lines", NEXT_START),  # the engine's line ring is sized at its spawn
    ("evidence.", NOW),
    ("audit.", NOW),  # the trail is reopened at the new path and sizes
    ("log.level", NOW),
    ("log.", DAEMON_RESTART),  # the renderer is chosen once
    # the listening sockets, and the limits their HTTP parser was built with
    ("proxy.enabled", DAEMON_RESTART),
    ("proxy.listen", DAEMON_RESTART),
    ("proxy.workers", DAEMON_RESTART),
    ("proxy.max_body_bytes", DAEMON_RESTART),
    ("proxy.max_header_bytes", DAEMON_RESTART),
    ("proxy.max_connections", DAEMON_RESTART),
    ("proxy.header_timeout_s", DAEMON_RESTART),
    ("proxy.body_timeout_s", DAEMON_RESTART),
    ("proxy.send_timeout_s", DAEMON_RESTART),
    ("proxy.idle_timeout_s", DAEMON_RESTART),
    ("proxy.max_buffered_bytes", DAEMON_RESTART),
    ("proxy.", NOW),  # admission limits, routes, Retry-After, continuation settings
    ("exporter.", DAEMON_RESTART),
    ("control.", DAEMON_RESTART),
    ("daemon.", DAEMON_RESTART),
    ("fleet.", DAEMON_RESTART),  # the registrar is built once, with its routers
)


def when(key: str) -> str:
    """When a changed key takes effect. KeyError for a key the table does not know."""
    for prefix, answer in WHEN:
        if key == prefix or (prefix.endswith(".") and key.startswith(prefix)):
            return answer
    raise KeyError(key)


@dataclass(frozen=True)
class ReloadPlan:
    """A reload's changed keys, each under when it takes effect."""

    applied_now: tuple[str, ...]
    next_engine_start: tuple[str, ...]
    next_daemon_start: tuple[str, ...]

    @property
    def changed(self) -> tuple[str, ...]:
        return self.applied_now + self.next_engine_start + self.next_daemon_start

    def as_dict(self) -> dict[str, list[str]]:
        return {"changed": list(self.changed), NOW: list(self.applied_now),
                NEXT_START: list(self.next_engine_start),
                DAEMON_RESTART: list(self.next_daemon_start)}


def plan(changed: list[str]) -> ReloadPlan:
    by: dict[str, list[str]] = {NOW: [], NEXT_START: [], DAEMON_RESTART: []}
    for key in changed:
        by[when(key)].append(key)
    return ReloadPlan(tuple(by[NOW]), tuple(by[NEXT_START]), tuple(by[DAEMON_RESTART]))


def config_keys() -> list[str]:
    """Every key path of a config (`section.key`), as `diff_keys` names them."""
    sections = typing.get_type_hints(Config)
    return [f"{s.name}.{f.name}" for s in dataclasses.fields(Config)
            if s.name not in ("source", "engines", "engine_name")
            for f in dataclasses.fields(sections[s.name])]
