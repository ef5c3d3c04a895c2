"""The configuration's rules across keys and sections (`supervisor/config.py` checks
each key on its own first): the engine arguments the daemon sets itself, an engine's
pinning and standby (`supervisor/engine_checks.py`), the engines against each other
(ports, fallbacks, GPUs), and the fleet against the proxy. Each rule appends a problem
naming the key path and what was expected; none raises.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Protocol

from supervisor import engine_checks
from supervisor.fleet.router import url_problem
from supervisor.ops.exporter import parse_listen

# What the rules read of the sections (`supervisor/config.py`'s dataclasses, which import
# this module: so by their shapes here, not by name).


class EngineConfig(engine_checks.CheckedEngine, Protocol):
    @property
    def port(self) -> int: ...
    @property
    def stop_grace_s(self) -> float: ...
    @property
    def drain_timeout_s(self) -> float: ...
    @property
    def fallback(self) -> str: ...
    @property
    def share_gpus(self) -> bool: ...
    @property
    def base_url(self) -> str: ...
    def second(self) -> EngineConfig: ...
    def served_models(self) -> tuple[str, ...]: ...


class FleetConfig(Protocol):
    @property
    def routers(self) -> list[str]: ...
    @property
    def advertise(self) -> str: ...
    @property
    def retry_initial_s(self) -> float: ...
    @property
    def retry_max_s(self) -> float: ...


class ProxyConfig(Protocol):
    @property
    def enabled(self) -> bool: ...
    @property
    def listen(self) -> str: ...


def check_engine(key: str, engine: EngineConfig, problems: list[str]) -> None:
    for flag in ("--host", "--port", "--shutdown-timeout"):
        if any(a == flag or a.startswith(flag + "=") for a in engine.args):
            problems.append(f"{key}.args: {flag} is set by the daemon; use the engine "
                            f"section's own key instead")
    if engine.stop_grace_s + engine.drain_timeout_s > 3600:
        problems.append(f"{key}.drain_timeout_s + {key}.stop_grace_s: expected at most "
                        "3600 s in all")
    engine_checks.check_pinning(key, engine, problems)
    engine_checks.check_standby(key, engine, problems)


def check_fleet(fleet: FleetConfig, proxy: ProxyConfig, problems: list[str]) -> None:
    """Routers to register with need the proxy, and an address they can reach it at."""
    for i, url in enumerate(fleet.routers):
        if (why := url_problem(url)) is not None:
            problems.append(f"fleet.routers[{i}]: {url!r}: {why}")
    if len(set(fleet.routers)) != len(fleet.routers):
        problems.append("fleet.routers: a router is named twice")
    if fleet.advertise and (why := url_problem(fleet.advertise)) is not None:
        problems.append(f"fleet.advertise: {fleet.advertise!r}: {why}")
    if fleet.retry_max_s < fleet.retry_initial_s:
        problems.append(f"fleet.retry_max_s: expected at least fleet.retry_initial_s "
                        f"({fleet.retry_initial_s:g}), got {fleet.retry_max_s:g}")
    if not fleet.routers:
        return
    if not proxy.enabled:
        problems.append("fleet.routers: routers send requests to the proxy, and "
                        "proxy.enabled is false")
    elif not fleet.advertise:
        try:
            host, _ = parse_listen(proxy.listen)
        except ValueError:
            return  # (proxy.listen's own problem is reported)
        if host in ("", "0.0.0.0", "::"):
            problems.append(f"fleet.advertise: required when proxy.listen ({proxy.listen}) "
                            "is a wildcard: the URL routers reach this daemon at, e.g. "
                            "http://10.0.0.12:8000")


def check_engines(key: str, engines: Mapping[str, EngineConfig],
                  problems: list[str]) -> None:
    """The rules across engines: distinct ports, known fallbacks without cycles, GPUs
    claimed once unless both engines share them."""
    by_port: dict[tuple[str, int], str] = {}
    for name, e in engines.items():
        places = [(e.port, "port")] + ([(e.second().port, "standby_port")]
                                       if e.standby != "none" else [])
        for port, what in places:
            other = by_port.setdefault((e.base_url.rsplit(":", 1)[0], port), name)
            if other != name:
                problems.append(f"{key}.{name}.{what}: {port} is engine {other}'s port too")
        if e.standby != "none" and e.second().port == e.port:
            problems.append(f"{key}.{name}.standby_port: {e.port} is the engine's own port")
    for name, e in engines.items():
        if not e.fallback:
            continue
        if e.fallback not in engines:
            problems.append(f"{key}.{name}.fallback: no engine named {e.fallback!r} (the "
                            f"engines are {', '.join(engines)})")
        elif not engines[e.fallback].served_models():
            problems.append(f"{key}.{name}.fallback: engine {e.fallback} serves no model "
                            f"name the daemon can read from its arguments; set "
                            f"{key}.{e.fallback}.models")
    for name in engines:  # a cycle: following fallbacks comes back to the start
        seen = [name]
        nxt = engines[name].fallback
        while nxt in engines and nxt not in seen:
            seen.append(nxt)
            nxt = engines[nxt].fallback
        if nxt == name:
            problems.append(f"{key}.{name}.fallback: a cycle ({' -> '.join([*seen, name])}); "
                            "a fallback must serve while its engine does not")
    names = list(engines)
    for i, a in enumerate(names):
        for b in names[i + 1:]:
            shared = sorted(set(engines[a].gpus) & set(engines[b].gpus))
            if shared and not (engines[a].share_gpus and engines[b].share_gpus):
                problems.append(f"{key}.{b}.gpus: GPU {shared[0]} is engine {a}'s too; set "
                                f"share_gpus = true on both to allow it")
