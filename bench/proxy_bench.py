"""The front proxy's overhead, side by side with going direct and with nginx, in one run.

Four paths to one fast synthetic upstream (`bench/synthetic_upstream.py`): direct,
through `FrontProxy` (run alone in its own process, its gate open and unlimited) on the
daemon's loop (uvloop) and on the standard library's loop (proxy-asyncio: the loop
choice, measured), and through nginx as a reverse proxy (one worker, keep-alive to the
upstream, no buffering). A separate client process (aiohttp, keep-alive) drives every
measurement; the paths alternate within each round, the order rotating from round to
round, and each figure is the median over the rounds.

1. Non-streaming latency: p50 and p99 per request at 1 and 64 concurrent clients, and the
   latency each proxy adds (path minus direct, paired within a round).
2. Streaming: SSE chunks per second at 64 and 256 concurrent streams of 200 chunks.
3. Optional: the real vLLM CPU engine with the tiny model, streamed tokens per second at
   32 streams, direct against through the proxy on either loop (`--skip-engine` leaves
   it out).

    .venv/bin/python bench/proxy_bench.py --out docs/benchmarks.md
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import json
import os
import platform
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import date
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.report import write_section  # noqa: E402

PY = sys.executable
# (sbin: not on a user's PATH; $NGINX: a binary brought along)
NGINX = os.environ.get("NGINX") or shutil.which("nginx") or "/usr/sbin/nginx"
ENGINE_PY = ROOT / ".venv-engine" / "bin" / "python"
PATHS: tuple[str, ...] = ("direct", "proxy", "proxy-asyncio", "nginx")
# "proxy" runs on the daemon's own loop (uvloop, `supervisor.loop`); "proxy-asyncio" is the
# same proxy on the standard library's loop: the loop choice, measured
ENGINE_PATHS = ("direct", "proxy", "proxy-asyncio")
HEADERS = {"Content-Type": "application/json"}
USAGE = re.compile(rb'"completion_tokens":\s*(\d+)')


# ---- the processes under test ---------------------------------------------------------

async def run_proxy(upstream: str, routed: bool = False) -> None:
    """The proxy alone: gate open and unlimited, serving until SIGTERM. `routed`: two
    engines behind it (both the same upstream), each request routed by its model to the
    first (the routing a host with several engines does per request)."""
    from supervisor.front.admission import Gate, GateLimits
    from supervisor.front.exchange import ProxySettings
    from supervisor.front.proxy import FrontProxy

    try:  # as the daemon logs: JSON lines (the proxy writes one per request)
        from supervisor.ops.logs import configure_logging
        configure_logging("info", "json")
    except ImportError:  # (a baseline from before that module)
        pass
    settings = ProxySettings(listen_host="127.0.0.1", listen_port=0, upstream=upstream)
    gate = Gate(GateLimits(concurrency=100000, max_wait_s=60))
    gate.release()
    if routed:
        from supervisor.front.dispatch import Backend

        proxy = FrontProxy(settings)
        other = Gate(GateLimits(concurrency=100000, max_wait_s=60))
        other.release()
        proxy.add_engine(Backend("a", gate, lambda: True, upstream, ("synthetic",),
                                 fallback="b"))
        proxy.add_engine(Backend("b", other, lambda: True, upstream, ("other",)))
    else:
        proxy = FrontProxy(settings, gate, ready=lambda: True)
    await proxy.start()
    print(f"LISTENING {proxy.port}", flush=True)
    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
    await stop.wait()
    await proxy.close()


def nginx_conf(tmp: Path, port: int, upstream_port: int) -> Path:
    """nginx, one worker, before one upstream (the proxy benches' baseline)."""
    return nginx_config(tmp, [(port, upstream_port)])


def nginx_config(tmp: Path, routes: list[tuple[int, int]], workers: int = 1,
                 connections: int = 4096, keepalive: int = 512, listen_opts: str = "",
                 name: str = "nginx.conf") -> Path:
    """nginx as a reverse proxy written in C: each (port, upstream port) of `routes` its
    own server and keep-alive upstream, buffering off both ways."""
    ups = "\n".join(f"""    upstream u{i} {{
        server 127.0.0.1:{u};
        keepalive {keepalive};
        keepalive_requests 1000000;
    }}""" for i, (_, u) in enumerate(routes))
    servers = "\n".join(f"""    server {{
        listen 127.0.0.1:{p}{listen_opts};
        location / {{
            proxy_pass http://u{i};
            proxy_http_version 1.1;
            proxy_set_header Connection "";
            proxy_buffering off;
            proxy_request_buffering off;
        }}
    }}""" for i, (p, _) in enumerate(routes))
    rlimit = f"worker_rlimit_nofile {4 * connections};\n" if workers > 1 else ""
    conf = tmp / name
    conf.write_text(f"""
daemon off;
master_process on;
worker_processes {workers};
{rlimit}pid {tmp}/nginx.pid;
error_log {tmp}/nginx-error.log warn;
events {{ worker_connections {connections}; }}
http {{
    access_log off;
    client_body_temp_path {tmp}/body;
    proxy_temp_path {tmp}/proxy;
    fastcgi_temp_path {tmp}/fastcgi;
    uwsgi_temp_path {tmp}/uwsgi;
    scgi_temp_path {tmp}/scgi;
    keepalive_requests 1000000;
{ups}
{servers}
}}
""")
    return conf


class Child:
    """A server process in its own session, its output in a log file; stopped by group."""

    def __init__(self, name: str, argv: list[str], tmp: Path,
                 env: dict[str, str] | None = None, cwd: Path = ROOT,
                 pass_fds: tuple[int, ...] = ()) -> None:
        self.name = name
        self.log = tmp / f"{name}.log"
        with open(self.log, "wb") as out:
            self.p = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT,
                                      stdin=subprocess.DEVNULL, start_new_session=True,
                                      cwd=cwd, env=env, pass_fds=pass_fds)

    def wait_listening(self, timeout: float = 60) -> int:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for line in self.log.read_text(errors="replace").splitlines():
                if line.startswith("LISTENING "):
                    return int(line.split()[1])
            self._check_alive()
            time.sleep(0.05)
        raise RuntimeError(f"{self.name} did not listen in {timeout} s: {self.tail()}")

    def wait_port(self, port: int, timeout: float = 30) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port),
                                                                        0.5):
                return
            self._check_alive()
            time.sleep(0.05)
        raise RuntimeError(f"{self.name} did not listen on {port}: {self.tail()}")

    def _check_alive(self) -> None:
        if self.p.poll() is not None:
            raise RuntimeError(f"{self.name} exited {self.p.returncode}: {self.tail()}")

    def tail(self) -> str:
        return self.log.read_text(errors="replace")[-2000:]

    def cpu_s(self) -> float:
        """CPU seconds of the process and its children (nginx's worker)."""
        import psutil
        try:
            procs = [psutil.Process(self.p.pid)]
            procs += procs[0].children(recursive=True)
        except psutil.NoSuchProcess:
            return float("nan")
        total = 0.0
        for p in procs:
            with contextlib.suppress(psutil.NoSuchProcess):
                t = p.cpu_times()
                total += t.user + t.system
        return total

    def rss_mb(self) -> float:
        """Resident memory of the process and its children (nginx's worker), MiB."""
        import psutil
        try:
            procs = [psutil.Process(self.p.pid)]
            procs += procs[0].children(recursive=True)
        except psutil.NoSuchProcess:
            return float("nan")
        total = 0
        for p in procs:
            with contextlib.suppress(psutil.NoSuchProcess):
                total += p.memory_info().rss
        return total / 2**20

    def stop(self, grace: float = 10) -> None:
        if self.p.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.p.pid, signal.SIGTERM)
            try:
                self.p.wait(grace)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.p.pid, signal.SIGKILL)
                self.p.wait(5)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# ---- the client (its own process) -----------------------------------------------------

async def client_batch(cmd: dict[str, Any]) -> dict[str, Any]:
    import aiohttp

    url, stream, conc = cmd["url"], bool(cmd["body"].get("stream")), int(cmd["concurrency"])
    data = json.dumps(cmd["body"]).encode()
    usage = bool(cmd["body"].get("stream_options", {}).get("include_usage"))
    warm = json.dumps(cmd.get("warmup_body", cmd["body"])).encode()
    connector = aiohttp.TCPConnector(limit=0, force_close=False)
    async with aiohttp.ClientSession(connector=connector,
                                     timeout=aiohttp.ClientTimeout(total=300)) as session:

        async def batch(total: int, body: bytes) -> dict[str, Any]:
            lat: list[float] = []
            events: list[int] = []
            tokens: list[int] = []
            sample: list[str] = []  # the end of one short stream, to see why
            errors = reads = 0
            todo = iter(range(total))

            async def worker() -> None:
                nonlocal errors, reads
                for _ in todo:
                    t0 = time.perf_counter()
                    try:
                        async with session.post(url, data=body, headers=HEADERS) as r:
                            if stream:
                                n, last, seen = 0, b"", bytearray()
                                async for chunk in r.content.iter_any():
                                    reads += 1
                                    if usage:
                                        seen += chunk
                                    # events end with a blank line; JSON holds no newline
                                    n += chunk.count(b"\n\n")
                                    if last == b"\n" and chunk[:1] == b"\n":
                                        n += 1
                                    last = chunk[-1:]
                                if r.status == 200:
                                    events.append(n - 1)  # less the [DONE]
                                if usage:  # the engine's own count, from the last chunk
                                    found = USAGE.findall(bytes(seen))
                                    if r.status == 200:
                                        tokens.append(int(found[-1]) if found else 0)
                                    if (not sample and (r.status != 200 or tokens[-1]
                                                        < cmd.get("expect", 0))):
                                        sample.append(bytes(seen[-400:]).decode(
                                            errors="replace") + f" status {r.status}")
                            else:
                                await r.read()
                            if r.status != 200:
                                errors += 1
                    except (aiohttp.ClientError, TimeoutError) as exc:
                        errors += 1
                        if not sample:
                            sample.append(f"client: {exc!r}")
                    lat.append(time.perf_counter() - t0)

            gc.collect()
            gc.disable()  # the client's collector pauses are not the path's latency
            t0 = time.perf_counter()
            await asyncio.gather(*(worker() for _ in range(conc)))
            elapsed = time.perf_counter() - t0
            gc.enable()
            lat.sort()
            q = statistics.quantiles(lat, n=100) if len(lat) > 1 else lat * 99
            return {"n": len(lat), "errors": errors, "elapsed_s": elapsed,
                    "p50_ms": statistics.median(lat) * 1e3, "p99_ms": q[98] * 1e3,
                    "rate": len(lat) / elapsed, "events": sum(events),
                    "events_per_s": sum(events) / elapsed, "reads": reads,
                    "short_sample": sample[0] if sample else None, "tokens": sum(tokens),
                    "tokens_per_s": sum(tokens) / elapsed,
                    "short_streams": sum(1 for e in (tokens if usage else events)
                                         if e < cmd.get("expect", 0))}

        if int(cmd["warmup"]) > 0:
            await batch(int(cmd["warmup"]), warm)
        return await batch(int(cmd["total"]), data)


def client_main() -> None:
    """Reads one JSON command a line, answers one JSON result a line."""
    async def loop() -> None:
        for line in sys.stdin:
            if not line.strip():
                continue
            res = await client_batch(json.loads(line))
            print(json.dumps(res), flush=True)
    asyncio.run(loop())


class Client:
    """A client process (`script _client`): one JSON command a line in, its result out."""

    def __init__(self, script: str = __file__) -> None:
        self.p = subprocess.Popen([PY, script, "_client"], stdin=subprocess.PIPE,
                                  stdout=subprocess.PIPE, text=True, cwd=ROOT,
                                  start_new_session=True)

    def run(self, **cmd: Any) -> dict[str, Any]:
        assert self.p.stdin is not None and self.p.stdout is not None
        self.p.stdin.write(json.dumps(cmd) + "\n")
        self.p.stdin.flush()
        line = self.p.stdout.readline()
        if not line:
            raise RuntimeError(f"the client exited {self.p.wait()}")
        return dict(json.loads(line))

    def close(self) -> None:
        if self.p.stdin is not None:
            self.p.stdin.close()
        try:
            self.p.wait(10)
        except subprocess.TimeoutExpired:
            os.killpg(self.p.pid, signal.SIGKILL)
            self.p.wait(5)


# ---- the measurements -----------------------------------------------------------------

def completion(stream: bool, tokens: int, model: str = "synthetic",
               **extra: Any) -> dict[str, Any]:
    return {"model": model, "prompt": "hello", "max_tokens": tokens, "stream": stream,
            **extra}


def synthetic(args: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    children: list[Child] = []
    client = None
    try:
        up = Child("upstream", [PY, str(ROOT / "bench" / "synthetic_upstream.py")], tmp)
        children.append(up)
        up_port = up.wait_listening()
        px = Child("proxy", [PY, __file__, "_proxy", f"http://127.0.0.1:{up_port}"], tmp)
        children.append(px)
        if args.routed:
            pa = Child(PATHS[2], [PY, __file__, "_proxy", f"http://127.0.0.1:{up_port}",
                                  "routed"], tmp)
            children.append(pa)
        if args.baseline:
            # the same proxy from the baseline commit, on the same loop: before and after
            base = tmp / "baseline"
            if args.baseline_dir is not None:  # (that commit's tree, already out)
                base = args.baseline_dir.resolve()
            else:
                subprocess.run(["git", "worktree", "add", "--detach", str(base),
                                args.baseline], cwd=ROOT, check=True, capture_output=True)
            pb = Child("proxy-before", [PY, str(base / "bench" / "proxy_bench.py"), "_proxy",
                                        f"http://127.0.0.1:{up_port}"], tmp)
            if not args.routed:
                pa = pb
            else:
                children.append(pb)
        elif not args.routed:
            pa = Child("proxy-asyncio", [PY, __file__, "_proxy", f"http://127.0.0.1:{up_port}",
                                         "asyncio"], tmp)
        if not args.routed:
            children.append(pa)
        ports = {"direct": up_port, "proxy": px.wait_listening(),
                 PATHS[2]: pa.wait_listening()}
        servers = {"direct": up, "proxy": px, PATHS[2]: pa}
        if args.routed and args.baseline:
            ports["proxy-before"], servers["proxy-before"] = pb.wait_listening(), pb
        if "nginx" in PATHS:
            ports["nginx"] = free_port()
            ng = Child("nginx", [NGINX, "-e", str(tmp / "nginx-error.log"), "-p", str(tmp),
                                 "-c", str(nginx_conf(tmp, ports["nginx"], up_port))], tmp)
            children.append(ng)
            ng.wait_port(ports["nginx"])
            servers["nginx"] = ng
        client = Client()
        s = args.scale
        cases = [
            ("plain", 1, dict(body=completion(False, 1), total=int(2000 * s),
                              warmup=int(200 * s), concurrency=1)),
            ("plain", 64, dict(body=completion(False, 1), total=int(20000 * s),
                               warmup=int(2000 * s), concurrency=64)),
            ("stream", 64, dict(body=completion(True, args.chunks), expect=args.chunks,
                                warmup_body=completion(True, 10), warmup=64,
                                total=max(64, int(1280 * s)), concurrency=64)),
            ("stream", 256, dict(body=completion(True, args.chunks), expect=args.chunks,
                                 warmup_body=completion(True, 10), warmup=256,
                                 total=max(256, int(2048 * s)), concurrency=256)),
        ]
        results: dict[str, Any] = {}
        for rnd in range(args.rounds):
            k = rnd % len(PATHS)
            order = PATHS[k:] + PATHS[:k]
            for kind, conc, cmd in cases:
                for path in order:
                    cpu0 = servers[path].cpu_s()
                    r = client.run(url=f"http://127.0.0.1:{ports[path]}/v1/completions",
                                   **cmd)
                    r["server_cpu_s"] = servers[path].cpu_s() - cpu0
                    r["server_rss_mb"] = servers[path].rss_mb()
                    results.setdefault(f"{kind}-{conc}", {}).setdefault(path, []).append(r)
                    print(f"round {rnd + 1} {kind} {conc:>3} {path:<13} "
                          f"p50 {r['p50_ms']:.3f} ms p99 {r['p99_ms']:.3f} ms "
                          f"{r['rate']:.0f}/s {r['events_per_s']:.0f} ev/s "
                          f"errors {r['errors']} short {r['short_streams']}", flush=True)
        return results
    finally:
        if client is not None:
            client.close()
        for c in reversed(children):
            c.stop()
        if args.baseline and args.baseline_dir is None:
            subprocess.run(["git", "worktree", "remove", "--force", str(tmp / "baseline")],
                           cwd=ROOT, check=False, capture_output=True)


def engine(args: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    import httpx

    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1")
    port = free_port()
    children: list[Child] = []
    client = None
    try:
        t0 = time.monotonic()
        eng = Child("vllm", [str(ENGINE_PY), "-m", "vllm.entrypoints.openai.api_server",
                             "--model", "models/tiny-llama", "--served-model-name",
                             "tiny-llama", "--max-model-len", "512", "--dtype", "float32",
                             "--host", "127.0.0.1", "--port", str(port)], tmp, env=env)
        children.append(eng)
        deadline = time.monotonic() + 240
        while True:
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                    break
            eng._check_alive()
            if time.monotonic() > deadline:
                raise RuntimeError(f"vLLM not healthy in 240 s: {eng.tail()}")
            time.sleep(0.5)
        print(f"vLLM healthy after {time.monotonic() - t0:.1f} s", flush=True)
        px = Child("proxy-vllm", [PY, __file__, "_proxy", f"http://127.0.0.1:{port}"], tmp)
        children.append(px)
        pa = Child("proxy-asyncio-vllm", [PY, __file__, "_proxy", f"http://127.0.0.1:{port}",
                                          "asyncio"], tmp)
        children.append(pa)
        ports = {"direct": port, "proxy": px.wait_listening(),
                 "proxy-asyncio": pa.wait_listening()}
        proxies = {"direct": px, "proxy": px, "proxy-asyncio": pa}
        client = Client()
        body = completion(True, args.engine_tokens, model="tiny-llama", ignore_eos=True,
                          stream_options={"include_usage": True})
        cmd = dict(body=body, expect=args.engine_tokens, concurrency=32, warmup=32,
                   warmup_body=completion(True, 8, model="tiny-llama", ignore_eos=True),
                   total=32 * args.engine_waves)
        results: dict[str, list[dict[str, Any]]] = {}
        for rnd in range(args.engine_rounds):
            k = rnd % len(ENGINE_PATHS)
            for path in ENGINE_PATHS[k:] + ENGINE_PATHS[:k]:
                cpu0 = proxies[path].cpu_s()
                r = client.run(url=f"http://127.0.0.1:{ports[path]}/v1/completions", **cmd)
                r["proxy_cpu_s"] = proxies[path].cpu_s() - cpu0
                results.setdefault(path, []).append(r)
                print(f"round {rnd + 1} vllm 32 {path:<13} {r['tokens_per_s']:.0f} tok/s "
                      f"{r['events_per_s']:.0f} chunks/s {r['reads']} reads "
                      f"proxy cpu {r['proxy_cpu_s']:.2f} s short {r['short_sample']!r} "
                      f"errors {r['errors']} short {r['short_streams']}", flush=True)
        return results
    finally:
        if client is not None:
            client.close()
        for c in reversed(children):
            c.stop(grace=20)


# ---- the report -----------------------------------------------------------------------

def med(runs: list[dict[str, Any]], key: str) -> float:
    return statistics.median(r[key] for r in runs)


def fmt(xs: list[float], nd: int = 0) -> str:
    return ", ".join(f"{x:.{nd}f}" for x in xs)


def _output(argv: list[str], stderr: bool = False) -> str:
    """A command's one line (nginx -v writes to stderr); "?" where it cannot run."""
    try:
        r = subprocess.run(argv, capture_output=True, text=True, cwd=ROOT, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return "?"
    return (r.stderr if stderr else r.stdout).strip() or "?"


def nginx_runs() -> bool:
    return _output([NGINX, "-v"], stderr=True).startswith("nginx version")


def versions() -> str:
    import aiohttp
    ng = _output([NGINX, "-v"], stderr=True) if "nginx" in PATHS else "no nginx here"

    eng = subprocess.run([str(ENGINE_PY), "-c", "import importlib.metadata as m; "
                          "print(m.version('vllm-cpu'))"], capture_output=True, text=True
                         ) if ENGINE_PY.exists() else subprocess.CompletedProcess([], 1, "", "")
    rev = os.environ.get("PROXY_BENCH_REV") or _output(["git", "rev-parse", "--short", "HEAD"])
    return (f"Python {platform.python_version()}, aiohttp {aiohttp.__version__}, "
            f"{ng.replace('nginx version: ', '')}, vllm-cpu {eng.stdout.strip() or '?'}, "
            f"proxy at commit {rev}")


def render(args: argparse.Namespace, syn: dict[str, Any],
           eng: dict[str, Any] | None, eng_note: str) -> str:
    out = [
        ("## Routing across engines (`bench/proxy_bench.py --routed`)" if args.routed
         else "## The front proxy (`bench/proxy_bench.py`)"), "",
        f"Run by `make bench-proxy` on {date.today().isoformat()}, {platform.machine()}, "
        f"{os.cpu_count()} cores (shared, noisy; nothing pinned), loopback. {versions()}.",
        "",
        "Four paths to one fast synthetic OpenAI-style upstream "
        "(`bench/synthetic_upstream.py`, aiohttp): **direct**, through **proxy** "
        "(`FrontProxy` alone in its own process, gate open and unlimited, on the daemon's "
        "event loop, uvloop), through **proxy-asyncio** (the same on the standard library's "
        "loop: what the loop choice buys) and through **nginx** (one worker, keep-alive to "
        "the upstream, `proxy_buffering off`). "
        + (f"In this run **proxy-before** (the proxy at commit {args.baseline}, same loop) "
           "takes proxy-asyncio's place: the change measured side by side. "
           if args.baseline and not args.routed else "")
        + ("**This is the routing run** (`make bench-proxy-routing`): **proxy-routed** is "
           "the same proxy with two engines behind it (two backends, two gates), each "
           "request routed by its `model` field (`supervisor/front/routing.py`), beside **proxy** "
           "with one engine"
           + (f" and **proxy-before**, the single-engine proxy at commit {args.baseline}, "
              "before the host and the routing" if args.baseline else "")
           + "; no nginx and no engine part here (the section above has them). "
           if args.routed else "")
        + "One client process (aiohttp, keep-alive) "
        "drives them all; the paths alternate within "
        f"each of {args.rounds} rounds, the order rotating; every figure is the median over "
        "the rounds, and an added latency is the path minus direct, paired within a round. "
        "Client, servers and upstream share the 2 cores, so at 64 clients the client's own "
        "CPU is in every figure. Server CPU is the proxy's (or nginx's master + worker) "
        "user + system time over the measurement.",
        "",
        "### Non-streaming `POST /v1/completions`: latency per request", "",
    ]
    met: list[str] = []
    for conc in (1, 64):
        data = syn[f"plain-{conc}"]
        n = data["direct"][0]["n"]
        out += [f"{conc} client{'s' if conc > 1 else ''}, {n} requests per run after a "
                "warm-up.", "",
                "| path | p50 (ms) | p99 (ms) | added p50 (ms) | added p99 (ms) | requests/s "
                "| ratio req/s to direct | server CPU per request (µs) |",
                "|---|---|---|---|---|---|---|---|"]
        for path in PATHS:
            runs = data[path]
            add50 = [r["p50_ms"] - d["p50_ms"] for r, d in zip(runs, data["direct"],
                                                                strict=True)]
            add99 = [r["p99_ms"] - d["p99_ms"] for r, d in zip(runs, data["direct"],
                                                                strict=True)]
            cpu = "" if path == "direct" else \
                f"{statistics.median(r['server_cpu_s'] / r['n'] for r in runs) * 1e6:.0f}"
            ratio = med(runs, "rate") / med(data["direct"], "rate")
            out.append(
                f"| {path} | {med(runs, 'p50_ms'):.3f} | {med(runs, 'p99_ms'):.3f} | "
                + ("— | — | " if path == "direct" else
                   f"{statistics.median(add50):+.3f} | {statistics.median(add99):+.3f} | ")
                + f"{med(runs, 'rate'):.0f} | {ratio:.2f} | {cpu} |")
            if path == "proxy" and conc == 1:
                a50, a99 = statistics.median(add50), statistics.median(add99)
                met.append(f"p50 added at 1 client <= 1 ms: "
                           f"{'met' if a50 <= 1 else 'NOT met'} ({a50:+.3f} ms)")
                met.append(f"p99 added at 1 client <= 5 ms: "
                           f"{'met' if a99 <= 5 else 'NOT met'} ({a99:+.3f} ms)")
        errors = sum(r["errors"] for p in PATHS for r in data[p])
        out += ["", f"Errors over all runs: {errors}.", ""]
    out += ["### Streaming: SSE chunks per second", "",
            f"Each stream {args.chunks} chunks of ~170 bytes then `data: [DONE]`; a run "
            "is a fixed number of streams after a warm-up wave, kept at the given "
            "concurrency; chunks/s = chunks received / run time.", "",
            "| concurrent streams | path | chunks/s (median) | runs | ratio to direct "
            "| server CPU per chunk (µs) | chunks per client read |",
            "|---|---|---|---|---|---|---|"]
    for conc in (64, 256):
        data = syn[f"stream-{conc}"]
        for path in PATHS:
            runs = data[path]
            rates = [r["events_per_s"] for r in runs]
            cpu = "" if path == "direct" else \
                f"{statistics.median(r['server_cpu_s'] / r['events'] for r in runs) * 1e6:.1f}"
            ratio = statistics.median(rates) / med(data["direct"], "events_per_s")
            per_read = statistics.median(r["events"] / max(1, r["reads"]) for r in runs)
            out.append(f"| {conc} | {path} | {statistics.median(rates):.0f} | {fmt(rates)} | "
                       f"{ratio:.2f} | {cpu} | {per_read:.1f} |")
            if path == "proxy" and conc == 64:
                rate = statistics.median(rates)
                met.append(f">= 20,000 chunks/s through the proxy at 64 streams: "
                           f"{'met' if rate >= 20000 else 'NOT met'} ({rate:.0f}/s)")
    rss = {p: max(r["server_rss_mb"] for k in syn for r in syn[k][p]) for p in PATHS
           if p != "direct" and all("server_rss_mb" in r for k in syn for r in syn[k][p])}
    bad = sum(r["errors"] + r["short_streams"] for k in ("stream-64", "stream-256")
              for p in PATHS for r in syn[k][p])
    out += ["", f"Failed or short streams over all runs: {bad}. The upstream writes its "
            "chunks back to back, so the socket coalesces them: the last column is how many "
            "SSE chunks one client read carried, i.e. how far per-write costs are amortised "
            "on each path (a real engine spaces its chunks out, one per decode step).", ""]
    if rss:
        out += ["Largest resident memory of each server process seen after a run (MiB; "
                "nginx: master and worker): "
                + ", ".join(f"{p} {v:.1f}" for p, v in rss.items()) + ".", ""]
    out += ["### The real engine: vLLM CPU, tiny model, 32 streams", ""]
    if eng is None:
        out += [eng_note, ""]
        met.append("streamed tokens/s through the proxy >= 95 % of direct: not measured "
                   "(engine part skipped)")
    else:
        n = eng["direct"][0]["n"]
        out += [f"{n} streams per run (32 at a time), each {args.engine_tokens} tokens "
                "(`ignore_eos`), after a warm-up wave; tokens/s = the engine's own "
                "`completion_tokens` (final usage chunk) over the run time, alternating "
                f"direct, proxy and proxy-asyncio over {args.engine_rounds} rounds (the order "
                "rotating each round). The engine, the proxy and the client share the 2 cores. "
                "The ratio is the median of the per-round ratios path / direct (run back to "
                "back), which cancels most of the machine's drift; the ratio of the two "
                "medians is given beside it.", "",
                "| path | tokens/s (median) | runs | ratio to direct | SSE chunks per client "
                "read | proxy CPU per token (µs) |", "|---|---|---|---|---|---|"]
        base = med(eng["direct"], "tokens_per_s")
        for path in ENGINE_PATHS:
            runs = eng[path]
            rates = [r["tokens_per_s"] for r in runs]
            per_read = statistics.median(r["events"] / max(1, r["reads"]) for r in runs)
            cpu = "" if path == "direct" else \
                f"{statistics.median(r['proxy_cpu_s'] / r['tokens'] for r in runs) * 1e6:.1f}"
            ratios = [r["tokens_per_s"] / d["tokens_per_s"]
                      for r, d in zip(runs, eng["direct"], strict=True)]
            shown = "1.000" if path == "direct" else (
                f"{statistics.median(ratios):.3f} (rounds {fmt(ratios, 2)}; ratio of "
                f"medians {statistics.median(rates) / base:.3f})")
            out.append(f"| {path} | {statistics.median(rates):.0f} | {fmt(rates)} | "
                       f"{shown} | {per_read:.1f} | {cpu} |")
        ratio = statistics.median(r["tokens_per_s"] / d["tokens_per_s"]
                                  for r, d in zip(eng["proxy"], eng["direct"], strict=True))
        failed = {p: sum(r["errors"] for r in eng[p]) for p in ENGINE_PATHS}
        short = sum(r["short_streams"] for p in ENGINE_PATHS for r in eng[p])
        samples = [r["short_sample"] for p in ENGINE_PATHS for r in eng[p]
                   if r["short_sample"]]
        out += ["", f"Failed streams: {failed['direct']} direct, {failed['proxy']} through "
                f"the proxy, {failed['proxy-asyncio']} through proxy-asyncio; short streams: "
                f"{short}."
                + (f" First failure: `{samples[0][-220:]}`." if samples else ""), ""]
        share = {p: statistics.median(r["proxy_cpu_s"] / r["elapsed_s"] for r in eng[p])
                 for p in ("proxy", "proxy-asyncio")}
        out += [f"The engine is CPU-bound on both cores here, so whatever the proxy burns "
                f"comes out of the engine: {share['proxy'] * 100:.0f} % of one core during the "
                f"proxy runs (median; {share['proxy-asyncio'] * 100:.0f} % on the standard "
                "loop), one upstream read and one client write per one or two tokens.", ""]
        met.append(f"streamed tokens/s through the proxy >= 95 % of direct: "
                   f"{'met' if ratio >= 0.95 else 'NOT met'} ({ratio * 100:.1f} %)")
    met += issue_25(syn, rss)
    out += ["### Targets", ""] + [f"- {m}" for m in met]
    return "\n".join(out) + "\n"


def issue_25(syn: dict[str, Any], rss: dict[str, float]) -> list[str]:
    """The targets of issue 25 (the front door at nginx's cost), for the proxy."""
    def cpu(key: str, per: str) -> float:
        return statistics.median(r["server_cpu_s"] / r[per] for r in syn[key]["proxy"]) * 1e6

    def ratio(key: str, field: str) -> float:
        return med(syn[key]["proxy"], field) / med(syn[key]["direct"], field)

    def verdict(ok: bool) -> str:
        return "met" if ok else "NOT met"

    per_req = [cpu("plain-1", "n"), cpu("plain-64", "n")]
    per_chunk = [cpu("stream-64", "events"), cpu("stream-256", "events")]
    add50 = statistics.median(r["p50_ms"] - d["p50_ms"] for r, d in zip(
        syn["plain-1"]["proxy"], syn["plain-1"]["direct"], strict=True))
    rps = ratio("plain-64", "rate")
    chunks = [ratio("stream-64", "events_per_s"), ratio("stream-256", "events_per_s")]
    out = [f"issue 25: server CPU per non-streaming request <= 160 µs: "
           f"{verdict(max(per_req) <= 160)} ({per_req[0]:.0f} µs at 1 client, "
           f"{per_req[1]:.0f} at 64)",
           f"issue 25: server CPU per streamed chunk <= 4 µs: "
           f"{verdict(max(per_chunk) <= 4)} ({per_chunk[0]:.1f} µs at 64 streams, "
           f"{per_chunk[1]:.1f} at 256)",
           f"issue 25: added p50 at 1 client <= 0.15 ms: {verdict(add50 <= 0.15)} "
           f"({add50:+.3f} ms)",
           f"issue 25: requests/s at 64 clients >= 0.6 of direct: {verdict(rps >= 0.6)} "
           f"({rps:.2f})",
           f"issue 25: streamed chunks/s at 64 and 256 streams >= direct: "
           f"{verdict(min(chunks) >= 1)} ({chunks[0]:.2f}, {chunks[1]:.2f})"]
    if "proxy" in rss:
        out.append(f"issue 25: RSS under load <= 60 MB (the proxy process alone here; the "
                   f"daemon's is in the fault soak): {verdict(rss['proxy'] <= 60)} "
                   f"({rss['proxy']:.1f} MiB)")
    return out


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "_proxy":
        from supervisor import loop
        prof = None
        if os.environ.get("PROXY_CPROFILE"):  # bench/proxy_profile.py --cprofile
            import cProfile
            prof = cProfile.Profile()
            prof.enable()
        loop.run(run_proxy(sys.argv[2], routed=sys.argv[3:] == ["routed"]),
                 "asyncio" if sys.argv[3:] == ["asyncio"] else "uvloop")
        if prof is not None:
            prof.disable()
            prof.dump_stats(os.environ["PROXY_CPROFILE"])
        return 0
    if len(sys.argv) > 1 and sys.argv[1] == "_client":
        client_main()
        return 0
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, help="rewrite the proxy section of this file")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--scale", type=float, default=1.0, help="request counts x this")
    ap.add_argument("--chunks", type=int, default=200, help="SSE chunks per stream")
    ap.add_argument("--skip-engine", action="store_true", help="leave the vLLM part out")
    ap.add_argument("--engine-tokens", type=int, default=256)
    ap.add_argument("--engine-waves", type=int, default=4)
    ap.add_argument("--engine-rounds", type=int, default=5,
                    help="more than the synthetic part: the engine shares 2 noisy cores")
    ap.add_argument("--baseline", metavar="REF",
                    help="in the synthetic part, the proxy at this git commit in place of "
                         "proxy-asyncio (proxy-before: the same loop, before a change)")
    ap.add_argument("--baseline-dir", type=Path, metavar="DIR",
                    help="with --baseline: that commit's tree, already checked out here "
                         "(a machine without the repository's history)")
    ap.add_argument("--routed", action="store_true",
                    help="the routing bench: proxy (one engine) beside proxy-routed (two "
                         "engines, routed by model) and proxy-before (with --baseline); no "
                         "nginx, no engine part; writes its own section")
    args = ap.parse_args()
    global PATHS
    if args.routed:
        PATHS = ("direct", "proxy", "proxy-routed",
                 *(("proxy-before",) if args.baseline else ()))
        args.skip_engine = True
    elif args.baseline:
        PATHS = ("direct", "proxy", "proxy-before", "nginx")
    if "nginx" in PATHS and not nginx_runs():
        print(f"nginx does not run here ({NGINX}): left out", flush=True)
        PATHS = tuple(p for p in PATHS if p != "nginx")
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="proxy-bench-") as d:
        tmp = Path(d)
        syn = synthetic(args, tmp)
        print(f"synthetic part: {time.monotonic() - t0:.0f} s", flush=True)
        eng, note = None, ""
        if args.skip_engine:
            note = "Skipped in this run (`--skip-engine`)."
        elif not ENGINE_PY.exists():
            note = "Skipped: `.venv-engine` is not built (`make setup`)."
        else:
            eng = engine(args, tmp)
    text = render(args, syn, eng, note)
    print(text)
    print(f"total: {time.monotonic() - t0:.0f} s")
    if args.out is not None:
        write_section(args.out, "proxy-routing" if args.routed else "proxy", text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
