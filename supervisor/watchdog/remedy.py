"""In-place remedies on a running engine, over its internal port: the prefix-cache reset
and the KV reset, by a pause of the engine's scheduler or through vLLM's sleep mode (which
of their routes an engine serves is `supervisor/watchdog/devroutes.py`'s).

Fetching only, each call bounded by a timeout: the daemon decides when to call them,
holds new requests at the proxy around a KV reset, and records each outcome. Never
touches the engine's lifecycle (a remedy that fails is the daemon's to escalate).

What vLLM offers (see the brief): with VLLM_SERVER_DEV_MODE=1 the API server has
`POST /reset_prefix_cache`; started with `--enable-sleep-mode` as well, `POST
/sleep?level=1` drops the KV cache (and offloads the weights) and `POST /wake_up`
restores them, in a fraction of a second against a cold start of minutes; `GET
/is_sleeping` says which. Neither sleep mode nor CUDA exist on the CPU backend. From
vLLM 0.26 a sleep pauses the engine's scheduler first (`mode=abort`, the default: every
request at it aborted, new ones queued until the wake); before, a request that met a
sleeping engine could crash or hang it, so a KV reset waits for the engine's own count of
requests to read 0 before it sleeps an older engine (`sleep_aborts`).

From vLLM 0.26 the KV cache can be emptied without a sleep (`pause_resets`): `POST
/pause?mode=abort&clear_cache=true` aborts every request at the engine, frees their blocks
and empties the prefix cache, and `POST /resume` lets it serve again. That is all a
sleep's KV reset does to the cache that matters (the scheduler's blocks; the memory a
wake maps back holds nothing either), without copying the weights to host RAM and back
(0.5-0.8 s of a KV reset's 1.5-2.0 s on an 8B engine), and it works where sleep mode
does not (vLLM's CPU build). A `POST /reset_prefix_cache` while paused checks it: it
succeeds only when no block is held, so a leak that an abort cannot free is said, not
hidden.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from dataclasses import dataclass, field

import httpx

from supervisor.ops import vllm_versions
from supervisor.ops.descriptors import OutOfDescriptors, exhausted
from supervisor.watchdog import canary
from supervisor.watchdog.metrics import SleepOps
from supervisor.watchdog.poller import scrape


@dataclass(frozen=True)
class RemedyOutcome:
    ok: bool
    steps: dict[str, float] = field(default_factory=dict)  # step -> seconds, in order
    error: str | None = None
    attempted: bool = True  # False: not started (requests did not drain in time)
    # what vLLM itself measured of its sleep and wake, by its operation; None: unknown
    vllm_s: dict[str, float] | None = None
    # a KV reset's wait for the engine to go idle, as its count read: (seconds into the
    # wait, requests) at the first read and at each change (`IdleTrace`); None: no wait
    idle_counts: tuple[tuple[float, float], ...] | None = None
    # the engine's vLLM version as the KV reset knew it (its start lines, else its
    # /version); a version whose sleep aborts its requests is not waited on (`sleep_aborts`)
    vllm_version: str | None = None


async def is_sleeping(client: httpx.AsyncClient, base_url: str,
                      timeout_s: float) -> tuple[bool | None, str | None]:
    """(asleep, None), or (None, why the answer is unknown)."""
    return await _flag(client, base_url, "/is_sleeping", "is_sleeping", timeout_s)


async def _flag(client: httpx.AsyncClient, base_url: str, route: str, key: str,
                timeout_s: float) -> tuple[bool | None, str | None]:
    """A `GET route` that answers `{key: bool}`: (value, None), or (None, why the answer
    is unknown)."""
    try:
        r = await client.get(f"{base_url}{route}", timeout=timeout_s)
    except (httpx.HTTPError, OSError) as exc:  # (httpx lets a bare OSError through)
        return None, f"GET {route}: {_failure(exc)}"
    if r.status_code != 200:
        return None, f"GET {route}: HTTP {r.status_code}"
    try:
        value = r.json().get(key)
    except (ValueError, AttributeError):
        value = None
    if not isinstance(value, bool):
        return None, f"GET {route}: unexpected answer {r.text[:100]!r}"
    return value, None


async def _post(client: httpx.AsyncClient, url: str, timeout_s: float) -> str | None:
    """None on 200, else what went wrong, naming the call."""
    return (await _post_answer(client, url, timeout_s))[1]


async def _post_answer(client: httpx.AsyncClient, url: str,
                       timeout_s: float) -> tuple[int | None, str | None]:
    """(the HTTP status, None on 200 else what went wrong, naming the call); no status
    when there was no answer."""
    what = "POST /" + url.split("/", 3)[-1]
    try:
        r = await client.post(url, timeout=timeout_s)
    except httpx.TimeoutException:
        return None, f"{what}: no answer within {timeout_s:g} s"
    except (httpx.HTTPError, OSError) as exc:  # (httpx lets a bare OSError through)
        return None, f"{what}: {_failure(exc)}"
    if r.status_code != 200:
        return r.status_code, f"{what}: HTTP {r.status_code}: {r.text[:200]}"
    return 200, None


def _failure(exc: BaseException) -> str:
    if exhausted(exc):  # (whose fault it was, in the words the operator reads)
        return f"the daemon is out of file descriptors ({type(exc).__name__}: {exc})"
    return f"{type(exc).__name__}: {exc}"


# reading vLLM's own count of its sleep-mode calls around the daemon's (its /metrics): a
# page of an idle local API server comes in milliseconds; bounded apart from the call,
# and never its failure
SLEEP_METRICS_TIMEOUT_S = 1.0


async def sleep_ops(client: httpx.AsyncClient, metrics_url: str,
                    timeout_s: float) -> SleepOps | None:
    """vLLM's sleep-mode counts on its page now (`metrics.sleep_op_seconds` compares two);
    None when the page cannot be read."""
    try:
        snap, _ = await scrape(client, metrics_url, timeout_s)
    except OutOfDescriptors:
        return None
    return snap.sleep_ops if snap is not None else None


# a sleep or wake call's bound: the first sleep of an engine pins its weights in host RAM
# (11-13 s for an 8B model on the H100; later ones 0.4 s; a wake 0.5-0.6 s)
SLEEP_TIMEOUT_S = 60.0


# a wake of the weights alone (vLLM's allocator tags, 0.26+): the engine still sleeps
# after it, until a wake of the rest (`REST`) or of everything
WEIGHTS = ("weights",)
REST = ("kv_cache",)


async def set_asleep(client: httpx.AsyncClient, base_url: str, asleep: bool,
                     timeout_s: float, tags: tuple[str, ...] = ()) -> str | None:
    """Sleep (level 1: KV cache dropped, weights to host RAM) or wake (`tags`: only that
    memory, `/wake_up?tags=...`), then check that `/is_sleeping` agrees (after a wake of
    the weights alone, it still sleeps). None when it does, else what went wrong."""
    call = f"{base_url}/sleep?level=1" if asleep else f"{base_url}/wake_up" + (
        "?" + "&".join(f"tags={t}" for t in tags) if tags else "")
    error = await _post(client, call, timeout_s)
    if error is not None:
        return error
    now, why = await is_sleeping(client, base_url, timeout_s)
    if now is None:
        return why
    if now != (asleep or tags == WEIGHTS):
        return f"the engine still reports it is {'asleep' if now else 'awake'}"
    return None


@dataclass(frozen=True)
class WarmUp:
    """One sleep and wake of an engine before it first serves (`warm_up`)."""

    steps: dict[str, float] = field(default_factory=dict)  # step -> seconds, in order
    skipped: str | None = None  # why none was tried (the engine's sleep mode unanswered)
    error: str | None = None  # a sleep or a wake that failed
    # a wake failed (the engine may be asleep or wedged) or the engine failed a canary
    # after it: unusable
    broken: bool = False
    vllm_s: dict[str, float] | None = None  # vLLM's own timing (RemedyOutcome's)
    # its weights' pinned host copy after it, for an engine that will not sleep again
    # (its KV reset pauses it): "emptied", "kept: why"; None: not asked
    host_cache: str | None = None


async def warm_up(client: httpx.AsyncClient, base_url: str, timeout_s: float) -> WarmUp:
    """Sleep and wake an engine that never slept. vLLM's first sleep of an engine pins
    its weights in host RAM (12.8 s for an 8B model on the H100, later ones 0.4 s): paid
    here, before the engine serves and where nobody waits for it, the first KV reset
    holds clients for sleep and wake alone. The caller keeps every request off the
    engine meanwhile (a request that meets a sleeping vLLM can crash or hang it)."""
    now, why = await is_sleeping(client, base_url, min(timeout_s, 10.0))
    if now is None:
        return WarmUp(skipped=why)
    steps: dict[str, float] = {}
    if not now:
        t = time.monotonic()
        error = await set_asleep(client, base_url, True, timeout_s)
        steps["sleep"] = time.monotonic() - t
        if error is not None:
            now, _ = await is_sleeping(client, base_url, min(timeout_s, 10.0))
            if now is False:  # (still awake: it serves, its first KV reset pays the sleep)
                return WarmUp(steps, error=error)
    t = time.monotonic()
    error = await set_asleep(client, base_url, False, timeout_s)
    steps["wake_up"] = time.monotonic() - t
    return WarmUp(steps, error=error, broken=error is not None)


async def reset_prefix_cache(client: httpx.AsyncClient, base_url: str,
                             timeout_s: float) -> RemedyOutcome:
    t0 = time.monotonic()
    error = await _post(client, f"{base_url}/reset_prefix_cache", timeout_s)
    return RemedyOutcome(error is None, {"reset_prefix_cache": time.monotonic() - t0}, error)


# how often the engine's page is read while a KV reset waits for its own count of
# requests to reach 0 (a local API server answers in milliseconds)
ENGINE_IDLE_POLL_S = 0.05
# that wait's least bound, whatever the drain left of drain_timeout_s: vLLM aborts a
# request whose connection the proxy closed within a step or two
ENGINE_IDLE_MIN_S = 2.0


async def engine_requests(client: httpx.AsyncClient, metrics_url: str,
                          timeout_s: float) -> tuple[float | None, str | None]:
    """The requests at the engine by its own count, running and waiting
    (`vllm:num_requests_running` + `vllm:num_requests_waiting`): (count, None); (None,
    None) when its page has neither series (an engine that publishes no count); (None,
    why) when the page cannot be read."""
    try:
        snap, why = await scrape(client, metrics_url, timeout_s)
    except OutOfDescriptors as exc:
        return None, str(exc)
    if snap is None:
        return None, why or "no page"
    if snap.requests_running is None and snap.requests_waiting is None:
        return None, None
    return (snap.requests_running or 0.0) + (snap.requests_waiting or 0.0), None


# changes kept by an IdleTrace (a count falling from 256 by ones would have 256)
IDLE_TRACE_MAX = 24


class IdleTrace:
    """The engine's count as a wait for it to go idle read it: the first read and each
    change, at most IDLE_TRACE_MAX of them (the last change always kept). On the H200 a
    copy's count took 0.4-4.9 s to read 0 after 256 streams were paused, where a CPU
    engine's takes 0.01-0.11 s through the relay or not: whether it falls step by step
    (vLLM aborting slowly) or sits on a few (a page not refreshed) says which."""

    def __init__(self) -> None:
        self.t0 = time.monotonic()
        self.points: list[tuple[float, float]] = []

    def read(self, count: float | None) -> None:
        if count is None or (self.points and self.points[-1][1] == count):
            return
        point = (round(time.monotonic() - self.t0, 3), count)
        if len(self.points) >= IDLE_TRACE_MAX:
            self.points[-1] = point
        else:
            self.points.append(point)


async def wait_engine_idle(client: httpx.AsyncClient, metrics_url: str,
                           timeout_s: float, trace: IdleTrace | None = None) -> str | None:
    """Wait, up to `timeout_s`, until the engine's own count of its requests reads 0:
    a request leaves the proxy (paused, its connection closed) before vLLM aborts it,
    and before vLLM 0.26 a sleep must not meet it (a request that meets a sleeping
    engine can crash or hang it; from 0.26 the sleep aborts it: `sleep_aborts`). None once it
    reads 0, or at once when the engine publishes no count (nothing to wait on); else
    what it read last. Each count read goes to `trace`."""
    deadline = time.monotonic() + timeout_s
    while True:
        left = deadline - time.monotonic()
        count, why = await engine_requests(client, metrics_url,
                                           max(min(left, SLEEP_METRICS_TIMEOUT_S), 0.1))
        if trace is not None:
            trace.read(count)
        if count == 0 or (count is None and why is None):
            return None
        left = deadline - time.monotonic()
        if left <= 0:
            return (f"{count:g} requests still at the engine by its own count"
                    if count is not None else f"its {metrics_url} unread: {why}") \
                + f" after {timeout_s:g} s"
        await asyncio.sleep(min(ENGINE_IDLE_POLL_S, left))


# the first vLLM whose sleep pauses its scheduler before it sleeps (`mode=abort`, the
# default: every request at the engine aborted, new ones queued until the wake), and
# puts its executor to sleep only once no step is left in flight (`EngineCoreProc`'s
# pause completes when `has_work()` is false, its batch queue included: no batch on the
# GPU while its memory is unmapped); read in the 0.26.0 wheel's vllm/v1/engine/core.py,
# `EngineCore.sleep`, `EngineCoreProc.pause_scheduler` and `_pause_complete`
SLEEP_ABORTS_FROM = (0, 26)
VERSION_TIMEOUT_S = 2.0
# what a front end answers a sleep whose `mode` it does not take (FastAPI's validation
# error, a plain bad request): the engine was not touched
SLEEP_MODE_REFUSED = (400, 422)


def sleep_aborts(version: str | None) -> bool:
    """Whether a vLLM of this version aborts the requests at it when told to sleep (and
    queues new ones until it wakes): then nothing needs to leave it before its sleep. An
    unknown or unreadable version: no."""
    return vllm_versions.at_least(version, SLEEP_ABORTS_FROM)


async def engine_version(client: httpx.AsyncClient, base_url: str,
                         timeout_s: float) -> str | None:
    """The vLLM version the engine's `GET /version` names; None if it names none or does
    not answer in time."""
    try:
        r = await client.get(f"{base_url}/version", timeout=timeout_s)
        value = r.json().get("version") if r.status_code == 200 else None
    except (httpx.HTTPError, OSError, ValueError, AttributeError):
        return None
    return value if isinstance(value, str) else None


async def kv_reset(client: httpx.AsyncClient, base_url: str, model: str | None,
                   prompt: str, timeout_s: float, canary_timeout_s: float, *,
                   metrics_url: str | None = None,
                   idle_within_s: float = ENGINE_IDLE_MIN_S,
                   version: str | None = None, pause: bool = False,
                   sleep: bool = True) -> RemedyOutcome:
    """Empty the KV cache, then one canary. The caller has drained the proxy (its streams
    finished, or paused for continuation: their connections closed, so vLLM aborts them)
    and holds new requests.

    With `pause` (the engine serves `/pause` and `/resume`) and a vLLM that empties its
    cache so (`pause_resets` of `version`, else of its `/version`): pause, check, resume
    (`_pause_reset`). A pause refused as unknown (HTTP 404, 405, 400 or 422: the engine
    untouched) goes on to the sleep, step `pause_refused`, where there is one.

    With `sleep` (the engine has sleep mode): sleep (level 1: the KV cache dropped), wake,
    check awake. An engine whose sleep aborts what is at it (`sleep_aborts`) is told to
    sleep at once, `mode=abort` said; an older one only once its own count of requests
    reads 0 (`wait_engine_idle`, up to `idle_within_s` and at least ENGINE_IDLE_MIN_S; not
    without `metrics_url`), and not at all if its count stays above 0 (`attempted` False:
    nothing was touched). A sleep whose `mode` is refused (HTTP 400 or 422: the engine
    untouched) is asked again the older way, step `sleep_mode_refused` beside the
    others."""
    steps: dict[str, float] = {}
    t0 = time.monotonic()
    counts = None
    version = version or await engine_version(client, base_url, VERSION_TIMEOUT_S)
    if pause and pause_resets(version):
        out = await _pause_reset(client, base_url, model, prompt, timeout_s,
                                 canary_timeout_s, steps)
        if out.attempted or not sleep:
            return dataclasses.replace(out, vllm_version=version)
        steps = {"pause_refused": steps["pause"]}
    if not sleep:
        why = (f"vLLM {version or 'of unknown version'} does not empty its KV cache when "
               "paused (0.26 or later does)") if pause else "it cannot be paused"
        return RemedyOutcome(False, steps, f"the engine cannot sleep, and {why}: the KV "
                             "cache was not touched", attempted=False, vllm_version=version)
    if sleep_aborts(version):
        out = await _sleep_wake_prove(client, base_url, model, prompt, timeout_s,
                                      canary_timeout_s, steps, abort=True)
        if out.attempted:
            return dataclasses.replace(out, vllm_version=version)
        # its sleep refused the mode (a front end that takes no `mode`), the engine
        # untouched: the wait, then the plain sleep, as for an older vLLM
        steps = {"sleep_mode_refused": steps["sleep"]}
    if metrics_url is not None:
        t = time.monotonic()
        trace = IdleTrace()  # (within what the drain left, less what was spent here)
        busy = await wait_engine_idle(client, metrics_url, round(max(
            idle_within_s - (t - t0), ENGINE_IDLE_MIN_S), 2), trace)
        steps["engine_idle"] = time.monotonic() - t
        counts = tuple(trace.points)
        if busy is not None:
            return RemedyOutcome(False, steps, f"{busy}: the KV cache was not touched",
                                 attempted=False, idle_counts=counts, vllm_version=version)
    out = await _sleep_wake_prove(client, base_url, model, prompt, timeout_s,
                                  canary_timeout_s, steps)
    return dataclasses.replace(out, idle_counts=counts, vllm_version=version)


# what a front end answers a pause it does not serve or whose arguments it does not take
# (not routed, POST not allowed, a validation error): the engine untouched
PAUSE_REFUSED = (400, 404, 405, 422)


def pause_resets(version: str | None) -> bool:
    """Whether `POST /pause?mode=abort&clear_cache=true` empties the KV cache of a vLLM of
    this version: the scheduler paused in the engine core, every request aborted, their
    blocks freed, the prefix cache reset (`EngineCore.pause_scheduler`, read in the
    0.26.0 and 0.32.0 wheels; the same release that made a sleep abort). An unknown or
    unreadable version: no."""
    return vllm_versions.at_least(version, SLEEP_ABORTS_FROM)


async def _pause_reset(client: httpx.AsyncClient, base_url: str, model: str | None,
                       prompt: str, timeout_s: float, canary_timeout_s: float,
                       steps: dict[str, float]) -> RemedyOutcome:
    """A KV reset without a sleep: pause (every request aborted, the caches cleared),
    `POST /reset_prefix_cache` to check that no block is held, resume, check that it
    serves, one canary; each step's seconds added to `steps`. Once paused, or perhaps
    paused (a pause that failed otherwise than refused: vLLM 0.32 pauses, then raises
    when its cache reset fails), it is resumed whatever else was found: an engine left
    paused would hold every request."""
    t = time.monotonic()
    status, error = await _post_answer(
        client, f"{base_url}/pause?mode=abort&clear_cache=true", timeout_s)
    steps["pause"] = time.monotonic() - t
    if error is not None and status in PAUSE_REFUSED:
        return RemedyOutcome(False, steps, error, attempted=False)
    held = None
    if error is None:
        t = time.monotonic()
        held = await _prefix_reset_failure(client, base_url, timeout_s)
        steps["check"] = time.monotonic() - t
    t = time.monotonic()
    resumed = await _post(client, f"{base_url}/resume", timeout_s)
    steps["resume"] = time.monotonic() - t
    if error is None and resumed is None:
        paused, why = await _flag(client, base_url, "/is_paused", "is_paused", timeout_s)
        resumed = why if paused is None else \
            "the engine still reports it is paused" if paused else None
    if error is not None or held is not None or resumed is not None:
        return RemedyOutcome(False, steps, "; ".join(e for e in (error, held, resumed) if e))
    return await _canary(client, base_url, model, prompt, canary_timeout_s, steps,
                         "after its resume")


# how long a pause-reset's check asks again while vLLM says blocks are held: vLLM
# documents the reset as failing while in-flight KV offload transfers hold blocks
# ("callers may retry"), which a KV tier's last stores can be just after the abort
CHECK_WITHIN_S = 2.0
CHECK_POLL_S = 0.05


async def _prefix_reset_failure(client: httpx.AsyncClient, base_url: str,
                                timeout_s: float) -> str | None:
    """None when `POST /reset_prefix_cache` succeeds (no block of the KV cache held),
    asked again for up to CHECK_WITHIN_S while it says blocks are held; else what it
    said."""
    url = f"{base_url}/reset_prefix_cache"
    deadline = time.monotonic() + CHECK_WITHIN_S
    while True:
        try:
            r = await client.post(url, timeout=timeout_s)
        except (httpx.HTTPError, OSError) as exc:  # (httpx lets a bare OSError through)
            return f"POST /reset_prefix_cache: {_failure(exc)}"
        if r.status_code != 200:
            return f"POST /reset_prefix_cache: HTTP {r.status_code}: {r.text[:200]}"
        try:
            success = r.json().get("success")
        except (ValueError, AttributeError):
            success = None
        if success is not False:
            return None
        if time.monotonic() >= deadline:
            return (f"blocks of the KV cache still held {CHECK_WITHIN_S:g} s after every "
                    "request was aborted (POST /reset_prefix_cache: success false): a leak "
                    "this reset cannot free")
        await asyncio.sleep(CHECK_POLL_S)


async def _canary(client: httpx.AsyncClient, base_url: str, model: str | None,
                  prompt: str, canary_timeout_s: float, steps: dict[str, float],
                  when: str) -> RemedyOutcome:
    """A KV reset's last step, one canary (`steps["canary"]`), `when` naming it."""
    t = time.monotonic()
    try:
        model = model or await canary.find_model(client, base_url, canary_timeout_s)
        if model is None:
            return RemedyOutcome(False, steps, f"{when}: /v1/models named no model")
        outcome = await canary.probe(client, base_url, model, prompt, 1, canary_timeout_s)
    except OutOfDescriptors as exc:
        return RemedyOutcome(False, steps, f"canary {when}: {exc}")
    steps["canary"] = time.monotonic() - t
    if not outcome.ok:
        return RemedyOutcome(False, steps, f"canary {when}: {outcome.error}")
    return RemedyOutcome(True, steps)


async def _sleep_wake_prove(client: httpx.AsyncClient, base_url: str, model: str | None,
                            prompt: str, timeout_s: float, canary_timeout_s: float,
                            steps: dict[str, float], abort: bool = False) -> RemedyOutcome:
    """A KV reset's sleep (`abort`: saying `mode=abort`, which vLLM 0.26+ takes to abort
    every request at it), wake, awake check and canary, each step's seconds added to
    `steps`."""
    t = time.monotonic()
    status, error = await _post_answer(
        client, f"{base_url}/sleep?level=1" + ("&mode=abort" if abort else ""), timeout_s)
    steps["sleep"] = time.monotonic() - t
    if error is not None:  # (a request refused as malformed did not sleep the engine)
        return RemedyOutcome(False, steps, error,
                             attempted=not (abort and status in SLEEP_MODE_REFUSED))
    t = time.monotonic()
    error = await _post(client, f"{base_url}/wake_up", timeout_s)
    steps["wake_up"] = time.monotonic() - t
    if error is not None:
        return RemedyOutcome(False, steps, error)
    asleep, why = await is_sleeping(client, base_url, timeout_s)
    if asleep is not False:
        return RemedyOutcome(False, steps, why or "the engine still reports it is asleep")
    return await _canary(client, base_url, model, prompt, canary_timeout_s, steps,
                         "after waking")
