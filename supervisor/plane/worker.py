"""A proxy worker: one process of the front door (`proxy.workers` > 1), started by the
daemon (`supervisor/plane/pool.py`) with its listening socket and its link.

It runs the front door's data path (`FrontProxy`: the connections it accepts, their
requests, their streams and continuations, their access lines) over the daemon's
engines as the daemon describes them (`supervisor/plane/mirror.py`), and asks the daemon
for every slot and suspect lane. Its counters and histograms go to the daemon twice a
second, for the exporter. It ends when told to (its busy connections given their grace),
on SIGTERM, or when the link to the daemon closes (the daemon is gone: nothing may be
admitted any more); SIGINT, a terminal's Ctrl-C to the daemon's group, is the daemon's.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import resource
import signal
import socket
import sys
from collections.abc import Sequence
from typing import assert_never

import structlog

from supervisor import loop
from supervisor.front.proxy import FrontProxy
from supervisor.ops.logs import configure_logging
from supervisor.plane.messages import (
    TO_WORKER,
    Counters,
    EngineState,
    Granted,
    HistogramCounts,
    Init,
    Laned,
    Pause,
    Ready,
    Refused,
    Report,
    Settings,
    State,
    Stats,
    Stop,
    ToDaemon,
    ToWorker,
)
from supervisor.plane.mirror import Daemon, RemoteLanes, WorkerBackend
from supervisor.plane.wire import Link

log = structlog.get_logger("supervisor.plane")
REPORT_S = 0.5


def counters(proxy: FrontProxy) -> Counters:
    """The worker's counters and histograms, as the daemon adds them up."""
    st = proxy.stats
    return Counters(
        responses=dict(st.responses), rejections=dict(st.rejections),
        continuations=dict(st.continuations), refusals=dict(st.refusals),
        retried_connects=st.retried_connects,
        cpu_s=sum(resource.getrusage(resource.RUSAGE_SELF)[:2]),
        latency=tuple(HistogramCounts(v.kind, dict(v.labels)["model"], _counts(v.buckets),
                                      v.sum, v.count)
                      for v in proxy.latency.views()))


def _counts(cumulative: Sequence[tuple[float, int]]) -> tuple[int, ...]:
    """Per bucket, from the cumulative counts a view gives."""
    out, last = [], 0
    for _, running in cumulative:
        out.append(running - last)
        last = running
    return tuple(out)


class Worker:
    def __init__(self, index: int, link: Link[ToWorker, ToDaemon]) -> None:
        self.index = index
        self.link = link
        self.daemon = Daemon(link)
        self.proxy: FrontProxy | None = None
        self.stop = asyncio.Event()

    def state(self, engines: tuple[EngineState, ...]) -> None:
        assert self.proxy is not None
        names = {e.name for e in engines}
        for name in [n for n in self.proxy.backends if n not in names]:
            self.proxy.remove_engine(name)
        for e in engines:
            b = self.proxy.backends.get(e.name)
            if isinstance(b, WorkerBackend):
                models = b.models
                b.told(e)
                if b.models != models:
                    self.proxy.add_engine(b)  # (in its place: the latency labels anew)
            else:
                self.proxy.add_engine(WorkerBackend(e, self.daemon))

    def handle(self, m: ToWorker) -> None:
        assert self.proxy is not None
        match m:
            case Granted() | Laned():
                self.daemon.answered(m)
            case Refused():
                self.daemon.refused(m)
            case State(engines):
                self.state(engines)
            case Pause(engine):
                paused = self.proxy.pause_streams(engine)
                log.info("streams paused, to go on after it", engine=engine, paused=paused,
                         worker=self.index)
            case Settings(settings):
                self.proxy.reconfigure(settings)
            case Report(asked):
                self.link.send(Stats(counters(self.proxy), asked))
            case Stop():
                self.stop.set()
            case Init():
                log.warning("the daemon said init twice; ignored")
            case _:
                assert_never(m)

    async def read(self) -> None:
        """The daemon's messages as they arrive, until the link closes: then nothing may
        be admitted any more, and the worker ends."""
        self.link.handle_with(self.handle)
        why = await self.link.wait_closed()
        self.daemon.lost(why)
        self.stop.set()

    async def report(self) -> None:
        last: Counters | None = None
        while True:
            await asyncio.sleep(REPORT_S)
            assert self.proxy is not None
            now = counters(self.proxy)
            if now != last:
                self.link.send(Stats(now, None))
                last = now

    async def run(self, listen_fd: int) -> int:
        init = await self.link.recv()
        if not isinstance(init, Init):
            log.error("the daemon's first message is not init", kind=init.KIND)
            return 1
        self.proxy = FrontProxy(init.settings, lanes=RemoteLanes(self.daemon))
        self.proxy.worker = self.index
        self.state(init.engines)
        await self.proxy.start(socket.socket(fileno=listen_fd))
        asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, self.stop.set)
        self.link.send(Ready(os.getpid()))
        tasks = [asyncio.create_task(self.read()), asyncio.create_task(self.report())]
        await self.stop.wait()
        await self.proxy.close()
        self.link.send(Stats(counters(self.proxy), None))
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await self.link.close()
        return 0


async def _main(args: argparse.Namespace) -> int:
    link: Link[ToWorker, ToDaemon] = await Link.over(socket.socket(fileno=args.link_fd),
                                                     TO_WORKER)
    return await Worker(args.index, link).run(args.listen_fd)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="supervisor.plane.worker")
    p.add_argument("--index", type=int, required=True)
    p.add_argument("--link-fd", type=int, required=True)
    p.add_argument("--listen-fd", type=int, required=True)
    p.add_argument("--log-level", default="info")
    p.add_argument("--log-format", default="json")
    args = p.parse_args(argv)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    configure_logging(args.log_level, args.log_format)
    structlog.contextvars.bind_contextvars(worker=args.index)
    with contextlib.suppress(KeyboardInterrupt):
        return loop.run(_main(args))  # (uvloop, as the daemon's)
    return 1


if __name__ == "__main__":
    sys.exit(main())
