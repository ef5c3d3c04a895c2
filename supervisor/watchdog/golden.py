"""The golden check: right, not just alive (docs/watchdog.md).

An engine that answers after a wake, a restart or a swap may still answer wrongly (vLLM
zeroed EAGLE3 draft weights after a level-2 wake, vllm#52487; wrong output after a wake,
vllm#16234): a canary that only checks that tokens come back passes it. So, as vLLM's
own snapshot restore does, a fixed greedy prompt is asked of every engine the daemon
proves, through the completions and the chat route, with the token ids and their
log-probabilities; the first proven start of an engine's arguments records them as the
baseline, and every later proof of the same arguments must reproduce them: the same
token ids, each log-probability within a tolerance.

With speculative decoding, the share of draft tokens the engine accepted while it
answered is kept beside them and must not fall by more than half (a wake that zeroed
the draft weights changes no token, only that share).

A near-tie is no fault: where the baseline's best two tokens were within twice the
tolerance, another choice there (and whatever follows it) is accepted. An answer
without log-probabilities (an engine that does not give them) is no verdict.

Greedy answers are exact only for the same batch: a request the engine served beside
the golden prompt's (a client at its own port, a canary) changes the kernels' shapes,
and with them log-probabilities by more than the tolerance (the CPU engine chose
another token at a margin of 0.24 so). So the engine's generated-token counter is read
before and after: tokens beyond the answers' own were another client's, and the prompt
is asked again (at most TRIES times). Answers every try of which was shared say so
(`Golden.shared`): they may record nothing and condemn nothing (golden_check.py).

Fetching and comparing only: the unit owns the baselines and decides what a mismatch
means (`supervisor/engine/golden_check.py`).
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass
from typing import Any

import httpx

from supervisor.ops.descriptors import raise_if_exhausted
from supervisor.watchdog.metrics import MetricsParseError, parse_metrics
from supervisor.watchdog.relaunch import apply

# flags that change how much an engine holds or where it listens, not what it answers:
# a thin standby or a throttled batch keeps its engine's baseline
_CAPACITY = ("--host", "--port", "--shutdown-timeout", "--gpu-memory-utilization",
             "--max-num-seqs", "--max-num-batched-tokens")
_CAPACITY_SWITCHES = ("--enable-sleep-mode", "--disable-uvicorn-access-log")
TOP = 2  # log-probabilities asked per position: the chosen token's and its runner-up's
# the share of its baseline's speculative acceptance an engine may lose: greedy answers
# of one request draft alike, but a bf16 kernel's tie can change a draft or two of ~16
ACCEPTANCE_DROP = 0.5
# fewer draft tokens than this in one check tell nothing of the drafts' health: a short
# answer drafts once or twice, and whether those land is chance (the CPU engine's eight
# tokens drafted 2-4 and accepted none once, where a restart accepted half)
MIN_DRAFT_TOKENS = 12
TRIES = 3  # asks of the golden prompt while another client's tokens share its batch
ROUTES = ("completion", "chat")
# after a wake, the completions route alone: what a wake can break is on the card (the
# weights, the KV cache), which either route's answer shows; the chat route adds the API
# server's template, which no wake touches (one generation less while clients wait: about
# 0.07 s of an 8B engine's failover and KV reset on the H200)
AFTER_WAKE = ("completion",)
NO_LOGPROBS = "no log-probabilities in either answer"  # (no verdict, asked again or not)


@dataclass(frozen=True)
class Answer:
    """One route's greedy answer: token ids, their log-probabilities, and the margin
    by which each was chosen (its log-probability less the runner-up's; inf alone)."""

    ids: tuple[int, ...]
    logprobs: tuple[float, ...]
    margins: tuple[float, ...]

    def doc(self) -> dict[str, Any]:
        return {"ids": list(self.ids), "logprobs": [round(x, 5) for x in self.logprobs]}


@dataclass(frozen=True)
class Golden:
    """An engine's answers to the golden prompt: the completions route's and the chat
    route's (None where the route gave no log-probabilities), and with speculative
    decoding the share of draft tokens accepted while it answered them (None without)."""

    completion: Answer | None
    chat: Answer | None
    acceptance: float | None = None
    # tokens the engine generated for other clients while it answered (its last try);
    # 0: none, or no counter to tell
    shared: int = 0
    asked: int = 1  # how many times the prompt was asked (again while shared)
    routes: tuple[str, ...] = ROUTES  # the routes asked (after a wake: AFTER_WAKE)

    def doc(self) -> dict[str, Any]:
        return {"completion": self.completion.doc() if self.completion else None,
                "chat": self.chat.doc() if self.chat else None,
                **({"acceptance": round(self.acceptance, 4)}
                   if self.acceptance is not None else {}),
                **({"shared_tokens": self.shared} if self.shared else {})}


def baseline_key(argv: tuple[str, ...] | list[str]) -> tuple[str, ...]:
    """What an engine's baseline is recorded under: its command line less the flags of
    capacity and place (a new model, revision, dtype or speculative config: a new one)."""
    kept = [a for a in argv if a.split("=", 1)[0] not in _CAPACITY_SWITCHES]
    return tuple(apply(kept, dict.fromkeys(_CAPACITY)))


def _token_id(token: object) -> int | None:
    """vLLM's `token_id:123` (with `return_tokens_as_token_ids`)."""
    if isinstance(token, str) and token.startswith("token_id:"):
        try:
            return int(token[len("token_id:"):])
        except ValueError:
            return None
    return None


def _answer(chosen: list[tuple[object, object]], tops: list[list[object]]) -> Answer | None:
    ids: list[int] = []
    lps: list[float] = []
    margins: list[float] = []
    for (token, lp), top in zip(chosen, tops, strict=True):
        tid = _token_id(token)
        if tid is None or not isinstance(lp, int | float) or isinstance(lp, bool):
            return None
        others = sorted((float(x) for x in top if isinstance(x, int | float)), reverse=True)
        runner_up = others[1] if len(others) > 1 else -math.inf
        ids.append(tid)
        lps.append(float(lp))
        margins.append(float(lp) - runner_up)
    return Answer(tuple(ids), tuple(lps), tuple(margins)) if ids else None


def parse_completion(doc: Any) -> Answer | None:
    """A /v1/completions answer's logprobs (tokens, token_logprobs, top_logprobs)."""
    try:
        lp = doc["choices"][0]["logprobs"]
        tokens, values, tops = lp["tokens"], lp["token_logprobs"], lp["top_logprobs"]
        return _answer(list(zip(tokens, values, strict=True)),
                       [list((t or {}).values()) for t in tops])
    except (KeyError, IndexError, TypeError, ValueError, AttributeError):
        return None


def parse_chat(doc: Any) -> Answer | None:
    """A /v1/chat/completions answer's logprobs.content."""
    try:
        content = doc["choices"][0]["logprobs"]["content"]
        return _answer([(c["token"], c["logprob"]) for c in content],
                       [[t["logprob"] for t in c["top_logprobs"]] for c in content])
    except (KeyError, IndexError, TypeError, ValueError, AttributeError):
        return None


def speculative(argv: list[str] | tuple[str, ...]) -> bool:
    """The engine decodes speculatively (its drafts' acceptance is then compared)."""
    return any(a.split("=", 1)[0] in ("--speculative-config", "--speculative_config")
               for a in argv)


async def fetch(client: httpx.AsyncClient, base_url: str, model: str, prompt: str,
                max_tokens: int, timeout_s: float, drafts: bool = False,
                routes: tuple[str, ...] = ROUTES) -> Golden | str:
    """The engine's greedy answers to `prompt` on `routes` (a route not asked: None), or
    why there are none
    (an error, or no log-probabilities); asked again while another client's tokens
    shared their batch (up to TRIES asks; `Golden.shared` says the last one's). With
    `drafts`, the share of draft tokens it accepted meanwhile, from its /metrics before
    and after (None where it drafted fewer than MIN_DRAFT_TOKENS). Raises
    OutOfDescriptors when the daemon could not ask."""
    got: Golden | str = "not asked"
    before = await _counters(client, base_url, timeout_s)
    for asked in range(1, TRIES + 1):
        answered = await _ask(client, base_url, model, prompt, max_tokens, timeout_s,
                              routes)
        if isinstance(answered, str):
            return answered
        answers, generated = answered
        after = await _counters(client, base_url, timeout_s) if before is not None else None
        shared = 0
        if before is not None and after is not None and None not in (before[0], after[0]):
            shared = max(0, round(after[0] - before[0]) - generated)  # type: ignore[operator]
        got = Golden(*answers, acceptance=_acceptance(before, after) if drafts else None,
                     shared=shared, asked=asked, routes=routes)
        if not shared:
            break
        before = after  # (the next ask's reads start where this one's ended)
    return got


async def _ask(client: httpx.AsyncClient, base_url: str, model: str, prompt: str,
               max_tokens: int, timeout_s: float, routes: tuple[str, ...] = ROUTES
               ) -> tuple[tuple[Answer | None, Answer | None], int] | str:
    """The routes' answers (None: not asked, or no log-probabilities) and the tokens they
    generated (their `usage`), or why none."""
    # (ignore_eos: always `max_tokens` tokens to compare, and drafts to count, where a
    # model would stop at once)
    common = {"model": model, "max_tokens": max_tokens, "temperature": 0,
              "ignore_eos": True, "return_tokens_as_token_ids": True}
    asks = (("completion", "/v1/completions", {**common, "prompt": prompt, "logprobs": TOP},
             parse_completion),
            ("chat", "/v1/chat/completions",
             {**common, "logprobs": True, "top_logprobs": TOP,
              "messages": [{"role": "user", "content": prompt}]}, parse_chat))
    got: list[Answer | None] = []
    generated = 0
    for route, path, body, parse in asks:
        if route not in routes:
            got.append(None)
            continue
        try:
            r = await client.post(f"{base_url}{path}", json=body, timeout=timeout_s)
        except httpx.TimeoutException:
            return f"{path}: no answer within {timeout_s:g} s"
        except (httpx.HTTPError, OSError) as exc:
            raise_if_exhausted(exc)
            return f"{path}: {type(exc).__name__}: {exc}"
        if r.status_code != 200:
            # (a model without a chat template answers 400 there: that route is skipped)
            got.append(None)
            continue
        try:
            doc = r.json()
        except ValueError:
            got.append(None)
            continue
        answer = parse(doc)
        got.append(answer)
        generated += _generated(doc, answer)
    if all(a is None for a in got):
        return NO_LOGPROBS
    return (got[0], got[1]), generated


def _generated(doc: Any, answer: Answer | None) -> int:
    """The tokens one answer generated: its `usage`, else its log-probabilities' count."""
    with contextlib.suppress(KeyError, TypeError, ValueError, AttributeError):
        n = doc["usage"]["completion_tokens"]
        if isinstance(n, int) and not isinstance(n, bool):
            return n
    return len(answer.ids) if answer is not None else 0


Counters = tuple[float | None, float | None, float | None]  # generated, drafted, accepted


def _acceptance(before: Counters | None, after: Counters | None) -> float | None:
    """The share of draft tokens accepted between two reads, where enough were drafted
    to tell (the engine answered nothing else meanwhile: a proof runs before it serves,
    and a try that shared its batch is asked again)."""
    if before is None or after is None or None in (before[1], before[2], after[1], after[2]):
        return None
    drafted = after[1] - before[1]  # type: ignore[operator]
    if drafted < MIN_DRAFT_TOKENS:
        return None
    return (after[2] - before[2]) / drafted  # type: ignore[operator]


async def _counters(client: httpx.AsyncClient, base_url: str,
                    timeout_s: float) -> Counters | None:
    """The engine's generated tokens and speculative decoding's draft and accepted
    tokens now (each None where the page has no such series), or None (no page)."""
    try:
        r = await client.get(f"{base_url}/metrics", timeout=timeout_s)
        snap = parse_metrics(r.text) if r.status_code == 200 else None
    except (httpx.HTTPError, OSError, MetricsParseError) as exc:
        raise_if_exhausted(exc)
        return None
    if snap is None:
        return None
    return (snap.generation_tokens_total, snap.spec_decode_draft_tokens_total,
            snap.spec_decode_accepted_tokens_total)


def compare_answer(want: Answer, got: Answer, tolerance: float) -> str | None:
    """Why `got` is not `want`, or None. Position by position: the same token within the
    tolerance; another token only where the baseline's choice was a near-tie (its margin
    within twice the tolerance), and nothing compared after it."""
    for i, (w, g) in enumerate(zip(want.ids, got.ids, strict=False)):
        if w != g:
            if want.margins[i] <= 2 * tolerance:
                return None  # (a near-tie: either choice is right)
            return (f"token {i}: id {g} where the baseline chose {w} by a margin of "
                    f"{want.margins[i]:.4g}")
        diff = abs(want.logprobs[i] - got.logprobs[i])
        if diff > tolerance:
            return (f"token {i} (id {w}): log-probability {got.logprobs[i]:.5g}, the "
                    f"baseline {want.logprobs[i]:.5g} (off by {diff:.4g} > {tolerance:g})")
    if len(want.ids) != len(got.ids):
        return f"{len(got.ids)} tokens, the baseline {len(want.ids)}"
    return None


def compare(want: Golden, got: Golden, tolerance: float,
            acceptance_drop: float = ACCEPTANCE_DROP) -> str | None:
    """Why `got` does not reproduce the baseline `want`, or None (a route either side
    did not answer with log-probabilities is not compared; nor acceptance where either
    has none). Speculative decoding's acceptance may fall by `acceptance_drop` of the
    baseline's: a wake that zeroed the draft weights falls to 0 (vllm#52487)."""
    for route, w, g in (("completion", want.completion, got.completion),
                        ("chat", want.chat, got.chat)):
        if w is not None and g is not None and (why := compare_answer(w, g, tolerance)):
            return f"{route}: {why}"
    if want.acceptance is not None and got.acceptance is not None \
            and got.acceptance < want.acceptance * (1 - acceptance_drop):
        return (f"speculative decoding accepted {got.acceptance:.1%} of its draft tokens, "
                f"the baseline {want.acceptance:.1%} (more than {acceptance_drop:.0%} "
                f"less)")
    return None


def largest_difference(want: Golden, got: Golden) -> float:
    """The largest log-probability difference over the positions both chose alike."""
    diffs = [abs(a - b) for w, g in ((want.completion, got.completion),
                                     (want.chat, got.chat)) if w is not None and g is not None
             for x, y, a, b in zip(w.ids, g.ids, w.logprobs, g.logprobs, strict=False)
             if x == y]
    return max(diffs, default=0.0)
