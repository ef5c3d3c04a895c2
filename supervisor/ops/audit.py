"""The audit trail: every state change and action as one JSON line, size-rotated.

`events.jsonl`, `events.jsonl.1`, ... `events.jsonl.N` (oldest last). Appends are
small, flushed writes; the daemon calls `append` from its single state-owning task, and
a write error is reported to the caller, never raised into the lifecycle. Reading
(`tail`) touches only files, so the control handler runs it in a worker thread.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any


class AuditTrail:
    def __init__(self, path: str, max_bytes: int, backups: int) -> None:
        self.path = Path(path)
        self.max_bytes = max_bytes
        self.backups = backups
        self.write_errors = 0

    def append(self, record: dict[str, Any]) -> str | None:
        """Append one record; returns an error message instead of raising."""
        line = json.dumps(record, separators=(",", ":"), default=str) + "\n"
        data = line.encode()
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            try:
                size = self.path.stat().st_size
            except FileNotFoundError:
                size = 0
            if size and size + len(data) > self.max_bytes:
                self._rotate()
            fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC,
                         0o640)
            try:
                os.write(fd, data)
            finally:
                os.close(fd)
        except OSError as exc:
            self.write_errors += 1
            return f"cannot append to {self.path}: {exc}"
        return None

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
        """The last n records, oldest first, across rotated files. Skips damaged lines."""
        newest_first: list[dict[str, Any]] = []
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
