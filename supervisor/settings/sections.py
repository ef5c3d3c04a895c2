"""The configuration's sections: one frozen dataclass per TOML table (`[engine]` and
`[engines.NAME]`, `[restart]`, `[metrics]`, ... `[fleet]`), each key declared with its
default and its bounds (`supervisor/settings/schema.py`'s `spec`), and what each section derives
from its own keys (an engine's URL, the model names it serves, its standby's config).

`supervisor/settings/config.py` builds them from a TOML document into one `Config` and checks
them against each other (`supervisor/settings/checks.py`). Pure: nothing here reads a
file or the machine.
"""

from __future__ import annotations

import dataclasses
import itertools

from supervisor.front.deadlines import Deadline
from supervisor.front.deadlines import build as build_deadlines
from supervisor.ops.exporter import parse_listen
from supervisor.settings.schema import spec
from supervisor.watchdog.rules import DEFAULT_RULES, REMEDIES, RuleConfig
from supervisor.watchdog.signals import WindowConfig


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    # argv that starts vLLM's OpenAI server: [vllm, serve, MODEL] (the older module form,
    # [python, -m, vllm.entrypoints.openai.api_server, --model, MODEL], still works)
    command: list[str] = spec(nonempty=True)
    # extra engine arguments; --host, --port and --shutdown-timeout are added by the daemon
    args: list[str] = spec([])
    env: dict[str, str] = spec({})
    # pass the daemon's own environment (less systemd's NOTIFY_SOCKET, WATCHDOG_*, LISTEN_*)
    inherit_env: bool = spec(True)
    # a compile cache of its own under the state directory, one folder per vLLM version
    # (VLLM_CACHE_ROOT; engine/startup/compile_cache.py); false: vLLM's default (~/.cache/vllm)
    compile_cache: bool = spec(True)
    cwd: str = spec("")
    host: str = spec("127.0.0.1", nonempty=True)
    port: int = spec(8100, lo=1, hi=65535)
    health_path: str = spec("/health", nonempty=True)
    health_interval_s: float = spec(1.0, lo=0.05, hi=60)
    startup_timeout_s: float = spec(600.0, lo=1, hi=3600)
    # the engine's --shutdown-timeout: in-flight requests get this long to finish on SIGTERM
    drain_timeout_s: float = spec(30.0, lo=0, hi=3600)
    # the streams in flight at a drain (docs/proxy.md, "Faster drained restarts"):
    # "finish" waits for them, up to drain_timeout_s (at a restart they finish on the old
    # engine while an awake standby takes new requests: docs/standby.md; a KV reset under
    # a longer one is not attempted); "continue" pauses those the proxy can continue (the
    # engine returned their token ids) and goes on with them, token-exact, after the
    # restart or the KV reset; "auto": "continue" for a KV reset (the engine cannot sleep
    # under them, and waiting for them failed the reset whenever it was busy: issue 48),
    # "finish" for a restart (which goes on at drain_timeout_s whatever is in flight)
    drain: str = spec("auto", choices=("auto", "finish", "continue"))
    # after the drain, this long for the engine to exit before its group is SIGKILLed
    stop_grace_s: float = spec(10.0, lo=0.5, hi=600)
    # after SIGKILL, this long for the tree to vanish and the port to free up
    reap_timeout_s: float = spec(10.0, lo=0.5, hi=600)
    # GPU indices the engine uses (NVML); empty = all visible GPUs, when NVML is present
    gpus: list[int] = spec([])
    gpu_release_timeout_s: float = spec(60.0, lo=0, hi=600)
    # before a start: memory that processes this daemon did not start may hold on the
    # engine's GPUs (a display server, a monitoring agent); more refuses the start
    gpu_foreign_allowance_mib: int = spec(0, lo=0, hi=1 << 30)
    # vLLM's own (uvicorn) access log: off by default, since it echoes every scrape and
    # canary of this daemon, and the proxy writes a better line per client request
    access_log: bool = spec(False)
    # [engines.NAME] only: the engine that takes this one's requests while it does not
    # serve (starting, backing off, draining, FATAL, KV reset, breaker open)
    fallback: str = spec("")
    # the model names it serves; empty: read from its arguments (served_models)
    models: list[str] = spec([])
    # another engine may claim one of this engine's `gpus` (both must allow it)
    share_gpus: bool = spec(False)
    # a second engine of the same command and arguments on the same GPUs and its own
    # port takes over when this one fails or is restarted (docs/standby.md): "awake",
    # kept loaded and idle; "sleep", kept asleep through vLLM's sleep mode (GPUs only);
    # "snapshot", asleep, then kept as CRIU images and restored as a copy beside the
    # serving engine after every fault (docs/standby.md: the snapshot route); "none":
    # every fault costs a cold start
    standby: str = spec("none", choices=("none", "sleep", "awake", "snapshot"))
    # standby = "snapshot": the folder of the standby's images (~22 GiB for an 8B model
    # on a GPU; a tmpfs restores fastest, but not /dev/shm, which each copy gets afresh);
    # "": snapshots/<engine> beside the audit trail
    snapshot_dir: str = spec("")
    # standby = "snapshot": the CRIU that dumps and restores it (4.2 or later on a
    # kernel from 6.16)
    criu: str = spec("criu")
    # where a sleeping standby (standby = "sleep" or "snapshot") keeps its weights
    # between faults: "host", vLLM's level-1 sleep (a failover copies them back, ~0.5 s
    # for 8B, more beside a dying engine); "gpu", woken back onto the card ahead of a
    # fault once NVML's readings leave them room and 1 GiB more beside the serving engine
    # (vLLM 0.26+: its wake by tag), so a failover wakes only the KV cache. The card's
    # spare memory is then the standby's: docs/standby.md, "Its weights on the card"
    standby_weights: str = spec("host", choices=("host", "gpu"))
    # the standby's internal port; 0: this engine's port + 1
    standby_port: int = spec(0, lo=0, hi=65535)
    # flags that replace the engine's own in its standby (`--flag value` pairs): a
    # thinner standby, e.g. ["--gpu-memory-utilization", "0.28"] beside an engine at
    # 0.60. It serves alone after a fault while a full-size engine starts beside it, then
    # hands back and is the standby again (docs/standby.md: the asymmetric pair)
    standby_args: list[str] = spec([])
    # a daily window of the host's local time ("03:00-04:00") in which a standby with
    # no room beside the serving engine is re-armed by a drained restart (clients held
    # through the standby's start and the engine's); "": only `vllm-supervisorctl rearm`
    rearm_window: str = spec("")
    # a `vllm preload` process (vLLM >= 0.31, CUDA) keeps this engine's processed
    # weights on its GPUs, supervised beside it: started first, taken down last; an
    # engine start maps them (`--load-format ipc_cache`) while it answers healthy, and
    # loads from disk otherwise (docs/weight-cache.md)
    weight_cache: bool = spec(False)
    # the argv that runs vLLM's command line, to which `preload ...` is added; empty:
    # read from `command` ([.../vllm, serve, M] gives [.../vllm]; [python, -m,
    # vllm.entrypoints.openai.api_server] gives [python, -m, vllm.entrypoints.cli.main])
    weight_cache_command: list[str] = spec([])
    # more arguments for `vllm preload`, after the flags that shape the weights, which
    # are copied from the engine's (docs/weight-cache.md lists them)
    weight_cache_args: list[str] = spec([])
    # a KV tier that outlives the engine (vLLM >= 0.32 on CUDA): both engines of the pair
    # write every block they compute to files in this folder and read them back, so a
    # standby that takes over loads a continued stream's prompt instead of computing it
    # again (docs/standby.md, "The KV tier"). A folder of its own (on /dev/shm: host
    # memory), which the daemon empties at start and stop and keeps under
    # kv_tier_max_gib; "": off. The daemon adds the engine's --kv-transfer-config
    kv_tier: str = spec("")
    # the folder's bound, oldest blocks removed first (on tmpfs this is host memory: an
    # unbounded tier ran an H200 host out of memory in three minutes of 1.5k-token load)
    kv_tier_max_gib: float = spec(32.0, lo=0.25, hi=1 << 20)
    # each engine's CPU tier (pinned host memory), the way in and out of the files
    kv_tier_cpu_gib: float = spec(8.0, lo=0.25, hi=1 << 20)
    # tokens per block file: 256 loaded 2.8x faster than computing the blocks on the
    # H200, 16 (vLLM's default) 1.25x
    kv_tier_chunk_tokens: int = spec(256, lo=16, hi=1 << 16)

    @property
    def base_url(self) -> str:
        """Where the daemon reaches the engine: http://host:port (a wildcard listen
        address reached on loopback, IPv6 in brackets)."""
        host = {"0.0.0.0": "127.0.0.1", "": "127.0.0.1", "::": "::1"}.get(self.host, self.host)
        return f"http://[{host}]:{self.port}" if ":" in host else f"http://{host}:{self.port}"

    def in_bay(self, bay: int) -> EngineConfig:
        """The config of an engine started in engine bay `bay` (settings/bays.py): this
        one's, on that place's port: bay 0 `port`, bay 1 `standby_port` (0: `port` + 1),
        each further bay the port after. The engines take turns serving: each start
        uses the port of its place."""
        if bay == 0:
            return self
        return dataclasses.replace(self, port=(self.standby_port or self.port + 1) + bay - 1)

    @property
    def models_open(self) -> bool:
        """LoRA on (`--enable-lora`): adapters are served under names of their own, added
        at run time too, so a model name the arguments do not list may still be served."""
        return any(a == "--enable-lora" or a.startswith("--enable-lora=")
                   for a in [*self.command, *self.args])

    def served_models(self) -> tuple[str, ...]:
        """The model names the engine serves, read from its arguments as vLLM reads them:
        `--served-model-name A [B ...]`, else `--model M`, else `serve M`; () when none.
        The `models` key, when set, says it instead."""
        if self.models:
            return tuple(self.models)
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
    backoff_initial_s: float = spec(1.0, lo=0, hi=3600)
    backoff_max_s: float = spec(60.0, lo=0, hi=86400)
    backoff_multiplier: float = spec(2.0, lo=1, hi=10)
    # an engine that served this long resets the backoff to its initial delay
    stable_uptime_s: float = spec(300.0, lo=0, hi=86400)
    # this many boot failures (never became healthy) within the window: FATAL
    boot_failures_max: int = spec(3, lo=1, hi=1000)
    boot_failure_window_s: float = spec(900.0, lo=1, hi=86400 * 7)


@dataclasses.dataclass(frozen=True)
class MetricsConfig:
    # scrape the engine's Prometheus page while it runs (signals in status; the watchdog's input)
    enabled: bool = spec(True)
    path: str = spec("/metrics", nonempty=True)
    period_s: float = spec(2.0, lo=0.1, hi=3600)
    timeout_s: float = spec(2.0, lo=0.1, hi=60)


@dataclasses.dataclass(frozen=True)
class ControlConfig:
    socket: str = spec("")
    # members of this group may use the socket besides root and the daemon's own user
    group: str = spec("")


@dataclasses.dataclass(frozen=True)
class AuditConfig:
    path: str = spec("")
    max_bytes: int = spec(10 * 1024 * 1024, lo=4096, hi=1 << 40)
    backups: int = spec(3, lo=0, hi=100)


@dataclasses.dataclass(frozen=True)
class LogConfig:
    level: str = spec("info", choices=("debug", "info", "warning", "error"))
    # auto: console renderer on a TTY, JSON lines otherwise
    format: str = spec("auto", choices=("auto", "json", "console"))


@dataclasses.dataclass(frozen=True)
class DaemonConfig:
    # state file (pids of the engine tree) and default control socket live here
    runtime_dir: str = spec("")


@dataclasses.dataclass(frozen=True)
class CanaryConfig:
    # a tiny generation with a deadline: the one probe a frozen engine cannot pass
    enabled: bool = spec(True)
    period_s: float = spec(10.0, lo=0.5, hi=3600)
    timeout_s: float = spec(5.0, lo=0.1, hi=600)
    max_tokens: int = spec(1, lo=1, hi=16)
    prompt: str = spec("Hello", nonempty=True)
    # the model name to ask for; empty: the first one the engine's /v1/models lists
    model: str = spec("")
    # the golden check (docs/watchdog.md): every proof of an engine (after a start, a
    # wake, a swap) asks this greedy prompt with log-probabilities, on the completions
    # and the chat route, and must reproduce what the first proven start of the same
    # arguments answered: the same token ids, each log-probability within the tolerance
    golden: bool = spec(True)
    golden_prompt: str = spec("The capital of France is", nonempty=True)
    golden_tokens: int = spec(8, lo=1, hi=64)
    golden_tolerance: float = spec(0.1, lo=0.0, hi=10.0)
    # the warm-up (docs/watchdog.md): before its canary, an engine process's first proof
    # asks once every path clients take (log-probabilities, chat, streaming, sampling
    # parameters, stop strings, structured output, a long prefill), so that what vLLM
    # builds at first use (a compile, a JIT kernel, a grammar) is built before clients
    # come and before the progress rule judges it; all of them within warm_up_timeout_s,
    # else the start failed
    warm_up: bool = spec(True)
    warm_up_timeout_s: float = spec(300.0, lo=1, hi=3600)


@dataclasses.dataclass(frozen=True)
class GpuConfig:
    # auto: NVML when a GPU is there, else off; file: scripted readings from `file`
    sampler: str = spec("auto", choices=("auto", "nvml", "file", "off"))
    file: str = spec("")
    period_s: float = spec(5.0, lo=0.5, hi=600)
    # used only when NVML does not report the card's own slowdown temperature
    slowdown_fallback_c: float = spec(85.0, lo=30, hi=120)


@dataclasses.dataclass(frozen=True)
class SignalsConfig:
    rate_window_s: float = spec(60.0, lo=2, hi=3600)
    baseline_window_s: float = spec(3600.0, lo=60, hi=86400)
    rss_growth_window_s: float = spec(1800.0, lo=60, hi=86400)
    gpu_memory_growth_window_s: float = spec(1800.0, lo=60, hi=86400)
    min_prefix_queries: float = spec(2048.0, lo=1, hi=1e12)  # tokens
    min_spec_draft_tokens: float = spec(256.0, lo=1, hi=1e12)

    def window(self, gpu: GpuConfig) -> WindowConfig:
        return WindowConfig(self.rate_window_s, self.baseline_window_s,
                            self.rss_growth_window_s, self.gpu_memory_growth_window_s,
                            self.min_prefix_queries, self.min_spec_draft_tokens,
                            gpu.slowdown_fallback_c, gpu_stale_s=max(30.0, gpu.period_s * 3))


@dataclasses.dataclass(frozen=True)
class ThrottleConfig:
    # throttle level N relaunches the engine with its batch limits times factor N
    level_factors: list[float] = spec([0.75, 0.5, 0.25])
    # the engine's limits when engine.args does not set --max-num-seqs /
    # --max-num-batched-tokens (vLLM's own defaults vary by version and hardware)
    max_num_seqs: int = spec(256, lo=1, hi=1 << 20)
    max_num_batched_tokens: int = spec(8192, lo=16, hi=1 << 24)
    min_num_batched_tokens: int = spec(256, lo=16, hi=1 << 24)
    # the thermal rule's last step: batched tokens times this, on top of the level
    reduce_batch_factor: float = spec(0.5, lo=0.05, hi=0.95)


@dataclasses.dataclass(frozen=True)
class PolicyConfig:
    enabled: bool = spec(True)
    # decisions are logged and audited, never carried out
    dry_run: bool = spec(False)
    # restarts the policy may cause in any hour; past it: alert and stop acting
    max_restarts_per_hour: int = spec(4, lo=0, hi=1000)
    min_action_gap_s: float = spec(60.0, lo=0, hi=86400)
    # more_spec_tokens raises num_speculative_tokens up to this; 0: the engine's start value
    spec_tokens_max: int = spec(0, lo=0, hi=64)
    # the rungs of the remediation ladder the policy may use (rules.LADDER); a rule whose
    # rung is not listed, or not supported by the engine, takes the next one up
    remedies: list[str] = spec(list(REMEDIES), choices=REMEDIES)
    # [policy.rules.NAME] tables: merged key by key over the defaults (rules.py)
    rules: dict[str, RuleConfig] = dataclasses.field(
        default_factory=lambda: dict(DEFAULT_RULES), metadata={"table": True})


@dataclasses.dataclass(frozen=True)
class ProxyConfig:
    # the public port: the engine's whole serving API, with drain-and-hold and admission
    enabled: bool = spec(True)
    listen: str = spec("127.0.0.1:8000", nonempty=True)
    # live throttle: level N scales these by throttle.level_factors[N-1]
    max_concurrency: int = spec(256, lo=1, hi=1 << 20)
    max_tokens_in_flight: int = spec(0, lo=0, hi=1 << 40)  # 0: no token budget
    hold_queue_max: int = spec(1024, lo=0, hi=1 << 20)
    # a request waits at most this long for a drain, a restart or a slot, then gets 503
    hold_timeout_s: float = spec(300.0, lo=0.1, hi=3600)
    # the KV circuit breaker: no new requests from usage >= high until usage < low
    kv_breaker_high: float = spec(0.88, lo=0.01, hi=1.0)
    kv_breaker_low: float = spec(0.80, lo=0.0, hi=1.0)
    max_body_bytes: int = spec(16 << 20, lo=1024, hi=1 << 31)
    max_header_bytes: int = spec(16 << 10, lo=1024, hi=1 << 20)
    # the guard rails of a server that faces clients (docs/proxy.md, "Guard rails"):
    # open client connections at most (above it: 503 and close; also kept under the
    # descriptor limit, with room for the daemon's own work)
    max_connections: int = spec(4096, lo=1, hi=1 << 20)
    header_timeout_s: float = spec(60.0, lo=0.1, hi=3600)  # a request's head, whole
    body_timeout_s: float = spec(60.0, lo=0.1, hi=3600)  # between two reads of a body
    send_timeout_s: float = spec(60.0, lo=0.1, hi=3600)  # between two writes that moved
    idle_timeout_s: float = spec(75.0, lo=0.1, hi=3600)  # a kept-alive connection, idle
    # request bodies held in memory, all connections together (a body past it: 503)
    max_buffered_bytes: int = spec(256 << 20, lo=1 << 20, hi=1 << 40)
    retry_after_s: int = spec(5, lo=1, hi=3600)
    # routes forwarded besides the serving API (exact paths, * for one segment; the
    # allow-list in routes.py)
    extra_routes: list[str] = spec([])
    # a stream the engine fails mid-answer goes on, token-exact, on the engine that comes
    # back (supervisor/front/continuation.py); false: it ends with an error event
    continue_streams: bool = spec(True)
    continue_timeout_s: float = spec(300.0, lo=1, hi=3600)  # waiting for an engine
    max_continuations: int = spec(3, lo=1, hi=100)  # faults one request survives
    # deadlines (0: none). A continuable stream with no token for stall_timeout_s is the
    # engine's fault for that request: aborted there and continued (a fault counted
    # against max_continuations, never a death). A request past request_timeout_s from
    # its arrival ends: a stream with an error event `request_timeout` and no [DONE],
    # any other with 504
    stall_timeout_s: float = spec(0.0, lo=0.0, hi=3600)
    request_timeout_s: float = spec(0.0, lo=0.0, hi=86400)
    # [proxy.deadlines.NAME]: those two for one model (as clients name it) or one engine,
    # the model's first (supervisor/front/deadlines.py)
    deadlines: dict[str, Deadline] = dataclasses.field(
        default_factory=dict, metadata={"table": build_deadlines})
    keepalive_s: float = spec(10.0, lo=0.5, hi=300)  # blank keep-alive lines while it waits
    # processes carrying the client connections (docs/proxy.md, "A data plane over several
    # processes"); 0: one per four cores, at most 8 (1 on a small host). Each decision
    # stays the daemon's, so every limit and hold is the host's whatever worker a client
    # reached; raise it when the daemon's CPU nears a core under load
    workers: int = spec(0, lo=0, hi=64)


@dataclasses.dataclass(frozen=True)
class EvidenceConfig:
    # a bounded snapshot (stacks, last engine lines, signals, GPU) before a fault's kill
    enabled: bool = spec(True)
    dir: str = spec("")  # default: "evidence" beside the audit trail
    keep: int = spec(20, lo=1, hi=10000)
    timeout_s: float = spec(5.0, lo=0.5, hi=60)  # the kill never waits longer
    log_lines: int = spec(200, lo=0, hi=100000)
    # the rules whose restart captures one (a failed in-place remedy always does)
    rules: list[str] = spec(["hang", "no_progress", "xid_restart", "xid_reset"])


@dataclasses.dataclass(frozen=True)
class ExporterConfig:
    # the daemon's own /metrics, /healthz and /readyz
    enabled: bool = spec(True)
    listen: str = spec("127.0.0.1:9402", nonempty=True)


@dataclasses.dataclass(frozen=True)
class FleetConfig:
    # vllm-router base URLs (http://HOST:PORT) this daemon registers with (docs/fleet.md)
    routers: list[str] = spec([])
    # this daemon's proxy as the routers reach it; "": from proxy.listen (not a wildcard)
    advertise: str = spec("")
    # how often each router's worker list is read while registered (a restarted router
    # has forgotten its workers)
    check_interval_s: float = spec(10.0, lo=0.1, hi=3600)
    request_timeout_s: float = spec(5.0, lo=0.1, hi=600)  # each call to a router
    # after a failed call: exponential backoff with jitter, from the first to the most
    retry_initial_s: float = spec(0.5, lo=0.01, hi=600)
    retry_max_s: float = spec(30.0, lo=0.01, hi=3600)
    # stopping: the most the daemon waits to leave its routers before its engines stop
    leave_timeout_s: float = spec(3.0, lo=0.0, hi=60)

    def advertised(self, proxy_listen: str) -> str:
        """The URL the routers know this daemon by."""
        if self.advertise:
            return self.advertise
        host, port = parse_listen(proxy_listen)
        return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"
