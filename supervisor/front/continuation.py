"""Token-level continuation: a stream whose engine fails mid-answer goes on, token-exact.

The proxy asks the engine for token ids (vLLM's `return_token_ids`) on every streamed
`/v1/completions` and `/v1/chat/completions` request it can continue, and removes them
from what the client receives unless the client asked for them. A `Transcript` records
the prompt's token ids and every token id delivered. When the engine fails mid-answer,
the proxy waits for an engine serving the model and sends a continuation: a
`/v1/completions` request whose prompt is the prompt's token ids followed by the
delivered ones, `max_tokens` and `min_tokens` reduced by what was delivered, the same
sampling parameters. Its chunks are reframed into the original stream: the same `id`,
`created`, `model` and choice index, a chat answer as chat deltas, usage for the whole
answer (the original prompt's tokens, every completion token).

Where continuation cannot be exact it is not attempted (`continuable.refusal`), and a stream that
breaks then ends with an explicit error event and no `[DONE]`: several choices (`n`,
`best_of`, beam search), structured output, `echo`, logprobs (their offsets and prompt
logprobs restart), stop strings (one could span the gap), presence and frequency
penalties (vLLM applies them to generated tokens only: delivered tokens would become
prompt), tools, multimodal input, several prompts in one request; and, found while
recording, a reasoning or tool-call parser's deltas, or an engine that does not return
token ids.

Pure: no I/O, no clock.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from supervisor.front.continuable import Plan
from supervisor.front.sse import DONE, EventReader
from supervisor.front.sse import event as _event
from supervisor.watchdog.relaunch import arg_value

# How a broken stream ended (the exporter's label; every one born at 0): continued on an
# engine; resent whole (the client had seen nothing); closed (only its end was lost);
# refused (see continuable.REFUSALS); failed (no engine took it in time, or one refused it);
# client_gone (the client left while it waited).
OUTCOMES = ("continued", "resent", "closed", "refused", "failed", "client_gone")
CONTINUATION_PATH = "/v1/completions"
# Where the engine schedules by priority (`--scheduling-policy priority`: lower goes
# first, and preempts a running request of a higher one), a continuation is sent this far
# ahead of its request's own priority, the fewer tokens to come the earlier (issue 51).
CONTINUED_FIRST = 1 << 20


def schedules_by_priority(argv: Sequence[str]) -> bool:
    """Whether an engine run with these arguments schedules by priority (vLLM refuses a
    request's non-zero priority otherwise); the last `--scheduling-policy` counts."""
    return arg_value(argv, "--scheduling-policy") == "priority"

# Chat keys a continuation (a completions request) keeps: sampling and output shaping.
# Everything else of a chat request is either the prompt (now token ids) or refused.
_CHAT_KEPT = ("model", "temperature", "top_p", "top_k", "min_p", "seed",
              "repetition_penalty", "ignore_eos", "stop_token_ids", "skip_special_tokens",
              "spaces_between_special_tokens", "logit_bias", "allowed_token_ids",
              "bad_words", "include_stop_str_in_output", "priority", "user",
              "stream_options", "length_penalty", "vllm_xargs")
# A completions request's keys that only make sense for its original prompt.
_COMPLETION_DROPPED = ("prompt", "max_tokens", "min_tokens", "suffix", "add_special_tokens",
                       "truncate_prompt_tokens", "return_token_ids", "cache_salt")
# Chat delta keys of a plain answer; any other (reasoning, tool_calls) comes from a parser
# that read the whole answer so far: a continuation would restart it.
_PLAIN_DELTA = frozenset(("role", "content"))


# A token-id field as vLLM writes it (pydantic's compact JSON), with its leading comma.
_TOKEN_IDS = re.compile(rb',\s*"(?:prompt_)?token_ids"\s*:\s*(?:\[[0-9,\s]*\]|null)')
# A plain token chunk exactly as vLLM writes it (pydantic's compact JSON; captured in
# tests/fixtures/vllm-0.32-cpu-sse/): one choice, not finished, no usage, a chat delta of
# content alone, its token ids. Transcript.read takes these without decoding the JSON.
# Inside a JSON string every `"` is escaped, so the id and model exclude `"` and `\`, and
# a text is a run of unescaped non-quotes and escapes.
_STR = rb'"[^"\\]*(?:\\.[^"\\]*)*"'  # (unrolled: a run of plain bytes is one step)
_IDS = rb'(?:(?:0|[1-9][0-9]*)(?:,(?:0|[1-9][0-9]*))*)?'  # as JSON writes a list of ints
_PLAIN = re.compile(
    rb'\{"id":"[^"\\]*","object":"(?:text_completion|(chat)\.completion\.chunk)",'
    rb'"created":\d+,"model":"[^"\\]*","choices":\[\{"index":0,'
    rb'(?:"text":' + _STR + rb'|"delta":\{"content":' + _STR + rb'\})'
    rb',"logprobs":null,"finish_reason":null(?:,"stop_reason":null)?'
    rb'(,"prompt_token_ids":null)?(,"token_ids":\[(' + _IDS + rb')\])\}\]\}', re.S)


def _plain_event(chat: bool, groups: bool) -> bytes:
    """One whole plain token event (`data: ` + `_PLAIN` + a blank line) of one kind, with
    no newline inside it (JSON escapes its newlines; an event with a raw one goes the
    long way). `groups`: those of `_PLAIN` less the chat one (the token-id fields, the
    ids)."""
    s = rb'"[^"\\\n]*(?:\\[^\n][^"\\\n]*)*"'
    obj, text = ((rb'chat\.completion\.chunk', rb'"delta":\{"content":' + s + rb'\}') if chat
                 else (rb'text_completion', rb'"text":' + s))
    ids = (rb'(,"prompt_token_ids":null)?(,"token_ids":\[(' + _IDS + rb')\])' if groups
           else rb'(?:,"prompt_token_ids":null)?,"token_ids":\[' + _IDS + rb'\]')
    return (rb'data: \{"id":"[^"\\\n]*","object":"' + obj + rb'","created":\d+,'
            rb'"model":"[^"\\\n]*","choices":\[\{"index":0,' + text +
            rb',"logprobs":null,"finish_reason":null(?:,"stop_reason":null)?' + ids +
            rb'\}\]\}\n\n')


# A run of whole plain token events: Transcript.read takes such a run with three scans of
# its bytes, not a Python loop over its events. One such event, as a read of vLLM's
# stream usually is (one event per engine step): taken with one match of the read.
_RUNS = {chat: re.compile(rb"(?:" + _plain_event(chat, False) + rb")+")
         for chat in (False, True)}
_ONE = {chat: re.compile(_plain_event(chat, True)) for chat in (False, True)}
_RUN_MIN = 1024  # a read of this many bytes or more is looked at for runs (4 events)
# In a run: each event's token ids (its last field), and the id fields to cut out
_RUN_IDS = re.compile(rb'"token_ids":\[([0-9,]*)\]\}\]\}\n\n')
_RUN_CUT = re.compile(rb',"(?:prompt_token_ids":null,")?token_ids":\[[0-9,]*\](?=\}\]\}\n\n)')


class StreamBroken(Exception):
    """The engine's stream failed: an error event, an end before the answer's end, or
    garbage where an event should be. The message says which, for the client's error."""

    partial = b""  # set by Transcript.read: the client's bytes of the events before it


@dataclass
class Transcript:
    """One continuable stream as the client received it: what a continuation needs, and
    the reframing of the engine's events into the client's one stream."""

    plan: Plan
    include_usage: bool = False  # the client asked for a usage chunk at the end
    id: str | None = None
    created: int | None = None
    model: str | None = None
    system_fingerprint: str | None = None
    prompt_ids: list[int] | None = None
    delivered: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    usage_sent: bool = False
    done: bool = False  # [DONE] written
    attempt: int = 0  # 0: the original request; n: the nth continuation
    base: int = 0  # tokens delivered before this attempt began
    events: int = 0  # data events written to the client
    not_continuable: str | None = None  # found while recording
    paused: bool = False  # taken off its engine on purpose (a drained restart)

    def __post_init__(self) -> None:
        so = self.plan.doc.get("stream_options")
        self.include_usage = isinstance(so, dict) and so.get("include_usage") is True
        self._continuous = isinstance(so, dict) and so.get("continuous_usage_stats") is True
        self._reader = EventReader()
        self._strip = not self.plan.client_token_ids and self.plan.refused is None

    def new_reader(self) -> None:
        """A fresh SSE reader for the next engine answer (an attempt's own stream)."""
        self._reader = EventReader()

    def read(self, chunk: bytes) -> bytes:
        """Bytes from the engine as they arrive -> the bytes for the client (the events
        complete in them). Plain token chunks of the original answer, exactly as vLLM
        writes them (`_PLAIN`), are recorded without decoding their JSON, with `take`'s
        exact result (tests/test_continuation.py checks the two against each other):
        one by one, or, in a large read, a run of them at once (`_read_runs`); every
        other event goes through `take`. Stops at the answer's end (`done`). Raises
        StreamBroken as `take` does; what was taken before is recorded, and
        `StreamBroken.partial` holds its bytes for the client."""
        out: list[bytes] = []
        if (len(chunk) < _RUN_MIN and not self.attempt and self.id is not None
                and self.prompt_ids is not None and not self._reader._buf):
            m = _ONE[self.plan.chat].match(chunk)
            if m is not None and m.end() == len(chunk):
                # an engine's usual read, one whole plain token event: `_take_plain`'s
                # first turn inline (every event of every stream)
                ids = m[3]
                if b"," in ids:
                    self.delivered.extend(map(int, ids.split(b",")))
                elif ids:
                    self.delivered.append(int(ids))
                self.events += 1
                if not self._strip:
                    return chunk
                cut = m.start(1)
                return chunk[:cut if cut >= 0 else m.start(2)] + chunk[m.end(2):]
            # a few whole events, or one and the start of the next
            pos = self._take_plain(chunk, out) if m is not None else 0
            if pos == len(chunk):
                return out[0] if len(out) == 1 else b"".join(out)
            if pos:
                chunk = chunk[pos:]
        try:
            if len(chunk) >= _RUN_MIN:
                self._read_runs(chunk, out)
            else:  # an engine's usual read: an event or two
                self._events(self._reader.feed(chunk), out)
        except StreamBroken as exc:
            exc.partial = b"".join(out)
            raise
        return b"".join(out)

    def _take_plain(self, chunk: bytes, out: list[bytes]) -> int:
        """The whole plain token events at the start of a read, one match of the read
        each (`_ONE`: what `_events` gives them, without the SSE splitter or a slice per
        event); where the first other bytes begin. (Every event of every stream: no
        tuple of groups, one id without a split.)"""
        match, strip, delivered = _ONE[self.plan.chat].match, self._strip, self.delivered
        pos, end, n = 0, len(chunk), 0
        while pos < end:
            m = match(chunk, pos)
            if m is None:
                break
            ids = m[3]
            if b"," in ids:
                delivered.extend(map(int, ids.split(b",")))
            elif ids:
                delivered.append(int(ids))
            n += 1
            stop = m.end()
            if strip:  # the two id fields cut out (group 1: `,"prompt_token_ids":null`)
                cut = m.start(1)
                out.append(chunk[pos:cut if cut >= 0 else m.start(2)] + chunk[m.end(2):stop])
            else:
                out.append(chunk if pos == 0 and stop == end else chunk[pos:stop])
            pos = stop
        self.events += n
        return pos

    def _read_runs(self, chunk: bytes, out: list[bytes]) -> None:
        """A large read (the engine wrote faster than the proxy read): each run of plain
        token events in it taken at once (`_take_run`), the events between one by one."""
        reader = self._reader
        buf = reader.pending_and(chunk)
        if b"\r" in buf:  # (not vLLM's framing: every event the long way)
            self._events(reader.feed(buf), out)
            return
        run, pos = _RUNS[self.plan.chat].match, 0
        while True:
            if not self.attempt and self.id is not None and self.prompt_ids is not None:
                m = run(buf, pos)
                if m is not None:
                    out.append(self._take_run(m[0]))
                    pos = m.end()
            end = buf.find(b"\n\n", pos)
            if end < 0:
                break
            self._events(reader.feed(buf[pos:end + 2]), out)  # one event
            pos = end + 2
            if self.done:
                break
        reader.keep(buf[pos:])

    def _take_run(self, run: bytes) -> bytes:
        """A run of plain token events (`_RUNS`): each one's ids recorded, and what the
        client gets: the same bytes, less the id fields unless it asked for them."""
        found = _RUN_IDS.findall(run)
        ids = b",".join(filter(None, found))
        if ids:
            self.delivered.extend(map(int, ids.split(b",")))
        self.events += len(found)
        return _RUN_CUT.sub(b"", run) if self._strip else run

    def _events(self, events: list[bytes], out: list[bytes]) -> None:
        """Whole events' data, one by one: a plain token chunk without decoding its JSON,
        any other through `take`; stops at the answer's end."""
        # (the hot path of every continuable stream: locals, one match, one groups())
        plain, chat, strip, delivered = _PLAIN.fullmatch, self.plan.chat, self._strip, \
            self.delivered
        fast = not self.attempt and self.id is not None and self.prompt_ids is not None
        for data in events:
            m = plain(data) if fast else None
            if m is not None and (m[1] is not None) is chat:
                _, pnull, _, ids = m.groups()
                if ids:
                    delivered.extend(map(int, ids.split(b",")))
                self.events += 1
                if strip:  # what _TOKEN_IDS.sub removes: the two id fields
                    cut = m.start(2) if pnull is not None else m.start(3)
                    out.append(b"data: " + data[:cut] + data[m.end(3):] + b"\n\n")
                else:
                    out.append(b"data: " + data + b"\n\n")
                continue
            o = self.take(data)
            if o:
                out.append(o)
            if self.done:
                break
            fast = not self.attempt and self.id is not None and self.prompt_ids is not None

    # ---- what can be done --------------------------------------------------------------

    def refusal(self) -> str | None:
        """Why this stream cannot be continued now; None if it can."""
        if self.plan.refused is not None:
            return self.plan.refused
        if self.not_continuable is not None:
            return self.not_continuable
        if self.events and self.prompt_ids is None:
            return "no_token_ids"  # an engine that ignores return_token_ids
        return None

    @property
    def remaining(self) -> int | None:
        mt = self.plan.max_tokens
        return None if mt is None else mt - len(self.delivered)

    def continuation(self, first: bool = False) -> bytes:
        """The continuation request: the prompt's token ids and the delivered ones, the
        token budgets reduced, the same sampling; streamed, with token ids. `first`: the
        engine schedules by priority, and the continuation goes ahead of every request
        of its own priority or later, the nearest done first (`CONTINUED_FIRST`)."""
        assert self.prompt_ids is not None
        doc = self.plan.doc
        if self.plan.chat:
            body = {k: doc[k] for k in _CHAT_KEPT if k in doc}
        else:
            body = {k: v for k, v in doc.items() if k not in _COMPLETION_DROPPED}
        body["prompt"] = self.prompt_ids + self.delivered
        body["stream"] = True
        body["return_token_ids"] = True
        if self.remaining is not None:
            body["max_tokens"] = self.remaining
        if self.plan.min_tokens:
            body["min_tokens"] = max(0, self.plan.min_tokens - len(self.delivered))
        if first:
            own = doc.get("priority", 0)
            own = own if type(own) is int else 0  # (the engine took the request so)
            to_go = CONTINUED_FIRST - 1 if self.remaining is None else self.remaining
            body["priority"] = own - CONTINUED_FIRST + min(max(0, to_go), CONTINUED_FIRST - 1)
        return json.dumps(body, separators=(",", ":")).encode()

    def begin_attempt(self) -> None:
        self.attempt += 1
        self.base = len(self.delivered)

    # ---- reading the engine's events ---------------------------------------------------

    def take(self, data: bytes) -> bytes | None:
        """One event's data from the engine -> the bytes for the client (None: nothing).
        Raises StreamBroken for an error event, a [DONE] before the answer's end, or an
        event that is not a chunk."""
        if data == b"[DONE]":
            if self.finish_reason is None:
                raise StreamBroken("the engine ended the stream before the answer's end")
            return self.close()
        try:
            chunk = json.loads(data)
        except ValueError:
            raise StreamBroken("the engine sent an event that is not JSON") from None
        if not isinstance(chunk, dict):
            raise StreamBroken("the engine sent an event that is not a chunk")
        if "error" in chunk:
            err = chunk["error"]
            msg = err.get("message") if isinstance(err, dict) else err
            raise StreamBroken(f"the engine failed mid-answer: {str(msg)[:300]}")
        if self.attempt == 0:
            return self._take_original(chunk, data)
        return self._take_continued(chunk)

    def _take_original(self, chunk: dict[str, Any], data: bytes) -> bytes | None:
        if self.id is None:
            self.id, self.created, self.model = (chunk.get("id"), chunk.get("created"),
                                                 chunk.get("model"))
        if chunk.get("system_fingerprint") is not None:
            self.system_fingerprint = chunk["system_fingerprint"]
        strip = self._strip
        changed = False
        if "prompt_token_ids" in chunk:  # a chat stream's first chunk
            self._prompt(chunk["prompt_token_ids"])
            if strip:
                del chunk["prompt_token_ids"]
                changed = True
        for choice in chunk.get("choices") or ():
            if not isinstance(choice, dict):
                raise StreamBroken("the engine sent a choice that is not an object")
            if "prompt_token_ids" in choice:  # a completions stream's first chunk
                self._prompt(choice["prompt_token_ids"])
                if strip:
                    del choice["prompt_token_ids"]
                    changed = True
            self._record(choice)
            if strip and "token_ids" in choice:
                del choice["token_ids"]
                changed = True
            if self.plan.chat and self.not_continuable is None:
                delta = choice.get("delta")
                if isinstance(delta, dict) and any(
                        v for k, v in delta.items() if k not in _PLAIN_DELTA):
                    self.not_continuable = "parser_output"
        if chunk.get("usage") is not None and not chunk.get("choices"):
            self.usage_sent = True
        self.events += 1
        if changed:
            # the same bytes less the token ids (vLLM's compact JSON), else re-encoded
            data = _TOKEN_IDS.sub(b"", data)
            if b'token_ids"' in data:
                return _event(chunk)
        return b"data: " + data + b"\n\n"

    def _prompt(self, ids: object) -> None:
        if self.prompt_ids is None and isinstance(ids, list):
            self.prompt_ids = [int(x) for x in ids]

    def _record(self, choice: dict[str, Any]) -> None:
        ids = choice.get("token_ids")
        if isinstance(ids, list):
            self.delivered.extend(int(x) for x in ids)
        if choice.get("finish_reason") is not None:
            self.finish_reason = choice["finish_reason"]

    def _take_continued(self, chunk: dict[str, Any]) -> bytes | None:
        """A continuation's chunk (always a completions chunk) in the original's shape."""
        choices = chunk.get("choices") or []
        usage = chunk.get("usage")
        if not choices:
            if usage is None or not self.include_usage:
                return None
            self.usage_sent = True
            return _event(self._frame([], self._usage(usage)))
        out = []
        for choice in choices:
            if not isinstance(choice, dict):
                raise StreamBroken("the engine sent a choice that is not an object")
            self._record(choice)
            text = choice.get("text") or ""
            ids = choice.get("token_ids")
            if not text and not ids and choice.get("finish_reason") is None:
                continue
            framed: dict[str, Any] = {"index": 0}
            if self.plan.chat:
                framed["delta"] = {"content": text}
                framed["logprobs"] = None
            else:
                framed["text"] = text
                framed["logprobs"] = None
            framed["finish_reason"] = choice.get("finish_reason")
            if "stop_reason" in choice and not self.plan.chat:
                framed["stop_reason"] = choice.get("stop_reason")
            if self.plan.client_token_ids:
                framed["token_ids"] = ids
            out.append(framed)
        if not out:
            return None
        self.events += 1
        cont_usage = self._usage(usage) if (usage is not None and self._continuous) else None
        return _event(self._frame(out, cont_usage))

    def _usage(self, usage: dict[str, Any]) -> dict[str, int]:
        prompt = len(self.prompt_ids or ())
        done = self.base + int(usage.get("completion_tokens") or 0)
        return {"prompt_tokens": prompt, "total_tokens": prompt + done,
                "completion_tokens": done}

    def _frame(self, choices: list[dict[str, Any]], usage: dict[str, int] | None
               ) -> dict[str, Any]:
        out: dict[str, Any] = {
            "id": self.id, "object": "chat.completion.chunk" if self.plan.chat
            else "text_completion", "created": self.created, "model": self.model,
            "choices": choices}
        if self.system_fingerprint is not None:
            out["system_fingerprint"] = self.system_fingerprint
        if usage is not None:
            out["usage"] = usage
        return out

    def close(self) -> bytes:
        """The stream's end as the client expects it: the usage chunk (when asked for and
        not yet sent) and [DONE]."""
        self.done = True
        out = b""
        if self.include_usage and not self.usage_sent:
            done = len(self.delivered)
            prompt = len(self.prompt_ids or ())
            self.usage_sent = True
            out = _event(self._frame([], {"prompt_tokens": prompt, "total_tokens":
                                          prompt + done, "completion_tokens": done}))
        return out + DONE
