"""The proxy workers' parts, without the processes: the wire between the daemon and a
worker (`supervisor/plane/wire.py`), over a real Unix socket pair (order kept, messages
split and joined across reads, bytes that are not this program's closing the link with a
reason instead of being read), and the counters of ended workers added up
(`supervisor/plane/pool.py`)."""

from __future__ import annotations

import asyncio
import pickle
import socket
import struct

from supervisor.plane.wire import HEADER, MAX_MESSAGE, Link, LinkClosed


async def pair() -> tuple[Link, Link]:
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    return await Link.over(a), await Link.over(b)


def test_messages_arrive_whole_and_in_order_before_and_after_a_handler() -> None:
    async def main() -> None:
        left, right = await pair()
        for i in range(500):
            left.send(("n", i, "x" * (i % 97)))
        first = [await right.recv() for _ in range(3)]  # before a handler: one by one
        got: list[tuple[object, ...]] = []
        all_in = asyncio.Event()

        def take(m: tuple[object, ...]) -> None:
            got.append(m)
            if len(got) == 597:
                all_in.set()

        right.handle_with(take)  # the rest, and what is still queued, in order
        for i in range(500, 600):
            left.send(("n", i, b"\0" * 70000))  # (larger than one read)
        await asyncio.wait_for(all_in.wait(), 10)
        assert [m[1] for m in first + got] == list(range(600))
        await left.close()
        assert "end" in await asyncio.wait_for(right.wait_closed(), 5)
        assert right.closed
        await right.close()

    asyncio.run(main())


def test_a_frame_split_across_writes_is_read_once_whole() -> None:
    async def main() -> None:
        a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        link = await Link.over(b)
        data = pickle.dumps(("hello", 1))
        frame = HEADER.pack(len(data)) + data
        a.setblocking(False)
        for i in range(len(frame)):  # a byte at a time
            a.send(frame[i:i + 1])
            await asyncio.sleep(0)
        assert await asyncio.wait_for(link.recv(), 5) == ("hello", 1)
        a.close()
        await link.close()

    asyncio.run(main())


def test_bytes_not_this_programs_close_the_link_with_a_reason() -> None:
    async def main() -> None:
        for garbage in (HEADER.pack(5) + b"\xffnope",  # not a pickle
                        HEADER.pack(len(pickle.dumps([1]))) + pickle.dumps([1]),  # no tuple
                        struct.pack("!I", MAX_MESSAGE + 1)):  # a length past any message
            a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
            link = await Link.over(b)
            a.sendall(garbage)
            why = await asyncio.wait_for(link.wait_closed(), 5)
            assert why and "end of the link" not in why, why
            try:
                await link.recv()
            except LinkClosed as exc:
                assert str(exc) == why
            else:
                raise AssertionError("read past a closed link")
            link.send(("ignored",))  # (a send to a closed link is dropped, not raised)
            a.close()

    asyncio.run(main())


def test_the_counters_of_ended_workers_add_up_into_one() -> None:
    from supervisor.plane.pool import added

    a = {"responses": {"200": 3}, "rejections": {}, "continuations": {"continued": 1},
         "refusals": {}, "retried_connects": 2,
         "latency": {("ttft", "m"): ([1, 2, 0], 0.5, 3)}}
    b = {"responses": {"200": 1, "503": 4}, "rejections": {"queue_full": 4},
         "continuations": {}, "refusals": {}, "retried_connects": 0,
         "latency": {("ttft", "m"): ([0, 1, 1], 2.0, 2), ("duration", "m"): ([1], 0.1, 1)}}
    out = added(added({}, a), b)
    assert out["responses"] == {"200": 4, "503": 4} and out["rejections"] == {"queue_full": 4}
    assert out["continuations"] == {"continued": 1} and out["retried_connects"] == 2
    assert out["latency"] == {("ttft", "m"): ([1, 3, 1], 2.5, 5),
                              ("duration", "m"): ([1], 0.1, 1)}
