"""`vllm-supervisor`: the daemon's entry point.

    vllm-supervisor run --config FILE     run in the foreground (under systemd, or by hand)
    vllm-supervisor check --config FILE   validate a config file and exit

A bad config exits with status 78 (EX_CONFIG) and one message naming each bad key,
before anything is started. What prints ends with status 141, quietly, when its reader
went away first (`check ... | head -0`, as coreutils' tools).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import structlog

from supervisor import __version__, loop
from supervisor.control.server import ControlSocketError
from supervisor.front.proxy import ProxyError
from supervisor.host import Host
from supervisor.ops import descriptors, pipes
from supervisor.ops.exporter import ExporterError
from supervisor.ops.logs import configure_logging
from supervisor.ops.sdnotify import Notifier
from supervisor.settings.config import EX_CONFIG, Config, ConfigError, load_config
from supervisor.settings.sections import EngineConfig
from supervisor.watchdog.gpu import FileSampler, GpuProcessLister, GpuSampler, NoGpu, NvmlSampler


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="vllm-supervisor",
                                description="Keep a vLLM engine healthy and serving.")
    p.add_argument("--version", action="version", version=f"vllm-supervisor {__version__}")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, text in (("run", "run the daemon in the foreground"),
                       ("check", "validate a config file and exit")):
        c = sub.add_parser(name, help=text)
        c.add_argument("--config", required=True, help="path to config.toml")
    return p


def _gpu(cfg: Config, engine: EngineConfig) -> tuple[GpuProcessLister, GpuSampler | None]:
    """What lists the processes on an engine's GPUs (take-down) and what samples them (the
    watchdog). No GPU is never an error: the daemon runs on, with GPU checks off and one
    line saying so."""
    log = structlog.get_logger("supervisor.gpu")
    mode = cfg.gpu.sampler
    if mode == "file":
        scripted = FileSampler(cfg.gpu.file, engine.gpus)
        log.info("GPU readings come from a file (scripted)", file=cfg.gpu.file,
                 gpus=engine.gpus)
        return scripted, scripted
    nvml = NvmlSampler(list(engine.gpus))
    problem = nvml.init()
    if problem is not None:
        if engine.gpus or mode == "nvml":
            log.warning("GPU checks are off", reason=problem, gpus=engine.gpus)
        else:
            log.warning("no GPU found; GPU checks and readings are off", reason=problem)
        return NoGpu(), None
    if not engine.gpus and len(nvml.indices) > 1:
        log.warning("engine.gpus is not set: the engine sees every GPU of this host; name "
                    "its GPUs to give it those alone",
                    engine=next((n for n, e in cfg.engines.items() if e is engine), None),
                    gpus_seen=nvml.indices)
    return nvml, (nvml if mode != "off" else None)


def runtime_paths_ok(cfg: Config) -> str | None:
    """Create the runtime directory; returns a problem instead of raising."""
    try:
        Path(cfg.daemon.runtime_dir).mkdir(parents=True, exist_ok=True)
        Path(cfg.control.socket).parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        return f"cannot create runtime directory: {exc}"
    return None


def main(argv: list[str] | None = None) -> int:
    to_run: list[Config] = []
    # what prints (--help, --version, `check`, a bad config) ends quietly, 141, when its
    # reader went away first (supervisor/ops/pipes.py); `run` keeps its own exit status,
    # which systemd acts on
    code = pipes.printing(lambda: _check(argv, to_run))
    return _run(to_run[0]) if to_run else code


def _check(argv: list[str] | None, to_run: list[Config]) -> int:
    """The command line read and the config checked; the config goes to `to_run` when
    the command is `run`."""
    ns = _parser().parse_args(argv)
    try:
        cfg = load_config(ns.config)
    except ConfigError as exc:
        print(f"vllm-supervisor: invalid config\n{exc}", file=sys.stderr)
        return EX_CONFIG
    if ns.command == "check":
        print(f"{cfg.source}: ok")
    else:
        to_run.append(cfg)
    return 0


def _run(cfg: Config) -> int:
    configure_logging(cfg.log.level, cfg.log.format)
    log = structlog.get_logger("supervisor")
    # Each client of the front proxy holds a descriptor: the soft limit (1024 by default)
    # is far below what the unit's LimitNOFILE allows as the hard one.
    soft_before, soft, hard = descriptors.raise_soft_limit()
    log.info("file descriptor limit", soft=soft, hard=hard, soft_before=soft_before,
             open=descriptors.open_count())
    problem = runtime_paths_ok(cfg)
    if problem is not None:
        log.error("cannot start", error=problem)
        return 1
    host = Host(config=cfg, notifier=Notifier(), gpu_for=lambda e: _gpu(cfg, e))
    try:
        return loop.run(host.run())
    except (ControlSocketError, ExporterError, ProxyError) as exc:
        log.error("cannot start", error=str(exc))
        return 1


if __name__ == "__main__":
    sys.exit(main())

