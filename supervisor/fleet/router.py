"""vllm-router's worker API, as this daemon uses it: add itself, remove itself, read the
list of workers (`POST /add_worker?url=`, `POST /remove_worker?url=`, `GET
/list_workers`; vllm-router 0.1.17, docs/fleet.md).

What the router does that shapes these calls (measured on 0.1.17): `add_worker` checks the
worker's `/health` first and, while that is not 200, blocks up to its
`--worker-startup-timeout-secs` (600 s by default), then answers 400; a client that hangs
up cancels the add. A URL is a worker's identity as an exact string (`localhost` and
`127.0.0.1` are two workers; a trailing `/` makes its health path `//health`, which never
answers). Adding a URL it has answers 400 "already exists"; removing one it does not have
answers 200. So: add only when this daemon's own `/health` says 200, bound every call,
read the list before adding, and treat "already exists" as success.

Fetching only: each call raises `RouterError` naming the router and what went wrong.
"""

from __future__ import annotations

import re

import httpx


class RouterError(Exception):
    """A router call that did not do what was asked."""


_URL = re.compile(r"(?P<scheme>[a-z]+)://(?P<host>\[[0-9a-fA-F:.]+\]|[^/:\[\]@?#]+)"
                  r"(?::(?P<port>\d{1,5}))?(?P<rest>.*)")


def url_problem(url: str) -> str | None:
    """Why `url` cannot name a router or a worker (http(s)://HOST:PORT, nothing after)."""
    m = _URL.fullmatch(url)
    if m is None or m["scheme"] not in ("http", "https"):
        return "expected http://HOST:PORT or https://HOST:PORT"
    if m["port"] is None:
        return "no port (say it: routers compare worker URLs as exact strings)"
    if not 0 < int(m["port"]) < 65536:
        return f"port {m['port']} is out of range 1-65535"
    if m["rest"] == "/":
        return "no trailing '/': vllm-router would probe '//health' and never add it"
    if m["rest"]:
        return "expected nothing after HOST:PORT"
    return None


class Router:
    """One router, reached through `client`; every call bounded by `timeout_s`."""

    def __init__(self, url: str, client: httpx.AsyncClient, timeout_s: float) -> None:
        self.url, self._client, self._timeout_s = url, client, timeout_s

    async def _call(self, method: str, path: str, worker: str | None = None) -> httpx.Response:
        params = {"url": worker} if worker is not None else None
        try:
            return await self._client.request(method, f"{self.url}{path}", params=params,
                                              timeout=self._timeout_s)
        except httpx.TimeoutException:
            raise RouterError(f"{method} {path}: no answer within {self._timeout_s:g} s") \
                from None
        except httpx.HTTPError as exc:
            raise RouterError(f"{method} {path}: {type(exc).__name__}: {exc}") from None

    async def workers(self) -> list[str]:
        r = await self._call("GET", "/list_workers")
        if r.status_code != 200:
            raise RouterError(f"GET /list_workers: HTTP {r.status_code}: {r.text[:200]}")
        try:
            urls = r.json()["urls"]
        except (ValueError, KeyError, TypeError):
            urls = None
        if not isinstance(urls, list) or not all(isinstance(u, str) for u in urls):
            raise RouterError(f"GET /list_workers: unexpected answer {r.text[:200]!r}")
        return urls

    async def add(self, worker: str) -> None:
        r = await self._call("POST", "/add_worker", worker)
        if r.status_code == 200 or (r.status_code == 400 and "already exists" in r.text):
            return
        raise RouterError(f"POST /add_worker: HTTP {r.status_code}: {r.text[:200]}")

    async def remove(self, worker: str) -> None:
        r = await self._call("POST", "/remove_worker", worker)
        if r.status_code != 200:
            raise RouterError(f"POST /remove_worker: HTTP {r.status_code}: {r.text[:200]}")
