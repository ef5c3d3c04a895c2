"""Configuration: a TOML file, validated completely when loaded.

Owns the schema (frozen dataclasses, one per section) and the rules that check a parsed
TOML document against it. Loading never starts anything and never half-applies: it
returns a whole `Config` or raises `ConfigError` naming every bad key path and what was
expected. Relative paths are resolved against the directory of the config file, so the
demo's `config.toml` works from any working directory.
"""

from __future__ import annotations

import dataclasses
import itertools
import os
import tomllib
import typing
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from supervisor.conditions import parse_condition
from supervisor.exporter import parse_listen
from supervisor.routes import route_problem
from supervisor.rules import ACTIONS, DEFAULT_RULES, REMEDIES, RuleConfig
from supervisor.signals import SIGNAL_NAMES, WindowConfig

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
    # a drained restart: "finish" waits for the streams in flight (up to drain_timeout_s);
    # "continue" pauses the ones the proxy can continue and goes on with them on the new
    # engine, so long generations do not hold the restart (docs/proxy.md)
    drain: str = _field("finish", choices=("finish", "continue"))
    # after the drain, this long for the engine to exit before its group is SIGKILLed
    stop_grace_s: float = _field(10.0, lo=0.5, hi=600)
    # after SIGKILL, this long for the tree to vanish and the port to free up
    reap_timeout_s: float = _field(10.0, lo=0.5, hi=600)
    # GPU indices the engine uses (NVML); empty = all visible GPUs, when NVML is present
    gpus: list[int] = _field([])
    gpu_release_timeout_s: float = _field(60.0, lo=0, hi=600)
    # before a start: memory that processes this daemon did not start may hold on the
    # engine's GPUs (a display server, a monitoring agent); more refuses the start
    gpu_foreign_allowance_mib: int = _field(0, lo=0, hi=1 << 30)
    # vLLM's own (uvicorn) access log: off by default, since it echoes every scrape and
    # canary of this daemon, and the proxy writes a better line per client request
    access_log: bool = _field(False)

    @property
    def base_url(self) -> str:
        """Where the daemon reaches the engine: http://host:port (a wildcard listen
        address reached on loopback, IPv6 in brackets)."""
        host = {"0.0.0.0": "127.0.0.1", "": "127.0.0.1", "::": "::1"}.get(self.host, self.host)
        return f"http://[{host}]:{self.port}" if ":" in host else f"http://{host}:{self.port}"

    @property
    def models_open(self) -> bool:
        """LoRA on (`--enable-lora`): adapters are served under names of their own, added
        at run time too, so a model name the arguments do not list may still be served."""
        return any(a == "--enable-lora" or a.startswith("--enable-lora=")
                   for a in [*self.command, *self.args])

    def served_models(self) -> tuple[str, ...]:
        """The model names the engine serves, read from its arguments as vLLM reads them:
        `--served-model-name A [B ...]`, else `--model M`, else `serve M`; () when none."""
        argv = [*self.command, *self.args]
        for flag in ("--served-model-name", "--model"):
            names: list[str] = []
            for i, a in enumerate(argv):
                if a.startswith(flag + "="):
                    names = [a.split("=", 1)[1]]
                elif a == flag:
                    names = list(itertools.takewhile(lambda x: not x.startswith("-"),
                                                     argv[i + 1:]))
                    if flag == "--model":
                        names = names[:1]
            if names:
                return tuple(names)
        if "serve" in argv:
            rest = argv[argv.index("serve") + 1:]
            if rest and not rest[0].startswith("-"):
                return (rest[0],)
        return ()


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
class CanaryConfig:
    # a tiny generation with a deadline: the one probe a frozen engine cannot pass
    enabled: bool = _field(True)
    period_s: float = _field(10.0, lo=0.5, hi=3600)
    timeout_s: float = _field(5.0, lo=0.1, hi=600)
    max_tokens: int = _field(1, lo=1, hi=16)
    prompt: str = _field("Hello", nonempty=True)
    # the model name to ask for; empty: the first one the engine's /v1/models lists
    model: str = _field("")


@dataclasses.dataclass(frozen=True)
class GpuConfig:
    # auto: NVML when a GPU is there, else off; file: scripted readings from `file`
    sampler: str = _field("auto", choices=("auto", "nvml", "file", "off"))
    file: str = _field("")
    period_s: float = _field(5.0, lo=0.5, hi=600)
    # used only when NVML does not report the card's own slowdown temperature
    slowdown_fallback_c: float = _field(85.0, lo=30, hi=120)


@dataclasses.dataclass(frozen=True)
class SignalsConfig:
    rate_window_s: float = _field(60.0, lo=2, hi=3600)
    baseline_window_s: float = _field(3600.0, lo=60, hi=86400)
    rss_growth_window_s: float = _field(1800.0, lo=60, hi=86400)
    gpu_memory_growth_window_s: float = _field(1800.0, lo=60, hi=86400)
    min_prefix_queries: float = _field(2048.0, lo=1, hi=1e12)  # tokens
    min_spec_draft_tokens: float = _field(256.0, lo=1, hi=1e12)

    def window(self, gpu: GpuConfig) -> WindowConfig:
        return WindowConfig(self.rate_window_s, self.baseline_window_s,
                            self.rss_growth_window_s, self.gpu_memory_growth_window_s,
                            self.min_prefix_queries, self.min_spec_draft_tokens,
                            gpu.slowdown_fallback_c, gpu_stale_s=max(30.0, gpu.period_s * 3))


@dataclasses.dataclass(frozen=True)
class ThrottleConfig:
    # throttle level N relaunches the engine with its batch limits times factor N
    level_factors: list[float] = _field([0.75, 0.5, 0.25])
    # the engine's limits when engine.args does not set --max-num-seqs /
    # --max-num-batched-tokens (vLLM's own defaults vary by version and hardware)
    max_num_seqs: int = _field(256, lo=1, hi=1 << 20)
    max_num_batched_tokens: int = _field(8192, lo=16, hi=1 << 24)
    min_num_batched_tokens: int = _field(256, lo=16, hi=1 << 24)
    # the thermal rule's last step: batched tokens times this, on top of the level
    reduce_batch_factor: float = _field(0.5, lo=0.05, hi=0.95)


@dataclasses.dataclass(frozen=True)
class PolicyConfig:
    enabled: bool = _field(True)
    # decisions are logged and audited, never carried out
    dry_run: bool = _field(False)
    # restarts the policy may cause in any hour; past it: alert and stop acting
    max_restarts_per_hour: int = _field(4, lo=0, hi=1000)
    min_action_gap_s: float = _field(60.0, lo=0, hi=86400)
    # more_spec_tokens raises num_speculative_tokens up to this; 0: the engine's start value
    spec_tokens_max: int = _field(0, lo=0, hi=64)
    # the rungs of the remediation ladder the policy may use (rules.LADDER); a rule whose
    # rung is not listed, or not supported by the engine, takes the next one up
    remedies: list[str] = _field(list(REMEDIES), choices=REMEDIES)
    # [policy.rules.NAME] tables: merged key by key over the defaults (rules.py)
    rules: dict[str, RuleConfig] = dataclasses.field(
        default_factory=lambda: dict(DEFAULT_RULES), metadata={"table": True})


@dataclasses.dataclass(frozen=True)
class ProxyConfig:
    # the public port: the engine's whole serving API, with drain-and-hold and admission
    enabled: bool = _field(True)
    listen: str = _field("127.0.0.1:8000", nonempty=True)
    # live throttle: level N scales these by throttle.level_factors[N-1]
    max_concurrency: int = _field(256, lo=1, hi=1 << 20)
    max_tokens_in_flight: int = _field(0, lo=0, hi=1 << 40)  # 0: no token budget
    hold_queue_max: int = _field(1024, lo=0, hi=1 << 20)
    # a request waits at most this long for a drain, a restart or a slot, then gets 503
    hold_timeout_s: float = _field(300.0, lo=0.1, hi=3600)
    # the KV circuit breaker: no new requests from usage >= high until usage < low
    kv_breaker_high: float = _field(0.88, lo=0.01, hi=1.0)
    kv_breaker_low: float = _field(0.80, lo=0.0, hi=1.0)
    max_body_bytes: int = _field(16 << 20, lo=1024, hi=1 << 31)
    max_header_bytes: int = _field(16 << 10, lo=1024, hi=1 << 20)
    retry_after_s: int = _field(5, lo=1, hi=3600)
    # routes forwarded besides the serving API (exact paths, * for one segment; the
    # allow-list in routes.py)
    extra_routes: list[str] = _field([])
    # a stream the engine fails mid-answer goes on, token-exact, on the engine that comes
    # back (supervisor/continuation.py); false: it ends with an error event
    continue_streams: bool = _field(True)
    continue_timeout_s: float = _field(300.0, lo=1, hi=3600)  # waiting for an engine
    max_continuations: int = _field(3, lo=1, hi=100)  # faults one request survives
    keepalive_s: float = _field(10.0, lo=0.5, hi=300)  # SSE comments while it waits


@dataclasses.dataclass(frozen=True)
class EvidenceConfig:
    # a bounded snapshot (stacks, last engine lines, signals, GPU) before a fault's kill
    enabled: bool = _field(True)
    dir: str = _field("")  # default: "evidence" beside the audit trail
    keep: int = _field(20, lo=1, hi=10000)
    timeout_s: float = _field(5.0, lo=0.5, hi=60)  # the kill never waits longer
    log_lines: int = _field(200, lo=0, hi=100000)
    # the rules whose restart captures one (a failed in-place remedy always does)
    rules: list[str] = _field(["hang", "no_progress", "xid_restart", "xid_reset"])


@dataclasses.dataclass(frozen=True)
class ExporterConfig:
    # the daemon's own /metrics, /healthz and /readyz
    enabled: bool = _field(True)
    listen: str = _field("127.0.0.1:9402", nonempty=True)


@dataclasses.dataclass(frozen=True)
class Config:
    engine: EngineConfig
    restart: RestartConfig = _field(RestartConfig())
    metrics: MetricsConfig = _field(MetricsConfig())
    control: ControlConfig = _field(ControlConfig())
    audit: AuditConfig = _field(AuditConfig())
    log: LogConfig = _field(LogConfig())
    daemon: DaemonConfig = _field(DaemonConfig())
    canary: CanaryConfig = _field(CanaryConfig())
    gpu: GpuConfig = _field(GpuConfig())
    signals: SignalsConfig = _field(SignalsConfig())
    throttle: ThrottleConfig = _field(ThrottleConfig())
    policy: PolicyConfig = _field(PolicyConfig())
    exporter: ExporterConfig = _field(ExporterConfig())
    proxy: ProxyConfig = _field(ProxyConfig())
    evidence: EvidenceConfig = _field(EvidenceConfig())
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
    "canary": CanaryConfig,
    "gpu": GpuConfig,
    "signals": SignalsConfig,
    "throttle": ThrottleConfig,
    "policy": PolicyConfig,
    "exporter": ExporterConfig,
    "proxy": ProxyConfig,
    "evidence": EvidenceConfig,
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
        if meta["choices"] is not None and (bad := [v for v in value
                                                    if v not in meta["choices"]]):
            problems.append(f"{key}: expected a list of {', '.join(meta['choices'])}, "
                            f"got {bad[0]!r}")
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
    nested = [fname for fname, f in fields.items() if f.metadata.get("table")]
    for fname in nested:  # nested tables, built by their own rules
        del fields[fname]
        if fname in table:
            kwargs[fname] = _build_rules(f"{name}.{fname}", table[fname], problems)
    for key in table:
        if key not in fields and key not in nested:
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


_RULE_NUMBERS = ("for_s", "clear_for_s", "cooldown_s", "escalate_after_s")


def _build_rules(prefix: str, table: Any, problems: list[str]) -> dict[str, RuleConfig]:
    """[policy.rules.NAME] tables over the defaults: a default rule takes the keys given
    and keeps the others; a new rule needs `when` and `action`."""
    rules = dict(DEFAULT_RULES)
    if not isinstance(table, dict):
        problems.append(f"{prefix}: expected tables [{prefix}.NAME], got {table!r}")
        return rules
    known = [f.name for f in dataclasses.fields(RuleConfig)]
    for name, raw in table.items():
        key = f"{prefix}.{name}"
        if not isinstance(raw, dict):
            problems.append(f"{key}: expected a table, got {raw!r}")
            continue
        values: dict[str, Any] = {}
        base = DEFAULT_RULES.get(name)
        for k, v in raw.items():
            where = f"{key}.{k}"
            if k not in known:
                problems.append(f"{where}: unknown key (known keys: {', '.join(sorted(known))})")
            elif k == "enabled":
                if isinstance(v, bool):
                    values[k] = v
                else:
                    problems.append(f"{where}: expected true or false, got {v!r}")
            elif k in _RULE_NUMBERS:
                if isinstance(v, int | float) and not isinstance(v, bool) and 0 <= v <= 604800:
                    values[k] = float(v)
                else:
                    problems.append(f"{where}: expected a number of seconds from 0 to 604800, "
                                    f"got {v!r}")
            elif k == "for_fraction":
                if isinstance(v, int | float) and not isinstance(v, bool) and 0 < v <= 1:
                    values[k] = float(v)
                else:
                    problems.append(f"{where}: expected a share above 0 and at most 1, "
                                    f"got {v!r}")
            elif k in ("when", "clear_when"):
                if not isinstance(v, str) or (k == "when" and not v.strip()):
                    problems.append(f"{where}: expected a condition string, got {v!r}")
                elif v.strip():
                    try:
                        parse_condition(v, SIGNAL_NAMES)
                        values[k] = v
                    except ValueError as exc:
                        problems.append(f"{where}: {exc}")
                else:
                    values[k] = ""
            elif k in ("action", "escalate_action"):
                allowed = ACTIONS if k == "action" else ("", *ACTIONS)
                if v in allowed:
                    values[k] = v
                else:
                    problems.append(f"{where}: expected one of {', '.join(ACTIONS)}, got {v!r}")
        if base is None:
            for req in ("when", "action"):
                if req not in raw:
                    problems.append(f"{key}.{req}: required for a new rule (the default rules "
                                    f"are {', '.join(DEFAULT_RULES)})")
            if "when" not in values or "action" not in values:
                continue
            rule = RuleConfig(**values)
        else:
            rule = dataclasses.replace(base, **values)
        if rule.escalate_after_s and not rule.escalate_action:
            problems.append(f"{key}.escalate_action: required when escalate_after_s is set")
        rules[name] = rule
    return rules


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
    if problems:
        raise ConfigError(source, problems)

    command = list(engine.command)
    if "/" in command[0]:
        command[0] = _resolve(base, command[0])
    runtime_dir = _resolve(base, sections["daemon"].runtime_dir or _default_runtime_dir())
    control: ControlConfig = sections["control"]
    audit: AuditConfig = sections["audit"]
    audit_path = _resolve(base, audit.path or str(Path(_default_state_dir()) / "events.jsonl"))
    evidence: EvidenceConfig = sections["evidence"]
    return Config(
        engine=dataclasses.replace(engine, command=command,
                                   cwd=_resolve(base, engine.cwd or ".")),
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
