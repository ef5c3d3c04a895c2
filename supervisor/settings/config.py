"""Configuration: a TOML file, validated completely when loaded.

Owns the whole `Config` (its sections, one frozen dataclass each, in
`supervisor/settings/sections.py`) and loading it: the rules that check a parsed TOML
document against the sections (those across keys and sections in
`supervisor/settings/checks.py`). Loading never starts anything and never half-applies: it
returns a whole `Config` or raises `ConfigError` naming every bad key path and what was
expected. Relative paths are resolved against the directory of the config file, so the
demo's `config.toml` works from any working directory.
"""

from __future__ import annotations

import dataclasses
import itertools
import os
import re
import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from supervisor.front.routes import route_problem
from supervisor.ops.exporter import parse_listen
from supervisor.settings import checks, weight_cache_argv
from supervisor.settings.bays import WEIGHT_CACHE_BAY
from supervisor.settings.schema import ConfigError as ConfigError  # raised by load_config
from supervisor.settings.schema import build_section, spec
from supervisor.settings.sections import (
    AuditConfig,
    CanaryConfig,
    ControlConfig,
    DaemonConfig,
    EngineConfig,
    EvidenceConfig,
    ExporterConfig,
    FleetConfig,
    GpuConfig,
    LogConfig,
    MetricsConfig,
    PolicyConfig,
    ProxyConfig,
    RestartConfig,
    SignalsConfig,
    ThrottleConfig,
)

EX_CONFIG = 78  # sysexits.h: configuration error
DEFAULT_ENGINE = "default"  # the name of the one engine of an [engine] table
ENGINE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,31}")


def _default_runtime_dir() -> str:
    return os.environ.get("RUNTIME_DIRECTORY", "/run/vllm-supervisor").split(":")[0]


def _default_state_dir() -> str:
    return os.environ.get("STATE_DIRECTORY", "/var/lib/vllm-supervisor").split(":")[0]


@dataclasses.dataclass(frozen=True)
class Config:
    # the engine this config is viewed for: a unit's own (`for_engine`), else the first
    engine: EngineConfig
    restart: RestartConfig = spec(RestartConfig())
    metrics: MetricsConfig = spec(MetricsConfig())
    control: ControlConfig = spec(ControlConfig())
    audit: AuditConfig = spec(AuditConfig())
    log: LogConfig = spec(LogConfig())
    daemon: DaemonConfig = spec(DaemonConfig())
    canary: CanaryConfig = spec(CanaryConfig())
    gpu: GpuConfig = spec(GpuConfig())
    signals: SignalsConfig = spec(SignalsConfig())
    throttle: ThrottleConfig = spec(ThrottleConfig())
    policy: PolicyConfig = spec(PolicyConfig())
    exporter: ExporterConfig = spec(ExporterConfig())
    proxy: ProxyConfig = spec(ProxyConfig())
    evidence: EvidenceConfig = spec(EvidenceConfig())
    fleet: FleetConfig = spec(FleetConfig())
    source: str = ""  # the file this came from; not a TOML key
    # every engine by name, in config order: [engines.NAME] tables, or the one [engine]
    # named "default" (not TOML keys themselves)
    engines: dict[str, EngineConfig] = dataclasses.field(default_factory=dict)
    engine_name: str = DEFAULT_ENGINE  # whose `engine` this is

    def __post_init__(self) -> None:
        if not self.engines:  # built by hand (tests): the one engine
            object.__setattr__(self, "engines", {self.engine_name: self.engine})

    @property
    def several(self) -> bool:
        """More than one engine, or any named by [engines.NAME]: names appear in logs,
        keys and labels."""
        return list(self.engines) != [DEFAULT_ENGINE]

    def for_engine(self, name: str) -> Config:
        """This config as one engine's unit reads it: `engine` is that engine's."""
        return dataclasses.replace(self, engine=self.engines[name], engine_name=name)

    @property
    def state_file(self) -> Path:
        if self.engine_name == DEFAULT_ENGINE:
            return Path(self.daemon.runtime_dir) / "engine-tree.json"
        return Path(self.daemon.runtime_dir) / f"engine-tree-{self.engine_name}.json"

    @property
    def weight_cache_dir(self) -> str:
        """The folder of this engine's weight cache sockets (`engine.weight_cache`)."""
        return weight_cache_argv.socket_dir(self.daemon.runtime_dir, self.engine_name)

    def state_file_of(self, bay: int) -> Path:
        """The state file of the process tree in `bay` (settings/bays.py): bay 0
        today's file, another engine bay `engine-tree.bayN.json`, the weight cache's
        `engine-tree.weight-cache.json`."""
        if bay == WEIGHT_CACHE_BAY:
            return self.state_file.with_suffix(".weight-cache.json")
        return self.state_file if bay == 0 else self.state_file.with_suffix(f".bay{bay}.json")


_SECTIONS: dict[str, type[Any]] = {
    "engine": EngineConfig,
    "restart": RestartConfig,
    "metrics": MetricsConfig,
    "control": ControlConfig,
    "audit": AuditConfig,
    "log": LogConfig,
    "daemon": DaemonConfig,
    "canary": CanaryConfig,
    "gpu": GpuConfig,
    "signals": SignalsConfig,
    "throttle": ThrottleConfig,
    "policy": PolicyConfig,
    "exporter": ExporterConfig,
    "proxy": ProxyConfig,
    "evidence": EvidenceConfig,
    "fleet": FleetConfig,
}


def _resolve(base: Path, path: str) -> str:
    # normpath, not resolve(): following the symlink of a venv's bin/python would run the
    # base interpreter, outside the virtualenv.
    p = Path(path).expanduser()
    return os.path.normpath(p if p.is_absolute() else base / p)


def _within(path: str, folder: str) -> bool:
    """`path` is `folder` or inside it, links followed (/dev/shm is /run/shm on some)."""
    real, top = os.path.realpath(path), os.path.realpath(folder)
    return real == top or real.startswith(top.rstrip("/") + "/")


def _resolve_argv(base: Path, argv: list[str]) -> list[str]:
    """A command's program resolved against the config's folder when it is a path."""
    if not argv:
        return argv
    return [_resolve(base, argv[0]) if "/" in argv[0] else argv[0], *argv[1:]]


def _engine_tables(doc: Mapping[str, Any], problems: list[str]) -> dict[str, Any]:
    """The engines' raw tables by name: [engines.NAME], or the one [engine] as "default"."""
    if "engine" in doc and "engines" in doc:
        problems.append("engines: [engine] and [engines.NAME] cannot both be given (an "
                        "[engine] table is one engine named \"default\")")
        return {}
    if "engine" in doc:
        return {DEFAULT_ENGINE: doc["engine"]}
    if "engines" not in doc:
        problems.append("engine: required section [engine] is missing (or [engines.NAME] tables)")
        return {}
    tables = doc["engines"]
    if not isinstance(tables, dict) or not tables or not all(
            isinstance(t, dict) for t in tables.values()):
        problems.append(f"engines: expected one or more tables [engines.NAME], got {tables!r}")
        return {}
    for name in tables:
        if ENGINE_NAME.fullmatch(name) is None:
            problems.append(f"engines.{name}: expected a name of letters, digits, '_', '.' "
                            f"or '-' (at most 32, a letter or digit first)")
    return dict(tables)


def parse_config(doc: Mapping[str, Any], source: str = "<config>",
                 base_dir: Path | None = None) -> Config:
    """Validate a parsed TOML document and return a Config, with paths resolved."""
    base = base_dir or Path.cwd()
    problems: list[str] = []
    for key in doc:
        if key not in _SECTIONS and key != "engines":
            problems.append(f"{key}: unknown section (known sections: "
                            f"{', '.join(sorted([*_SECTIONS, 'engines']))})")
    tables = _engine_tables(doc, problems)
    key = "engine" if "engine" in doc else "engines"
    # each engine's table as an error names it
    where = {name: "engine" if key == "engine" else f"engines.{name}" for name in tables}
    engines: dict[str, EngineConfig] = {}
    for name, table in tables.items():
        engine = build_section(where[name], EngineConfig, table, problems)
        if engine is not None:
            engines[name] = engine
    sections: dict[str, Any] = {}
    for name, cls in _SECTIONS.items():
        if name == "engine":
            continue  # built above, with [engines.NAME]
        if name in doc:
            sections[name] = build_section(name, cls, doc[name], problems)
        else:
            sections[name] = cls()
    if problems:
        raise ConfigError(source, problems)

    for name, engine in engines.items():
        checks.check_engine(where[name], engine, problems)
    if key == "engine" and engines[DEFAULT_ENGINE].fallback:
        problems.append("engine.fallback: a fallback is another engine: name the engines "
                        "in [engines.NAME] tables")
    checks.check_engines(key, engines, problems)
    restart: RestartConfig = sections["restart"]
    if restart.backoff_max_s < restart.backoff_initial_s:
        problems.append(f"restart.backoff_max_s: expected at least restart.backoff_initial_s "
                        f"({restart.backoff_initial_s:g}), got {restart.backoff_max_s:g}")
    exporter: ExporterConfig = sections["exporter"]
    if exporter.enabled:
        try:
            parse_listen(exporter.listen)
        except ValueError as exc:
            problems.append(f"exporter.listen: {exc}")
    proxy: ProxyConfig = sections["proxy"]
    if proxy.enabled:
        try:
            parse_listen(proxy.listen)
        except ValueError as exc:
            problems.append(f"proxy.listen: {exc}")
        if proxy.kv_breaker_low >= proxy.kv_breaker_high:
            problems.append(f"proxy.kv_breaker_low: expected less than proxy.kv_breaker_high "
                            f"({proxy.kv_breaker_high:g}), got {proxy.kv_breaker_low:g}")
        if proxy.max_buffered_bytes < proxy.max_body_bytes:
            problems.append(f"proxy.max_buffered_bytes: expected at least proxy.max_body_bytes "
                            f"({proxy.max_body_bytes}), got {proxy.max_buffered_bytes}")
        for route in proxy.extra_routes:
            why = route_problem(route)
            if why is not None:
                problems.append(f"proxy.extra_routes: {route!r} is not a route: {why}")
    unknown = [r for r in sections["evidence"].rules if r not in sections["policy"].rules]
    if unknown:
        problems.append(f"evidence.rules: unknown rules {unknown!r} (the rules are "
                        f"{', '.join(sections['policy'].rules)})")
    gpu: GpuConfig = sections["gpu"]
    if gpu.sampler == "file" and not gpu.file:
        problems.append("gpu.file: required when gpu.sampler is \"file\"")
    factors = sections["throttle"].level_factors
    if not factors or any(not 0 < f < 1 for f in factors) or any(
            b >= a for a, b in itertools.pairwise(factors)):
        problems.append(f"throttle.level_factors: expected decreasing factors between 0 and 1 "
                        f"(one per level), got {factors!r}")
    checks.check_listeners(key, engines, proxy, exporter, problems)
    checks.check_deadlines(proxy.deadlines, engines, problems)
    checks.check_fleet(sections["fleet"], proxy, problems)
    runtime_dir = _resolve(base, sections["daemon"].runtime_dir or _default_runtime_dir())
    for name, e in engines.items():
        if e.weight_cache:
            weight_cache_argv.check_socket_dir(
                where[name], weight_cache_argv.socket_dir(runtime_dir, name), problems)
    if problems:
        raise ConfigError(source, problems)

    control: ControlConfig = sections["control"]
    audit: AuditConfig = sections["audit"]
    audit_path = _resolve(base, audit.path or str(Path(_default_state_dir()) / "events.jsonl"))
    resolved = {name: dataclasses.replace(
        e, command=_resolve_argv(base, e.command), cwd=_resolve(base, e.cwd or "."),
        weight_cache_command=_resolve_argv(base, e.weight_cache_command),
        snapshot_dir=_resolve(base, e.snapshot_dir or str(
            Path(audit_path).parent / "snapshots" / name)))
        for name, e in engines.items()}
    in_shm = [f"{where[name]}.snapshot_dir: "
              f"{e.snapshot_dir} is in /dev/shm, which each copy of the standby gets "
              f"afresh, hiding the images from their own restore: put them on another "
              f"tmpfs (or a disk)" for name, e in resolved.items()
              if e.standby == "snapshot" and _within(e.snapshot_dir, "/dev/shm")]
    if in_shm:
        raise ConfigError(source, in_shm)
    evidence: EvidenceConfig = sections["evidence"]
    return Config(
        engine=next(iter(resolved.values())),
        engines=resolved,
        engine_name=next(iter(resolved)),
        restart=restart,
        metrics=sections["metrics"],
        control=dataclasses.replace(
            control, socket=_resolve(base, control.socket or
                                     str(Path(runtime_dir) / "control.sock"))),
        audit=dataclasses.replace(audit, path=audit_path),
        log=sections["log"],
        daemon=DaemonConfig(runtime_dir=runtime_dir),
        canary=sections["canary"],
        gpu=dataclasses.replace(gpu, file=_resolve(base, gpu.file) if gpu.file else ""),
        signals=sections["signals"],
        throttle=sections["throttle"],
        policy=sections["policy"],
        exporter=exporter,
        proxy=proxy,
        evidence=dataclasses.replace(evidence, dir=_resolve(
            base, evidence.dir or str(Path(audit_path).parent / "evidence"))),
        fleet=sections["fleet"],
        source=source,
    )


def load_config(path: str | os.PathLike[str]) -> Config:
    """Read and validate a config file. Raises ConfigError; never returns half a config."""
    p = Path(path)
    try:
        raw = p.read_bytes()
    except OSError as exc:
        raise ConfigError(str(p), [f"cannot read: {exc.strerror or exc}"]) from exc
    try:
        doc = tomllib.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as exc:
        raise ConfigError(str(p), [f"not UTF-8 text: {exc}"]) from exc
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(str(p), [f"not valid TOML: {exc}"]) from exc
    return parse_config(doc, source=os.path.abspath(p), base_dir=Path(os.path.abspath(p)).parent)


def diff_keys(old: Config, new: Config) -> list[str]:
    """Key paths whose values differ between two configs, e.g. `engine.args` (the
    config's own `engine`: a unit's, seen through `for_engine`)."""
    changed = []
    for name in _SECTIONS:
        a, b = getattr(old, name), getattr(new, name)
        for f in dataclasses.fields(a):
            if getattr(a, f.name) != getattr(b, f.name):
                changed.append(f"{name}.{f.name}")
    return changed
