"""A start whose core said it failed, but whose engine never exits (issue 52: a TP=2
engine's workers hung after "EngineCore failed to start." on four H200s, and the daemon
waited out its whole startup timeout): the start is given up `BOOT_FAILED_GRACE_S`
after that line, with the line as the reason, on real processes and over the daemon."""

from __future__ import annotations

import asyncio
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from supervisor.engine.process import process as eng
from supervisor.engine.process.enginelog import boot_failure_of
from supervisor.settings.sections import EngineConfig
from tests.harness import FAKE_ENGINE, alive, fake_engine_config, free_port, wait_for


@pytest.mark.parametrize(("line", "failed"), [
    ("EngineCore failed to start.", True),
    ("EngineCore failed to start: fake boot failure", True),
    ("RuntimeError: Engine core initialization failed. See root cause above. Failed core "
     "proc(s): {}", True),
    ("Initializing a V1 LLM engine (v0.26.0) with config: ...", False),
    ("the engine failed to answer /health", False),
])
def test_the_lines_that_say_a_core_failed_to_start(line: str, failed: bool) -> None:
    assert boot_failure_of(line) is failed


def test_wait_healthy_gives_up_once_the_core_said_it_failed_and_the_grace_passed(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(eng, "BOOT_FAILED_GRACE_S", 0.5)
    cfg = EngineConfig(command=[sys.executable, str(FAKE_ENGINE), "--fail-boot-hang"],
                       port=free_port(), cwd=str(Path.cwd()), drain_timeout_s=1,
                       stop_grace_s=1, reap_timeout_s=3)

    async def run() -> tuple[bool, float, str | None, eng.EngineProcess]:
        e = await eng.spawn_engine(eng.build_spawn_spec(cfg, {"PATH": "/usr/bin:/bin"}), 1,
                                   time.monotonic(), cfg)
        assert e.proc.stdout is not None and e.proc.stderr is not None
        e.relays = [asyncio.create_task(eng.relay_output(e, e.proc.stdout, "stdout")),
                    asyncio.create_task(eng.relay_output(e, e.proc.stderr, "stderr"))]
        exited: asyncio.Future[int] = asyncio.ensure_future(e.proc.wait())
        t0 = time.monotonic()
        # a startup timeout far beyond the grace: only the core's line can end the wait
        healthy = await eng.wait_healthy(f"http://127.0.0.1:{cfg.port}/health", 0.05, 120,
                                         exited, lambda: eng.start_given_up(e, time.monotonic()))
        waited = time.monotonic() - t0
        why = eng.start_given_up(e, time.monotonic())
        running = e.proc.returncode is None
        e.proc.kill()
        await e.proc.wait()
        for t in e.relays:
            t.cancel()
        assert running  # it was given up while it still ran: nothing else ended the wait
        return healthy, waited, why, e

    healthy, waited, why, e = asyncio.run(run())
    assert healthy is False and waited < 120
    assert e.boot_failure == "EngineCore failed to start."
    assert e.phase == eng.BOOT_FAILED_PHASE  # what `status` said meanwhile
    assert why is not None and "its core failed to start ('EngineCore failed to start.')" in why


def test_no_line_no_give_up() -> None:
    e = eng.EngineProcess(generation=1, proc=None, pid=1, started_at=0.0,  # type: ignore[arg-type]
                          spec=None, config=None)  # type: ignore[arg-type]
    assert eng.start_given_up(e, 10_000.0) is None
    e.boot_failed_at, e.boot_failure = 100.0, "EngineCore failed to start."
    assert eng.start_given_up(e, 100.0 + eng.BOOT_FAILED_GRACE_S - 0.1) is None
    assert eng.start_given_up(e, 100.0 + eng.BOOT_FAILED_GRACE_S) is not None


def test_the_daemon_takes_down_an_engine_whose_core_failed_and_that_never_exits(
        daemon_factory: Any, tmp_path: Path) -> None:
    """Over the real daemon: the start fails `BOOT_FAILED_GRACE_S` (30 s) after the line,
    not at the 600 s startup timeout; the hung tree is taken down and the reason says
    what the core said."""
    cfg = fake_engine_config(tmp_path, "--fail-boot-hang",
                             engine={"startup_timeout_s": 600.0},
                             restart={"boot_failures_max": 1})
    d = daemon_factory(cfg)
    # meanwhile `status` says so, not the phase before it
    wait_for(lambda: (d.status().get("start") or {}).get("phase")
             == eng.BOOT_FAILED_PHASE, 30, "status to show the core's failure")
    st = d.wait_state("FATAL", eng.BOOT_FAILED_GRACE_S + 60)
    assert "its core failed to start ('EngineCore failed to start.')" in st["fatal_reason"]
    wait_for(lambda: alive(d.engine_pids()) == []
             and any(e["event"] == "reaped" for e in d.events()), 30,
             "the hung engine to be reaped")


def test_no_eta_for_a_start_whose_core_failed(tmp_path: Path) -> None:
    """`status`'s ETA and a refusal's Retry-After come from past starts; once the core
    said it failed to start, there is none to promise."""
    from tests.unit_world import World

    w = World(tmp_path)
    try:
        w.sup.start("test")
        e = w.spawned()
        assert w.state == "STARTING"
        w.sup.start_times.record(e.spec.command_line, None, 60.0, [])
        w.now += 10
        expected = w.sup.expected_start()
        assert expected is not None and expected.left_s == pytest.approx(50.0)
        e.boot_failed_at, e.boot_failure = w.now, "EngineCore failed to start."
        assert w.sup.expected_start() is None
    finally:
        w.loop.close()
