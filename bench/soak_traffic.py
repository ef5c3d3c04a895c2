"""Traffic that looks like a service's, for `bench/healthy_soak.py`: a seeded mix of
requests through the proxy, by a pool of clients whose number follows a schedule.

The mix: completions (prompts as token ids, so their length is exact: up to 480 of the
engine's 512) and chats, streamed or not, long prefills, log-probabilities, several
choices (`n`), stop strings, JSON-schema structured output (a new schema every few
minutes: each compiles a grammar), clients that close a stream after a few chunks,
sampling and greedy. The schedule: load segments of a few minutes at a drawn number of
clients, silences of a few minutes each ended by a burst of requests at once. A CPU hog
(`python -c 'while True: pass'`, its own process group) can run beside the engine.

Every request is counted as its client saw it: answered, failed (an exception, a 5xx or
any non-2xx the client did not cause, an error event in a stream), truncated (a stream
that ended without [DONE] or without a finish_reason for each choice, or a body without
them), cancelled (closed by the client on purpose), refused (4xx for a bad request: the
client's fault; a bug of this bench, never expected).
"""

from __future__ import annotations

import contextlib
import json
import random
import string
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import httpx

MAX_MODEL_LEN = 512  # the engine's --max-model-len
PROMPT_MAX = 480
CHAT_OVERHEAD = 24  # the chat template's tokens around a message, at most
CLIENT_FAULTS = (400, 404, 413, 422)  # what a client's bad request earns
# what the proxy never continues on another engine (supervisor/front/continuation.py)
NOT_CONTINUABLE = ("n>1", "logprobs", "stop", "json_schema")
TIMEOUT = httpx.Timeout(connect=30.0, read=420.0, write=30.0, pool=60.0)
WORDS = ["the", "model", "engine", "token", "answer", "quick", "brown", "fox", "cache",
         "request", "stream", "value", "red", "blue", "seven", "north", "light", "data"]


@dataclass
class Shape:
    """One request: where it goes, its body, how its client reads it."""

    path: str
    body: dict[str, Any]
    stream: bool
    n: int
    cancel_after: int | None  # chunks read before the client closes the stream
    tags: tuple[str, ...]


@dataclass
class Record:
    """One request as its client saw it (monotonic times)."""

    t0: float
    t1: float
    phase: str
    tags: tuple[str, ...]
    outcome: str  # answered, failed, truncated, cancelled, refused
    detail: str = ""


def _schema(k: int, seed: int) -> dict[str, Any]:
    """The k-th JSON schema of a run: an object of 1-4 drawn properties."""
    rnd = random.Random(f"{seed}-schema-{k}")
    props: dict[str, Any] = {}
    for _ in range(rnd.randint(1, 4)):
        name = "".join(rnd.choice(string.ascii_lowercase) for _ in range(rnd.randint(3, 8)))
        kind = rnd.choice(["string", "integer", "boolean", "enum", "array", "object"])
        if kind == "string":
            props[name] = {"type": "string", "maxLength": rnd.randint(4, 16)}
        elif kind == "enum":
            props[name] = {"enum": rnd.sample(WORDS, rnd.randint(2, 4))}
        elif kind == "array":
            props[name] = {"type": "array", "items": {"type": "integer"},
                           "maxItems": rnd.randint(1, 3)}
        elif kind == "object":
            props[name] = {"type": "object", "properties": {"id": {"type": "integer"},
                                                            "ok": {"type": "boolean"}},
                           "required": ["id", "ok"], "additionalProperties": False}
        else:
            props[name] = {"type": kind}
    return {"type": "object", "properties": props, "required": sorted(props),
            "additionalProperties": False}


class SchemaPool:
    """A new schema every `every_s` seconds of the run; requests ask the newest one half
    of the time, else any one seen so far."""

    def __init__(self, seed: int, every_s: float) -> None:
        self.seed, self.every_s = seed, every_s
        self.t0 = time.monotonic()
        self.used: set[int] = set()
        self._lock = threading.Lock()

    def pick(self, rnd: random.Random) -> tuple[int, dict[str, Any]]:
        known = 1 + int((time.monotonic() - self.t0) / self.every_s)
        k = known - 1 if rnd.random() < 0.5 else rnd.randrange(known)
        with self._lock:
            self.used.add(k)
        return k, _schema(k, self.seed)


def _text(rnd: random.Random, chars: int) -> str:
    out = ""
    while len(out) < chars:
        out += rnd.choice(WORDS) + " "
    return out[:chars].strip() or "hello"


def draw(rnd: random.Random, schemas: SchemaPool) -> Shape:
    """One request of the mix."""
    chat = rnd.random() < 0.45
    stream = rnd.random() < 0.6
    tags: list[str] = ["chat" if chat else "completion", "stream" if stream else "whole"]
    r = rnd.random()
    if r < 0.5:
        prompt_len = rnd.randint(4, 48)
    elif r < 0.8:
        prompt_len = rnd.randint(48, 200)
    else:
        prompt_len = rnd.randint(300, PROMPT_MAX - (CHAT_OVERHEAD if chat else 0))
        tags.append("long_prefill")
    room = MAX_MODEL_LEN - prompt_len - (CHAT_OVERHEAD if chat else 0) - 4
    r = rnd.random()
    want = (rnd.randint(8, 64) if r < 0.6 else rnd.randint(64, 200) if r < 0.9
            else rnd.randint(200, 400))
    body: dict[str, Any] = {"model": "tiny-llama", "max_tokens": max(1, min(want, room))}
    structured = chat and rnd.random() < 0.25
    if chat:
        body["messages"] = [{"role": "user", "content": _text(rnd, prompt_len)}]
    else:
        body["prompt"] = [rnd.randrange(3, 500) for _ in range(prompt_len)]
    if structured:
        k, schema = schemas.pick(rnd)
        body["response_format"] = {"type": "json_schema",
                                   "json_schema": {"name": f"s{k}", "schema": schema}}
        body["max_tokens"] = max(1, min(rnd.randint(32, 128), room))
        tags.append("json_schema")
    elif rnd.random() < 0.8:
        # (the tiny random model ends most answers at its first token otherwise)
        body["ignore_eos"] = True
    n = 1
    if rnd.random() < 0.12:
        n = rnd.randint(2, 4)
        body["n"] = n
        tags.append("n>1")
    if n > 1 or rnd.random() < 0.6:
        body["temperature"] = round(rnd.uniform(0.5, 1.0), 2)
        if rnd.random() < 0.5:
            body["top_p"] = 0.9
    else:
        body["temperature"] = 0
    if rnd.random() < 0.15:
        if chat:
            body.update(logprobs=True, top_logprobs=5)
        else:
            body["logprobs"] = 5
        tags.append("logprobs")
    if rnd.random() < 0.15:
        body["stop"] = rnd.sample(["\n", ".", "the", "zz", "END"], 2)
        tags.append("stop")
    cancel_after = None
    if stream:
        body["stream"] = True
        if rnd.random() < 0.5:
            body["stream_options"] = {"include_usage": True}
        if rnd.random() < 0.08:
            cancel_after = rnd.randint(1, 6)
            tags.append("cancel")
    return Shape("/v1/chat/completions" if chat else "/v1/completions", body, stream, n,
                 cancel_after, tuple(tags))


def ask(client: httpx.Client, base: str, s: Shape) -> tuple[str, str]:
    """One request; (outcome, detail)."""
    try:
        if not s.stream:
            r = client.post(base + s.path, json=s.body)
            if r.status_code != 200:
                kind = "refused" if r.status_code in CLIENT_FAULTS else "failed"
                return kind, f"HTTP {r.status_code} {r.text[:200]}"
            choices = r.json().get("choices") or []
            done = [c for c in choices if c.get("finish_reason")]
            if len(choices) == s.n and len(done) == s.n:
                return "answered", ""
            return "truncated", f"{len(done)} of {s.n} choices finished"
        with client.stream("POST", base + s.path, json=s.body) as r:
            if r.status_code != 200:
                r.read()
                kind = "refused" if r.status_code in CLIENT_FAULTS else "failed"
                return kind, f"HTTP {r.status_code} {r.text[:200]}"
            return _read_stream(r, s)
    except httpx.HTTPError as exc:
        return "failed", type(exc).__name__
    except ValueError as exc:  # a body that is not JSON
        return "failed", f"bad body: {exc}"[:120]


def _read_stream(r: httpx.Response, s: Shape) -> tuple[str, str]:
    chunks, done, finished = 0, False, set()
    rid, bad = "", None  # the answer's id; an event that is not JSON, and what followed
    try:
        for line in _lines(r):
            if not line.startswith("data: "):
                continue
            if bad is not None:
                return "failed", f"a malformed event, then more ({rid}): {bad}"
            if line == "data: [DONE]":
                done = True
                continue
            try:
                doc = json.loads(line[6:])
            except ValueError:
                bad = f"{line[:160]!r}...{line[-60:]!r}"
                continue
            rid = rid or str(doc.get("id", ""))
            if "error" in doc:
                err = doc["error"]
                msg = err.get("message", err) if isinstance(err, dict) else err
                return "failed", f"error event: {str(msg)[:200]}"
            for c in doc.get("choices") or ():
                if c.get("finish_reason"):
                    finished.add(c.get("index", 0))
            chunks += 1
            if s.cancel_after is not None and chunks >= s.cancel_after and not done:
                return "cancelled", ""  # (leaving the block closes the connection)
    except httpx.HTTPError as exc:
        return "truncated", f"{type(exc).__name__} after {chunks} chunks ({rid})"
    if bad is not None:
        return "truncated", f"cut inside its last event ({rid}): {bad}"
    if done and len(finished) == s.n:
        return "answered", ""
    if s.cancel_after is not None and len(finished) == s.n:
        return "answered", ""  # (done before the client meant to close it)
    return "truncated", (f"[DONE] {done}, {len(finished)} of {s.n} finished, {chunks} "
                         f"chunks ({rid})")


def _lines(r: httpx.Response) -> Iterator[str]:
    """The stream's lines, split at "\n" only (httpx's iter_lines splits as
    str.splitlines does, inside a JSON string too: at U+0085 or U+2028, which the tiny
    model's byte-level tokens do produce)."""
    buf = b""
    for data in r.iter_bytes():
        buf += data
        *lines, buf = buf.split(b"\n")
        for line in lines:
            yield line.rstrip(b"\r").decode("utf-8", "replace")
    if buf:
        yield buf.decode("utf-8", "replace")


@dataclass
class Segment:
    """A stretch of the schedule: `level` clients asking; a burst of requests at once at
    its start (after a silence)."""

    start_s: float
    length_s: float
    level: int
    burst: int = 0


LEVELS = [(2, 1), (6, 2), (12, 3), (24, 3), (40, 2), (48, 1)]


def schedule(rnd: random.Random, total_s: float, silences: bool,
             burst: int = 32) -> list[Segment]:
    """Load segments of 1-4 minutes (shorter in a short run); with `silences`, one silence
    of 2-3 minutes per half hour (at least one; 15 % of a short run), a burst after it."""
    seg_lo, seg_hi = min(60.0, total_s / 6), min(240.0, total_s / 3)
    quiet: list[tuple[float, float]] = []
    if silences:
        n = max(1, round(total_s / 1800))
        for k in range(n):
            length = rnd.uniform(120, 180) if total_s >= 1200 else max(20.0, total_s * 0.15)
            lo, hi = total_s * k / n, total_s * (k + 1) / n - length
            start = rnd.uniform(lo + 0.2 * (hi - lo), lo + 0.8 * (hi - lo))
            quiet.append((start, length))
    levels, weights = zip(*LEVELS, strict=True)
    out: list[Segment] = []
    t, after_silence = 0.0, False
    while t < total_s:
        nxt = next(((s, q) for s, q in quiet if s >= t), None)
        length = rnd.uniform(seg_lo, seg_hi)
        if nxt is not None and t + length > nxt[0]:
            if nxt[0] - t > 1:
                out.append(Segment(t, nxt[0] - t, rnd.choices(levels, weights)[0],
                                   burst if after_silence else 0))
            out.append(Segment(nxt[0], nxt[1], 0))
            quiet.remove(nxt)
            t, after_silence = nxt[0] + nxt[1], True
            continue
        length = min(length, total_s - t)
        out.append(Segment(t, length, rnd.choices(levels, weights)[0],
                           burst if after_silence else 0))
        t, after_silence = t + length, False
    return out


@dataclass
class Traffic:
    """The clients: `clients` steady ones, of which the first `level` ask in turn (a short
    think time between requests), and one-shot bursts."""

    base: str
    seed: int
    schemas: SchemaPool
    clients: int = 48
    phase: str = "start"
    records: list[Record] = field(default_factory=list)
    level: int = 0
    bursts: int = 0

    def __post_init__(self) -> None:
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._wake = threading.Condition()
        self._threads = [threading.Thread(target=self._client, args=(i,), daemon=True,
                                          name=f"client-{i}") for i in range(self.clients)]

    def start(self) -> None:
        for t in self._threads:
            t.start()

    def set_level(self, level: int) -> None:
        with self._wake:
            self.level = min(level, self.clients)
            self._wake.notify_all()

    def burst(self, n: int) -> None:
        """`n` requests at once, each from a client of its own."""
        self.bursts += 1
        k = self.bursts
        gate = threading.Barrier(n)
        for i in range(n):
            threading.Thread(target=self._one_shot, args=(k, i, gate), daemon=True,
                             name=f"burst-{k}-{i}").start()

    def stop(self, wait_s: float) -> None:
        """No new requests; wait for those in flight (a bounded time)."""
        self._stop.set()
        with self._wake:
            self._wake.notify_all()
        deadline = time.monotonic() + wait_s
        for t in threading.enumerate():
            if t.name.startswith(("client-", "burst-")):
                t.join(max(0.0, deadline - time.monotonic()))

    def counts(self, phase: str | None = None) -> Counter[str]:
        with self._lock:
            return Counter(r.outcome for r in self.records
                           if phase is None or r.phase == phase)

    def snapshot(self) -> list[Record]:
        with self._lock:
            return list(self.records)

    def _run(self, client: httpx.Client, rnd: random.Random, extra: tuple[str, ...]) -> None:
        shape = draw(rnd, self.schemas)
        phase, t0 = self.phase, time.monotonic()
        outcome, detail = ask(client, self.base, shape)
        rec = Record(t0, time.monotonic(), phase, shape.tags + extra, outcome, detail)
        with self._lock:
            self.records.append(rec)

    def _client(self, i: int) -> None:
        rnd = random.Random(f"{self.seed}-client-{i}")
        with httpx.Client(timeout=TIMEOUT) as client:
            while not self._stop.is_set():
                with self._wake:
                    if i >= self.level:
                        self._wake.wait(1.0)
                        continue
                self._run(client, rnd, ())
                self._stop.wait(min(5.0, rnd.expovariate(2.0)))

    def _one_shot(self, k: int, i: int, gate: threading.Barrier) -> None:
        rnd = random.Random(f"{self.seed}-burst-{k}-{i}")
        with httpx.Client(timeout=TIMEOUT) as client:
            with contextlib.suppress(threading.BrokenBarrierError):
                gate.wait(30)
            self._run(client, rnd, ("burst",))


class Hog:
    """A CPU hog beside the engine: a busy loop in its own process group, ended by pid."""

    def __init__(self) -> None:
        self.proc: subprocess.Popen[bytes] | None = None
        self.started: float | None = None
        self.stopped: float | None = None

    def start(self) -> None:
        self.proc = subprocess.Popen([sys.executable, "-c", "while True: pass"],
                                     start_new_session=True)
        self.started = time.monotonic()

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()  # (SIGKILL by its pid)
            self.proc.wait(10)
            self.stopped = time.monotonic()
