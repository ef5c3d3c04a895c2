"""Fetching vLLM's `/metrics` and judging the stream of scrapes. Fetching is apart from
parsing (`metrics.parse_metrics`), and both are apart from the daemon's state.

`scrape` takes an `httpx.AsyncClient`, so tests can pass `httpx.MockTransport`; it
never raises for an engine's fault (HTTP error, timeout, garbage): it returns the
reason. The daemon's own fault (out of file descriptors) is no scrape at all: it raises
`OutOfDescriptors`. `ScrapeHealth` is pure bookkeeping, fed by the daemon's state-owning task:
failures counted, reported once per streak, and staleness: a snapshot that stops
changing while requests are running means the engine (and its metrics) froze, since
`/health` keeps answering 200 for a stopped EngineCore.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

import httpx

from supervisor.ops.descriptors import raise_if_exhausted
from supervisor.watchdog.metrics import MetricsParseError, Snapshot, parse_metrics

# how a scrape that timed out begins its reason: the API server did not answer at all
# (`ScrapeHealth.silent`), as against one that answered wrongly
NO_ANSWER = "no answer within"


async def scrape(client: httpx.AsyncClient, url: str,
                 timeout_s: float) -> tuple[Snapshot | None, str | None]:
    """(snapshot, None) or (None, why it failed)."""
    try:
        r = await client.get(url, timeout=timeout_s)
    except httpx.TimeoutException:
        return None, f"{NO_ANSWER} {timeout_s:g} s"
    except (httpx.HTTPError, OSError) as exc:  # (httpx lets a bare OSError through)
        raise_if_exhausted(exc)
        return None, f"{type(exc).__name__}: {exc}"
    if r.status_code != 200:
        return None, f"HTTP {r.status_code}"
    try:
        # ~13 ms for a 600-line page (docs/benchmarks.md): off the event loop
        return await asyncio.to_thread(parse_metrics, r.text), None
    except MetricsParseError as exc:
        return None, str(exc)


@dataclass
class ScrapeHealth:
    failures_total: int = 0
    streak: int = 0  # consecutive failures now
    last: Snapshot | None = None
    last_at: float | None = None  # monotonic time of the last good scrape
    unchanged_since: float | None = None  # first scrape of a run of identical ones, busy
    silent: bool = False  # the last scrape timed out: no answer at all (`NO_ANSWER`)

    def failed(self, silent: bool = False) -> bool:
        """Count a failure (`silent`: it timed out); True when it starts a streak (the
        one to log)."""
        self.failures_total += 1
        self.streak += 1
        self.silent = silent
        return self.streak == 1

    def succeeded(self, snap: Snapshot, now: float) -> int:
        """Record a good scrape; returns the length of the failure streak it ended."""
        ended, self.streak, self.silent = self.streak, 0, False
        busy = (snap.requests_running or 0) > 0
        if busy and snap == self.last:
            if self.unchanged_since is None:
                self.unchanged_since = self.last_at
        else:
            self.unchanged_since = None
        self.last, self.last_at = snap, now
        return ended

    def staleness_s(self, now: float) -> float:
        """How long the metrics have not moved while requests were running (0 if they move)."""
        return 0.0 if self.unchanged_since is None else now - self.unchanged_since

    def reset(self) -> None:
        """A new engine: its counters start afresh."""
        self.last = self.last_at = self.unchanged_since = None
        self.streak, self.silent = 0, False
