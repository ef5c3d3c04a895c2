"""The control socket's server: framing, peer checks and error replies.

Owns the listening socket and its connections, nothing else. Each well-formed,
authorised request is handed to `submit` (the supervisor's queue) and its answer sent
back; the server never touches the daemon's state. A client that sends garbage, too
much, or nothing at all costs one bounded connection and gets an error reply; whatever
fails while serving a connection is logged as one line naming its type, never with a
traceback (its frames hold the client's bytes).
"""

from __future__ import annotations

import asyncio
import contextlib
import grp
import logging
import os
import socket
import stat
import struct
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import structlog

from supervisor.control import protocol
from supervisor.settings.sections import ControlConfig

log = structlog.get_logger("supervisor.control")

Submit = Callable[[str, dict[str, Any]], Awaitable[dict[str, Any]]]
MAX_CONNECTIONS = 32
# how long a reply may take, per command; stop waits for the whole bounded stop
REPLY_TIMEOUT_S = {"stop": 3600.0, "restart": 30.0, "kv-reset": 600.0}
DEFAULT_REPLY_TIMEOUT_S = 30.0


class ControlSocketError(Exception):
    pass


def peer_credentials(sock: socket.socket) -> tuple[int, int, int]:
    """(pid, uid, gid) of the peer, from the kernel (SO_PEERCRED)."""
    raw = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    pid, uid, gid = struct.unpack("3i", raw)
    return pid, uid, gid


def peer_groups(pid: int, gid: int) -> set[int]:
    """The peer's primary and supplementary groups (from /proc; primary only if gone)."""
    groups = {gid}
    with contextlib.suppress(OSError, ValueError):
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("Groups:"):
                groups.update(int(g) for g in line.split()[1:])
    return groups


def is_authorised(uid: int, groups: set[int], own_uid: int, allowed_gid: int | None) -> bool:
    """Root, the daemon's own user, or a member of the configured group."""
    return uid == 0 or uid == own_uid or (allowed_gid is not None and allowed_gid in groups)


class ControlServer:
    def __init__(self, cfg: ControlConfig, submit: Submit) -> None:
        self.path = Path(cfg.socket)
        self.group = cfg.group
        self._submit = submit
        self._server: asyncio.AbstractServer | None = None
        self._allowed_gid: int | None = None
        self._conns: set[asyncio.Task[None]] = set()

    async def start(self) -> None:
        if self.group:
            try:
                self._allowed_gid = grp.getgrnam(self.group).gr_gid
            except KeyError:
                raise ControlSocketError(f"control.group: no group named {self.group!r}") from None
        self.path.parent.mkdir(parents=True, exist_ok=True)
        await self._remove_stale()
        self._server = await asyncio.start_unix_server(
            self._accept, path=str(self.path), limit=protocol.MAX_MESSAGE_BYTES)
        os.chmod(self.path, 0o660)
        if self._allowed_gid is not None:
            os.chown(self.path, -1, self._allowed_gid)

    async def _remove_stale(self) -> None:
        """A socket file left by a dead daemon is removed; a live one is an error."""
        try:
            mode = self.path.lstat().st_mode
        except FileNotFoundError:
            return
        if not stat.S_ISSOCK(mode):
            raise ControlSocketError(f"control.socket: {self.path} exists and is not a socket")
        try:
            _, writer = await asyncio.wait_for(asyncio.open_unix_connection(str(self.path)), 2)
        except (OSError, TimeoutError):
            self.path.unlink(missing_ok=True)
            return
        writer.close()
        raise ControlSocketError(f"control.socket: {self.path} is in use by a running daemon")

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            # let replies in flight (the answer to `stop`) reach their clients
            if self._conns:
                await asyncio.wait(self._conns, timeout=2.0)
            for t in self._conns:
                t.cancel()
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._server.wait_closed(), 2.0)
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._conns.add(task)
        try:
            await self._serve(reader, writer)
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        except Exception as exc:  # one connection's fault never reaches the loop
            log.error("control connection failed", error=type(exc).__name__)
            with contextlib.suppress(Exception):
                writer.write(protocol.encode_error(
                    f"internal error serving this connection ({type(exc).__name__})"))
                await asyncio.wait_for(writer.drain(), 1.0)
        finally:
            self._conns.discard(task)
            writer.close()
            with contextlib.suppress(Exception):
                await writer.wait_closed()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        sock = writer.get_extra_info("socket")
        pid, uid, gid = peer_credentials(sock)
        if len(self._conns) > MAX_CONNECTIONS:
            await self._refuse(writer, "too many control connections", pid=pid, uid=uid)
            return
        if not is_authorised(uid, peer_groups(pid, gid), os.getuid(), self._allowed_gid):
            await self._refuse(writer, f"unauthorised: uid {uid} may not use this socket",
                               pid=pid, uid=uid)
            return
        while True:
            try:
                line = await asyncio.wait_for(reader.readuntil(b"\n"), protocol.IDLE_TIMEOUT_S)
            except TimeoutError:
                return
            except asyncio.IncompleteReadError as exc:
                if exc.partial.strip():
                    await self._refuse(writer, "malformed request: no newline before EOF",
                                       pid=pid, uid=uid)
                return
            except asyncio.LimitOverrunError:
                await self._refuse(writer, f"request exceeds {protocol.MAX_MESSAGE_BYTES} "
                                           "bytes", pid=pid, uid=uid)
                return
            try:
                req = protocol.decode_request(line)
            except protocol.ProtocolError as exc:
                await self._refuse(writer, str(exc), pid=pid, uid=uid)
                continue
            except Exception as exc:  # (decode_request should raise nothing else)
                await self._refuse(writer, f"malformed request ({type(exc).__name__})",
                                   pid=pid, uid=uid)
                continue
            log.log(logging.DEBUG if req.cmd in protocol.READS else logging.INFO,
                    "control request", cmd=req.cmd, peer_pid=pid, peer_uid=uid)
            timeout = REPLY_TIMEOUT_S.get(req.cmd, DEFAULT_REPLY_TIMEOUT_S)
            try:
                result = await asyncio.wait_for(self._submit(req.cmd, req.args), timeout)
                writer.write(protocol.encode_ok(result))
            except TimeoutError:
                writer.write(protocol.encode_error(f"{req.cmd}: no answer within {timeout:g} s"))
            except Exception as exc:  # a refused command: its message goes to the client
                writer.write(protocol.encode_error(str(exc)))
            await writer.drain()
            if req.cmd == "stop":
                return  # the daemon is gone after this reply: nothing more to read

    async def _refuse(self, writer: asyncio.StreamWriter, message: str, *, pid: int,
                      uid: int) -> None:
        log.warning("control request refused", error=message, peer_pid=pid, peer_uid=uid)
        writer.write(protocol.encode_error(message))
        with contextlib.suppress(ConnectionError):
            await writer.drain()
