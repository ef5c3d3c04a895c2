"""The floor under the front proxy's cost: the least a Python proxy on the daemon's loop
(uvloop) costs per non-streamed request when it is written on asyncio protocols with
httptools' C parsers (as uvicorn is) instead of aiohttp: keep-alive on both sides, the
request and the answer each one write, no gate, no routes, no log. Not the proxy: a
measure of what aiohttp's two sides cost beside such protocols (docs/proxy.md, "Cost per
request and per chunk"), run against the proxy bench's synthetic upstream with its
client, the proxy beside it.

    .venv/bin/python bench/proxy_floor.py [--rounds 3]

httptools is not one of the supervisor's dependencies: this needs it importable, or
`FLOOR_SITE_PACKAGES` naming a site-packages that has it (vLLM's environment does:
.venv-engine/lib/python3.11/site-packages); only the floor's server process reads it.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.proxy_bench import PY, Child, Client, completion  # noqa: E402

HOP = {b"connection", b"keep-alive", b"transfer-encoding", b"content-length", b"host",
       b"te", b"trailer", b"upgrade", b"proxy-authorization", b"proxy-authenticate"}


def serve(upstream: str) -> None:
    if os.environ.get("FLOOR_SITE_PACKAGES"):
        sys.path.append(os.environ["FLOOR_SITE_PACKAGES"])
    import httptools  # type: ignore[import-not-found]
    import uvloop

    host, port = upstream.removeprefix("http://").split(":")
    pool: list[Upstream] = []

    class Upstream(asyncio.Protocol):
        def connection_made(self, t: Any) -> None:
            self.t, self.p, self.cb = t, httptools.HttpResponseParser(self), None

        def data_received(self, d: bytes) -> None:
            self.p.feed_data(d)

        def on_message_begin(self) -> None:
            self.h: list[tuple[bytes, bytes]] = []
            self.b: list[bytes] = []

        def on_header(self, n: bytes, v: bytes) -> None:
            self.h.append((n, v))

        def on_body(self, b: bytes) -> None:
            self.b.append(b)

        def on_message_complete(self) -> None:
            cb, self.cb = self.cb, None
            pool.append(self)
            assert cb is not None
            cb(self.p.get_status_code(), self.h, b"".join(self.b))

        def connection_lost(self, exc: Exception | None) -> None:
            if self in pool:
                pool.remove(self)

    class Server(asyncio.Protocol):
        def connection_made(self, t: Any) -> None:
            self.t, self.p = t, httptools.HttpRequestParser(self)

        def data_received(self, d: bytes) -> None:
            self.p.feed_data(d)

        def on_message_begin(self) -> None:
            self.h: list[tuple[bytes, bytes]] = []
            self.b: list[bytes] = []

        def on_url(self, u: bytes) -> None:
            self.u = u

        def on_header(self, n: bytes, v: bytes) -> None:
            self.h.append((n, v))

        def on_body(self, b: bytes) -> None:
            self.b.append(b)

        def on_message_complete(self) -> None:
            body = b"".join(self.b)
            out = [self.p.get_method(), b" ", self.u, b" HTTP/1.1\r\nHost: upstream\r\n"]
            for n, v in self.h:
                if n.lower() not in HOP:
                    out += [n, b": ", v, b"\r\n"]
            out += [b"Content-Length: ", str(len(body)).encode(), b"\r\n\r\n", body]
            req = b"".join(out)
            if pool:
                self.send(pool.pop(), req)
            else:
                asyncio.get_running_loop().create_task(self.connect(req))

        async def connect(self, req: bytes) -> None:
            _, up = await asyncio.get_running_loop().create_connection(
                Upstream, host, int(port))
            self.send(up, req)

        def send(self, up: Upstream, req: bytes) -> None:
            up.cb = self.answer
            up.t.write(req)

        def answer(self, status: int, headers: list[tuple[bytes, bytes]],
                   body: bytes) -> None:
            out = [b"HTTP/1.1 %d OK\r\n" % status]
            for n, v in headers:
                if n.lower() not in HOP:
                    out += [n, b": ", v, b"\r\n"]
            out += [b"Content-Length: ", str(len(body)).encode(), b"\r\n\r\n", body]
            self.t.write(b"".join(out))

    async def main() -> None:
        loop = asyncio.get_running_loop()
        srv = await loop.create_server(Server, "127.0.0.1", 0)
        print(f"LISTENING {srv.sockets[0].getsockname()[1]}", flush=True)
        stop = asyncio.Event()
        loop.add_signal_handler(signal.SIGTERM, stop.set)
        await stop.wait()

    uvloop.run(main())


def main() -> int:
    if sys.argv[1:2] == ["_serve"]:
        serve(sys.argv[2])
        return 0
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    res: dict[tuple[int, str], list[tuple[float, float, float, int]]] = {}
    with tempfile.TemporaryDirectory(prefix="proxy-floor-") as d:
        tmp = Path(d)
        up = Child("upstream", [PY, str(ROOT / "bench" / "synthetic_upstream.py")], tmp)
        children = [up]
        client = None
        try:
            upstream = f"http://127.0.0.1:{up.wait_listening()}"
            servers = {"direct": up}
            servers["floor"] = Child("floor", [PY, __file__, "_serve", upstream], tmp)
            servers["proxy"] = Child("proxy", [PY, str(ROOT / "bench" / "proxy_bench.py"),
                                               "_proxy", upstream], tmp)
            children += [servers["floor"], servers["proxy"]]
            ports = {k: s.wait_listening() for k, s in servers.items()}
            client = Client()
            for _ in range(args.rounds):
                for conc, total in ((1, 2000), (64, 20000)):
                    for name, srv in servers.items():
                        cpu0 = srv.cpu_s()
                        r = client.run(url=f"http://127.0.0.1:{ports[name]}/v1/completions",
                                       body=completion(False, 1), total=total,
                                       warmup=total // 10, concurrency=conc)
                        res.setdefault((conc, name), []).append(
                            ((srv.cpu_s() - cpu0) / r["n"] * 1e6, r["p50_ms"], r["rate"],
                             r["errors"]))
        finally:
            if client is not None:
                client.close()
            for c in reversed(children):
                c.stop()
    print("| clients | path | server CPU per request (µs) | p50 (ms) | requests/s | errors |")
    print("|---|---|---|---|---|---|")
    for (conc, name), v in sorted(res.items()):
        print(f"| {conc} | {name}{' (the upstream)' if name == 'direct' else ''} | "
              f"{statistics.median(x[0] for x in v):.0f} | "
              f"{statistics.median(x[1] for x in v):.3f} | "
              f"{statistics.median(x[2] for x in v):.0f} | {sum(x[3] for x in v)} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
