"""The KV reset's calls to an engine (`supervisor/watchdog/remedy.py`), in order, through
httpx.MockTransport: an engine older than vLLM 0.26 is told to sleep only once its own
count of requests (running and waiting, on its /metrics) reads 0, waited for within a
bound; one that publishes no count is not waited on; one whose count stays up is not put
to sleep. A vLLM 0.26+ engine (its sleep aborts what is at it) is told to sleep at once;
where it serves /pause, it is paused instead (its cache emptied without a sleep), checked,
resumed. The daemon's side, through the proxy and the fake engine, is in
tests/test_continuation_proxy.py (issue 48)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import httpx
import pytest

from supervisor.watchdog import remedy

BASE = "http://engine"
METRICS = BASE + "/metrics"


def page(running: float | None, waiting: float | None = 0) -> str:
    lines = ["# HELP vllm:num_requests_running Number of requests in model execution batches."]
    if running is not None:
        lines.append(f'vllm:num_requests_running{{engine="0",model_name="m"}} {running}')
    if waiting is not None:
        lines.append(f'vllm:num_requests_waiting{{engine="0",model_name="m"}} {waiting}')
    return "\n".join(lines) + "\n"


class Engine:
    """vLLM's routes as a KV reset meets them; its /metrics pages, one per read (the last
    one repeated), and every call in order."""

    def __init__(self, pages: list[str | int], version: str | None = None) -> None:
        self.pages = pages  # a page's text, or an HTTP status to answer instead
        self.version = version  # what GET /version says (None: 404, as before 0.2)
        self.calls: list[str] = []
        self.asleep = False
        self.paused = False
        self.pause_status = 200  # what POST /pause answers (404: not served)
        self.blocks_held = False  # POST /reset_prefix_cache's `success: false`
        self.held_for = 0  # or only for its first so many answers (offloads in flight)

    def __call__(self, req: httpx.Request) -> httpx.Response:
        path = req.url.path + (f"?{req.url.query.decode()}" if req.url.query else "")
        self.calls.append(f"{req.method} {path}")
        if path == "/metrics":
            p = self.pages.pop(0) if len(self.pages) > 1 else self.pages[0]
            return httpx.Response(p, text="") if isinstance(p, int) else \
                httpx.Response(200, text=p)
        if path == "/version" and self.version is not None:
            return httpx.Response(200, json={"version": self.version})
        if path in ("/sleep?level=1", "/sleep?level=1&mode=abort"):
            self.asleep = True
            return httpx.Response(200)
        if path == "/wake_up":
            self.asleep = False
            return httpx.Response(200)
        if path == "/is_sleeping":
            return httpx.Response(200, json={"is_sleeping": self.asleep})
        if path == "/pause?mode=abort&clear_cache=true":
            self.paused = self.pause_status == 200
            return httpx.Response(self.pause_status, json={"status": "paused"})
        if path == "/reset_prefix_cache":
            held = self.blocks_held or self.calls.count("POST /reset_prefix_cache") \
                <= self.held_for
            return httpx.Response(200, json={"success": not held})
        if path == "/resume":
            self.paused = False
            return httpx.Response(200, json={"status": "resumed"})
        if path == "/is_paused":
            return httpx.Response(200, json={"is_paused": self.paused})
        if path == "/v1/completions":
            return httpx.Response(200, json={"choices": [{"index": 0, "text": "x"}]})
        return httpx.Response(404)

    def reads_before_sleep(self) -> int:
        return self.calls[:self.calls.index("POST /sleep?level=1")].count("GET /metrics")


def reset(engine: Callable[[httpx.Request], httpx.Response], metrics: str | None,
          within_s: float, version: str | None = None, pause: bool = False,
          sleep: bool = True) -> remedy.RemedyOutcome:
    async def go() -> remedy.RemedyOutcome:
        async with httpx.AsyncClient(transport=httpx.MockTransport(engine)) as client:
            return await remedy.kv_reset(client, BASE, "m", "hi", 5.0, 5.0,
                                         metrics_url=metrics, idle_within_s=within_s,
                                         version=version, pause=pause, sleep=sleep)
    return asyncio.run(go())


@pytest.fixture
def short_bounds(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(remedy, "ENGINE_IDLE_MIN_S", 0.1)
    monkeypatch.setattr(remedy, "ENGINE_IDLE_POLL_S", 0.01)


def test_the_engine_sleeps_only_once_its_own_count_reads_zero(short_bounds: None) -> None:
    """The proxy's requests were paused (their connections closed) and the engine still
    counts them until it has aborted them: the sleep waits for its count, the waiting
    ones included."""
    e = Engine([page(6), page(2, 1), page(0, 1), page(0, 0)])
    out = reset(e, METRICS, 10.0)
    assert out.ok and out.error is None, out
    assert list(out.steps) == ["engine_idle", "sleep", "wake_up", "canary"]
    assert e.reads_before_sleep() == 4  # the last of them read 0
    assert e.calls[-4:] == ["POST /sleep?level=1", "POST /wake_up", "GET /is_sleeping",
                            "POST /v1/completions"]
    # the wait's reads, each change once: 6, then 3 (2 running, 1 waiting), 1, 0
    assert out.idle_counts is not None
    assert [c for _, c in out.idle_counts] == [6, 3, 1, 0]
    seconds = [t for t, _ in out.idle_counts]
    assert seconds == sorted(seconds) and seconds[0] >= 0


def test_the_idle_trace_keeps_its_first_reads_and_always_the_last() -> None:
    trace = remedy.IdleTrace()
    for n in [256.0, 256.0, None, *range(255, -1, -1)]:
        trace.read(n)
    counts = [c for _, c in trace.points]
    assert len(counts) == remedy.IDLE_TRACE_MAX
    assert counts[:3] == [256, 255, 254] and counts[-1] == 0


def test_an_engine_that_publishes_no_count_is_not_waited_on(short_bounds: None) -> None:
    """No `vllm:num_requests_*` series on its page (the count unknown, never 0): one
    read, then the sleep."""
    e = Engine([page(None, None)])
    out = reset(e, METRICS, 10.0)
    assert out.ok, out
    assert e.reads_before_sleep() == 1


def test_without_the_metrics_page_the_reset_reads_nothing_first() -> None:
    """`metrics.enabled = false`: the daemon reads no page of the engine's."""
    e = Engine([page(3)])
    out = reset(e, None, 10.0)
    assert out.ok and list(out.steps) == ["sleep", "wake_up", "canary"], out
    assert "GET /metrics" not in e.calls


@pytest.mark.parametrize(("pages", "why"), [
    ([page(3)], "3 requests still at the engine by its own count after 0.3 s"),
    ([503], "unread: HTTP 503 after 0.3 s"),
], ids=["count_stays_up", "page_unread"])
def test_an_engine_whose_count_stays_up_is_not_put_to_sleep(
        short_bounds: None, pages: list[str | int], why: str) -> None:
    """Bounded: past its bound the reset is not attempted (nothing touched, no restart
    follows), rather than sleep an engine with requests at it."""
    e = Engine(pages)
    out = reset(e, METRICS, 0.3)
    assert not out.ok and not out.attempted, out
    assert out.error is not None and why in out.error and "not touched" in out.error
    assert list(out.steps) == ["engine_idle"] and 0.3 <= out.steps["engine_idle"] < 5
    assert not any(c.startswith("POST") for c in e.calls)  # never told to sleep
    # what it read, for the operator: the count that stayed up, or nothing read
    assert [c for _, c in out.idle_counts or ()] == ([3] if pages == [page(3)] else [])


def test_the_wait_is_at_least_its_floor_whatever_the_drain_left(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A drain that used its whole timeout on other requests still leaves vLLM the time
    to abort the paused ones (a step or two)."""
    monkeypatch.setattr(remedy, "ENGINE_IDLE_MIN_S", 0.3)
    monkeypatch.setattr(remedy, "ENGINE_IDLE_POLL_S", 0.01)
    e = Engine([page(1), page(1), page(0)])
    out = reset(e, METRICS, -2.0)  # (drain_timeout_s minus a longer drain)
    assert out.ok, out
    assert e.reads_before_sleep() == 3


AFTER_SLEEP = ["POST /wake_up", "GET /is_sleeping", "POST /v1/completions"]


def test_an_engine_whose_sleep_aborts_its_requests_is_told_to_sleep_at_once(
        short_bounds: None) -> None:
    """vLLM 0.26+ (its /version read, its start lines having said none: a restored
    copy's): its sleep aborts every request at it and queues new ones until its wake, so
    its count of the paused streams' requests is not waited out; `mode=abort` is said
    rather than left to the default."""
    e = Engine([page(256)], version="0.26.0")
    out = reset(e, METRICS, 10.0)
    assert out.ok and out.error is None, out
    assert e.calls == ["GET /version", "POST /sleep?level=1&mode=abort", *AFTER_SLEEP]
    assert list(out.steps) == ["sleep", "wake_up", "canary"]
    assert out.idle_counts is None and out.vllm_version == "0.26.0"


def test_a_version_known_from_the_start_lines_is_not_asked_again(short_bounds: None) -> None:
    e = Engine([page(3)], version="0.1.0")  # (what /version would say: never asked)
    out = reset(e, METRICS, 10.0, version="0.33.0")
    assert out.ok, out
    assert e.calls == ["POST /sleep?level=1&mode=abort", *AFTER_SLEEP]
    assert out.vllm_version == "0.33.0"


@pytest.mark.parametrize("version", ["0.25.1", None, "garbage"])
def test_an_older_or_unknown_version_waits_for_the_count_and_says_no_mode(
        short_bounds: None, version: str | None) -> None:
    """0.25 and before, a /version that is not there, or one that does not read: the
    wait, then the plain sleep of every vLLM."""
    e = Engine([page(2), page(0)], version=version)
    out = reset(e, METRICS, 10.0)
    assert out.ok, out
    assert e.calls[0] == "GET /version" and e.reads_before_sleep() == 2
    assert "POST /sleep?level=1" in e.calls
    assert list(out.steps) == ["engine_idle", "sleep", "wake_up", "canary"]
    assert out.vllm_version == version


@pytest.mark.parametrize(("version", "aborts"), [
    ("0.26.0", True), ("0.26.1.dev12+g3f5e1a", True), ("0.33.0", True), ("1.0.0", True),
    ("v0.27.0rc1", True), ("0.25.9", False), ("0.3.3", False), ("0.2", False), ("", False),
    (None, False), ("dev", False), ("0.x", False),
])
def test_which_versions_abort_at_their_sleep(version: str | None, aborts: bool) -> None:
    assert remedy.sleep_aborts(version) is aborts


class RefusesMode(Engine):
    """A 0.26+ engine behind a front end that refuses `mode` on /sleep, as a validating
    API answers a parameter it does not take."""

    def __call__(self, req: httpx.Request) -> httpx.Response:
        if req.url.query and b"mode=" in req.url.query:
            self.calls.append(f"{req.method} {req.url.path}?{req.url.query.decode()}")
            return httpx.Response(422, json={"detail": "unknown parameter: mode"})
        return super().__call__(req)


def test_a_sleep_whose_mode_is_refused_is_asked_again_the_older_way(
        short_bounds: None) -> None:
    """The refusal touched nothing: no restart for it, but the wait and the plain sleep."""
    e = RefusesMode([page(2), page(0)], version="0.33.0")
    out = reset(e, METRICS, 10.0)
    assert out.ok and out.error is None, out
    assert e.calls[:2] == ["GET /version", "POST /sleep?level=1&mode=abort"]
    assert e.calls[-4:] == ["POST /sleep?level=1", *AFTER_SLEEP]
    assert e.reads_before_sleep() == 2
    assert list(out.steps) == ["sleep_mode_refused", "engine_idle", "sleep", "wake_up",
                               "canary"]
    assert [c for _, c in out.idle_counts or ()] == [2, 0]


def test_a_sleep_that_fails_otherwise_is_a_failed_reset(short_bounds: None) -> None:
    """A 500 (or no answer) may have left the engine asleep or broken: failed, attempted,
    for the daemon's restart to follow."""
    def engine(req: httpx.Request) -> httpx.Response:
        if req.url.path == "/sleep":
            return httpx.Response(500, text="EngineDeadError")
        return Engine([page(0)], version="0.26.0")(req)
    out = reset(engine, METRICS, 10.0)
    assert not out.ok and out.attempted and "HTTP 500" in (out.error or ""), out


# ---- a KV reset without a sleep: pause, check, resume ---------------------------------

PAUSED = ["POST /pause?mode=abort&clear_cache=true", "POST /reset_prefix_cache",
          "POST /resume", "GET /is_paused", "POST /v1/completions"]


@pytest.mark.parametrize("sleep", [True, False])
def test_an_engine_that_empties_its_cache_when_paused_is_paused_not_put_to_sleep(
        short_bounds: None, sleep: bool) -> None:
    """vLLM 0.26+ with /pause served: no sleep, no wake, no wait for its count (the pause
    aborts what is at it), with or without sleep mode (vLLM's CPU build has none)."""
    e = Engine([page(256)], version="0.26.0")
    out = reset(e, METRICS, 10.0, pause=True, sleep=sleep)
    assert out.ok and out.error is None, out
    assert e.calls == ["GET /version", *PAUSED]
    assert list(out.steps) == ["pause", "check", "resume", "canary"]
    assert out.idle_counts is None and out.vllm_version == "0.26.0" and not e.paused


@pytest.mark.parametrize("status", [404, 405, 422])
def test_a_pause_refused_as_unknown_goes_on_to_the_sleep(short_bounds: None,
                                                         status: int) -> None:
    """Not routed, or a front end that does not take its arguments: the engine was not
    touched, so the sleep follows where the engine has one."""
    e = Engine([page(0)], version="0.33.0")
    e.pause_status = status
    out = reset(e, METRICS, 10.0, pause=True)
    assert out.ok, out
    assert e.calls == ["GET /version", "POST /pause?mode=abort&clear_cache=true",
                       "POST /sleep?level=1&mode=abort", *AFTER_SLEEP]
    assert list(out.steps) == ["pause_refused", "sleep", "wake_up", "canary"]
    # without sleep mode: not attempted, nothing touched, said so
    e = Engine([page(0)], version="0.33.0")
    e.pause_status = status
    out = reset(e, METRICS, 10.0, pause=True, sleep=False)
    assert not out.ok and not out.attempted, out
    assert (out.error or "").startswith(f"POST /pause?mode=abort&clear_cache=true: HTTP "
                                        f"{status}"), out
    assert e.calls == ["GET /version", "POST /pause?mode=abort&clear_cache=true"]


def test_a_pause_that_fails_otherwise_is_a_failed_reset_and_is_resumed(
        short_bounds: None) -> None:
    """A 500 or no answer may have left it paused (vLLM 0.32 pauses, then raises when its
    cache reset fails): resumed all the same, failed, attempted (the restart follows)."""
    e = Engine([page(0)], version="0.26.0")
    e.pause_status = 500
    out = reset(e, METRICS, 10.0, pause=True)
    assert not out.ok and out.attempted and "POST /pause" in (out.error or ""), out
    assert e.calls == ["GET /version", "POST /pause?mode=abort&clear_cache=true",
                       "POST /resume"]
    assert list(out.steps) == ["pause", "resume"]


def test_blocks_held_for_a_moment_after_the_pause_are_asked_again(
        short_bounds: None) -> None:
    """vLLM: the reset fails while in-flight KV offload transfers hold blocks, "callers
    may retry" (a KV tier's last stores just after the abort): not a leak."""
    e = Engine([page(0)], version="0.26.0")
    e.held_for = 2
    out = reset(e, METRICS, 10.0, pause=True)
    assert out.ok, out
    assert e.calls.count("POST /reset_prefix_cache") == 3
    assert list(out.steps) == ["pause", "check", "resume", "canary"]


def test_blocks_held_after_the_pause_fail_the_reset_and_the_engine_is_resumed(
        short_bounds: None, monkeypatch: pytest.MonkeyPatch) -> None:
    """A leak that aborting every request did not free: said, not hidden (a sleep's
    reset would have woken the engine with the leak still in its scheduler); the engine
    is resumed all the same and no canary is sent."""
    monkeypatch.setattr(remedy, "CHECK_WITHIN_S", 0.2)
    e = Engine([page(0)], version="0.26.0")
    e.blocks_held = True
    out = reset(e, METRICS, 10.0, pause=True)
    assert not out.ok and out.attempted, out
    assert "still held 0.2 s after every request was aborted" in (out.error or "")
    assert "a leak this reset cannot free" in (out.error or "")
    asked = e.calls.count("POST /reset_prefix_cache")
    assert asked >= 2  # (asked again within the bound)
    assert e.calls == ["GET /version", PAUSED[0], *[PAUSED[1]] * asked, *PAUSED[2:4]]
    assert not e.paused
    assert list(out.steps) == ["pause", "check", "resume"]


@pytest.mark.parametrize("version", ["0.25.1", None])
def test_an_older_or_unknown_version_is_not_paused(short_bounds: None,
                                                   version: str | None) -> None:
    """Before 0.26 a pause need not empty the cache in the engine: the sleep's reset."""
    e = Engine([page(0)], version=version)
    out = reset(e, METRICS, 10.0, pause=True)
    assert out.ok and "POST /pause?mode=abort&clear_cache=true" not in e.calls, e.calls
    assert list(out.steps) == ["engine_idle", "sleep", "wake_up", "canary"]
    e = Engine([page(0)], version=version)
    out = reset(e, METRICS, 10.0, pause=True, sleep=False)
    assert not out.ok and not out.attempted and e.calls == ["GET /version"], out
    assert "does not empty its KV cache when paused (0.26 or later does)" in (out.error or "")


def test_an_engine_still_paused_after_its_resume_fails_the_reset(short_bounds: None) -> None:
    def engine(req: httpx.Request) -> httpx.Response:
        if req.url.path == "/is_paused":
            return httpx.Response(200, json={"is_paused": True})
        return base(req)
    base = Engine([page(0)], version="0.26.0")
    out = reset(engine, METRICS, 10.0, pause=True)
    assert not out.ok and out.error == "the engine still reports it is paused", out
