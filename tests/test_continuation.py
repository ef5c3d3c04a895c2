"""Token-level continuation, pure: the plan, the refusal rules, recording a stream,
the continuation request and the reframing of its chunks into the client's stream."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any
from unittest import mock

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from supervisor.front import continuable, continuation
from supervisor.front.continuable import REFUSALS, plan, refusal
from supervisor.front.continuation import StreamBroken, Transcript
from supervisor.front.sse import DONE, EventReader, error_event
from tests.hypothesis_profiles import examples

COMP = "/v1/completions"
CHAT = "/v1/chat/completions"


def body(**kw: Any) -> bytes:
    return json.dumps({"model": "m", "prompt": "hello", "stream": True, **kw}).encode()


def chat_body(**kw: Any) -> bytes:
    return json.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}],
                       "stream": True, **kw}).encode()


def event(out: bytes | None) -> dict[str, Any]:
    assert out is not None and out.startswith(b"data: ") and out.endswith(b"\n\n"), out
    return json.loads(out[6:])


def comp_chunk(text: str, ids: list[int], finish: str | None = None,
               prompt: list[int] | None = None, **extra: Any) -> bytes:
    """As vLLM 0.32 writes a completions chunk with return_token_ids."""
    choice: dict[str, Any] = {"index": 0, "text": text, "logprobs": None,
                              "finish_reason": finish, "stop_reason": None}
    if prompt is not None:
        choice["prompt_token_ids"] = prompt
    choice["token_ids"] = ids
    return json.dumps({"id": "cmpl-1", "object": "text_completion", "created": 100,
                       "model": "m", "choices": [choice], **extra}).encode()


# ---- the plan and its refusals --------------------------------------------------------

def test_only_streamed_generations_get_a_plan() -> None:
    assert plan("/v1/embeddings", body()) is None
    assert plan(COMP, body(stream=False)) is None
    assert plan(COMP, b"{not json") is None
    assert plan(COMP, b"[1, 2]") is None
    assert plan(COMP, body(max_tokens="ten")) is None  # the engine answers 400 itself


def test_a_continuable_request_asks_for_token_ids_and_keeps_the_rest() -> None:
    p = plan(COMP, body(max_tokens=50, min_tokens=5, temperature=0.7, seed=3))
    assert p is not None and p.refused is None and not p.client_token_ids
    sent = json.loads(p.body)
    assert sent == {**json.loads(body(max_tokens=50, min_tokens=5, temperature=0.7, seed=3)),
                    "return_token_ids": True}
    assert (p.max_tokens, p.min_tokens) == (50, 5)
    chat = plan(CHAT, chat_body(max_completion_tokens=30))
    assert chat is not None and chat.chat and chat.max_tokens == 30


@pytest.mark.parametrize("raw", [
    b'{"model":"m","prompt":"hi","stream":true}',
    b' \r\n\t{ "model" : "m", "prompt": "hi", "stream": true }',  # spaced, as any client
    b'{"model":"m","prompt":"hi","stream":true,"return_token_ids":false}',  # its own: no
    b'\xef\xbb\xbf{"model":"m","prompt":"hi","stream":true}',  # a BOM: encoded again
    '{"model":"m","prompt":"caf\u00e9 \\u2603","stream":true}'.encode(),
])
def test_the_token_ids_key_goes_in_front_of_the_clients_bytes_or_the_body_is_encoded(
        raw: bytes) -> None:
    doc = json.loads(raw)
    sent = continuable.with_token_ids(raw, doc)
    assert json.loads(sent) == {**doc, "return_token_ids": True}
    if raw.lstrip()[:1] == b"{" and "return_token_ids" not in doc:
        assert sent.endswith(raw.lstrip()[1:])  # the client's bytes, untouched
    else:
        assert sent == json.dumps({**doc, "return_token_ids": True},
                                  separators=(",", ":")).encode()


def test_the_clients_own_token_ids_request_is_sent_as_it_is() -> None:
    raw = body(return_token_ids=True)
    p = plan(COMP, raw)
    assert p is not None and p.client_token_ids and p.body == raw


@pytest.mark.parametrize(("path", "kw", "why"), [
    (COMP, {"n": 2}, "several_choices"),
    (COMP, {"best_of": 3}, "several_choices"),
    (COMP, {"use_beam_search": True}, "beam_search"),
    (COMP, {"echo": True}, "echo"),
    (COMP, {"logprobs": 2}, "logprobs"),
    (CHAT, {"logprobs": True, "top_logprobs": 2}, "logprobs"),
    (COMP, {"prompt_logprobs": 1}, "logprobs"),
    (COMP, {"return_tokens_as_token_ids": True}, "logprobs"),
    (COMP, {"guided_json": {"type": "object"}}, "structured_output"),
    (COMP, {"structured_outputs": {"regex": "a+"}}, "structured_output"),
    (CHAT, {"response_format": {"type": "json_object"}}, "structured_output"),
    (COMP, {"stop": ["\n\n"]}, "stop_strings"),
    (COMP, {"stop": "END"}, "stop_strings"),
    (COMP, {"presence_penalty": 0.5}, "penalties"),
    (CHAT, {"frequency_penalty": 0.1}, "penalties"),
    (COMP, {"logits_processors": ["x"]}, "logits_processors"),
    (CHAT, {"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),
    (CHAT, {"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "data:,"}}]}]}, "multimodal"),
    (COMP, {"suffix": "end"}, "prompt_form"),
    (COMP, {"prompt": ["one", "two"]}, "several_prompts"),
    (COMP, {"prompt": [[1, 2], [3]]}, "several_prompts"),
    (COMP, {"model": 7}, "no_model"),
])
def test_each_refusal_rule(path: str, kw: dict[str, Any], why: str) -> None:
    raw = (chat_body if path == CHAT else body)(**kw)
    p = plan(path, raw)
    assert p is not None and p.refused == why and why in REFUSALS
    assert p.body == raw  # a refused request goes as the client sent it


@pytest.mark.parametrize(("path", "kw"), [
    (COMP, {"prompt": [1, 2, 3]}), (COMP, {"prompt": ["one"]}), (COMP, {"n": 1}),
    (COMP, {"stop": []}), (COMP, {"presence_penalty": 0}), (CHAT, {"logprobs": False}),
    (CHAT, {"response_format": {"type": "text"}}),
    (CHAT, {"tools": [{"type": "function"}], "tool_choice": "none"}),
    (CHAT, {"messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]}),
    (COMP, {"temperature": 0.9, "top_p": 0.5, "repetition_penalty": 1.1}),
])
def test_what_is_continued(path: str, kw: dict[str, Any]) -> None:
    doc = json.loads((chat_body if path == CHAT else body)(**kw))
    assert refusal(doc, path == CHAT) is None


# ---- recording and reframing --------------------------------------------------------

def recorded(raw: bytes, path: str = COMP) -> Transcript:
    p = plan(path, raw)
    assert p is not None
    return Transcript(p)


def test_a_completions_stream_is_recorded_and_its_token_ids_removed() -> None:
    t = recorded(body(max_tokens=5, stream_options={"include_usage": True}))
    out = event(t.take(comp_chunk("a", [11], prompt=[1, 2, 3])))
    assert out["choices"][0] == {"index": 0, "text": "a", "logprobs": None,
                                 "finish_reason": None, "stop_reason": None}
    event(t.take(comp_chunk("b", [12])))
    assert (t.id, t.created, t.model) == ("cmpl-1", 100, "m")
    assert t.prompt_ids == [1, 2, 3] and t.delivered == [11, 12] and t.remaining == 3
    assert t.refusal() is None


def test_the_clients_token_ids_pass_unchanged() -> None:
    t = recorded(body(return_token_ids=True))
    raw = comp_chunk("a", [11], prompt=[1, 2])
    assert t.take(raw) == b"data: " + raw + b"\n\n"
    assert t.delivered == [11]


def test_the_continuation_request() -> None:
    t = recorded(body(max_tokens=5, min_tokens=4, temperature=0, seed=9, ignore_eos=True,
                      add_special_tokens=True, stream_options={"include_usage": True}))
    t.take(comp_chunk("a", [11], prompt=[1, 2, 3]))
    t.take(comp_chunk("b", [12, 13]))
    cont = json.loads(t.continuation())
    assert cont == {"model": "m", "prompt": [1, 2, 3, 11, 12, 13], "stream": True,
                    "return_token_ids": True, "max_tokens": 2, "min_tokens": 1,
                    "temperature": 0, "seed": 9, "ignore_eos": True,
                    "stream_options": {"include_usage": True}}


def test_a_chat_continuation_is_a_completions_request_of_the_chat_prompts_ids() -> None:
    t = recorded(chat_body(max_completion_tokens=4, temperature=0.5, top_k=5,
                           chat_template_kwargs={"x": 1}), CHAT)
    first = {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 7,
             "model": "m", "prompt_token_ids": [5, 6], "choices": [
                 {"index": 0, "delta": {"role": "assistant", "content": ""},
                  "logprobs": None, "finish_reason": None, "token_ids": []}]}
    out = event(t.take(json.dumps(first).encode()))
    assert "prompt_token_ids" not in out and "token_ids" not in out["choices"][0]
    t.take(json.dumps({**first, "prompt_token_ids": None, "choices": [
        {"index": 0, "delta": {"content": "x"}, "token_ids": [40]}]}).encode())
    assert t.prompt_ids == [5, 6] and t.delivered == [40]
    assert json.loads(t.continuation()) == {
        "model": "m", "temperature": 0.5, "top_k": 5, "prompt": [5, 6, 40], "stream": True,
        "return_token_ids": True, "max_tokens": 3}


def test_continued_chunks_are_reframed_into_the_original_stream() -> None:
    t = recorded(body(max_tokens=4, stream_options={"include_usage": True}))
    t.take(comp_chunk("a", [11], prompt=[1, 2, 3]))
    t.take(comp_chunk("b", [12]))
    t.begin_attempt()
    assert (t.attempt, t.base) == (1, 2)
    # the continuation's own id, created and prompt ids never reach the client
    raw = json.dumps({"id": "cmpl-2", "object": "text_completion", "created": 200,
                      "model": "m", "choices": [{"index": 0, "text": "c", "logprobs": None,
                                                 "finish_reason": None, "stop_reason": None,
                                                 "prompt_token_ids": [1, 2, 3, 11, 12],
                                                 "token_ids": [13]}]}).encode()
    out = event(t.take(raw))
    assert out == {"id": "cmpl-1", "object": "text_completion", "created": 100, "model": "m",
                   "choices": [{"index": 0, "text": "c", "logprobs": None,
                                "finish_reason": None, "stop_reason": None}]}
    out = event(t.take(comp_chunk("d", [14], "length")))
    assert out["choices"][0]["finish_reason"] == "length" and out["id"] == "cmpl-1"
    usage = event(t.take(json.dumps({"id": "cmpl-2", "choices": [], "usage": {
        "prompt_tokens": 5, "completion_tokens": 2, "total_tokens": 7}}).encode()))
    # the whole answer's usage: the original prompt, every completion token
    assert usage["usage"] == {"prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7}
    assert usage["id"] == "cmpl-1" and usage["choices"] == []
    assert t.take(b"[DONE]") == DONE and t.done
    assert t.delivered == [11, 12, 13, 14]


def test_continuous_usage_counts_the_whole_answer() -> None:
    so = {"include_usage": True, "continuous_usage_stats": True}
    t = recorded(body(max_tokens=4, stream_options=so))
    t.take(comp_chunk("a", [11], prompt=[1, 2], usage={
        "prompt_tokens": 2, "completion_tokens": 1, "total_tokens": 3}))
    t.begin_attempt()
    out = event(t.take(comp_chunk("b", [12], usage={
        "prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4})))
    assert out["usage"] == {"prompt_tokens": 2, "completion_tokens": 2, "total_tokens": 4}


def test_a_chat_continuation_goes_on_as_chat_deltas() -> None:
    t = recorded(chat_body(max_tokens=3, return_token_ids=True), CHAT)
    t.take(json.dumps({"id": "chatcmpl-9", "object": "chat.completion.chunk", "created": 5,
                       "model": "m", "prompt_token_ids": [1], "choices": [
                           {"index": 0, "delta": {"role": "assistant", "content": ""},
                            "token_ids": []}]}).encode())
    t.take(json.dumps({"id": "chatcmpl-9", "choices": [
        {"index": 0, "delta": {"content": "x"}, "token_ids": [7]}]}).encode())
    t.begin_attempt()
    out = event(t.take(comp_chunk("y", [8], "length")))
    assert out == {"id": "chatcmpl-9", "object": "chat.completion.chunk", "created": 5,
                   "model": "m", "choices": [{"index": 0, "delta": {"content": "y"},
                                              "logprobs": None, "finish_reason": "length",
                                              "token_ids": [8]}]}


def test_a_usage_chunk_the_client_did_not_ask_for_is_dropped() -> None:
    t = recorded(body(max_tokens=3))
    t.take(comp_chunk("a", [1], prompt=[1]))
    t.begin_attempt()
    assert t.take(json.dumps({"choices": [], "usage": {"completion_tokens": 2}}).encode()) \
        is None


def test_the_end_of_an_answer_whose_end_was_lost() -> None:
    t = recorded(body(max_tokens=2, stream_options={"include_usage": True}))
    t.take(comp_chunk("a", [11], prompt=[1, 2, 3]))
    t.take(comp_chunk("b", [12], "length"))
    end = t.close()
    usage, done = end.split(b"\n\n", 1)
    assert json.loads(usage[6:])["usage"] == {"prompt_tokens": 3, "completion_tokens": 2,
                                             "total_tokens": 5}
    assert done == DONE


@pytest.mark.parametrize(("data", "words"), [
    (b'{"error": {"message": "EngineCore encountered an issue", "code": 500}}',
     "EngineCore encountered"),
    (b"[DONE]", "before the answer's end"),
    (b"{truncated", "not JSON"),
    (b"[1, 2]", "not a chunk"),
])
def test_a_broken_stream_is_never_taken_for_an_answer(data: bytes, words: str) -> None:
    t = recorded(body())
    t.take(comp_chunk("a", [11], prompt=[1]))
    with pytest.raises(StreamBroken, match=words):
        t.take(data)
    assert not t.done


def test_a_parsers_deltas_make_a_chat_stream_not_continuable() -> None:
    t = recorded(chat_body(), CHAT)
    t.take(json.dumps({"id": "c", "prompt_token_ids": [1], "choices": [
        {"index": 0, "delta": {"reasoning": "hmm"}, "token_ids": [3]}]}).encode())
    assert t.refusal() == "parser_output"


def test_an_engine_that_ignores_return_token_ids() -> None:
    t = recorded(body())
    t.take(json.dumps({"id": "c", "choices": [{"index": 0, "text": "a"}]}).encode())
    assert t.refusal() == "no_token_ids"


# ---- SSE framing --------------------------------------------------------------------

def test_events_are_framed_across_reads() -> None:
    r = EventReader()
    assert r.feed(b"data: {\"a\"") == [] and r.pending
    assert r.feed(b": 1}\n\ndata: [DONE]\n") == [b'{"a": 1}']
    assert r.feed(b"\n") == [b"[DONE]"] and not r.pending


def test_comments_crlf_and_multiline_data() -> None:
    r = EventReader()
    got = r.feed(b": keep-alive\r\n\r\nevent: x\r\ndata: one\r\ndata:two\r\n\r\n")
    assert got == [b"one\ntwo"]


def test_the_error_event_has_no_done() -> None:
    ev = error_event("the engine died; the answer cannot be continued (echo)")
    assert ev.startswith(b"data: ") and b"[DONE]" not in ev
    assert json.loads(ev[6:])["error"]["message"].endswith("(echo)")


# ---- the fast path for plain token chunks ---------------------------------------------
# Transcript.read skips decoding the JSON of a plain token chunk; whatever the engine
# sends, its result must be exactly that of EventReader + take (the reference).

_text = st.lists(st.sampled_from(['a', ' ', '"', '\\', '\n', 'é', '}', ',', ':', '"index":',
                                 '"token_ids":[1]', '{"id":', '"},']),
                max_size=6).map("".join)


@st.composite
def _chunk(draw: st.DrawFn, chat: bool, first: bool) -> bytes:
    """An engine event: mostly vLLM's plain token chunk, often something near it."""
    often = st.integers(0, 5).map(bool)  # True 5 times in 6
    finish = None if draw(often) else draw(st.sampled_from(["length", "stop"]))
    ids = draw(st.lists(st.integers(0, 600), max_size=3))
    choice: dict[str, Any] = {"index": 0 if draw(often) else 1}
    if chat:
        delta: dict[str, Any] = {"content": draw(_text)}
        if first or not draw(often):
            delta = draw(st.sampled_from([{"role": "assistant", "content": ""},
                                          {"content": "x", "reasoning_content": "r"},
                                          {"content": "x", "reasoning_content": None},
                                          {"tool_calls": [{"index": 0}]}, {}]))
        choice["delta"] = delta
    else:
        choice["text"] = draw(_text)
    choice.update({"logprobs": None, "finish_reason": finish})
    if not chat:
        choice["stop_reason"] = None
        prompt = [1, 2, 3] if first else None if draw(often) else draw(
            st.sampled_from([[9], "absent"]))
        if prompt != "absent":
            choice["prompt_token_ids"] = prompt
    if draw(often):
        choice["token_ids"] = ids
    if not draw(often):  # the keys in another order
        choice = dict(reversed(choice.items()))
    doc: dict[str, Any] = {"id": "cmpl-1" if draw(often) else 'x"y',
                           "object": "chat.completion.chunk" if chat else "text_completion",
                           "created": 5, "model": "m",
                           "choices": [choice] if draw(often) else draw(
                               st.sampled_from([[], [choice, choice]]))}
    if chat and first:
        doc["prompt_token_ids"] = [1, 2, 3]
    if not draw(often):
        doc["usage"] = draw(st.sampled_from([None, {"completion_tokens": 2}]))
    if not draw(often):
        doc["system_fingerprint"] = "fp"
    if draw(st.integers(0, 29)) == 0:
        doc = {"error": {"message": "boom"}}
    compact = draw(often)
    return json.dumps(doc, separators=(",", ":") if compact else (", ", ": ")).encode()


@st.composite
def _stream(draw: st.DrawFn) -> tuple[bool, bool, list[bytes]]:
    chat = draw(st.booleans())
    client_ids = draw(st.booleans())
    events = [draw(_chunk(chat, i == 0)) for i in range(draw(st.integers(1, 8)))]
    if draw(st.booleans()):
        events.append(b"[DONE]")
    raw = b"".join(b"data: " + e + b"\n\n" for e in events)
    cuts = sorted(draw(st.lists(st.integers(0, len(raw)), max_size=4)))
    pieces = [raw[a:b] for a, b in zip([0, *cuts], [*cuts, len(raw)], strict=True)]
    return chat, client_ids, pieces


def _through(t: Transcript, pieces: list[bytes], fast: bool) -> tuple[bytes, str]:
    out, reader = b"", EventReader()
    try:
        for piece in pieces:
            if fast:
                out += t.read(piece)
            else:
                for data in reader.feed(piece):
                    out += t.take(data) or b""
                    if t.done:
                        break
            if t.done:
                break
    except StreamBroken as exc:
        return out + (exc.partial if fast else b""), str(exc)
    return out, ""


@st.composite
def _runs(draw: st.DrawFn) -> tuple[bool, bool, list[bytes]]:
    """Long runs of plain token chunks, as an engine that writes faster than the proxy
    reads gives them, now and then something else among them, cut anywhere."""
    chat = draw(st.booleans())
    client_ids = draw(st.booleans())
    events = [draw(_chunk(chat, True))]
    for _ in range(draw(st.integers(0, 3))):
        for _ in range(draw(st.integers(0, 12))):
            text = draw(_text)
            ids = draw(st.lists(st.integers(0, 70000), max_size=3))
            if chat:
                raw = {"id": "c", "object": "chat.completion.chunk", "created": 1,
                       "model": "m", "choices": [{"index": 0, "delta": {"content": text},
                                                  "logprobs": None, "finish_reason": None,
                                                  "token_ids": ids}]}
            else:
                raw = {"id": "c", "object": "text_completion", "created": 1, "model": "m",
                       "choices": [{"index": 0, "text": text, "logprobs": None,
                                    "finish_reason": None, "stop_reason": None,
                                    "prompt_token_ids": None, "token_ids": ids}]}
            events.append(json.dumps(raw, separators=(",", ":")).encode())
        events.append(draw(_chunk(chat, False)))
    if draw(st.booleans()):
        events.append(b"[DONE]")
    raw = b"".join(b"data: " + e + b"\n\n" for e in events)
    cuts = sorted(draw(st.lists(st.integers(0, len(raw)), max_size=3)))
    pieces = [raw[a:b] for a, b in zip([0, *cuts], [*cuts, len(raw)], strict=True)]
    return chat, client_ids, pieces


@pytest.mark.parametrize(("run_min", "per_event"), [(continuation._RUN_MIN, False),
                                                     (0, False),
                                                     (continuation._RUN_MIN, True)])
@settings(max_examples=examples(400), deadline=None)
@given(st.one_of(_stream(), _runs()))
def test_the_fast_path_reads_every_stream_exactly_as_take_does(
        run_min: int, per_event: bool, stream: tuple[bool, bool, list[bytes]]) -> None:
    """One event at a time, (run_min 0: every read) runs of them at once, and (per_event)
    each read one whole event, as vLLM writes one per engine step."""
    chat, client_ids, pieces = stream
    if per_event:
        pieces = [e + b"\n\n" for e in b"".join(pieces).split(b"\n\n")[:-1]]
    raw = chat_body(return_token_ids=client_ids) if chat else body(return_token_ids=client_ids)
    fast, slow = recorded(raw, CHAT if chat else COMP), recorded(raw, CHAT if chat else COMP)
    with mock.patch.object(continuation, "_RUN_MIN", run_min):
        assert _through(fast, pieces, True) == _through(slow, pieces, False)
    keys = ("id", "created", "model", "system_fingerprint", "prompt_ids", "delivered",
            "finish_reason", "usage_sent", "done", "events", "not_continuable")
    assert {k: getattr(fast, k) for k in keys} == {k: getattr(slow, k) for k in keys}


def test_a_large_read_takes_its_runs_of_plain_chunks_at_once() -> None:
    """The engine wrote faster than the proxy read: the plain token chunks of one read
    are taken as runs, the first chunk (the prompt's ids) and the last one decoded."""
    raw = body(max_tokens=40)
    events = [comp_chunk("", [7], prompt=[1, 2]), *(comp_chunk(f" t{i}", [100 + i])
                                                    for i in range(38)),
              comp_chunk(" end", [200], finish="length")]
    stream = b"".join(b"data: " + e.replace(b", ", b",").replace(b": ", b":") + b"\n\n"
                      for e in events) + DONE
    fast, slow = recorded(raw, COMP), recorded(raw, COMP)
    taken: list[bytes] = []
    take = fast.take

    def counted(data: bytes) -> bytes | None:
        taken.append(data)
        return take(data)

    fast.take = counted  # type: ignore[method-assign]
    assert len(stream) >= continuation._RUN_MIN
    assert _through(fast, [stream], True) == _through(slow, [stream], False)
    assert fast.delivered == [7, *range(100, 138), 200] and fast.events == 40 and fast.done
    assert len(taken) == 3  # the first, the last, [DONE]


SSE = Path(__file__).parent / "fixtures" / "vllm-0.32-cpu-sse"


@pytest.mark.parametrize("client_ids", [False, True])
@pytest.mark.parametrize(("name", "path", "raw"), [
    ("completions.txt", COMP, body(max_tokens=3, stream_options={"include_usage": True})),
    ("chat.txt", CHAT, chat_body(max_tokens=3, stream_options={"include_usage": True}))])
def test_the_fast_path_takes_vllms_own_plain_chunks(name: str, path: str, raw: bytes,
                                                     client_ids: bool) -> None:
    """vLLM's real chunks: every plain token chunk is read without decoding, and the
    client gets what `take` gives, byte for byte."""
    if client_ids:
        raw = json.dumps({**json.loads(raw), "return_token_ids": True}).encode()
    stream = (SSE / name).read_bytes()
    fast, slow = recorded(raw, path), recorded(raw, path)
    taken: list[bytes] = []
    take = fast.take

    def counted(data: bytes) -> bytes | None:
        taken.append(data)
        return take(data)

    fast.take = counted  # type: ignore[method-assign]
    assert _through(fast, [stream], True) == _through(slow, [stream], False)
    assert fast.done and fast.delivered == slow.delivered and len(fast.delivered) == 3
    # the first chunk (the prompt's ids), the last (its finish), usage and [DONE] are
    # decoded; the plain token chunks between are not
    plain = 1 if path == COMP else 2
    assert len(taken) == stream.count(b"data: ") - plain
    assert (b"token_ids" in _through(recorded(raw, path), [stream], True)[0]) == client_ids
    # one event per read, as vLLM writes them: each plain token chunk is one match of
    # its read (`_ONE`), never the event loop of `_events`
    reads = [e + b"\n\n" for e in stream.split(b"\n\n")[:-1]]
    one, slow = recorded(raw, path), recorded(raw, path)
    events = one._events
    looped: list[int] = []

    def loop(evs: list[bytes], out: list[bytes]) -> None:
        looped.append(len(evs))
        events(evs, out)

    one._events = loop  # type: ignore[method-assign]
    assert _through(one, reads, True) == _through(slow, reads, False)
    assert one.delivered == slow.delivered and one.events == slow.events
    assert sum(looped) == stream.count(b"data: ") - plain  # (the decoded ones only)


def test_which_engines_schedule_by_priority() -> None:
    from supervisor.front.continuation import schedules_by_priority

    assert schedules_by_priority(["vllm", "serve", "m", "--scheduling-policy", "priority"])
    assert schedules_by_priority(["--scheduling-policy=priority"])
    assert not schedules_by_priority(["--scheduling-policy", "fcfs"])
    assert not schedules_by_priority(["--scheduling-policy=priority",
                                      "--scheduling-policy", "fcfs"])  # the last counts
    assert not schedules_by_priority(["--scheduling-policy"])  # (no value)
    assert not schedules_by_priority([])


def test_a_continuation_first_goes_ahead_of_its_requests_own_priority() -> None:
    """For an engine that schedules by priority: CONTINUED_FIRST ahead of the request's
    own, plus the tokens still to come; without a max_tokens, last among continuations."""
    from supervisor.front.continuation import CONTINUED_FIRST

    t = recorded(body(max_tokens=5, priority=3))
    t.take(comp_chunk("a", [11], prompt=[1, 2, 3]))
    assert json.loads(t.continuation())["priority"] == 3  # (not first: as the client sent)
    assert json.loads(t.continuation(first=True))["priority"] == 3 - CONTINUED_FIRST + 4
    t = recorded(body(priority="high"))  # (not an int: counted as 0)
    t.take(comp_chunk("a", [11], prompt=[1]))
    assert json.loads(t.continuation(first=True))["priority"] == -1
