from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.harness import Daemon


@pytest.fixture
def daemon_factory(tmp_path: Path) -> Iterator[Callable[..., Daemon]]:
    started: list[Daemon] = []

    def start(sections: dict[str, dict[str, Any]], env: dict[str, str] | None = None,
              sub: str = "") -> Daemon:
        where = tmp_path / sub if sub else tmp_path
        where.mkdir(exist_ok=True)
        d = Daemon(where, sections, env)
        started.append(d)
        return d

    yield start
    for d in started:
        d.close()
