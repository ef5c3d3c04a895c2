"""Relaunch arguments (throttle levels, reduced batch, speculative tokens) and the canary
probe against scripted HTTP answers (httpx.MockTransport)."""

from __future__ import annotations

import asyncio
import json

import httpx

from supervisor.settings.sections import ThrottleConfig
from supervisor.watchdog import canary, relaunch

CFG = ThrottleConfig(level_factors=[0.75, 0.5, 0.25], max_num_seqs=256,
                     max_num_batched_tokens=8192, min_num_batched_tokens=256,
                     reduce_batch_factor=0.5)


def test_arg_value_reads_both_spellings_and_the_last_wins():
    args = ["--max-num-seqs", "16", "--max-num-seqs=32", "--model", "m"]
    assert relaunch.arg_value(args, "--max-num-seqs") == "32"
    assert relaunch.arg_value(args, "--model") == "m"
    assert relaunch.arg_value(args, "--absent") is None


def test_apply_replaces_removes_and_appends_flags():
    args = ["--model", "m", "--max-num-seqs", "16", "--max-num-batched-tokens=1024"]
    out = relaunch.apply(args, {"--max-num-seqs": "8", "--max-num-batched-tokens": None,
                                "--new": "1"})
    assert out == ["--model", "m", "--max-num-seqs", "8", "--new", "1"]
    assert relaunch.apply(args, {}) == args


def test_no_overrides_at_level_zero():
    assert relaunch.overrides(["--max-num-seqs", "16"], CFG, 0, False, None) == {}


def test_levels_scale_the_engine_args_or_the_configured_defaults():
    args = ["--max-num-seqs", "16", "--max-num-batched-tokens", "2048"]
    assert relaunch.overrides(args, CFG, 1, False, None) == {
        "--max-num-seqs": "12", "--max-num-batched-tokens": "1536"}
    assert relaunch.overrides(args, CFG, 3, False, None) == {
        "--max-num-seqs": "4", "--max-num-batched-tokens": "512"}
    # level beyond the table: the last factor; defaults when args say nothing
    assert relaunch.overrides([], CFG, 9, False, None) == {
        "--max-num-seqs": "64", "--max-num-batched-tokens": "2048"}


def test_reduced_batch_halves_batched_tokens_on_top_of_the_level_with_a_floor():
    args = ["--max-num-batched-tokens", "1024"]
    assert relaunch.overrides(args, CFG, 0, True, None) == {"--max-num-batched-tokens": "512"}
    assert relaunch.overrides(args, CFG, 3, True, None)["--max-num-batched-tokens"] == "256"


def test_speculative_tokens_are_rewritten_in_the_json_and_removed_at_zero():
    spec = json.dumps({"method": "ngram", "num_speculative_tokens": 4})
    args = ["--speculative-config", spec]
    assert relaunch.spec_tokens(args) == 4
    out = relaunch.overrides(args, CFG, 0, False, 3)
    assert json.loads(out["--speculative-config"] or "") == {
        "method": "ngram", "num_speculative_tokens": 3}
    assert relaunch.overrides(args, CFG, 0, False, 0) == {"--speculative-config": None}
    assert relaunch.overrides(args, CFG, 0, False, 4) == {}
    assert relaunch.spec_tokens(["--speculative-config", "not json"]) is None
    assert relaunch.spec_tokens([]) is None


def _run(handler, coro_fn):
    async def go():
        async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as client:
            return await coro_fn(client)
    return asyncio.run(go())


def test_canary_passes_on_a_completion_and_sends_a_tiny_request():
    seen = {}

    def handler(req: httpx.Request) -> httpx.Response:
        seen.update(json.loads(req.content))
        return httpx.Response(200, json={"choices": [{"text": "x"}]})

    out = _run(handler, lambda c: canary.probe(c, "http://e", "m", "Hello", 1, 5.0))
    assert out.ok and out.error is None and out.latency_s >= 0
    assert seen == {"model": "m", "prompt": "Hello", "max_tokens": 1, "temperature": 0}


def test_canary_fails_with_the_reason_on_errors_timeouts_and_garbage():
    def status(req: httpx.Request) -> httpx.Response:
        return httpx.Response(500, text="engine dead")

    def garbage(req: httpx.Request) -> httpx.Response:
        return httpx.Response(200, text="<html>")

    def timeout(req: httpx.Request) -> httpx.Response:
        raise httpx.ReadTimeout("slow", request=req)

    def refused(req: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("refused", request=req)

    probe = lambda c: canary.probe(c, "http://e", "m", "Hi", 1, 0.5)  # noqa: E731
    assert "HTTP 500" in (_run(status, probe).error or "")
    assert "malformed" in (_run(garbage, probe).error or "")
    assert _run(timeout, probe).error == "no answer within 0.5 s"
    assert "ConnectError" in (_run(refused, probe).error or "")
    assert not any(_run(h, probe).ok for h in (status, garbage, timeout, refused))


def test_find_model_takes_the_first_listed_or_none():
    def models(req: httpx.Request) -> httpx.Response:
        return httpx.Response(200, json={"data": [{"id": "tiny"}, {"id": "other"}]})

    def empty(req: httpx.Request) -> httpx.Response:
        return httpx.Response(200, json={"data": []})

    assert _run(models, lambda c: canary.find_model(c, "http://e", 1.0)) == "tiny"
    assert _run(empty, lambda c: canary.find_model(c, "http://e", 1.0)) is None
