"""The folders the daemon gives an engine at each start, under its state directory beside
the audit trail: its compile cache (`vllm-cache/<engine>/<version>`, compile_cache.py:
vLLM's, torch inductor's and Triton's)
and, from vLLM 0.33, the folder of vLLM's own stack dumps (`stack-dumps/<engine>/<start>`,
watchdog/stackdumps.py), with the `--watchdog-config` that points vLLM at it. Both follow
the vLLM version the engine's command runs, asked once a start.

Called by the spawn job before the checks and the spawn; nothing here fails or holds up
a start: a folder that cannot be made, or a version that cannot be told, leaves the
engine as vLLM starts it by default, said in the log.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Callable, Collection
from pathlib import Path

import structlog

from supervisor.engine.process.process import SpawnSpec
from supervisor.engine.startup import compile_cache
from supervisor.engine.startup.compile_cache import CACHE_ENV, CacheInfo
from supervisor.settings.config import Config
from supervisor.settings.sections import EngineConfig
from supervisor.watchdog import stackdumps
from supervisor.watchdog.stackdumps import StackDumps

log = structlog.get_logger("supervisor")


@dataclasses.dataclass(frozen=True)
class StartDirs:
    spec: SpawnSpec  # what is spawned: the asked spec with the daemon's additions
    cache: CacheInfo | None
    dumps: StackDumps | None


def deadline_s(config: Config) -> float | None:
    """The daemon's own stall deadline under its current rules (stackdumps.py)."""
    c = config
    return stackdumps.stall_deadline_s(
        c.policy.rules if c.policy.enabled else {}, canary_enabled=c.canary.enabled,
        canary_period_s=c.canary.period_s, canary_timeout_s=c.canary.timeout_s)


async def prepare(spec: SpawnSpec, cfg: EngineConfig, config: Config, name: str, bay: int,
                  generation: int, in_use: Collection[str],
                  now: Callable[[], float]) -> StartDirs:
    """The folders of this start, made, and the spec to spawn. `in_use`: the dump folders
    of the unit's engines still running (never pruned)."""
    state = Path(config.audit.path).parent
    wants_cache = cfg.compile_cache and CACHE_ENV not in spec.env
    wants_version = wants_cache or stackdumps.operator_config(spec.argv) is None
    version = await compile_cache.installed_version(spec.argv, spec.env, spec.cwd) \
        if wants_version else None
    cache: CacheInfo | None = None
    if wants_cache:
        try:
            cache = await compile_cache.prepare(spec.env, spec.argv, spec.cwd,
                                                state / "vllm-cache" / name, name, now,
                                                version)
        except Exception as exc:  # (never a failed or stuck start for the cache's sake)
            log.warning("no compile cache of the daemon's for this start", error=repr(exc))
    dumps = await _stack_dumps(spec, version, config, state / "stack-dumps" / name, bay,
                               generation, in_use)
    run = spec
    if cache is not None:
        run = dataclasses.replace(run, env={**run.env,
                                            **compile_cache.env_for(cache, run.env)})
    if dumps is not None and dumps.owned:
        run = dataclasses.replace(run, argv=[*run.argv, *dumps.flag()])
    return StartDirs(run, cache, dumps)


async def _stack_dumps(spec: SpawnSpec, version: str | None, config: Config, root: Path,
                       bay: int, generation: int, in_use: Collection[str]
                       ) -> StackDumps | None:
    folder = stackdumps.start_folder(root, bay, generation, time.time())
    try:
        plan = stackdumps.plan(spec.argv, spec.cwd, version, deadline_s(config), folder)
        if plan is None or not plan.owned:
            return plan
        dropped = await asyncio.to_thread(stackdumps.make, folder, in_use)
    except Exception as exc:  # (never a failed start for the dumps' sake)
        log.warning("no stack dumps of vLLM's for this start", dir=str(folder),
                    error=repr(exc))
        return None
    if dropped:
        log.info("stack dumps of older starts dropped", dropped=dropped)
    return plan
