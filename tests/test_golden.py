"""The golden check's pure parts (supervisor/watchdog/golden.py) and its verdicts in one
engine unit (supervisor/engine/golden_check.py), with recorded effects: a baseline
recorded at the first proof, reproduced or not at the next; a near-tie is no fault; a
standby that fails it is not swapped in, a woken one is a failed takeover, a serving
engine is restarted once and then held down."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from supervisor.engine.events import (
    Exited,
    GateProbe,
    HealthResult,
    RemedyDone,
    SleepModeProbed,
    Slept,
    Woken,
)
from supervisor.engine.process.process import EngineProcess
from supervisor.watchdog import golden
from supervisor.watchdog.remedy import WarmUp
from tests.fake_tokens import logprobs_of
from tests.harness import FAKE_ENGINE, free_port, wait_for
from tests.standby_worlds import SLEEP
from tests.unit_world import World

PROMPT = [ord(c) for c in "The capital of France is"]


def answer(shift: int = 0, n: int = 8) -> golden.Golden:
    comp = golden.parse_completion({"choices": [{"logprobs": logprobs_of(PROMPT, n, False,
                                                                          shift)}]})
    chat = golden.parse_chat({"choices": [{"logprobs": logprobs_of(PROMPT, n, True, shift)}]})
    assert comp is not None and chat is not None
    return golden.Golden(comp, chat)


def test_vllms_two_logprob_shapes_parse_to_ids_logprobs_and_margins() -> None:
    g = answer()
    assert g.completion == g.chat
    assert g.completion is not None and len(g.completion.ids) == 8
    assert all(abs(m - 1.0) < 1e-9 for m in g.completion.margins)
    # without `return_tokens_as_token_ids` (tokens as text) there is no verdict
    assert golden.parse_completion({"choices": [{"logprobs": {
        "tokens": ["Paris"], "token_logprobs": [-0.1], "top_logprobs": [{"Paris": -0.1}]}}]}) \
        is None
    assert golden.parse_chat({"choices": [{"logprobs": None}]}) is None


def test_the_same_answer_passes_and_another_token_or_a_drifted_logprob_does_not() -> None:
    want = answer()
    assert golden.compare(want, answer(), 0.1) is None
    why = golden.compare(want, answer(shift=1), 0.1)
    assert why is not None and why.startswith("completion: token 0: id")
    assert want.completion is not None
    drift = golden.Answer(want.completion.ids,
                          (want.completion.logprobs[0] - 0.5, *want.completion.logprobs[1:]),
                          want.completion.margins)
    why = golden.compare(want, golden.Golden(drift, None), 0.1)
    assert why is not None and "off by 0.5 > 0.1" in why
    assert golden.compare(want, golden.Golden(drift, None), 0.6) is None
    assert golden.largest_difference(want, golden.Golden(drift, None)) == 0.5


def test_speculative_acceptance_may_dip_but_not_fall_to_nothing() -> None:
    """vllm#52487: after a level-2 wake the EAGLE3 draft weights were zeroed, the tokens
    right and 0 of 4,560 drafts accepted: only the acceptance tells."""
    want = golden.Golden(answer().completion, answer().chat, acceptance=0.69)
    same = answer()
    assert golden.compare(want, golden.Golden(same.completion, same.chat, 0.5), 0.1) is None
    why = golden.compare(want, golden.Golden(same.completion, same.chat, 0.0), 0.1)
    assert why == ("speculative decoding accepted 0.0% of its draft tokens, the baseline "
                   "69.0% (more than 50% less)")
    # no drafts on either side (no speculative decoding, or no page): not compared
    assert golden.compare(want, same, 0.1) is None
    assert golden.compare(same, golden.Golden(same.completion, same.chat, 0.0), 0.1) is None
    assert want.doc()["acceptance"] == 0.69 and "acceptance" not in same.doc()
    # counted only for an engine that drafts
    assert golden.speculative(["vllm", "serve", "m", "--speculative-config", "{}"])
    assert golden.speculative(["vllm", "serve", "m", '--speculative_config={"n": 2}'])
    assert not golden.speculative(["vllm", "serve", "m", "--max-num-seqs", "8"])


def test_a_near_tie_in_the_baseline_may_go_either_way() -> None:
    tie = golden.Answer((5, 6, 7), (-0.7, -0.1, -0.1), (0.05, 2.0, 2.0))
    other = golden.Answer((9, 1, 1), (-0.7, -0.3, -0.3), (0.05, 2.0, 2.0))
    assert golden.compare_answer(tie, other, 0.1) is None  # chosen by 0.05 <= 0.2
    assert golden.compare_answer(tie, other, 0.01) is not None


def test_capacity_flags_share_a_baseline_and_the_model_does_not() -> None:
    base = ["vllm", "serve", "m", "--port", "8100", "--gpu-memory-utilization", "0.62",
            "--enable-sleep-mode", "--max-num-seqs", "64"]
    thin = ["vllm", "serve", "m", "--port", "8101", "--enable-sleep-mode",
            "--gpu-memory-utilization=0.30", "--max-num-seqs", "8"]
    assert golden.baseline_key(base) == golden.baseline_key(thin) == ("vllm", "serve", "m")
    assert golden.baseline_key([*base, "--revision", "v2"]) != golden.baseline_key(base)


def proven_with_a_standby(w: World, standby_shift: int = 0) -> tuple[EngineProcess,
                                                                      EngineProcess]:
    """The serving engine's first proof records the baseline; its standby, spawned and
    healthy, answers its own proof (other tokens with `standby_shift`)."""
    first = w.serving()
    w.feed(GateProbe(first.generation, True, None, golden=answer()))
    spare = w.spawned()
    w.feed(HealthResult(spare.generation, True))
    w.feed(GateProbe(spare.generation, True, None, golden=answer(shift=standby_shift)))
    return first, spare


def events(tmp: Path) -> list[dict[str, object]]:
    return [json.loads(x) for x in (tmp / "events.jsonl").read_text().splitlines()]


def test_a_woken_standby_that_answers_otherwise_is_not_served_from(tmp_path: Path) -> None:
    """The baseline is the serving engine's first proof; the standby's own proof matches
    it; after a crash the woken standby answers other tokens: a failed takeover (a cold
    start), the evidence in the audit."""
    w = World(tmp_path, fronted=True, engine={
        **SLEEP, "args": ["--enable-sleep-mode", "--gpu-memory-utilization", "0.45"]})
    try:
        first, spare = proven_with_a_standby(w)
        assert w.sup.status()["golden"]["passed"] == 1
        w.feed(Slept(spare.generation, None, 0.2))
        w.feed(Exited(first.generation, 0))
        w.feed(Woken(spare.generation, None, 0.5))
        # proven as a woken engine: its golden answers on one route, no canary first
        assert w.fx.woken_asked[-1] is True and w.fx.golden_asked[-1] is True
        one_route = dataclasses.replace(answer(shift=1), chat=None)
        w.feed(GateProbe(spare.generation, True, None, golden=one_route))
        assert w.state == "BACKOFF" and "golden check failed" in w.sup.state_reason
        assert w.sup.gate.held_reason is not None  # nothing went to it
        mismatch = next(e for e in events(tmp_path) if e["event"] == "golden_mismatch")
        assert mismatch["pid"] == spare.pid and "expected" in mismatch and "got" in mismatch
        st = w.sup.status()["golden"]
        assert st["mismatches"] == 1 and st["last"]["verdict"] == "mismatch"
    finally:
        w.loop.close()


def test_a_standby_that_answers_otherwise_is_failed_before_it_sleeps(tmp_path: Path) -> None:
    w = World(tmp_path, fronted=True, engine={"standby": "awake"})
    try:
        proven_with_a_standby(w, standby_shift=1)
        st = w.sup.status()["standby"]
        assert st["state"] == "retiring" and "golden check failed" in st["reason"]
    finally:
        w.loop.close()


def test_a_restarted_engine_that_answers_otherwise_is_restarted_once_then_held_down(
        tmp_path: Path) -> None:
    w = World(tmp_path, fronted=True)
    try:
        first = w.serving()
        w.feed(GateProbe(first.generation, True, None, golden=answer()))
        w.control("restart")
        w.down(first)
        second = w.serving()
        w.feed(GateProbe(second.generation, True, None, golden=answer(shift=1)))
        assert w.state == "BACKOFF" and "golden check failed" in w.sup.state_reason
        assert w.sup.gate.held_reason is not None  # nothing went to it
        w.down(second)
        timer = w.fx.timers[-1]
        w.now += timer.delay_s
        w.feed(timer.event)
        third = w.serving()
        w.feed(GateProbe(third.generation, True, None, golden=answer(shift=1)))
        assert w.state == "FATAL" and "twice in a row" in w.sup.state_reason
        assert w.sup.status()["golden"]["mismatches"] == 2
    finally:
        w.loop.close()


def test_an_answer_without_logprobs_is_no_verdict(tmp_path: Path) -> None:
    w = World(tmp_path, fronted=True)
    try:
        first = w.serving()
        w.feed(GateProbe(first.generation, True, None,
                         golden="no log-probabilities in either answer"))
        assert w.state == "RUNNING" and w.sup.gate.held_reason is None
        assert w.sup.status()["golden"]["last"]["verdict"] == "unavailable"
    finally:
        w.loop.close()


def test_the_golden_check_is_asked_where_an_engine_may_have_changed(tmp_path: Path) -> None:
    """At a start and of a standby before it is ready, yes; an awake standby taking over
    (checked when it became ready, unchanged since) is proven by a canary alone: every
    held request waits for that proof."""
    w = World(tmp_path, fronted=True, engine={"standby": "awake"})
    try:
        first, _ = proven_with_a_standby(w)
        w.feed(Exited(first.generation, 0))  # the awake standby takes over
        assert w.fx.golden_asked == [True, True, False]
        assert w.fx.woken_asked == [False, False, False]  # (never asleep)
        # the warm-up sleep (where the engine's flags give it sleep mode) before an
        # engine serves and before an awake standby is ready; not in a takeover
        assert w.fx.warm_asked == [True, True, False]
    finally:
        w.loop.close()


def test_answers_that_change_across_the_warm_up_wake_fail_the_proof_and_stop_sleeping(
        tmp_path: Path) -> None:
    """The answers before the warm-up record the baseline; those after its wake differ:
    the engine is restarted (never served), and no engine of the unit is put to sleep
    again: the next start asks no warm-up, the KV reset is refused saying why."""
    w = World(tmp_path, fronted=True)
    try:
        first = w.serving()
        w.feed(GateProbe(first.generation, True, None, golden=answer(),
                         warm_up=WarmUp({"sleep": 0.4, "wake_up": 0.5}),
                         golden_woken=answer(shift=1)))
        assert w.state == "BACKOFF" and "after its wake" in w.sup.state_reason
        assert w.sup.gate.held_reason is not None  # (nothing was let through)
        names = [e["event"] for e in events(tmp_path)]
        assert names.count("golden_recorded") == 1 and "golden_mismatch" in names
        assert "warmed_up" in names
        w.down(first)
        timer = w.fx.timers[-1]
        w.now += timer.delay_s
        w.feed(timer.event)
        second = w.serving()
        assert w.fx.warm_asked == [True, False]
        w.feed(SleepModeProbed(second.generation, True, None))
        assert "a wake broke an engine" in (w.sup.watch.kv_reset_refusal(w.sup.facts()) or "")
    finally:
        w.loop.close()


def test_an_awake_standby_a_wake_broke_is_failed_and_the_next_one_not_put_to_sleep(
        tmp_path: Path) -> None:
    """The awake standby's answers change across its warm-up wake: it is failed (never
    ready), and neither the next standby nor the unit's engines sleep again."""
    w = World(tmp_path, fronted=True, engine={"standby": "awake"})
    try:
        first = w.serving()
        w.feed(GateProbe(first.generation, True, None, golden=answer()))
        spare = w.spawned()
        w.feed(HealthResult(spare.generation, True))
        w.feed(GateProbe(spare.generation, True, None, golden=answer(),
                         warm_up=WarmUp({"sleep": 0.4, "wake_up": 0.5}),
                         golden_woken=answer(shift=1)))
        st = w.sup.status()["standby"]
        assert st["state"] in ("retiring", "none", "failed") and "after its wake" in st["reason"]
        assert w.sup.watch.wake_broken is not None
        assert w.sup.handover.standby.warm_up is False
        assert w.fx.warm_asked == [True, True]  # (the engine's and this standby's proofs)
    finally:
        w.loop.close()


@pytest.fixture
def engine_beside_others() -> Iterator[tuple[str, subprocess.Popen[bytes]]]:
    """A fake engine whose first two answers share their batch with another client's
    request (5 tokens of its own each, and other tokens answered)."""
    port = free_port()
    proc = subprocess.Popen([sys.executable, str(FAKE_ENGINE), "--host", "127.0.0.1",
                             "--port", str(port), "--logprobs", "--token-delay", "0",
                             "--others-beside", "2"])
    base = f"http://127.0.0.1:{port}"
    try:
        wait_for(lambda: httpx.get(f"{base}/health", timeout=1).status_code == 200, 30,
                 "the fake engine's /health")
        yield base, proc
    finally:
        proc.kill()
        proc.wait(10)


def fetch(base: str) -> golden.Golden | str:
    async def run() -> golden.Golden | str:
        async with httpx.AsyncClient() as client:
            return await golden.fetch(client, base, "fake", "The capital of France is",
                                      8, 5.0)
    return asyncio.run(run())


def test_answers_that_shared_a_batch_with_another_client_are_asked_again(
        engine_beside_others: tuple[str, subprocess.Popen[bytes]]) -> None:
    """The engine's generated tokens rose by more than the answers' own: another
    client's request shared their batch, so the prompt is asked again, and the lone
    answers are the ones judged."""
    base, _ = engine_beside_others
    got = fetch(base)
    assert isinstance(got, golden.Golden) and got.shared == 0 and got.asked == 2
    # asked twice: two answers of 8 tokens each time, and 5 of another client's beside
    # each of the first two
    page = httpx.get(f"{base}/metrics", timeout=5).text
    assert 'vllm:generation_tokens_total{engine="0"} 42' in page, page
    assert got.completion == answer().completion  # the lone answer, not the shared one
    again = fetch(base)
    assert isinstance(again, golden.Golden) and golden.compare(got, again, 0.0) is None


def test_answers_shared_at_every_try_say_so_and_neither_record_nor_condemn(
        tmp_path: Path) -> None:
    w = World(tmp_path, fronted=True)
    try:
        shared = dataclasses.replace(answer(shift=1), shared=5, asked=golden.TRIES)
        first = w.serving()
        w.feed(GateProbe(first.generation, True, None, golden=shared))
        assert w.sup.status()["golden"]["baselines"] == 0  # nothing recorded from it
        assert w.sup.status()["golden"]["last"]["verdict"] == "unavailable"
        w.feed(GateProbe(first.generation, True, None, golden=answer()))
        assert w.sup.status()["golden"]["baselines"] == 1
        w.control("restart")
        w.down(first)
        second = w.serving()
        w.feed(GateProbe(second.generation, True, None, golden=shared))
        assert w.state == "RUNNING" and "golden" not in w.sup.state_reason
        st = w.sup.status()["golden"]
        assert st["mismatches"] == 0 and st["last"]["verdict"] == "unavailable"
        assert st["last"]["why"] == ("the engine served other clients' requests while it "
                                     "answered, 3 times (5 tokens of theirs the last)")
        # shared answers that match are a pass all the same
        w.feed(GateProbe(second.generation, True, None,
                         golden=dataclasses.replace(answer(), shared=5)))
        assert w.sup.status()["golden"]["passed"] == 1
    finally:
        w.loop.close()


# ---- a woken engine's proof: the golden answers on one route -------------------------------

def after_wake(tmp_path: Path, logprobs: bool, remedy: bool = False,
               first_times_out: bool = False) -> tuple[GateProbe | RemedyDone, list[str]]:
    """Through the daemon's own jobs, against an engine that answers the golden prompt
    (with log-probabilities or not): `gate_probe(woken=True)` (a woken takeover's proof)
    or, with `remedy`, a KV reset; the event it reports and the paths it asked, in
    order. `first_times_out`: the first golden ask gets no answer in time."""
    from tests.test_fd_exhaustion import client_of, config, effects, engine_of, next_event

    cfg = config(tmp_path, canary={"model": "fake", "warm_up": False})
    paths: list[str] = []
    timed_out: list[str] = []

    def handler(request: httpx.Request) -> httpx.Response:
        paths.append(request.url.path)
        if request.url.path == "/metrics":
            return httpx.Response(200, text='vllm:generation_tokens_total{engine="0"} 0\n')
        if request.url.path == "/version":
            return httpx.Response(200, json={"version": "0.26.0"})
        if request.url.path == "/is_sleeping":
            return httpx.Response(200, json={"is_sleeping": False})
        if request.url.path in ("/sleep", "/wake_up"):
            return httpx.Response(200)
        chat = request.url.path == "/v1/chat/completions"
        body = json.loads(request.content)
        if first_times_out and "logprobs" in body and not timed_out:
            timed_out.append(request.url.path)
            raise httpx.ReadTimeout("no answer", request=request)
        n = body.get("max_tokens", 1)
        choice: dict[str, object] = {"text": "x", "message": {"content": "x"}}
        if logprobs:
            choice["logprobs"] = logprobs_of(PROMPT, n, chat)
        return httpx.Response(200, json={"choices": [choice], "usage": {
            "prompt_tokens": 5, "completion_tokens": n, "total_tokens": 5 + n}})

    async def main() -> GateProbe | RemedyDone:
        queue: asyncio.Queue[object] = asyncio.Queue()
        act = effects(cfg, queue)  # type: ignore[arg-type]
        engine = engine_of(cfg, type("Running", (), {"returncode": None, "pid": 1 << 22})())
        engine.warmed = None
        task = asyncio.ensure_future(act.http.apply_remedy(engine, "kv_reset", ("sleep",)) if remedy
                                     else act.http.gate_probe(engine, True, False,
                                                              woken=True))
        try:
            return await next_event(queue, RemedyDone if remedy  # type: ignore[arg-type]
                                    else GateProbe)
        finally:
            await asyncio.gather(task, return_exceptions=True)

    import supervisor.engine.effects.http_jobs as http_jobs
    saved = http_jobs.http_client
    http_jobs.http_client = lambda **kw: client_of(handler)  # type: ignore[assignment]
    try:
        return asyncio.run(main()), paths
    finally:
        http_jobs.http_client = saved  # type: ignore[assignment]


def test_a_woken_takeover_is_proven_by_the_golden_answers_on_one_route(
        tmp_path: Path) -> None:
    """Clients wait for this proof: one generation (the completions route's golden
    answer) instead of three (a canary, then both routes); the chat route's template is
    the API server's, which no wake touches."""
    probe, paths = after_wake(tmp_path, logprobs=True)
    assert isinstance(probe, GateProbe)
    assert paths == ["/metrics", "/v1/completions", "/metrics"]
    assert probe.ok and isinstance(probe.golden, golden.Golden)
    assert probe.golden.completion == answer().completion and probe.golden.chat is None
    # judged against a baseline of both routes: the route asked is compared
    assert golden.compare(answer(), probe.golden, 0.1) is None
    assert golden.compare(answer(shift=1), probe.golden, 0.1) is not None


def test_golden_answers_that_prove_nothing_leave_the_proof_to_the_canary(
        tmp_path: Path) -> None:
    """No log-probabilities (no verdict): the canary proves the generation, as for any
    engine, and the golden answers are not asked again."""
    probe, paths = after_wake(tmp_path, logprobs=False)
    assert isinstance(probe, GateProbe) and probe.ok
    assert probe.golden == "no log-probabilities in either answer"
    assert paths == ["/metrics", "/v1/completions",  # the golden prompt, one route
                     "/v1/completions"]  # then the canary


def test_a_kv_resets_golden_answers_after_its_wake_are_asked_on_one_route(
        tmp_path: Path) -> None:
    """Its clients are held through them too: the completions route's answer only."""
    done, paths = after_wake(tmp_path, logprobs=True, remedy=True)
    assert isinstance(done, RemedyDone) and done.outcome.ok, done
    assert [p for p in paths if p in ("/sleep", "/wake_up")] == ["/sleep", "/wake_up"]
    assert "/v1/chat/completions" not in paths
    assert paths[-3:] == ["/metrics", "/v1/completions", "/metrics"]  # after the canary's
    assert isinstance(done.golden, golden.Golden) and done.golden.chat is None
    assert done.golden.completion == answer().completion


def test_one_routes_answers_after_a_wake_record_no_baseline(tmp_path: Path) -> None:
    """Where no proof asked both routes yet (no canary before the engine served), a
    KV reset's or a takeover's answers on one route neither record a baseline (the chat
    route would never be compared) nor condemn; the next proof of both records it."""
    w = World(tmp_path, fronted=True)
    try:
        first = w.serving()
        one_route = dataclasses.replace(answer(), chat=None, routes=golden.AFTER_WAKE)
        w.feed(GateProbe(first.generation, True, None, golden=one_route))
        st = w.sup.status()["golden"]
        assert st["baselines"] == 0 and st["last"]["verdict"] == "unavailable"
        assert "one route's" in st["last"]["why"]
        w.feed(GateProbe(first.generation, True, None, golden=answer()))
        assert w.sup.status()["golden"]["baselines"] == 1
        # from then on one route's answers are compared on that route
        assert golden.compare(answer(), one_route, 0.1) is None
    finally:
        w.loop.close()


def test_a_woken_takeovers_golden_ask_that_fails_is_asked_again_after_the_canary(
        tmp_path: Path) -> None:
    """No answer in time is no verdict to keep: the canary proves the generation, then
    the golden prompt is asked again as at any proof, both routes."""
    probe, paths = after_wake(tmp_path, logprobs=True, first_times_out=True)
    assert isinstance(probe, GateProbe) and probe.ok
    assert isinstance(probe.golden, golden.Golden) and probe.golden.chat is not None
    assert paths == ["/metrics", "/v1/completions",  # the one route: no answer
                     "/v1/completions",  # the canary
                     "/metrics", "/v1/completions", "/v1/chat/completions", "/metrics"]
