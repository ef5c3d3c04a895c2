"""The configuration's rules across keys and sections (`supervisor/settings/config.py` checks
each key on its own first): the engine arguments the daemon sets itself, an engine's
pinning and standby (`supervisor/settings/engine_checks.py`), the engines against each other
(fallbacks, GPUs), the daemon's own listeners against each other (the proxy, the
exporter, each engine and its standby), and the fleet against the proxy. Each rule
appends a problem naming the key path and what was expected; none raises, and none
reads the machine or resolves a name.
"""

from __future__ import annotations

import ipaddress
import os
from collections.abc import Mapping
from typing import NamedTuple

from supervisor.fleet.router import url_problem
from supervisor.ops.exporter import parse_listen
from supervisor.settings import engine_checks, weight_cache_argv
from supervisor.settings.sections import EngineConfig, ExporterConfig, FleetConfig, ProxyConfig
from supervisor.watchdog.relaunch import arg_value

ListenerConfig = ProxyConfig | ExporterConfig  # a socket of the daemon's own, when enabled


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
    weight_cache_argv.check(key, engine, problems)
    check_kv_tier(key, engine, problems)
    if engine.rearm_window:
        try:
            engine_checks.DailyWindow.parse(engine.rearm_window)
        except ValueError as exc:
            problems.append(f"{key}.rearm_window: {exc} (a daily window of the host's "
                            f'local time, e.g. "03:00-04:00")')
        if engine.standby == "none":
            problems.append(f'{key}.rearm_window: needs a standby ({key}.standby is "none")')
    if engine.standby_weights == "gpu" and engine.standby not in ("sleep", "snapshot"):
        problems.append(f'{key}.standby_weights: "gpu" keeps a sleeping standby\'s weights '
                        f'on the card; {key}.standby is "{engine.standby}" (needs "sleep" '
                        'or "snapshot")')
    elif engine.standby_weights == "gpu" and engine.standby_args:
        problems.append(f'{key}.standby_weights: "gpu" is not for an asymmetric pair '
                        f'({key}.standby_args): its thin standby fits beside the engine '
                        'awake, and its wake does not wait for the old engine\'s memory')


# folders that other programs use: never a KV tier's (the daemon empties it)
_SHARED_FOLDERS = frozenset({"/", "/dev", "/dev/shm", "/tmp", "/var/tmp", "/run", "/var",
                             "/home", "/root", "/usr", "/etc", "/opt", "/srv", "/mnt"})
# the flags that set vLLM's KV offloading, which `kv_tier` sets in their place
_KV_TIER_FLAGS = ("--kv-transfer-config", "--kv-offloading-size", "--kv-offloading-backend")


def check_kv_tier(key: str, engine: EngineConfig, problems: list[str]) -> None:
    """A KV tier's folder is one of its own, set in one place, in whole GPU blocks."""
    if not engine.kv_tier:
        return
    folder = os.path.normpath(engine.kv_tier)
    if not engine.kv_tier.startswith("/"):
        problems.append(f"{key}.kv_tier: expected an absolute path, got {engine.kv_tier!r}")
    elif folder in _SHARED_FOLDERS:
        problems.append(f"{key}.kv_tier: {engine.kv_tier!r} is a folder other programs use, "
                        "and the daemon empties its KV tier's folder; name one of its own, "
                        'e.g. "/dev/shm/vllm-supervisor/kv-tier"')
    for where, args in (("args", engine.args), ("standby_args", engine.standby_args)):
        for flag in _KV_TIER_FLAGS:
            if weight_cache_argv.has_flag(args, flag):  # (either spelling, `=` or not)
                problems.append(f"{key}.{where}: {flag} sets vLLM's KV offloading, which "
                                f"{key}.kv_tier sets too; keep one of them")
    # vLLM offloads whole GPU blocks: a chunk that is not a multiple of one is refused
    # at the engine's start (vLLM's default block: 16 tokens)
    block = arg_value(engine.args, "--block-size") or "16"
    if block.isdigit() and int(block) and engine.kv_tier_chunk_tokens % int(block):
        problems.append(f"{key}.kv_tier_chunk_tokens: {engine.kv_tier_chunk_tokens} is not a "
                        f"multiple of the engine's KV block ({block} tokens)")


def check_fleet(fleet: FleetConfig, proxy: ListenerConfig, problems: list[str]) -> None:
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
    """The rules across engines: known fallbacks without cycles, GPUs claimed once
    unless both engines share them. (Their ports: `check_listeners`.)"""
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
            ta, tb = (os.path.normpath(engines[n].kv_tier) if engines[n].kv_tier else ""
                      for n in (a, b))
            if ta and tb and (ta == tb or ta.startswith(tb.rstrip("/") + "/")
                              or tb.startswith(ta.rstrip("/") + "/")):
                problems.append(f"{key}.{b}.kv_tier: {engines[b].kv_tier!r} is, holds or is "
                                f"inside engine {a}'s KV tier ({engines[a].kv_tier!r}); each "
                                "engine needs a folder of its own (the daemon empties it)")
            shared = sorted(set(engines[a].gpus) & set(engines[b].gpus))
            if shared and not (engines[a].share_gpus and engines[b].share_gpus):
                problems.append(f"{key}.{b}.gpus: GPU {shared[0]} is engine {a}'s too; set "
                                f"share_gpus = true on both to allow it")


# ---- the daemon's own listeners ----------------------------------------------------------

_WILDCARDS = frozenset({"", "0.0.0.0", "::"})


class _Listener(NamedTuple):
    key: str  # the key that moves it
    host: str
    port: int
    how: str = ""  # how the port was chosen, when no key says it


def _host(host: str) -> str:
    """A listen host as compared: lower case, no brackets, an IP address in its short
    form (`0:0:0:0:0:0:0:1` is `::1`)."""
    h = host.strip("[]").lower()
    try:
        return str(ipaddress.ip_address(h))
    except ValueError:
        return h


def hosts_overlap(a: str, b: str) -> bool:
    """Two listen hosts one port cannot be bound on twice: the same host; a wildcard
    (`0.0.0.0`, `::`, `""`) beside any host (the families are not told apart: `::` takes
    IPv4 too on a dual-stack socket, and no config needs one port on both
    families for two of the daemon's listeners); `localhost` beside `127.0.0.1` or `::1`.
    Other names are compared as written: a load resolves no names."""
    a, b = _host(a), _host(b)
    if a == b or a in _WILDCARDS or b in _WILDCARDS:
        return True
    return "localhost" in (a, b) and {a, b} - {"localhost"} <= {"127.0.0.1", "::1"}


def _address(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def check_deadlines(named: Mapping[str, object], engines: Mapping[str, EngineConfig],
                    problems: list[str]) -> None:
    """Each `[proxy.deadlines.NAME]` names an engine or a model one of them serves (any
    name may be a model where an engine's names are open: LoRA, or none listed)."""
    models = {m for e in engines.values() for m in e.served_models()}
    if any(e.models_open or not e.served_models() for e in engines.values()):
        return
    for name in named:
        if name not in engines and name not in models:
            problems.append(f"proxy.deadlines.{name}: no engine or model of that name "
                            f"(engines: {', '.join(engines)}; models: "
                            f"{', '.join(sorted(models))})")


def check_listeners(key: str, engines: Mapping[str, EngineConfig], proxy: ListenerConfig,
                    exporter: ListenerConfig, problems: list[str]) -> None:
    """Every socket the daemon binds, or has an engine bind, on an address of its own:
    the proxy, the exporter, each engine's port and its standby's. The second of two on
    one address cannot bind, and a standby that cannot retries for ever, its status
    naming the daemon's own pid as the port's holder. A listener on port 0 takes a free
    port and clashes with none; the control socket is a path, not an address."""
    mine: list[_Listener] = []
    for section, listener in (("proxy", proxy), ("exporter", exporter)):
        if not listener.enabled:
            continue
        try:
            host, port = parse_listen(listener.listen)
        except ValueError:
            continue  # (its own problem is reported)
        if port:
            mine.append(_Listener(f"{section}.listen", host, port))
    for name, e in engines.items():
        where = "engine" if key == "engine" else f"{key}.{name}"
        mine.append(_Listener(f"{where}.port", e.host, e.port))
        if e.standby == "none":
            continue
        how = "" if e.standby_port else f"{where}.port + 1, as standby_port is 0"
        if e.in_bay(1).port > 65535:
            problems.append(f"{where}.standby_port: required when {where}.port is 65535 "
                            f"(the standby's port is {where}.port + 1 by default)")
            continue
        mine.append(_Listener(f"{where}.standby_port", e.host, e.in_bay(1).port, how))
    # (the later one is named first: an engine's port before the proxy's or the
    # exporter's, a standby's before its engine's)
    for i, this in enumerate(mine):
        for other in mine[:i]:
            if this.port == other.port and hosts_overlap(this.host, other.host):
                problems.append(
                    f"{this.key}: {_address(this.host, this.port)}"
                    f"{f' ({this.how})' if this.how else ''} is also {other.key} "
                    f"({_address(other.host, other.port)}"
                    f"{f', {other.how}' if other.how else ''}); each of the daemon's "
                    f"listeners needs an address of its own")
                break
