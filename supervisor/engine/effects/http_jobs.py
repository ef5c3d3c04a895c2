"""The jobs that talk to a running engine over HTTP: its first health and the probe of
vLLM's development routes, the weight cache's health watch, the metrics scrape, the
canary, the gate's probe and the warm-up, the sleep-mode probe, a sleep or a wake and the
KV reset, each timed with what vLLM measured of it.

`JobEffects` (`supervisor/engine/effects/jobs.py`) holds one `HttpJobs` and starts these
coroutines on its task group. As every job, each is given what it needs (the unit's
queue, its current config, clock, environment, gate and whether a front proxy holds its
requests), never the unit, and reports only by putting an event on the queue.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

import httpx
import structlog

from supervisor.engine.effects.probes import EngineProbes
from supervisor.engine.effects.protocol import Front
from supervisor.engine.events import (
    CanaryDone,
    Event,
    GateProbe,
    HealthLost,
    HealthResult,
    HostCacheEmptied,
    MetricsSampled,
    RemedyDone,
    SleepModeProbed,
    Slept,
    Woken,
)
from supervisor.engine.process import host_cache, takedown
from supervisor.engine.process import process as eng
from supervisor.front.admission import Gate
from supervisor.loop import Clock, http_client
from supervisor.ops.descriptors import OutOfDescriptors, Shortage
from supervisor.settings.config import Config
from supervisor.settings.sections import MetricsConfig
from supervisor.watchdog import devroutes, golden, model_len, remedy, warmup
from supervisor.watchdog import golden as golden_answers  # (`gate_probe`'s flag is `golden`)
from supervisor.watchdog.metrics import sleep_op_seconds
from supervisor.watchdog.poller import scrape
from supervisor.watchdog.remedy import WarmUp

log = structlog.get_logger("supervisor")

T = TypeVar("T")

# a process watched once healthy (the weight cache) is lost after this many misses
HEALTH_MISSES = 3


async def _acquire(lock: asyncio.Lock, timeout_s: float) -> bool:
    """The lock, or False once `timeout_s` has passed without it."""
    try:
        await asyncio.wait_for(lock.acquire(), timeout_s)
    except TimeoutError:
        return False
    return True


class HttpJobs:
    """The unit's jobs that send requests to an engine. They read the unit's current
    config and its clock; they never change its state. Owns the daemon's own requests to
    each engine (`EngineProbes`): the lock that keeps them from a KV reset, one per
    engine, so that a hung engine's canary never delays the proof of the standby that
    replaces it (engine/effects/probes.py)."""

    def __init__(self, *, queue: asyncio.Queue[Event], config: Callable[[], Config],
                 clock: Clock, environ: dict[str, str], gate: Gate,
                 front: Front | None) -> None:
        self.queue, self.config, self.clock, self.environ = queue, config, clock, environ
        self.gate, self.front = gate, front
        self.probes = EngineProbes(config, clock)

    def forget(self, engine: eng.EngineProcess) -> None:
        self.probes.forget(engine)

    def in_flight(self) -> int:
        return self.probes.in_flight()

    async def first_health(self, engine: eng.EngineProcess,
                           exited: asyncio.Future[int]) -> HealthResult:
        """The first health answer, and then, before the engine counts as healthy (and
        is declared serving, or a standby proven), which of vLLM's development routes
        it serves (`watchdog/devroutes.py`: four GETs together, bounded, no side
        effect): what it can do in place is known from its start, not at first use."""
        cfg = engine.config
        healthy = await eng.wait_healthy(
            cfg.base_url + cfg.health_path, cfg.health_interval_s, cfg.startup_timeout_s,
            exited, lambda: eng.start_given_up(engine, time.monotonic()))
        routes, length = None, None
        if healthy and not exited.done():
            try:
                async with http_client() as client:
                    routes, length = await asyncio.gather(
                        devroutes.probe(client, cfg.base_url),
                        model_len.ask(client, cfg.base_url))
            except Exception as exc:  # (never a failed start: the configuration decides)
                log.warning("the development routes were not probed", error=repr(exc))
        why = None if healthy else eng.start_given_up(engine, time.monotonic())
        return HealthResult(engine.generation, healthy, routes, why, length)

    async def watch_health(self, engine: eng.EngineProcess) -> None:
        cfg = engine.config
        exited = asyncio.ensure_future(takedown.wait_exit(engine.proc))
        try:
            why = await eng.watch_health(cfg.base_url + cfg.health_path,
                                         max(cfg.health_interval_s, 1.0), HEALTH_MISSES,
                                         exited)
        finally:
            exited.cancel()
        if why is not None:
            self.queue.put_nowait(HealthLost(engine.generation, why))

    async def poll(self, engine: eng.EngineProcess, cfg: MetricsConfig) -> None:
        """Scrape the engine's /metrics every period for as long as this engine lives."""
        ecfg = engine.config
        url = ecfg.base_url + cfg.path
        shortage = Shortage("metrics scrape", pid=engine.pid)
        async with http_client() as client:
            while engine.proc.returncode is None:
                try:
                    snap, error = await scrape(client, url, cfg.timeout_s)
                except OutOfDescriptors as exc:
                    shortage.failed(exc)  # no scrape: no sample, not a failed one
                else:
                    shortage.ok()
                    if engine.proc.returncode is not None:
                        return  # a failed scrape of an engine that is gone says nothing new
                    self.queue.put_nowait(MetricsSampled(engine.generation, snap, error))
                await asyncio.sleep(cfg.period_s)

    async def canary(self, engine: eng.EngineProcess) -> None:
        """A tiny generation every period, for as long as this engine lives."""
        shortage = Shortage("canary", pid=engine.pid)
        async with http_client() as client:
            model: str | None = None
            while engine.proc.returncode is None:
                await asyncio.sleep(self.config().canary.period_s)
                # (a reloaded canary.model applies at the next probe)
                try:
                    model, t0, outcome = await self.probes.periodic(
                        client, engine, self.config().canary.model or model)
                except OutOfDescriptors as exc:
                    # the daemon could not send it: no outcome, never a failure of the
                    # engine's (the hang rule counts failures)
                    shortage.failed(exc)
                    continue
                shortage.ok()
                if engine.proc.returncode is not None:
                    return
                if outcome is None:  # (cut for a KV reset: no outcome)
                    continue
                self.queue.put_nowait(CanaryDone(engine.generation, outcome, t0,
                                                 self.clock.monotonic()))

    async def gate_probe(self, engine: eng.EngineProcess, golden: bool,
                         warm: bool, woken: bool = False,
                         sleeps_later: bool = False) -> None:
        """Healthy is not enough to release held requests: one canary must pass first
        (bounded: a few tries, then the gate opens anyway and the hang rule judges).
        Before it, at an engine process's first proof, every path a client may take is
        asked once (`watchdog/warmup.py`): what vLLM builds at first use is built before
        any client comes; silence past `canary.warm_up_timeout_s` fails the proof.
        With `warm`, an engine that can sleep then sleeps and wakes once
        (`remedy.warm_up`: its first KV reset then costs sleep and wake alone), and is
        proven again after the wake, its golden answers taken again. `woken` (a sleeping
        standby that took over, its clients waiting): the golden answers on the completions
        route are the generation that proves it, with no canary before them (the canary
        only where they give no verdict)."""
        error: str | None = None
        async with http_client() as client:
            warmed: warmup.Warmed | None = None
            if self.config().canary.warm_up and engine.warmed is None:
                try:
                    warmed = await self.probes.warm(client, engine)
                except OutOfDescriptors as exc:  # (not warmed: the canary still proves it)
                    log.warning("the warm-up could not be sent", error=str(exc))
                if warmed is not None and not warmed.ok:
                    self.queue.put_nowait(GateProbe(engine.generation, False,
                                                    f"warm-up: {warmed.error}",
                                                    warmed=warmed))
                    return
            # a woken one's answers without log-probabilities: no verdict, and none to
            # come by asking again (any other failure: asked again after the canary)
            said: str | None = None
            if woken and golden and not warm:
                # (the completions route's: a proof of a generation when they came back)
                got = await self.probes.answers(client, engine, None, after_wake=True)
                if isinstance(got, golden_answers.Golden):
                    self.queue.put_nowait(GateProbe(engine.generation, True, None,
                                                    golden=got, warmed=warmed))
                    return
                said = got if got == golden_answers.NO_LOGPROBS else None
            for _ in range(3):
                try:
                    model, _, outcome = await self.probes.probe(client, engine, None)
                    answers = said if said is not None else \
                        await self.probes.answers(client, engine, model) \
                        if golden and outcome.ok and model is not None else None
                except OutOfDescriptors as exc:  # (the gate opens all the same, bounded)
                    error = str(exc)
                else:
                    if outcome.ok:
                        slept, again = await self._warm_up(
                            client, engine, model, golden, sleeps_later) \
                            if warm else (None, None)
                        broken = slept is not None and slept.broken
                        self.queue.put_nowait(GateProbe(
                            engine.generation, not broken,
                            slept.error if slept is not None and broken else None,
                            golden=answers, warm_up=slept, golden_woken=again,
                            broken_by_wake=broken, warmed=warmed))
                        return
                    error = outcome.error
                await asyncio.sleep(0.5)
        self.queue.put_nowait(GateProbe(engine.generation, False, error, warmed=warmed))

    async def _warm_up(self, client: httpx.AsyncClient, engine: eng.EngineProcess,
                       model: str | None, with_golden: bool, sleeps_later: bool = False,
                       ) -> tuple[WarmUp | None, golden.Golden | str | None]:
        """The warm-up sleep and wake of an engine whose flags give it sleep mode (None:
        they do not), no canary of the daemon's beside it; then a canary and, with
        `with_golden`, the golden answers again: a wake can leave an engine broken or
        wrong.

        An engine whose KV reset pauses it (`remedy.pause_resets`) will not sleep again,
        but is warmed all the same: the sleep empties torch's cache on the card (the
        profiling's activations, 1-2 GiB on an 8B engine), room a sleeping standby's
        weights need beside it (on an H200 at 0.85 an engine that never slept left 15.6
        GiB free where they need 16.5). What the sleep leaves behind, its weights' pinned
        host copy in torch's host cache (16 GiB, and 0.5 s more to give the card back
        when it is killed), is then let go (`host_cache.empty`): step
        `empty_host_cache`; not for an engine that `sleeps_later` (a standby to be
        dumped asleep: its sleep would pin that copy again, 2.2 s at 8B)."""
        env = eng.build_spawn_spec(engine.config, self.environ).env
        if self.front is None or devroutes.sleep_off(engine.routes, engine.spec.argv,
                                                     env) is not None:
            return None, None
        async with self.probes.lock(engine):
            warmed, _, took = await self._vllm_timed(client, engine, remedy.warm_up(
                client, engine.config.base_url, remedy.SLEEP_TIMEOUT_S))
            warmed = dataclasses.replace(warmed, vllm_s=took)
            if warmed.error is None and warmed.skipped is None and not sleeps_later \
                    and devroutes.pause_off(engine.routes, env) is None \
                    and remedy.pause_resets(engine.vllm_version):
                warmed = await self._let_go_of_host_cache(client, engine, warmed)
        if warmed.broken or warmed.skipped is not None or model is None:
            return warmed, None
        try:
            _, _, outcome = await self.probes.probe(client, engine, model)
        except OutOfDescriptors:  # (the daemon could not ask: no verdict, as at the gate)
            return warmed, None
        if not outcome.ok:
            return dataclasses.replace(warmed, broken=True,
                                       error=f"a canary after its wake: {outcome.error}"), None
        return warmed, await self.probes.answers(client, engine, model) if with_golden else None

    async def _let_go_of_host_cache(self, client: httpx.AsyncClient,
                                    engine: eng.EngineProcess, warmed: WarmUp) -> WarmUp:
        """After the warm-up of an engine that will not sleep again: its pinned host copy
        of the weights let go, said in `warmed` (`host_cache`, step `empty_host_cache`).
        Where it cannot be (no worker extension, an answer that says no), it is kept:
        the engine serves as before."""
        why = host_cache.why_not(engine.spec.argv)
        if why is None:
            try:
                got = await host_cache.empty(client, engine.config.base_url)
            except OutOfDescriptors as exc:
                got = host_cache.Emptied(False, 0.0, error=str(exc))
            why = None if got.emptied else got.error
            warmed = dataclasses.replace(
                warmed, steps={**warmed.steps, "empty_host_cache": got.seconds})
        return dataclasses.replace(warmed, host_cache="emptied" if why is None
                                   else f"kept: {why}")

    async def probe_sleep_mode(self, engine: eng.EngineProcess) -> None:
        """Can this engine drop its KV cache in place, by a pause or a sleep? Its flags
        and the development routes it was found serving at its health check say whether
        it should; its vLLM version whether a pause empties the cache
        (`remedy.pause_resets`); its /is_sleeping endpoint, once it serves, whether it
        sleeps."""
        env = eng.build_spawn_spec(engine.config, self.environ).env
        why = devroutes.sleep_off(engine.routes, engine.spec.argv, env)
        paused = devroutes.pause_off(engine.routes, env)
        no_front = "no front proxy to hold requests while the engine sleeps ([proxy] is off)"
        base = engine.config.base_url
        async with http_client() as client:
            if paused is None and self.front is not None:
                version = engine.vllm_version or await remedy.engine_version(
                    client, base, remedy.VERSION_TIMEOUT_S)
                if not remedy.pause_resets(version):
                    paused = (f"vLLM {version or 'of unknown version'}: only 0.26 or "
                              "later empties its KV cache when paused")
            if why is None and self.front is None:
                why = no_front
            if why is None:
                # (not in the middle of the engine's warm-up sleep: it would read as asleep)
                async with self.probes.lock(engine):
                    asleep, why = await remedy.is_sleeping(client, base, 10.0)
                if asleep:
                    why = "the engine reports it is asleep"
        if self.front is None and paused is None:
            paused = no_front
        self.queue.put_nowait(SleepModeProbed(engine.generation, why is None, why,
                                              pause=paused is None, pause_why=paused))

    async def sleep_or_wake(self, engine: eng.EngineProcess, asleep: bool,
                            tags: tuple[str, ...] = ()) -> None:
        """Bounded by `remedy.SLEEP_TIMEOUT_S` a call: the first sleep pins the weights in
        host RAM (11-13 s for an 8B model on the H100). `tags`: a wake of only that
        memory (`remedy.set_asleep`)."""
        async with http_client() as client:
            error, seconds, took = await self._vllm_timed(client, engine, remedy.set_asleep(
                client, engine.config.base_url, asleep, remedy.SLEEP_TIMEOUT_S, tags))
        if asleep:
            self.queue.put_nowait(Slept(engine.generation, error, seconds, took))
        else:
            self.queue.put_nowait(Woken(engine.generation, error, seconds, took, tags))

    async def empty_host_cache(self, engine: eng.EngineProcess) -> None:
        """Bounded (`host_cache.EMPTY_TIMEOUT_S`, and the call's own margin)."""
        async with http_client() as client:
            try:
                got = await host_cache.empty(client, engine.config.base_url)
            except OutOfDescriptors as exc:
                got = host_cache.Emptied(False, 0.0, error=str(exc))
        self.queue.put_nowait(HostCacheEmptied(engine.generation, got.emptied, got.seconds,
                                               got.worker_s, got.error))

    async def _vllm_timed(self, client: httpx.AsyncClient, engine: eng.EngineProcess,
                          call: Awaitable[T]) -> tuple[T, float, dict[str, float] | None]:
        """`call` (a sleep, a wake, both), how long it took, and what vLLM measured of
        each of its operations in it (metrics.sleep_op_seconds; None: unknown, or
        `metrics.enabled` off): its sleep-mode counts read after, and before unless the
        last such call's reading stands (a standby's wake, its sleep's: a failover waits
        on no read before its wake)."""
        m = self.config().metrics
        url, bound = engine.config.base_url + m.path, remedy.SLEEP_METRICS_TIMEOUT_S
        before = engine.sleep_ops
        if before is None and m.enabled:
            before = await remedy.sleep_ops(client, url, bound)
        t0 = self.clock.monotonic()
        result = await call
        seconds = self.clock.monotonic() - t0
        engine.sleep_ops = await remedy.sleep_ops(client, url, bound) if m.enabled else None
        took = sleep_op_seconds(before, engine.sleep_ops)
        return result, seconds, {k: round(v, 3) for k, v in took.items()} or None

    async def apply_remedy(self, engine: eng.EngineProcess, rung: str,
                           ways: tuple[str, ...]) -> None:
        """A prefix-cache reset, or a KV reset by `ways` ("pause", "sleep": the watch's
        verdict at the engine's probe, in the order tried): `RemedyDone`."""
        cfg = engine.config
        base = cfg.base_url
        t0 = self.clock.monotonic()
        answers: golden.Golden | str | None = None
        async with http_client() as client:
            if rung == "reset_prefix_cache":
                outcome = await remedy.reset_prefix_cache(client, base, 30.0)
            else:
                c = self.config().canary
                # the daemon's own canary in flight is cut, not waited for (it waits
                # for a place in a full batch); none starts once the lock is taken
                if self.probes.cut_canary(engine):
                    log.info("the daemon's canary in flight cut for the KV reset",
                             pid=engine.pid)
                locked = await _acquire(self.probes.lock(engine), c.timeout_s + 1.0)
                idle = locked and await self.gate.wait_idle(cfg.drain_timeout_s)
                waited = self.clock.monotonic() - t0
                if not idle:
                    if locked:
                        self.probes.lock(engine).release()
                    busy = (f"{self.gate.in_flight} requests still in flight after "
                            f"{cfg.drain_timeout_s:g} s" if locked else
                            f"a canary still in flight after {c.timeout_s + 1.0:g} s")
                    outcome = remedy.RemedyOutcome(
                        False, {"drain": waited}, f"{busy}: the KV cache was not touched",
                        attempted=False)
                else:
                    try:
                        m = self.config().metrics  # (the engine's own count of requests)
                        outcome, _, took = await self._vllm_timed(client, engine, remedy.kv_reset(
                            client, base, c.model or None, c.prompt, 60.0,
                            max(c.timeout_s, 10.0), metrics_url=base + m.path if m.enabled
                            else None, idle_within_s=cfg.drain_timeout_s - waited,
                            version=engine.vllm_version, pause="pause" in ways,
                            sleep="sleep" in ways))
                        outcome = dataclasses.replace(outcome, vllm_s=took)
                        # (a copy's, read from its /version: not asked again)
                        engine.vllm_version = engine.vllm_version or outcome.vllm_version
                        if outcome.ok and c.golden:  # (right after its wake, not just alive)
                            answers = await self.probes.golden_unlocked(client, engine,
                                                                        after_wake=True)
                    finally:
                        self.probes.lock(engine).release()
                    outcome = dataclasses.replace(outcome, steps={"drain": waited,
                                                                  **outcome.steps})
        self.queue.put_nowait(RemedyDone(engine.generation, rung, outcome,
                                         self.clock.monotonic() - t0, answers))
