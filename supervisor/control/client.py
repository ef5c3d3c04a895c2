"""A blocking client for the control socket, for the CLI and for tests."""

from __future__ import annotations

import contextlib
import socket
from typing import Any

from supervisor.control import protocol


class ControlClientError(Exception):
    """Could not talk to the daemon, or the daemon refused: one line for the operator."""


def recv_line(s: socket.socket) -> bytes:
    """One newline-terminated message (or what came before EOF)."""
    buf = b""
    while not buf.endswith(b"\n"):
        chunk = s.recv(65536)
        if not chunk:
            break
        buf += chunk
        if len(buf) > protocol.MAX_MESSAGE_BYTES:
            raise ControlClientError("reply from the daemon is too large")
    return buf


def call(path: str, cmd: str, args: dict[str, Any] | None = None,
         timeout_s: float = 30.0) -> dict[str, Any]:
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.settimeout(timeout_s)
            try:
                s.connect(path)
            except FileNotFoundError:
                raise ControlClientError(f"no control socket at {path} "
                                         "(is the daemon running?)") from None
            except ConnectionRefusedError:
                raise ControlClientError(f"nothing listens on {path} "
                                         "(the daemon is not running)") from None
            except PermissionError:
                raise ControlClientError(f"permission denied on {path} (run as root, "
                                         "the daemon's user or a member of control.group)"
                                         ) from None
            # refused before our request was read? its reason is still there to be read
            with contextlib.suppress(BrokenPipeError, ConnectionResetError):
                s.sendall(protocol.encode_request(cmd, args))
            buf = recv_line(s)
    except TimeoutError:
        raise ControlClientError(f"{cmd}: no reply within {timeout_s:g} s") from None
    except OSError as exc:
        raise ControlClientError(f"control socket {path}: {exc.strerror or exc}") from None
    if not buf:
        raise ControlClientError("the daemon closed the connection without replying")
    try:
        return protocol.decode_reply(buf)
    except protocol.ProtocolError as exc:
        raise ControlClientError(str(exc)) from None
