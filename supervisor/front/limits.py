"""The front door's bounds (`Limits`, from settings/sections.py's [proxy] keys), how many client
connections fit under the daemon's descriptor limit, and the bytes of a refusal: what
`supervisor/front/connection.py` and `supervisor/front/server.py` share. Pure but for
reading the descriptor limit."""

from __future__ import annotations

import dataclasses
import json

from supervisor.front.messages import REASONS, date_header
from supervisor.ops import descriptors


@dataclasses.dataclass(frozen=True)
class Limits:
    """The server's bounds: sizes in bytes, times in seconds (settings/sections.py's [proxy]
    keys)."""

    max_line: int
    max_field: int
    max_body: int
    header_timeout_s: float = 60.0
    body_timeout_s: float = 60.0
    send_timeout_s: float = 60.0
    idle_timeout_s: float = 75.0
    max_connections: int = 4096
    max_buffered: int = 256 << 20
    retry_after_s: int = 5  # told to a connection refused above the cap

    @property
    def max_head(self) -> int:
        """A head, with its chunk framing and trailers, at most this many bytes."""
        return 8 * self.max_field


def connection_cap(wanted: int, soft_limit: int | None = None) -> int:
    """The open client connections served at most: `wanted`, or fewer where the
    descriptor limit (the daemon's soft RLIMIT_NOFILE) would not hold them. Each client
    connection may hold two descriptors (its own and one to its engine), and a reserve
    (a quarter of the limit, 256 at most) stays for the daemon's own work: the control
    socket, the engines' probes and pipes, /proc reads, the audit trail."""
    if soft_limit is None:
        soft_limit = descriptors.soft_limit()
    reserve = min(256, soft_limit // 4)
    return max(1, min(wanted, (soft_limit - reserve) // 2))


def refusal(status: int, message: str, kind: str = "bad_http",
            retry_after_s: int | None = None) -> bytes:
    """A whole answer that refuses, and closes: its JSON error says why."""
    body = json.dumps({"error": {"message": message, "type": kind, "code": status}}).encode()
    retry = f"Retry-After: {retry_after_s}\r\n" if retry_after_s is not None else ""
    return (f"HTTP/1.1 {status} {REASONS.get(status, '')}\r\nContent-Type: "
            f"application/json\r\nContent-Length: {len(body)}\r\n{date_header()}\r\n"
            f"{retry}Connection: close\r\n\r\n").encode("latin-1") + body
