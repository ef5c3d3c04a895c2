"""The proxy's deadlines through the real daemon and the fake engine: a stream that
stalls on a live engine (`proxy.stall_timeout_s`) is aborted there and continued,
whole and token-exact, with no death counted; a request past `proxy.request_timeout_s`
ends: a stream with an error event `request_timeout` and no [DONE], a sized answer
with 504."""

from __future__ import annotations

import httpx

from tests import continuation_streams
from tests.continuation_streams import (
    TOKENS,
    chat,
    comp,
    expected_text,
    metrics,
    run,
    under_fault,
)
from tests.fake_tokens import prompt_ids
from tests.harness import wait_for, write_config
from tests.test_proxy import url

fronted = continuation_streams.fronted  # (the fixture: a daemon before a fake engine)

STALLED = ("vllm_supervisor_proxy_rejections_total", (("reason", "stalled"),))
TIMED_OUT = ("vllm_supervisor_proxy_rejections_total", (("reason", "request_timeout"),))


def test_a_stream_stalled_on_a_live_engine_is_continued_whole(fronted, tmp_path):
    d, cfg = fronted(stall_timeout_s=1.0)
    bodies = [("/v1/completions", comp()), ("/v1/chat/completions", chat())]
    seen = under_fault(cfg, tmp_path / "fault", "stall", bodies)
    want = expected_text(prompt_ids({"prompt": "once"}, False), TOKENS)
    want_chat = expected_text(prompt_ids(chat(), True), TOKENS)
    for (path, _), s in zip(bodies, seen, strict=True):
        assert s.complete and s.finish == "length" and s.error is None, s
        assert "".join(s.texts) == (want_chat if "chat" in path else want)
    m = wait_for(lambda: (x := metrics(cfg)).get(STALLED) == 2 and x, 10, "2 stalls")
    assert m[("vllm_supervisor_proxy_continuations_total", (("outcome", "continued"),))] == 2
    # aborted at the engine (its connection closed), which lives on: no restart
    wait_for(lambda: (tmp_path / "aborts").exists()
             and len((tmp_path / "aborts").read_text().split()) == 2, 10, "2 aborts")
    assert d.status()["restarts"] == 0
    stalled = [r for r in d.log_records() if r.get("event") == "stream stalled: continued "
               "elsewhere"]
    assert len(stalled) == 2


def test_a_request_past_its_total_deadline_ends_explicitly(fronted, tmp_path):
    d, cfg = fronted(request_timeout_s=1.5)
    # a stream of 200 tokens at 0.02 s each (4 s): an error event, no [DONE]
    s = run(cfg, comp(max_tokens=200))
    assert s.error is not None and s.error.startswith("request_timeout"), s
    assert not s.done and 0 < len(s.texts) < 200
    # a sized answer that takes 4 s: 504 before anything was sent
    r = httpx.post(url(cfg), json={"model": "fake", "prompt": "slow", "max_tokens": 200},
                   timeout=30)
    assert r.status_code == 504 and r.json()["error"]["type"] == "request_timeout", r.text
    # one within it is served as always
    ok = httpx.post(url(cfg), json={"model": "fake", "prompt": "quick", "max_tokens": 2},
                    timeout=30)
    assert ok.status_code == 200
    m = wait_for(lambda: (x := metrics(cfg)).get(TIMED_OUT) == 2 and x, 10, "2 timeouts")
    assert m.get(STALLED) is None
    lines = [r for r in d.log_records() if r.get("event") == "request timed out"]
    assert len(lines) == 2


def test_a_models_deadline_wins_over_its_engines_and_the_proxys_and_reloads_at_once(
        fronted, tmp_path):
    d, cfg = fronted(request_timeout_s=60, deadlines={
        "default": {"request_timeout_s": 30, "stall_timeout_s": 20},  # the engine's
        "fake": {"request_timeout_s": 1.5}})  # the model's
    s = run(cfg, comp(max_tokens=200))  # 4 s: past the model's 1.5 s
    assert s.error is not None and s.error.startswith("request_timeout"), s
    assert "(1.5 s)" in s.error and not s.done
    # the operator lifts the model's deadline: the engine's 30 s holds, applied at once
    cfg["proxy"]["deadlines"] = {"default": {"request_timeout_s": 30}}
    write_config(d.config, cfg)
    assert d.ctl("reload").returncode == 0
    s = run(cfg, comp(max_tokens=200))
    assert s.complete and s.done and s.error is None and len(s.texts) == 200, s
    # a name that is neither an engine nor a model it serves is refused, named
    cfg["proxy"]["deadlines"] = {"fake-70b": {"request_timeout_s": 1}}
    write_config(d.config, cfg)
    r = d.ctl("reload")
    assert r.returncode != 0 and "proxy.deadlines.fake-70b: no engine or model" in r.stderr
