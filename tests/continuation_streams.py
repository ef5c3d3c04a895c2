"""What the tests of streams through the real daemon and the fake engine share
(tests/test_continuation_proxy.py, test_deadlines.py, test_standby.py, test_kv_tier.py,
test_stream_clients.py): requests and streams sent and read whole (`run`,
`start_streams`), the fake's expected text, faults scripted through its fault file, the
proxy's metrics read, and `fronted` (a daemon before a fake engine, as a fixture: a module
takes it with `fronted = continuation_streams.fronted`)."""

from __future__ import annotations

import json
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.fake_tokens import next_token
from tests.harness import wait_for
from tests.test_proxy import proxy_config, url

TOKENS = 60


@dataclass
class Seen:
    """One stream as its client saw it."""

    texts: list[str] = field(default_factory=list)
    ids: list[int] = field(default_factory=list)
    chunks: list[dict[str, Any]] = field(default_factory=list)
    usage: dict[str, Any] | None = None
    finish: str | None = None
    done: bool = False
    error: str | None = None
    keepalives: int = 0  # blank lines beyond the events' own ends
    comments: int = 0  # SSE comment lines (the proxy writes none)
    status: int = 0

    @property
    def complete(self) -> bool:
        return self.done and self.error is None



def paused_streams(d: Any) -> tuple[int, list[str]]:
    """How many streams the front door paused, and the daemon's pauses (what for): with
    several proxy workers each logs its own count, the daemon's line none."""
    lines = [e for e in d.log_records() if e.get("event") == "streams paused, to go on after it"]
    return (sum(e["paused"] for e in lines if e.get("paused") is not None),
            [e["during"] for e in lines if "during" in e])

def start_streams(cfg: dict[str, Any], bodies: list[dict[str, Any]]
                  ) -> tuple[list[threading.Thread], list[Seen | None]]:
    """Each body streamed in a thread of its own, returned once every stream began: the
    threads, and the list each fills with what its client saw."""
    results: list[Seen | None] = [None] * len(bodies)
    started = [threading.Event() for _ in bodies]

    def one(i: int) -> None:
        results[i] = run(cfg, bodies[i], started=started[i])

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(bodies))]
    for t in threads:
        t.start()
    for e in started:
        assert e.wait(30), "a stream never started"
    return threads, results


def run(cfg: dict[str, Any], body: dict[str, Any], path: str = "/v1/completions",
        started: threading.Event | None = None) -> Seen:
    seen = Seen()
    with httpx.stream("POST", url(cfg, path), json=body, timeout=60) as r:
        seen.status = r.status_code
        prev: str | None = None
        for line in r.iter_lines():
            if line.startswith(":"):
                seen.comments += 1
            if line == "" and prev in (None, ""):
                seen.keepalives += 1
            prev = line
            if not line.startswith("data: "):
                continue
            data = line[6:]
            if data == "[DONE]":
                seen.done = True
                continue
            doc = json.loads(data)
            if "error" in doc:
                seen.error = doc["error"]["message"]
                continue
            seen.chunks.append(doc)
            if doc.get("usage"):
                seen.usage = doc["usage"]
            for c in doc["choices"]:
                seen.texts.append(c["delta"].get("content", "") if "delta" in c
                                  else c["text"])
                seen.ids += c.get("token_ids") or []
                seen.finish = c["finish_reason"] or seen.finish
            # five tokens, not five chunks: a chat stream's first chunk is its role alone
            if started is not None and sum(1 for t in seen.texts if t) >= 5:
                started.set()
    return seen


def expected_text(prompt: list[int], n: int) -> str:
    seq, out = list(prompt), []
    for _ in range(n):
        seq.append(next_token(seq))
        out.append(f"t{seq[-1]} ")
    return "".join(out)


def comp(**kw: Any) -> dict[str, Any]:
    return {"model": "fake", "prompt": "once", "max_tokens": TOKENS, "stream": True,
            "stream_options": {"include_usage": True}, **kw}


def chat(**kw: Any) -> dict[str, Any]:
    return {"model": "fake", "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": TOKENS, "stream": True, "stream_options": {"include_usage": True},
            **kw}


def under_fault(cfg: dict[str, Any], fault_file: Path, fault: str,
                bodies: list[tuple[str, dict[str, Any]]]) -> list[Seen]:
    """The streams started together; the fault once every one has tokens."""
    results: list[Seen | None] = [None] * len(bodies)
    started = [threading.Event() for _ in bodies]

    def one(i: int) -> None:
        path, body = bodies[i]
        results[i] = run(cfg, body, path, started[i])

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(bodies))]
    for t in threads:
        t.start()
    for e in started:
        assert e.wait(30), "a stream never started"
    fault_file.write_text(fault)
    for t in threads:
        t.join(90)
    assert all(r is not None for r in results)
    return [r for r in results if r is not None]


def metrics(cfg: dict[str, Any]) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    text = httpx.get(f"http://{cfg['exporter']['listen']}/metrics", timeout=5).text
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


CONTINUED = ("vllm_supervisor_proxy_continuations_total", (("outcome", "continued"),))


def metrics_once(cfg: dict[str, Any], key: tuple[str, tuple[tuple[str, str], ...]],
                 value: float) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """The metrics once `key` reads `value`. A stream is counted as continued after its
    end was written, which its client may read (and scrape the metrics) before the
    proxy's handler runs on: the count is waited for, never read at once."""
    return wait_for(lambda: (m := metrics(cfg)).get(key) == value and m, 10,
                    f"{key[0]}{dict(key[1])} to read {value:g}")


@pytest.fixture
def fronted(daemon_factory, tmp_path):
    def make(*fake: str, **proxy: Any):
        cfg = proxy_config(tmp_path, "--token-delay", "0.02", "--fault-file",
                           str(tmp_path / "fault"), *fake, **proxy)
        d = daemon_factory(cfg)
        d.wait_state("RUNNING")
        wait_for(lambda: d.status()["admission"]["held"] is None, 10, "the gate to open")
        return d, cfg
    return make
