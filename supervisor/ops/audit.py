"""The audit trail: every state change and action as one JSON line, size-rotated.

`events.jsonl`, `events.jsonl.1`, ... `events.jsonl.N` (oldest last). Appends are
small, flushed writes; the daemon calls `append` from its single state-owning task, and
a write error is reported to the caller, never raised into the lifecycle. Reading
(`tail`) touches only files, so the control handler runs it in a worker thread.

A write that fails because the daemon is out of file descriptors (EMFILE) keeps its
record, in order, for the next append that can open the file: at most `MAX_PENDING`
records, the oldest dropped beyond that and counted (`dropped`, and one
`audit_records_dropped` entry once writes go through again). Only the first failure of
such a run is reported to the caller (one log line per episode, not one per record).
"""

from __future__ import annotations

import json
import os
from collections import deque
from pathlib import Path
from typing import Any

from supervisor.ops.descriptors import exhausted

MAX_PENDING = 1000


class AuditTrail:
    def __init__(self, path: str, max_bytes: int, backups: int) -> None:
        self.path = Path(path)
        self.max_bytes = max_bytes
        self.backups = backups
        self.write_errors = 0
        self.dropped = 0  # records lost while out of descriptors (the oldest of them)
        self._pending: deque[bytes] = deque()  # kept while out of descriptors, in order
        self._dropped_unsaid = 0  # dropped since the last `audit_records_dropped` entry

    def append(self, record: dict[str, Any]) -> str | None:
        """Append one record; returns an error message instead of raising (None also
        while a run of descriptor shortages already reported keeps the record)."""
        line = json.dumps(record, separators=(",", ":"), default=str) + "\n"
        data = line.encode()
        if self._pending or self._dropped_unsaid:
            return self._append_kept(data, record.get("time"))
        try:
            self._write(data)
        except OSError as exc:
            self.write_errors += 1
            if exhausted(exc):
                self._keep(data)
                return (f"cannot append to {self.path}: {exc}; keeping up to {MAX_PENDING} "
                        "records until it can")
            return f"cannot append to {self.path}: {exc}"
        return None

    def _append_kept(self, data: bytes, time: Any) -> str | None:
        """Out of descriptors a moment ago: what was kept first, then this record."""
        self._keep(data)
        try:
            if self._dropped_unsaid:
                note = {"time": time, "event": "audit_records_dropped",
                        "count": self._dropped_unsaid,
                        "reason": "the daemon was out of file descriptors"}
                self._write(json.dumps(note, separators=(",", ":"), default=str).encode()
                            + b"\n")
                self._dropped_unsaid = 0
            while self._pending:
                self._write(self._pending[0])
                self._pending.popleft()
        except OSError as exc:
            self.write_errors += 1
            if exhausted(exc):
                return None  # (said at the start of this run; the records are kept)
            return f"cannot append to {self.path}: {exc}"
        return None

    def _keep(self, data: bytes) -> None:
        self._pending.append(data)
        while len(self._pending) > MAX_PENDING:
            self._pending.popleft()
            self.dropped += 1
            self._dropped_unsaid += 1

    def _write(self, data: bytes) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        try:
            size = self.path.stat().st_size
        except FileNotFoundError:
            size = 0
        if size and size + len(data) > self.max_bytes:
            self._rotate()
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o640)
        try:
            os.write(fd, data)
        finally:
            os.close(fd)

    def _rotate(self) -> None:
        if self.backups == 0:
            self.path.unlink(missing_ok=True)
            return
        for i in range(self.backups - 1, 0, -1):
            src = self.path.with_name(f"{self.path.name}.{i}")
            if src.exists():
                src.replace(self.path.with_name(f"{self.path.name}.{i + 1}"))
        self.path.replace(self.path.with_name(f"{self.path.name}.1"))

    def tail(self, n: int) -> list[dict[str, Any]]:
        """The last n records, oldest first, across rotated files and the records kept
        while out of descriptors (the newest). Skips damaged lines."""
        newest_first: list[dict[str, Any]] = []
        for raw in reversed(tuple(self._pending)):  # (a copy: append runs on the loop)
            if len(newest_first) >= n:
                break
            rec = json.loads(raw)
            if isinstance(rec, dict):
                newest_first.append(rec)
        files = [self.path] + [self.path.with_name(f"{self.path.name}.{i}")
                               for i in range(1, self.backups + 1)]
        for f in files:
            if len(newest_first) >= n:
                break
            try:
                lines = f.read_bytes().splitlines()
            except FileNotFoundError:
                continue
            for raw in reversed(lines):
                try:
                    rec = json.loads(raw)
                except ValueError:
                    continue
                if isinstance(rec, dict):
                    newest_first.append(rec)
                    if len(newest_first) >= n:
                        break
        return newest_first[::-1]
