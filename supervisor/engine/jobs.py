"""The unit's effects as jobs: spawn, watch, poll, probe, take down, drain, remedy,
sample, timers (`supervisor/engine/effects.py` is their protocol; tests replace this
class with a recording fake).

Each job is a coroutine started on the unit's task group. It does the I/O, reads the
unit's config, clock and (for the GPU check) its siblings, and reports only by putting
an event on the unit's queue: no job changes the unit's state.
"""

from __future__ import annotations

import asyncio
import dataclasses
from pathlib import Path
from typing import TYPE_CHECKING

import httpx
import structlog

from supervisor.config import EngineConfig, MetricsConfig
from supervisor.engine import process as eng
from supervisor.engine import proctree
from supervisor.engine.effects import Timer
from supervisor.engine.events import (
    CanaryDone,
    Down,
    Drained,
    Event,
    EvidenceCaptured,
    Exited,
    GateProbe,
    GpuSampled,
    HealthResult,
    MetricsSampled,
    RemedyDone,
    SleepModeProbed,
    Spawned,
    TreeSeen,
)
from supervisor.watchdog import canary, evidence, remedy
from supervisor.watchdog.gpu import GpuSampler
from supervisor.watchdog.poller import scrape

if TYPE_CHECKING:
    from supervisor.engine.unit import EngineUnit

log = structlog.get_logger("supervisor")


async def _acquire(lock: asyncio.Lock, timeout_s: float) -> bool:
    """The lock, or False once `timeout_s` has passed without it."""
    try:
        await asyncio.wait_for(lock.acquire(), timeout_s)
    except TimeoutError:
        return False
    return True


class JobEffects:
    """The unit's effects: each one a job (a coroutine below that reports back only
    through the unit's queue), started on the unit's task group. The jobs read the unit's
    config and clock; they never change its state."""

    def __init__(self, sup: EngineUnit) -> None:
        self.sup = sup

    def spawn(self, generation: int, spec: eng.SpawnSpec, cfg: EngineConfig) -> None:
        self.sup._launch(self._spawn(generation, spec, cfg), "spawn")

    def watch(self, engine: eng.EngineProcess) -> None:
        sup = self.sup
        sup.guard.arm(engine.pgid)
        assert engine.proc.stdout is not None and engine.proc.stderr is not None
        engine.relays = [
            sup._launch(eng.relay_output(engine, engine.proc.stdout, "stdout"), "relay stdout"),
            sup._launch(eng.relay_output(engine, engine.proc.stderr, "stderr"), "relay stderr")]
        sup._launch(self._watch(engine), "watch engine")

    def serve(self, engine: eng.EngineProcess) -> None:
        sup = self.sup
        if sup.config.metrics.enabled:
            sup._launch(self._poll(engine, sup.config.metrics), "poll metrics")
        if sup.config.canary.enabled:
            sup._launch(self._canary(engine), "canary")
        sup._launch(self._probe_sleep_mode(engine), "probe sleep mode")

    def gate_probe(self, engine: eng.EngineProcess) -> None:
        self.sup._launch(self._gate_probe(engine), "gate probe")

    def take_down(self, engine: eng.EngineProcess, graceful: bool, force: asyncio.Event,
                  req: evidence.EvidenceRequest | None) -> None:
        self.sup._launch(self._take_down(engine, graceful, force, req), "take down")

    def forget(self, engine: eng.EngineProcess) -> None:
        self.sup.state_file.remove()
        self.sup.guard.disarm()

    def drain(self, engine: eng.EngineProcess) -> None:
        self.sup._launch(self._drain(engine), "drain")

    def remedy(self, engine: eng.EngineProcess, rung: str) -> None:
        self.sup._launch(self._remedy(engine, rung), rung)

    def sample_gpu(self, sampler: GpuSampler) -> None:
        self.sup._launch(self._sample_gpu(sampler), "gpu sampler")

    def after(self, delay_s: float, event: Event) -> Timer:
        queue = self.sup.queue

        async def later() -> None:
            await asyncio.sleep(delay_s)
            queue.put_nowait(event)

        return self.sup._launch(later(), f"timer: {event.name}")

    async def _spawn(self, generation: int, spec: eng.SpawnSpec,
                         cfg: EngineConfig) -> None:
        sup = self.sup
        leftovers: list[str] = []
        try:
            leftovers, own = await eng.clean_leftovers(sup.state_file, cfg.reap_timeout_s)
            # (a sibling engine's processes on a shared GPU are expected, not foreign)
            await eng.check_gpus_free(sup.gpu, own, cfg.gpu_foreign_allowance_mib << 20,
                                      cfg.gpu_release_timeout_s, frozenset(sup.siblings()))
            held = await asyncio.to_thread(proctree.port_holder, spec.host, spec.port)
            if held is not None:
                raise RuntimeError(f"engine port refused: {held}")
            engine = await eng.spawn_engine(spec, generation, sup.clock.monotonic(), cfg,
                                            sup.config.evidence.log_lines)
            await asyncio.to_thread(sup.state_file.write, engine.pgid, engine.known)
        except Exception as exc:  # any failure here is a failed start, never a stuck one
            error = str(exc) if isinstance(exc, OSError | RuntimeError) else repr(exc)
            sup.queue.put_nowait(Spawned(generation, None, error, tuple(leftovers),
                                          gpu_busy=isinstance(exc, eng.GpuBusy)))
            return
        sup.queue.put_nowait(Spawned(generation, engine, None, tuple(leftovers)))

    async def _watch(self, engine: eng.EngineProcess) -> None:
        """Report the exit at once (asyncio wakes on SIGCHLD), the first health, and the
        tree as it grows, so that the tree can be proven gone later."""
        sup = self.sup
        gen = engine.generation
        exited: asyncio.Future[int] = asyncio.ensure_future(eng.wait_exit(engine.proc))
        exited.add_done_callback(
            lambda f: None if f.cancelled() else sup.queue.put_nowait(Exited(gen, f.result())))
        cfg = engine.config
        url = cfg.base_url + cfg.health_path
        health = asyncio.ensure_future(
            eng.wait_healthy(url, cfg.health_interval_s, cfg.startup_timeout_s, exited))
        # An error in the probe counts as "not healthy": STARTING must never outlive its bound.
        health.add_done_callback(
            lambda f: None if f.cancelled() else sup.queue.put_nowait(
                HealthResult(gen, f.exception() is None and f.result())))
        recorded = list(engine.known)  # what the state file holds (written at spawn)
        try:
            while not exited.done():
                procs = await asyncio.to_thread(proctree.snapshot_tree, engine.pid)
                if procs:
                    rss, cpu = await asyncio.to_thread(proctree.tree_usage, procs)
                    sup.queue.put_nowait(TreeSeen(gen, tuple(procs), sup.clock.monotonic(),
                                                   rss, cpu))
                    merged = merge_known(recorded, procs)
                    if len(merged) > len(recorded):  # rewrite only when the tree grew
                        try:
                            await asyncio.to_thread(sup.state_file.write, engine.pgid, merged)
                            recorded = merged
                        except OSError as exc:
                            log.warning("cannot write the state file", error=str(exc))
                await asyncio.wait({exited}, timeout=2.0 if engine.healthy_at is None else 10.0)
        finally:
            health.cancel()

    async def _poll(self, engine: eng.EngineProcess, cfg: MetricsConfig) -> None:
        """Scrape the engine's /metrics every period for as long as this engine lives."""
        sup = self.sup
        ecfg = engine.config
        url = ecfg.base_url + cfg.path
        async with httpx.AsyncClient() as client:
            while engine.proc.returncode is None:
                snap, error = await scrape(client, url, cfg.timeout_s)
                if engine.proc.returncode is not None:
                    return  # a failed scrape of an engine that is gone says nothing new
                sup.queue.put_nowait(MetricsSampled(engine.generation, snap, error))
                await asyncio.sleep(cfg.period_s)

    async def _evidence(self, engine: eng.EngineProcess,
                            req: evidence.EvidenceRequest) -> None:
        """Bounded: the take-down waits for this at most evidence.timeout_s (+1 s to write
        what was gathered), whatever py-spy does."""
        sup = self.sup
        cfg = sup.config.evidence
        # the tree as it is now, beside every pid seen in it: a child forked since the
        # last look at the tree is read too
        live = await asyncio.to_thread(proctree.snapshot_tree, engine.pid)
        req = dataclasses.replace(req, pids=list(dict.fromkeys(
            [*req.pids, *(p.pid for p in live)])))
        try:
            bundle = await asyncio.wait_for(
                evidence.capture(req, Path(cfg.dir), cfg.keep, cfg.timeout_s,
                                 evidence.find_py_spy()), cfg.timeout_s + 1.0)
        except TimeoutError:
            bundle = evidence.Bundle(str(Path(cfg.dir) / req.name), cfg.timeout_s + 1.0, 0,
                                     {}, "the capture ran past its bound")
        sup.queue.put_nowait(EvidenceCaptured(engine.generation, req, bundle))

    async def _take_down(self, engine: eng.EngineProcess, graceful: bool,
                             force: asyncio.Event,
                             req: evidence.EvidenceRequest | None = None) -> None:
        sup = self.sup
        try:
            if req is not None:
                await self._evidence(engine, req)
            # the engine's own config: a reload since its start does not change its stop
            result = await eng.take_down(engine, engine.config, graceful=graceful,
                                         force=force, gpu=sup.gpu)
            # With the tree gone the pipes close: let the relays log the engine's last
            # words (a boot failure's traceback) before anyone reads them.
            if engine.relays:
                await asyncio.wait(engine.relays, timeout=2.0)
        except Exception as exc:  # reported as an event: the lifecycle must not hang
            sup.queue.put_nowait(Down(engine.generation, None, f"take-down failed: {exc!r}"))
            raise
        sup.queue.put_nowait(Down(engine.generation, result))

    async def _gate_probe(self, engine: eng.EngineProcess) -> None:
        """Healthy is not enough to release held requests: one canary must pass first
        (bounded: a few tries, then the gate opens anyway and the hang rule judges)."""
        sup = self.sup
        ecfg = engine.config
        base = ecfg.base_url
        error: str | None = None
        async with httpx.AsyncClient() as client:
            for _ in range(3):
                _, _, outcome = await self._probe(client, base, None)
                if outcome.ok:
                    sup.queue.put_nowait(GateProbe(engine.generation, True, None))
                    return
                error = outcome.error
                await asyncio.sleep(0.5)
        sup.queue.put_nowait(GateProbe(engine.generation, False, error))

    async def _drain(self, engine: eng.EngineProcess) -> None:
        sup = self.sup
        t0 = sup.clock.monotonic()
        idle = await sup.gate.wait_idle(engine.config.drain_timeout_s)
        sup.queue.put_nowait(Drained(engine.generation, idle, sup.clock.monotonic() - t0))

    async def _probe_sleep_mode(self, engine: eng.EngineProcess) -> None:
        """Can this engine drop its KV cache in place? Its flags say whether it should;
        its /is_sleeping endpoint, once it serves, says whether it does."""
        sup = self.sup
        env = eng.build_spawn_spec(engine.config, sup.environ).env
        why = remedy.sleep_mode_flags(engine.spec.argv, env)
        if why is None and sup.proxy is None:
            why = "no front proxy to hold requests while the engine sleeps ([proxy] is off)"
        if why is None:
            base = engine.config.base_url
            async with httpx.AsyncClient() as client:
                asleep, why = await remedy.is_sleeping(client, base, 10.0)
            if asleep:
                why = "the engine reports it is asleep"
        sup.queue.put_nowait(SleepModeProbed(engine.generation, why is None, why))

    async def _remedy(self, engine: eng.EngineProcess, rung: str) -> None:
        sup = self.sup
        cfg = engine.config
        base = cfg.base_url
        t0 = sup.clock.monotonic()
        async with httpx.AsyncClient() as client:
            if rung == "reset_prefix_cache":
                outcome = await remedy.reset_prefix_cache(client, base, 30.0)
            else:
                c = sup.config.canary
                idle = await sup.gate.wait_idle(cfg.drain_timeout_s)
                # a canary in flight ends within its own deadline; none starts meanwhile
                quiet = idle and await _acquire(sup._probe_lock, c.timeout_s + 1.0)
                waited = sup.clock.monotonic() - t0
                if not quiet:
                    busy = (f"{sup.gate.in_flight} requests still in flight after "
                            f"{cfg.drain_timeout_s:g} s" if not idle else
                            f"a canary still in flight after {c.timeout_s + 1.0:g} s")
                    outcome = remedy.RemedyOutcome(
                        False, {"drain": waited}, f"{busy}: the KV cache was not touched",
                        attempted=False)
                else:
                    try:
                        outcome = await remedy.kv_reset(client, base, c.model or None,
                                                        c.prompt, 60.0, max(c.timeout_s, 10.0))
                    finally:
                        sup._probe_lock.release()
                    outcome = dataclasses.replace(outcome, steps={"drain": waited,
                                                                  **outcome.steps})
        sup.queue.put_nowait(RemedyDone(engine.generation, rung, outcome,
                                         sup.clock.monotonic() - t0))

    async def _probe(self, client: httpx.AsyncClient, base: str,
                     model: str | None) -> tuple[str | None, float, canary.CanaryOutcome]:
        """One canary (the model asked for, when it began, its outcome), never beside a
        KV reset: the daemon's own generation is engine traffic that reset must drain."""
        sup = self.sup
        cfg = sup.config.canary
        async with sup._probe_lock:
            t0 = sup.clock.monotonic()
            model = model or cfg.model or await canary.find_model(client, base, cfg.timeout_s)
            if model is None:
                return None, t0, canary.CanaryOutcome(False, sup.clock.monotonic() - t0,
                                                      "/v1/models named no model")
            sup._probes_in_flight += 1  # (read only by the state-owning task)
            try:
                return model, t0, await canary.probe(client, base, model, cfg.prompt,
                                                     cfg.max_tokens, cfg.timeout_s)
            finally:
                sup._probes_in_flight -= 1

    async def _canary(self, engine: eng.EngineProcess) -> None:
        """A tiny generation every period, for as long as this engine lives."""
        sup = self.sup
        ecfg = engine.config
        base = ecfg.base_url
        async with httpx.AsyncClient() as client:
            model: str | None = None
            while engine.proc.returncode is None:
                await asyncio.sleep(sup.config.canary.period_s)
                # (a reloaded canary.model applies at the next probe)
                model, t0, outcome = await self._probe(
                    client, base, sup.config.canary.model or model)
                if engine.proc.returncode is not None:
                    return
                sup.queue.put_nowait(CanaryDone(engine.generation, outcome, t0,
                                                 sup.clock.monotonic()))

    async def _sample_gpu(self, sampler: GpuSampler) -> None:
        sup = self.sup
        while True:
            reading = await asyncio.to_thread(sampler.sample)
            sup.queue.put_nowait(GpuSampled(reading, sup.clock.monotonic()))
            await asyncio.sleep(sup.config.gpu.period_s)  # (a reload applies here)


def merge_known(known: list[proctree.ProcInfo],
           seen: list[proctree.ProcInfo]) -> list[proctree.ProcInfo]:
    merged = {(p.pid, p.create_time): p for p in known}
    for p in seen:
        merged.setdefault((p.pid, p.create_time), p)
    return list(merged.values())
