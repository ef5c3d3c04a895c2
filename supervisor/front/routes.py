"""The public port's routes: one reading of a request's target, and the allow-list.

Owns the answer to "which engine route does this request reach?". A request target is
read exactly once (`read_target`): percent-decoded once, split into segments, and
refused with 400 where servers disagree about what it means (dot segments, encoded
slashes or backslashes, doubled slashes, double encoding, control characters), since
the proxy must never guess differently from the engine. The allow-list is checked on
that one canonical path, and the upstream request is built from the same path,
re-encoded (`Target.upstream_path_qs`), so the path checked is the path sent. The query
string travels as received and is never part of the route.

The allow-list names routes, not prefixes: the OpenAI-compatible serving API and vLLM's
public serving extras, each an exact path where `*` stands for one segment (an id), plus
`proxy.extra_routes` in the same form. Everything else is refused; vLLM's
unauthenticated administrative routes with 403 (a label for the operator: someone is
probing), the rest with 404. `/health` and `/ping` are answered by the proxy itself
(the daemon's view, which sees hangs that vLLM's own `/health` does not); the engine's
`/metrics` is not public (the daemon scrapes it on the internal port).

Pure: no I/O, no logging.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from urllib.parse import quote

# The serving API forwarded to the engine (vLLM 0.32's routes; `*` = one segment).
SERVING = (
    "/v1/models", "/v1/completions", "/v1/chat/completions", "/v1/chat/completions/batch",
    "/v1/embeddings",
    "/v1/responses", "/v1/responses/*", "/v1/responses/*/cancel",
    "/v1/messages", "/v1/messages/count_tokens",
    "/v1/audio/transcriptions", "/v1/audio/translations",
    "/v1/score", "/v1/rerank", "/v2/rerank", "/v2/embed",
    "/tokenize", "/detokenize", "/pooling", "/classify", "/score", "/rerank",
    "/invocations", "/version", "/generative_scoring", "/v1/systemone",
    "/inference/v1/generate",  # vLLM's tokens-in, tokens-out generation
    # prompt rendering only (chat template, tokenizer): no generation, no state
    "/v1/completions/render", "/v1/chat/completions/render", "/v1/messages/render",
    "/v1/completions/derender", "/v1/chat/completions/derender",
)
# Answered by the proxy itself, never forwarded.
LOCAL = ("/healthz", "/readyz", "/health", "/ping")
# vLLM's administrative routes (state-changing or revealing, unauthenticated): refused
# with 403 wherever they appear in a path, in any case. Not forwarded either way; the
# label tells an operator that someone aimed at them.
ADMIN = frozenset((
    "sleep", "wake_up", "is_sleeping", "reset_prefix_cache", "reset_mm_cache",
    "reset_encoder_cache", "pause", "resume", "is_paused", "collective_rpc",
    "scale_elastic_ep", "is_scaling_elastic_ep", "server_info", "start_profile",
    "stop_profile", "update_weights", "init_weight_transfer_engine",
    "start_weight_update", "finish_weight_update", "start_draft_weight_update",
    "shutdown_weight_transfer_engine", "update_weight_version", "weight_checker",
    "weight_info", "release_kv_cache_memory", "abort", "abort_requests",
    "load_lora_adapter", "unload_lora_adapter", "fault_tolerance", "get_world_size",
    "kv_event_sources",
))

_PCT = re.compile(rb"%([0-9A-Fa-f]{2})")
_BAD_PCT = re.compile(rb"%(?![0-9A-Fa-f]{2})")
# what a re-encoded path keeps as it is (RFC 3986 pchar, less "%")
_SAFE = "/-._~!$&'()*+,;=:@"


class PathRefused(Exception):
    """A target the proxy will not forward: the status, a reason label for the counters,
    and a message for the client that names what was wrong."""

    def __init__(self, status: int, reason: str, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.reason = reason
        self.message = message


@dataclass(frozen=True)
class Target:
    path: str  # decoded and canonical: what the allow-list was checked against
    query: str | None  # as received, without the "?"; None when there was none (or empty)

    @functools.cached_property  # (a Target is immutable; read_target's cache shares it)
    def upstream_path_qs(self) -> str:
        """What goes on the upstream request line: the checked path, re-encoded, and the
        query as received. Send it as already encoded (no client-side normalisation)."""
        encoded = quote(self.path, safe=_SAFE)
        return encoded if self.query is None else f"{encoded}?{self.query}"


_CACHED_TARGET_MAX = 256  # longer targets (rare, and attacker-sized) are read each time


def read_target(raw: str) -> Target:
    """The one reading of a request target (the raw request-line target, query
    included). Raises PathRefused(400, "bad_path", ...) for anything ambiguous.
    Pure, so short targets' answers are kept (a cache bounded in count and in size:
    clients send the same few targets; a refusal is an exception, read again each time)."""
    if len(raw) > _CACHED_TARGET_MAX:
        return _read_target(raw)
    return _read_target_cached(raw)


def _read_target(raw: str) -> Target:
    if not raw.startswith("/"):
        raise _bad("the request target must be a path starting with /")
    raw_path, _, query = raw.partition("?")
    if any(not 0x21 <= ord(c) <= 0x7E for c in raw_path + query) or "#" in raw:
        raise _bad("control characters, spaces, '#' and non-ASCII characters must be "
                   "percent-encoded")
    if "\\" in raw_path:
        raise _bad("backslashes are not path separators here")
    data = raw_path.encode("ascii")
    if _BAD_PCT.search(data):
        raise _bad("a '%' that does not start a percent-encoded byte")
    encoded = {m.group(1).upper() for m in _PCT.finditer(data)}
    if encoded & {b"2F", b"5C"}:
        raise _bad("percent-encoded slashes and backslashes are ambiguous")
    if b"25" in encoded:
        raise _bad("percent-encoded '%' (double encoding) is ambiguous")
    try:
        path = _PCT.sub(lambda m: bytes((int(m.group(1), 16),)), data).decode("utf-8")
    except UnicodeDecodeError:
        raise _bad("percent-encoded bytes that are not UTF-8") from None
    if any(ord(c) < 0x20 or ord(c) == 0x7F for c in path):
        raise _bad("percent-encoded control characters")
    segments = path.split("/")[1:]
    if any(s == "" for s in segments[:-1]):
        raise _bad("empty path segments ('//') are ambiguous")
    if any(s in (".", "..") for s in segments):
        raise _bad("dot segments ('.', '..', encoded or not) are not resolved here")
    return Target(path=path, query=query or None)



_read_target_cached = functools.lru_cache(maxsize=1024)(_read_target)

def _bad(why: str) -> PathRefused:
    return PathRefused(400, "bad_path", f"request path refused: {why}")


@dataclass(frozen=True)
class Routes:
    """The allow-list: exact routes, `*` for one non-empty segment."""

    patterns: tuple[tuple[str, ...], ...]
    # the routes without `*`, as paths: one set lookup answers the usual request
    exact: frozenset[str] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "exact", frozenset(
            "/" + "/".join(p) for p in self.patterns if "*" not in p))

    @classmethod
    def serving(cls, extra: Iterable[str] = ()) -> Routes:
        return cls(tuple(tuple(r.split("/")[1:]) for r in (*SERVING, *extra)))

    def allows(self, path: str) -> bool:
        if path in self.exact:
            return True
        segments = path.split("/")[1:]
        return any(_matches(p, segments) for p in self.patterns)

    def check(self, path: str) -> None:
        """Raises PathRefused (403 for an administrative route, 404 otherwise) unless
        `path`, a canonical path from read_target, is a forwarded route."""
        if self.allows(path):
            return
        if any(s.lower() in ADMIN for s in path.split("/")):
            raise PathRefused(403, "admin_route", f"{path} is an administrative route of "
                                                  "the engine and is not served here")
        raise PathRefused(404, "not_allowed", f"{path} is not a route this proxy forwards")


def _matches(pattern: tuple[str, ...], segments: list[str]) -> bool:
    return len(pattern) == len(segments) and all(
        p == s or (p == "*" and s != "") for p, s in zip(pattern, segments, strict=True))


def route_problem(route: str) -> str | None:
    """Why `route` (from proxy.extra_routes) is not a route, or None when it is one."""
    if not route.startswith("/"):
        return "a route starts with /"
    if route.endswith("/") and route != "/":
        return "a route is an exact path, not a prefix: drop the trailing / (use * for " \
               "one segment)"
    try:
        target = read_target(route.replace("*", "x"))
    except PathRefused as exc:
        return exc.message.removeprefix("request path refused: ")
    if target.query is not None:
        return "a route has no query string"
    if "%" in route:
        return "write the route decoded, without percent-encoding"
    if any("*" in s and s != "*" for s in route.split("/")):
        return "* stands for a whole segment"
    if any(s.lower() in ADMIN for s in route.split("/")):
        return "an administrative route of the engine cannot be made public"
    return None
