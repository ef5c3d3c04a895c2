"""Configuration: a TOML file, validated completely when loaded.

Owns the schema (frozen dataclasses, one per section) and the rules that check a parsed
TOML document against it. Loading never starts anything and never half-applies: it
returns a whole `Config` or raises `ConfigError` naming every bad key path and what was
expected. Relative paths are resolved against the directory of the config file, so the
demo's `config.toml` works from any working directory.
"""

from __future__ import annotations

import dataclasses
import os
import tomllib
import typing
from collections.abc import Mapping
from pathlib import Path
from typing import Any

EX_CONFIG = 78  # sysexits.h: configuration error


class ConfigError(Exception):
    """One or more problems in a config file; str() is the operator-facing message."""

    def __init__(self, source: str, problems: list[str]) -> None:
        self.source = source
        self.problems = problems
        super().__init__("\n".join(f"{source}: {p}" for p in problems))


def _field(default: Any = dataclasses.MISSING, *, lo: float | None = None,
           hi: float | None = None, choices: tuple[str, ...] | None = None,
           nonempty: bool = False) -> Any:
    meta = {"lo": lo, "hi": hi, "choices": choices, "nonempty": nonempty}
    if isinstance(default, list | dict):
        value = default
        return dataclasses.field(default_factory=lambda: type(value)(value), metadata=meta)
    return dataclasses.field(default=default, metadata=meta)


def _default_runtime_dir() -> str:
    return os.environ.get("RUNTIME_DIRECTORY", "/run/vllm-supervisor").split(":")[0]


def _default_state_dir() -> str:
    return os.environ.get("STATE_DIRECTORY", "/var/lib/vllm-supervisor").split(":")[0]


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    # argv that starts vLLM's OpenAI server, e.g. [python, -m, vllm.entrypoints.openai.api_server]
    command: list[str] = _field(nonempty=True)
    # extra engine arguments; --host, --port and --shutdown-timeout are added by the daemon
    args: list[str] = _field([])
    env: dict[str, str] = _field({})
    # pass the daemon's own environment (less systemd's NOTIFY_SOCKET, WATCHDOG_*, LISTEN_*)
    inherit_env: bool = _field(True)
    cwd: str = _field("")
    host: str = _field("127.0.0.1", nonempty=True)
    port: int = _field(8100, lo=1, hi=65535)
    health_path: str = _field("/health", nonempty=True)
    health_interval_s: float = _field(1.0, lo=0.05, hi=60)
    startup_timeout_s: float = _field(600.0, lo=1, hi=3600)
    # the engine's --shutdown-timeout: in-flight requests get this long to finish on SIGTERM
    drain_timeout_s: float = _field(30.0, lo=0, hi=3600)
    # after the drain, this long for the engine to exit before its group is SIGKILLed
    stop_grace_s: float = _field(10.0, lo=0.5, hi=600)
    # after SIGKILL, this long for the tree to vanish and the port to free up
    reap_timeout_s: float = _field(10.0, lo=0.5, hi=600)
    # GPU indices the engine uses (NVML); empty = all visible GPUs, when NVML is present
    gpus: list[int] = _field([])
    gpu_release_timeout_s: float = _field(60.0, lo=0, hi=600)


@dataclasses.dataclass(frozen=True)
class RestartConfig:
    backoff_initial_s: float = _field(1.0, lo=0, hi=3600)
    backoff_max_s: float = _field(60.0, lo=0, hi=86400)
    backoff_multiplier: float = _field(2.0, lo=1, hi=10)
    # an engine that served this long resets the backoff to its initial delay
    stable_uptime_s: float = _field(300.0, lo=0, hi=86400)
    # this many boot failures (never became healthy) within the window: FATAL
    boot_failures_max: int = _field(3, lo=1, hi=1000)
    boot_failure_window_s: float = _field(900.0, lo=1, hi=86400 * 7)


@dataclasses.dataclass(frozen=True)
class MetricsConfig:
    # scrape the engine's Prometheus page while it runs (signals in status; the watchdog's input)
    enabled: bool = _field(True)
    path: str = _field("/metrics", nonempty=True)
    period_s: float = _field(2.0, lo=0.1, hi=3600)
    timeout_s: float = _field(2.0, lo=0.1, hi=60)


@dataclasses.dataclass(frozen=True)
class ControlConfig:
    socket: str = _field("")
    # members of this group may use the socket besides root and the daemon's own user
    group: str = _field("")


@dataclasses.dataclass(frozen=True)
class AuditConfig:
    path: str = _field("")
    max_bytes: int = _field(10 * 1024 * 1024, lo=4096, hi=1 << 40)
    backups: int = _field(3, lo=0, hi=100)


@dataclasses.dataclass(frozen=True)
class LogConfig:
    level: str = _field("info", choices=("debug", "info", "warning", "error"))
    # auto: console renderer on a TTY, JSON lines otherwise
    format: str = _field("auto", choices=("auto", "json", "console"))


@dataclasses.dataclass(frozen=True)
class DaemonConfig:
    # state file (pids of the engine tree) and default control socket live here
    runtime_dir: str = _field("")


@dataclasses.dataclass(frozen=True)
class Config:
    engine: EngineConfig
    restart: RestartConfig = _field(RestartConfig())
    metrics: MetricsConfig = _field(MetricsConfig())
    control: ControlConfig = _field(ControlConfig())
    audit: AuditConfig = _field(AuditConfig())
    log: LogConfig = _field(LogConfig())
    daemon: DaemonConfig = _field(DaemonConfig())
    source: str = ""  # the file this came from; not a TOML key

    @property
    def state_file(self) -> Path:
        return Path(self.daemon.runtime_dir) / "engine-tree.json"


_SECTIONS: dict[str, type[Any]] = {
    "engine": EngineConfig,
    "restart": RestartConfig,
    "metrics": MetricsConfig,
    "control": ControlConfig,
    "audit": AuditConfig,
    "log": LogConfig,
    "daemon": DaemonConfig,
}


def _type_name(tp: Any) -> str:
    names = {str: "a string", int: "an integer", float: "a number", bool: "true or false"}
    if tp in names:
        return names[tp]
    origin = typing.get_origin(tp)
    if origin is list:
        (inner,) = typing.get_args(tp)
        return f"a list of {_type_name(inner).split(' ', 1)[1]}s"
    if origin is dict:
        return "a table of strings"
    return str(tp)


def _check_scalar(tp: Any, value: Any) -> bool:
    if tp is bool:
        return isinstance(value, bool)
    if tp is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if tp is float:
        return isinstance(value, int | float) and not isinstance(value, bool)
    if tp is str:
        return isinstance(value, str)
    return False


def _check_value(key: str, tp: Any, meta: Mapping[str, Any], value: Any,
                 problems: list[str]) -> Any:
    origin = typing.get_origin(tp)
    expected = _type_name(tp)
    if origin is list:
        (inner,) = typing.get_args(tp)
        if not isinstance(value, list) or not all(_check_scalar(inner, v) for v in value):
            problems.append(f"{key}: expected {expected}, got {value!r}")
            return None
        if meta["nonempty"] and not value:
            problems.append(f"{key}: expected a non-empty list")
            return None
        return [float(v) if inner is float else v for v in value]
    if origin is dict:
        if not isinstance(value, dict) or not all(
                isinstance(k, str) and isinstance(v, str) for k, v in value.items()):
            problems.append(f"{key}: expected {expected} (name = \"value\"), got {value!r}")
            return None
        return dict(value)
    if not _check_scalar(tp, value):
        problems.append(f"{key}: expected {expected}, got {value!r}")
        return None
    if tp is float:
        value = float(value)
    lo, hi, choices = meta["lo"], meta["hi"], meta["choices"]
    if lo is not None and hi is not None and not lo <= value <= hi:
        problems.append(f"{key}: expected a value from {lo:g} to {hi:g}, got {value!r}")
        return None
    if choices is not None and value not in choices:
        problems.append(f"{key}: expected one of {', '.join(choices)}, got {value!r}")
        return None
    if meta["nonempty"] and value == "":
        problems.append(f"{key}: expected a non-empty string")
        return None
    return value


def _build_section(name: str, cls: type[Any], table: Any, problems: list[str]) -> Any:
    if not isinstance(table, dict):
        problems.append(f"{name}: expected a table [{name}], got {table!r}")
        return None
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    kwargs: dict[str, Any] = {}
    for key in table:
        if key not in fields:
            known = ", ".join(sorted(fields))
            problems.append(f"{name}.{key}: unknown key (known keys: {known})")
    before = len(problems)
    for fname, f in fields.items():
        if fname in table:
            value = _check_value(f"{name}.{fname}", hints[fname], f.metadata, table[fname],
                                 problems)
            kwargs[fname] = value
        elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            problems.append(f"{name}.{fname}: required key is missing")
    if len(problems) > before:
        return None
    return cls(**kwargs)


def _resolve(base: Path, path: str) -> str:
    # normpath, not resolve(): following the symlink of a venv's bin/python would run the
    # base interpreter, outside the virtualenv.
    p = Path(path).expanduser()
    return os.path.normpath(p if p.is_absolute() else base / p)


def parse_config(doc: Mapping[str, Any], source: str = "<config>",
                 base_dir: Path | None = None) -> Config:
    """Validate a parsed TOML document and return a Config, with paths resolved."""
    base = base_dir or Path.cwd()
    problems: list[str] = []
    for key in doc:
        if key not in _SECTIONS:
            problems.append(f"{key}: unknown section (known sections: "
                            f"{', '.join(sorted(_SECTIONS))})")
    if "engine" not in doc:
        problems.append("engine: required section [engine] is missing")
    sections: dict[str, Any] = {}
    for name, cls in _SECTIONS.items():
        if name in doc:
            sections[name] = _build_section(name, cls, doc[name], problems)
        elif name != "engine":
            sections[name] = cls()
    if problems:
        raise ConfigError(source, problems)

    engine: EngineConfig = sections["engine"]
    for flag in ("--host", "--port", "--shutdown-timeout"):
        if any(a == flag or a.startswith(flag + "=") for a in engine.args):
            problems.append(f"engine.args: {flag} is set by the daemon; use the engine "
                            f"section's own key instead")
    if engine.stop_grace_s + engine.drain_timeout_s > 3600:
        problems.append("engine.drain_timeout_s + engine.stop_grace_s: expected at most "
                        "3600 s in all")
    restart: RestartConfig = sections["restart"]
    if restart.backoff_max_s < restart.backoff_initial_s:
        problems.append(f"restart.backoff_max_s: expected at least restart.backoff_initial_s "
                        f"({restart.backoff_initial_s:g}), got {restart.backoff_max_s:g}")
    if problems:
        raise ConfigError(source, problems)

    command = list(engine.command)
    if "/" in command[0]:
        command[0] = _resolve(base, command[0])
    runtime_dir = _resolve(base, sections["daemon"].runtime_dir or _default_runtime_dir())
    control: ControlConfig = sections["control"]
    audit: AuditConfig = sections["audit"]
    return Config(
        engine=dataclasses.replace(engine, command=command,
                                   cwd=_resolve(base, engine.cwd or ".")),
        restart=restart,
        metrics=sections["metrics"],
        control=dataclasses.replace(
            control, socket=_resolve(base, control.socket or
                                     str(Path(runtime_dir) / "control.sock"))),
        audit=dataclasses.replace(
            audit, path=_resolve(base, audit.path or
                                 str(Path(_default_state_dir()) / "events.jsonl"))),
        log=sections["log"],
        daemon=DaemonConfig(runtime_dir=runtime_dir),
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
    """Key paths whose values differ between two configs, e.g. `engine.args`."""
    changed = []
    for name in _SECTIONS:
        a, b = getattr(old, name), getattr(new, name)
        for f in dataclasses.fields(a):
            if getattr(a, f.name) != getattr(b, f.name):
                changed.append(f"{name}.{f.name}")
    return changed
