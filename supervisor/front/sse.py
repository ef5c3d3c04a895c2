"""Server-sent events as vLLM streams them: an event's bytes, the explicit error event
that ends a stream which cannot be finished, and the framing of events out of bytes as
they arrive (`EventReader`). Pure: no I/O."""

from __future__ import annotations

import json
from typing import Any

DONE = b"data: [DONE]\n\n"


def event(doc: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(doc, separators=(",", ":")).encode() + b"\n\n"


def error_event(message: str, code: int = 502, kind: str = "engine_failed") -> bytes:
    """The explicit end of a stream that cannot be finished: an error event, no [DONE]."""
    return event({"error": {"message": message, "type": kind, "code": code}})


class EventReader:
    """SSE framing: bytes as they arrive -> each complete event's data (comments and
    other fields dropped; several data lines joined with a newline, as the SSE rules say)."""

    def __init__(self) -> None:
        self._buf = b""

    def pending_and(self, chunk: bytes) -> bytes:
        """The bytes of an unfinished event, taken out, and `chunk` after them; `keep`
        gives back what is left unread (Transcript.read frames events itself)."""
        buf, self._buf = (self._buf + chunk if self._buf else chunk), b""
        return buf

    def keep(self, rest: bytes) -> None:
        self._buf = rest

    def feed(self, chunk: bytes) -> list[bytes]:
        buf = self._buf + chunk if self._buf else chunk
        if b"\r" in buf:
            buf = buf.replace(b"\r\n", b"\n")
        *events, self._buf = buf.split(b"\n\n")
        out = []
        for ev in events:
            if ev.startswith(b"data: ") and b"\n" not in ev and ev[6:7] != b" ":  # usual
                out.append(ev[6:])
                continue
            data = [line[5:].lstrip(b" ") if line.startswith(b"data:") else None
                    for line in ev.split(b"\n")]
            lines = [d for d in data if d is not None]
            if lines:
                out.append(b"\n".join(lines))
        return out

    @property
    def pending(self) -> bool:
        """Bytes of an unfinished event are waiting (a stream that ends here was cut)."""
        return bool(self._buf.strip())
