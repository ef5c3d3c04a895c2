"""The proxy workers' wire (`supervisor/plane/wire.py`) over a real Unix socket pair,
without the processes: order kept, frames split and joined across reads, each end's
hello first and its protocol checked, and bytes that are not a message this end takes
(garbage, a pickle, an oversized length, an unknown kind, a wrong field, another
protocol's hello, no hello) refusing the link with one log line that names the kind and
size, never the content."""

from __future__ import annotations

import asyncio
import pickle
import socket
import struct

import structlog

from supervisor.plane import codec
from supervisor.plane.messages import (
    HELLO_NOW,
    PROTOCOL,
    SCHEMA,
    TO_DAEMON,
    TO_WORKER,
    Done,
    Hello,
    Pause,
    Report,
    ToDaemon,
    ToWorker,
)
from supervisor.plane.wire import HEADER, MAX_FRAME, Link, LinkClosed

REFUSED = "the proxy workers' link refused a message, and closed"


def frame(body: bytes) -> bytes:
    return HEADER.pack(len(body)) + body


HELLO = frame(codec.encode(HELLO_NOW))


async def pair() -> tuple[Link[ToDaemon, ToWorker], Link[ToWorker, ToDaemon]]:
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    return await Link.over(a, TO_DAEMON), await Link.over(b, TO_WORKER)


def test_messages_arrive_whole_and_in_order_before_and_after_a_handler() -> None:
    async def main() -> None:
        daemon, worker = await pair()
        for i in range(500):
            daemon.send(Report(i))
        first = [await worker.recv() for _ in range(3)]  # before a handler: one by one
        got: list[ToWorker] = []
        all_in = asyncio.Event()

        def take(m: ToWorker) -> None:
            got.append(m)
            if len(got) == 597:
                all_in.set()

        worker.handle_with(take)  # the rest, and what is still queued, in order
        for i in range(500, 600):
            daemon.send(Pause(f"{i}:" + "x" * 70000))  # (larger than one read)
        await asyncio.wait_for(all_in.wait(), 10)
        assert [m.asked if isinstance(m, Report) else int(m.engine.split(":")[0])
                for m in first + got] == list(range(600))
        worker.send(Done(5))  # (and the other way, packed)
        assert await asyncio.wait_for(daemon.recv(), 5) == Done(5)
        await daemon.close()
        assert "end" in await asyncio.wait_for(worker.wait_closed(), 5)
        assert worker.closed and worker.fault is None
        await worker.close()

    asyncio.run(main())


def test_a_frame_split_across_writes_is_read_once_whole() -> None:
    async def main() -> None:
        a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        link: Link[ToWorker, ToDaemon] = await Link.over(b, TO_WORKER)
        data = HELLO + frame(codec.encode(Report(1)))
        a.setblocking(False)
        for i in range(len(data)):  # a byte at a time
            a.send(data[i:i + 1])
            await asyncio.sleep(0)
        assert await asyncio.wait_for(link.recv(), 5) == Report(1)
        # a frame whose length says more than comes before the end: nothing of it read
        a.send(HEADER.pack(100) + b'["report",')
        a.close()  # (unread, the link's hello: the end reads as a reset)
        await asyncio.wait_for(link.wait_closed(), 5)
        assert link.fault is None
        try:
            await link.recv()
        except LinkClosed:
            pass
        else:
            raise AssertionError("a cut frame was read")
        await link.close()

    asyncio.run(main())


class Runs:
    """Unpickled, it would call `exit`: the pickled wire would have run it."""

    def __reduce__(self) -> tuple[object, tuple[object, ...]]:
        return (exit, ("ran",))


BAD = {  # what the other end sends -> the kind the log line names
    "garbage": (HELLO + frame(b"\xffnope"), "?"),
    "a pickle that would run code": (HELLO + frame(pickle.dumps(Runs())), "?"),
    "a length past any frame": (HELLO + struct.pack("!I", MAX_FRAME + 1), "?"),
    "an unknown kind": (HELLO + frame(b'["exec","rm -rf"]'), "exec"),
    "a field of the wrong type": (HELLO + frame(b'["cancel","1",true]'), "cancel"),
    "a kind of the other way": (HELLO + frame(codec.encode(Report(1))), "report"),
    "another protocol's hello": (frame(codec.encode(Hello(PROTOCOL + 1, SCHEMA))), "hello"),
    "another schema's hello": (frame(codec.encode(Hello(PROTOCOL, "0" * 16))), "hello"),
    "no hello first": (frame(codec.encode(Done(1))), "?"),
    "a hello twice": (HELLO + HELLO, "hello"),
}


def test_what_is_not_a_message_of_this_protocol_refuses_the_link_with_a_reason() -> None:
    async def main() -> None:
        for what, (data, kind) in BAD.items():
            a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
            link: Link[ToDaemon, ToWorker] = await Link.over(b, TO_DAEMON, worker=3)
            got: list[ToDaemon] = []
            link.handle_with(got.append)
            with structlog.testing.capture_logs() as logs:
                a.sendall(data + frame(codec.encode(Done(1))))  # (a good one after it)
                why = await asyncio.wait_for(link.wait_closed(), 5)
            assert "refused" in why and link.fault is not None, what
            assert got == [], what  # nothing after the refusal is read
            [line] = [r for r in logs if r["event"] == REFUSED]
            assert line["kind"] == kind and line["worker"] == 3, (what, line)
            assert line["size"] == link.fault.size > 0, (what, line)
            assert "rm -rf" not in str(logs), what  # (the kind, never the content)
            if what == "another protocol's hello":
                [v] = [r for r in logs if "another protocol" in r["event"]]
                assert (v["protocol"], v["other"]) == (PROTOCOL, PROTOCOL + 1)
            if what == "another schema's hello":
                [v] = [r for r in logs if "another protocol" in r["event"]]
                assert (v["schema"], v["other_schema"]) == (SCHEMA, "0" * 16)
            try:
                await link.recv()
            except LinkClosed as exc:
                assert str(exc) == why
            else:
                raise AssertionError("read past a refused link")
            link.send(Report(1))  # (a send to a closed link is dropped, not raised)
            await link.close()
            a.close()

    asyncio.run(main())
