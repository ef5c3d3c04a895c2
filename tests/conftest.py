from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests import hypothesis_profiles  # noqa: F401  (the suite's profile, loaded)
from tests.harness import PROXY_WORKERS, Daemon

# the modules whose daemons run their front door over one process and over two
# (`proxy.workers`): every promise of the proxy must hold whichever worker a client reached
TWO_WORKERS = ("test_proxy", "test_continuation_proxy", "test_fleet")


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if metafunc.module.__name__.rsplit(".", 1)[-1] in TWO_WORKERS \
            and "proxy_workers" in metafunc.fixturenames:
        metafunc.parametrize("proxy_workers", [1, 2], ids=["1-worker", "2-workers"],
                             indirect=True)


@pytest.fixture
def proxy_workers(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> int:
    """The proxy workers of the daemons this test starts (1 unless parametrized)."""
    n = int(getattr(request, "param", 1))
    monkeypatch.setenv(PROXY_WORKERS, str(n))
    return n


@pytest.fixture
def daemon_factory(tmp_path: Path, proxy_workers: int) -> Iterator[Callable[..., Daemon]]:
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
