"""The daemon's own requests to an engine (supervisor/engine/effects/probes.py), against a real
socket that takes a request and never answers (a full batch's canary): a KV reset cuts
the periodic canary in flight, closing its request, with no outcome (no failure); a
proof's canary is never cut."""

from __future__ import annotations

import asyncio
from pathlib import Path

import httpx

from supervisor.engine.effects.probes import EngineProbes
from supervisor.engine.process import process as eng
from supervisor.loop import Clock
from supervisor.settings.config import parse_config

GUARD_S = 20.0  # every wait below is bounded by this


class Silent:
    """Reads each request and never answers; counts the connections its clients
    closed."""

    def __init__(self) -> None:
        self.requests = asyncio.Queue[bytes]()
        self.closed = asyncio.Queue[None]()

    async def serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.requests.put_nowait(await reader.readuntil(b"\r\n\r\n"))
        await reader.read()  # (b"" once the client closes)
        self.closed.put_nowait(None)
        writer.close()


async def world(tmp: Path) -> tuple[EngineProbes, eng.EngineProcess, Silent, asyncio.Server]:
    silent = Silent()
    server = await asyncio.start_server(silent.serve, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    cfg = parse_config({"engine": {"command": ["vllm", "serve", "m"], "port": port},
                        "canary": {"model": "m", "timeout_s": 600}}, "t.toml", tmp)
    spec = eng.SpawnSpec(argv=["true"], env={}, cwd="/", host="127.0.0.1", port=port)
    engine = eng.EngineProcess(generation=7, proc=None,  # type: ignore[arg-type]
                               pid=1 << 22, started_at=0.0, spec=spec, config=cfg.engine)
    return EngineProbes(lambda: cfg, Clock()), engine, silent, server


def test_a_kv_reset_cuts_the_periodic_canary_in_flight_and_it_has_no_outcome(
        tmp_path: Path) -> None:
    async def run() -> None:
        probes, engine, silent, server = await world(tmp_path)
        async with server, httpx.AsyncClient() as client, asyncio.timeout(GUARD_S):
            assert not probes.cut_canary(engine)  # (none in flight)
            canary = asyncio.create_task(probes.periodic(client, engine, None))
            head = await silent.requests.get()
            assert head.startswith(b"POST /v1/completions")
            assert probes.in_flight() == 1 and probes.lock(engine).locked()
            assert probes.cut_canary(engine)  # what a KV reset does first
            model, _, outcome = await canary
            assert model == "m" and outcome is None  # cut: neither a pass nor a failure
            await silent.closed.get()  # its request closed at the engine (vLLM aborts it)
            assert probes.in_flight() == 0 and not probes.lock(engine).locked()

    asyncio.run(run())


def test_a_proofs_canary_is_not_cut(tmp_path: Path) -> None:
    async def run() -> None:
        probes, engine, silent, server = await world(tmp_path)
        async with server, httpx.AsyncClient() as client, asyncio.timeout(GUARD_S):
            proof = asyncio.create_task(probes.probe(client, engine, None))
            await silent.requests.get()
            assert not probes.cut_canary(engine)
            await asyncio.sleep(0.2)
            assert not proof.done() and silent.closed.empty()
            proof.cancel()  # (the test's own end: its job cancelled)
            await asyncio.gather(proof, return_exceptions=True)
            await silent.closed.get()
            assert probes.in_flight() == 0

    asyncio.run(run())
