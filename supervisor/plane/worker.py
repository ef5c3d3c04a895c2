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
from typing import Any

import structlog

from supervisor import loop
from supervisor.front.proxy import FrontProxy
from supervisor.ops.logs import configure_logging
from supervisor.plane.mirror import Daemon, RemoteLanes, WorkerBackend, apply, worker_backend
from supervisor.plane.wire import Link

log = structlog.get_logger("supervisor.plane")
REPORT_S = 0.5


def stats_doc(proxy: FrontProxy) -> dict[str, Any]:
    """The worker's counters and histograms, as the daemon adds them up."""
    st = proxy.stats
    return {"responses": dict(st.responses), "rejections": dict(st.rejections),
            "continuations": dict(st.continuations), "refusals": dict(st.refusals),
            "retried_connects": st.retried_connects,
            "cpu_s": sum(resource.getrusage(resource.RUSAGE_SELF)[:2]),
            "latency": {key: (list(h.counts), h.total, h.n)
                        for key, h in proxy.latency._h.items()}}


class Worker:
    def __init__(self, index: int, link: Link) -> None:
        self.index = index
        self.link = link
        self.daemon = Daemon(link)
        self.proxy: FrontProxy | None = None
        self.stop = asyncio.Event()

    def state(self, engines: list[dict[str, Any]]) -> None:
        assert self.proxy is not None
        names = {e["name"] for e in engines}
        for name in [n for n in self.proxy.backends if n not in names]:
            self.proxy.remove_engine(name)
        for e in engines:
            b = self.proxy.backends.get(e["name"])
            if isinstance(b, WorkerBackend):
                apply(b, e)
                self.proxy._names_changed()
            else:
                self.proxy.add_engine(worker_backend(e, self.daemon))

    def handle(self, m: tuple[Any, ...]) -> None:
        assert self.proxy is not None
        kind = m[0]
        if kind == "ok":
            self.daemon.answered(m[1], m[2])
        elif kind == "no":
            self.daemon.refused(m[1], m[2], m[3], m[4], m[5])
        elif kind == "state":
            self.state(m[1])
        elif kind == "pause":
            paused = self.proxy.pause_streams(m[1])
            log.info("streams paused, to go on after it", engine=m[1], paused=paused,
                     worker=self.index)
        elif kind == "settings":
            self.proxy.reconfigure(m[1])
        elif kind == "report":
            self.link.send(("stats", stats_doc(self.proxy), m[1]))
        elif kind == "stop":
            self.stop.set()

    async def read(self) -> None:
        """The daemon's messages as they arrive, until the link closes: then nothing may
        be admitted any more, and the worker ends."""
        self.link.handle_with(self.handle)
        why = await self.link.wait_closed()
        self.daemon.lost(why)
        self.stop.set()

    async def report(self) -> None:
        last: dict[str, Any] | None = None
        while True:
            await asyncio.sleep(REPORT_S)
            assert self.proxy is not None
            doc = stats_doc(self.proxy)
            if doc != last:
                self.link.send(("stats", doc))
                last = doc

    async def run(self, listen_fd: int) -> int:
        kind, settings, engines = await self.link.recv()
        assert kind == "init"
        self.proxy = FrontProxy(settings, lanes=RemoteLanes(self.daemon))
        self.proxy.worker = self.index
        self.state(engines)
        await self.proxy.start(socket.socket(fileno=listen_fd))
        asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, self.stop.set)
        self.link.send(("ready", os.getpid()))
        tasks = [asyncio.create_task(self.read()), asyncio.create_task(self.report())]
        await self.stop.wait()
        await self.proxy.close()
        self.link.send(("stats", stats_doc(self.proxy)))
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await self.link.close()
        return 0


async def _main(args: argparse.Namespace) -> int:
    link = await Link.over(socket.socket(fileno=args.link_fd))
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
