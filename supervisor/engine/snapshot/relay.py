"""A copy's port on the daemon's loopback: a relay from a host address into the copy's
network namespace (issue 49's route 3; `criu.Copy`).

A copy restored in namespaces of its own listens on the dumped engine's port in its own
loopback, which nothing of the daemon's can reach. The relay makes it an engine like any
other to the proxy, the probes and the watchdog: the daemon binds a free port of its own
loopback (`bind_free`), and the relay process accepts there and connects each connection
to the engine's port inside the copy, copying bytes both ways (HTTP, streams and all; a
half-close passed on).

The relay runs inside the copy's PID and network namespaces (`nsenter`), with the
listening socket made outside and handed down: a socket keeps the namespace it was made
in. In the copy's PID namespace it dies with the copy (the kernel kills every process of
a namespace whose init is gone), so it needs no ending of its own.

    python -m supervisor.engine.snapshot.relay FD PORT   # (as `start` runs it)
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import sys

CHUNK = 1 << 16


def bind_free(host: str = "127.0.0.1") -> socket.socket:
    """A listening socket on a port the kernel gives as free, in the caller's namespace.
    SO_REUSEADDR, which the connections it accepts inherit: once the relay is gone, their
    ends linger on the port (closed first, by the relay's death, while the proxy's ends
    stay open), and without it they hold the port against the take-down's check that it
    is free (on the H200 that check waited out its 10 s at every fault of a copy)."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, 0))
    sock.listen(512)
    return sock


def argv(root: int, fd: int, port: int) -> list[str]:
    """The relay's command line: into `root`'s PID and network namespaces, `fd` (a
    listening socket, handed down) to `port` there."""
    return ["nsenter", f"--target={root}", "--net", "--pid", "--",
            sys.executable, "-m", "supervisor.engine.snapshot.relay", str(fd), str(port)]


async def start(root: int, listening: socket.socket, port: int
                ) -> asyncio.subprocess.Process:
    """The relay for the copy whose process `root` is: `listening` (made here, handed
    down) to `port` inside the copy. Its `nsenter` ends when the relay does."""
    fd = listening.fileno()
    return await asyncio.create_subprocess_exec(
        *argv(root, fd, port), pass_fds=(fd,), stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.DEVNULL,
        start_new_session=True)


async def _pump(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """One direction, to its end: the other side's write half closed after it."""
    try:
        while chunk := await reader.read(CHUNK):
            writer.write(chunk)
            await writer.drain()
        if writer.can_write_eof():
            writer.write_eof()
    except (ConnectionError, OSError):
        writer.close()


async def _connection(port: int, client_r: asyncio.StreamReader,
                      client_w: asyncio.StreamWriter) -> None:
    try:
        engine_r, engine_w = await asyncio.open_connection("127.0.0.1", port)
    except OSError:
        client_w.close()  # (the copy's engine is not listening: the client sees a reset)
        return
    try:
        await asyncio.gather(_pump(client_r, engine_w), _pump(engine_r, client_w))
    finally:
        for w in (engine_w, client_w):
            w.close()
            with contextlib.suppress(ConnectionError, OSError):
                await w.wait_closed()


async def serve(fd: int, port: int) -> None:
    listening = socket.socket(fileno=fd)
    listening.setblocking(False)
    server = await asyncio.start_server(
        lambda r, w: _connection(port, r, w), sock=listening)
    async with server:
        await server.serve_forever()


if __name__ == "__main__":
    asyncio.run(serve(int(sys.argv[1]), int(sys.argv[2])))
