"""Where the front proxy's CPU goes, per request and per streamed chunk: py-spy on the
proxy process under the proxy benchmark's own load (`bench/proxy_bench.py`: the same
synthetic upstream, the same proxy runner, the same client).

Three loads, one after the other against one proxy (or, with `--baseline REF`, the proxy
at that commit as well, profiled in turn under the same loads): non-streaming
`POST /v1/completions` at 1 and at 64 clients, and streams of 200 chunks at 64. For each,
the proxy's CPU per request (per chunk) from its own user + system time, and the
profile's proportions: the functions with the most samples of their own and in their
stacks (cumulative), and the samples by layer (aiohttp's server, aiohttp's client, the
proxy's own code by module, the access log, JSON, the loop).

    .venv/bin/python bench/proxy_profile.py [--baseline REF] [--out FILE.md] [--cprofile]

`--cprofile` runs cProfile inside the proxy instead (`PROXY_CPROFILE`: its stats are
written when it stops): call counts per request, at several times the cost.

`--instructions` runs each proxy under valgrind's callgrind instead and counts the
user-space instructions it executes per request and per chunk (`callgrind_control -e`
before and after each load): a figure that the machine's other load does not move, where
CPU time on 2 shared cores moves by a third from run to run. The proxy runs some 50
times slower under valgrind, so the loads are smaller and, at 64 clients, more of them
wait in each wake-up than at full speed: compare such counts with each other only.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import os
import pstats
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.proxy_bench import PY, Child, Client, completion  # noqa: E402

PYSPY = str(Path(sys.executable).parent / "py-spy")

# (name, concurrency, client command)
LOADS: list[tuple[str, int, dict[str, Any]]] = [
    ("plain", 1, dict(body=completion(False, 1), total=6000, warmup=300, concurrency=1)),
    ("plain", 64, dict(body=completion(False, 1), total=30000, warmup=2000, concurrency=64)),
    ("stream", 64, dict(body=completion(True, 200), expect=200,
                        warmup_body=completion(True, 10), warmup=64, total=1280,
                        concurrency=64)),
]

# A sample's layer, by the file of its innermost frame (first match wins).
LAYERS: list[tuple[str, tuple[str, ...]]] = [
    ("access log (structlog, logging)", ("structlog/", "/logging/")),
    ("JSON (json module)", ("/json/",)),
    ("aiohttp client", ("aiohttp/client", "aiohttp/connector.py")),
    ("upstream client (front/upstream.py, httptools)", ("front/upstream.py", "httptools/")),
    ("aiohttp server", ("aiohttp/web", "aiohttp/_http_parser", "aiohttp/http_parser",
                        "aiohttp/base_protocol")),
    ("aiohttp shared (streams, writer, helpers)", ("aiohttp/",)),
    ("yarl, multidict", ("yarl/", "multidict/")),
    ("front server (front/server.py)", ("front/server.py",)),
    ("proxy: continuation (transcript)", ("front/continuation.py",)),
    ("proxy: streams.py", ("front/streams.py",)),
    ("proxy: proxy.py", ("front/proxy.py",)),
    ("proxy: routes, dispatch, admission, latency, other", ("supervisor/",)),
    ("loop (uvloop / asyncio)", ("asyncio/", "uvloop", "<frozen", "contextvars")),
]


# Where in a request a sample was: the marker frame nearest its innermost frame (so the
# logging inside `_finish` is the access log's, the rest of `_finish` the histograms').
STAGES: list[tuple[str, tuple[str, ...]]] = [
    ("server: parse, dispatch, keep-alive (front/server.py; aiohttp web_protocol)",
     ("RequestHandler.", "Application._handle", "BaseRequest.", "Request.",
      "(aiohttp/web_protocol.py", "Connection.", "Server.", "(supervisor/front/server.py")),
    ("handler: our own code (proxy.py, streams.py)",
     ("FrontProxy._handle ", "FrontProxy._admit_and_forward", "FrontProxy._forward",
      "StreamRelay.relay", "StreamRelay.relay_events", "StreamRelay._write")),
    ("handler: target and allow-list (routes.py)", ("read_target ", "Routes.")),
    ("handler: body JSON and plan (read_request, continuable.plan)",
     ("read_request ", "plan (", "choices (")),
    ("handler: gate, dispatch, lane (admission.py, dispatch.py, quarantine.py)",
     ("acquire_any", "Gate.", "Quarantine.", "Exchange.sent", "Backend.")),
    ("handler: upstream headers copy (upstream_headers)", ("upstream_headers",)),
    ("server: request body read (request.read)", ("BaseRequest.read", "Request.read")),
    ("client: send the request, wait for its headers (session.request, Call.__aenter__)",
     ("_BaseRequestContextManager.__aenter__", "ClientSession._request", "Call.__aenter__",
      "Upstream._connection")),
    ("client: response release (async with exit)", ("_BaseRequestContextManager.__aexit__",
                                                     "ClientResponse.release",
                                                     "Call.__aexit__")),
    ("client: response body read (Answer.pump, its sink; upstream_chunks before)",
     ("upstream_chunks", "Answer.pump", "Answer._to_sink")),
    ("client: protocol (data_received, parser)", ("ResponseHandler.", "EngineConnection.",
                                                  "Answer._wake")),
    ("server: response headers (StreamResponse.prepare)", ("StreamResponse.prepare",)),
    ("server: body write (resp.write, write_eof)", ("StreamResponse.write",
                                                    "Response.write_eof")),
    ("transcript (Transcript.read)", ("Transcript.read",)),
    ("access line: histograms, fields (_finish)", ("FrontProxy._finish",)),
    ("access line: structlog + logging (render, write)", ("BoundLogger.info",
                                                         "RequestLog.info")),
    ("JSON encode/decode anywhere (json module)", ("(json/",)),
]


def stage(stack: list[str]) -> str:
    for frame in reversed(stack):
        for name, needles in reversed(STAGES):
            if any(frame.startswith(n) or (n[0] == "(" and n in frame) for n in needles):
                return name
    return "loop and the rest (uvloop callbacks, asyncio, tasks)"


def layer(frame_file: str) -> str:
    for name, needles in LAYERS:
        if any(n in frame_file for n in needles):
            return name
    return "other"


# frames every sample is under: not shown as cumulative
ROOTS = ("<module> ", "main (", "Runner.run ", "run (supervisor/loop.py)",
         "Application._handle ", "RequestHandler._handle_request ")


def parse_collapsed(path: Path) -> list[tuple[list[str], int]]:
    """py-spy's raw (collapsed) output: `frame;frame;... count`, root first."""
    out = []
    for line in path.read_text().splitlines():
        stack, _, n = line.rpartition(" ")
        if stack:
            out.append((stack.split(";"), int(n)))
    return out


def _short(frame: str) -> str:
    # "func (path/to/file.py:123)" -> "func (file.py)", paths shortened to their package
    name, _, where = frame.partition(" (")
    where = where.rstrip(")")
    file = where.rsplit(":", 1)[0]
    for cut in ("site-packages/", "lib/python3.11/", "wt-proxy/", "/baseline/"):
        if cut in file:
            file = file.split(cut, 1)[1]
    return f"{name} ({file})"


def summarise(samples: list[tuple[list[str], int]], top: int = 15) -> dict[str, Any]:
    total = sum(n for _, n in samples)
    own: collections.Counter[str] = collections.Counter()
    cum: collections.Counter[str] = collections.Counter()
    layers: collections.Counter[str] = collections.Counter()
    stages: collections.Counter[str] = collections.Counter()
    for stack, n in samples:
        stages[stage(stack)] += n
        leaf = stack[-1]
        own[_short(leaf)] += n
        for f in {_short(f) for f in stack}:
            if not f.startswith(ROOTS):
                cum[f] += n
        layers[layer(leaf.partition(" (")[2])] += n
    return {"total": total, "own": own.most_common(top), "cum": cum.most_common(top + 10),
            "layers": layers.most_common(),
            "stages": stages.most_common()}


def instructions(pid: int) -> int:
    """The process's instructions so far, every thread (`Th N  1,234` lines)."""
    out = subprocess.run(["callgrind_control", "-e", str(pid)], capture_output=True,
                         text=True, check=True).stdout
    counts = [int(line.split()[2].replace(",", "")) for line in out.splitlines()
              if line.split()[:1] == ["Th"] and len(line.split()) >= 3]
    if not counts:
        raise RuntimeError(f"no instruction count from callgrind_control: {out!r}")
    return sum(counts)


def count(client: Client, url: str, cmd: dict[str, Any], pid: int) -> dict[str, Any]:
    """The load under callgrind: instructions per request (per chunk for streams)."""
    warm = dict(cmd, total=max(1, cmd["warmup"]), warmup=0)
    if "warmup_body" in cmd:
        warm["body"] = cmd["warmup_body"]
    client.run(url=url, **warm)
    i0 = instructions(pid)
    r = client.run(url=url, **dict(cmd, warmup=0))
    r["instructions"] = instructions(pid) - i0
    return r


def drive(client: Client, url: str, cmd: dict[str, Any], proxy: Child, spy_out: Path | None,
          rate: int) -> dict[str, Any]:
    """The load, with py-spy recording the proxy while it runs (after its warm-up)."""
    warm = dict(cmd, total=max(1, cmd["warmup"]), warmup=0)
    if "warmup_body" in cmd:
        warm["body"] = cmd["warmup_body"]
    client.run(url=url, **warm)
    spy = None
    if spy_out is not None:
        spy = subprocess.Popen([PYSPY, "record", "--pid", str(proxy.p.pid), "--format", "raw",
                                "--rate", str(rate), "--nonblocking", "--gil", "-o", str(spy_out)],
                               stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                               start_new_session=True)
        time.sleep(1.0)  # (py-spy attaches)
    cpu0 = proxy.cpu_s()
    r = client.run(url=url, **dict(cmd, warmup=0))
    r["cpu_s"] = proxy.cpu_s() - cpu0
    if spy is not None:
        spy.send_signal(signal.SIGINT)
        _, err = spy.communicate(timeout=60)
        if spy.returncode not in (0, -signal.SIGINT) and not spy_out.exists():  # type: ignore[union-attr]
            raise RuntimeError(f"py-spy failed: {err.decode(errors='replace')[-500:]}")
    return r


@contextlib.contextmanager
def _staged(args: argparse.Namespace, tmp: Path, grace: float | None = None) -> Iterator[
        tuple[Path, list[tuple[str, list[str]]], list[Child], Client, int]]:
    """The proxies to profile (this tree's, and the baseline's in a worktree), the
    synthetic upstream and the client; everything stopped and removed afterwards."""
    proxies = [("proxy", [PY, str(ROOT / "bench" / "proxy_bench.py")])]
    if args.baseline:
        base = tmp / "baseline"
        subprocess.run(["git", "worktree", "add", "--detach", str(base), args.baseline],
                       cwd=ROOT, check=True, capture_output=True)
        proxies.insert(0, ("proxy-before", [PY, str(base / "bench" / "proxy_bench.py")]))
    children: list[Child] = []
    client = None
    try:
        up = Child("upstream", [PY, str(ROOT / "bench" / "synthetic_upstream.py")], tmp)
        children.append(up)
        up_port = up.wait_listening()
        client = Client()
        yield tmp, proxies, children, client, up_port
    finally:
        if client is not None:
            client.close()
        for c in reversed(children):
            if grace is None:
                c.stop()
            else:
                c.stop(grace=grace)
        if args.baseline:
            subprocess.run(["git", "worktree", "remove", "--force", str(tmp / "baseline")],
                           cwd=ROOT, check=False, capture_output=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--baseline", metavar="REF", help="profile the proxy at REF as well")
    ap.add_argument("--out", type=Path, help="write the tables (markdown) here")
    ap.add_argument("--rate", type=int, default=400, help="py-spy samples per second")
    ap.add_argument("--cprofile", action="store_true", help="cProfile in the proxy instead")
    ap.add_argument("--scale", type=float, default=1.0)
    ap.add_argument("--raw", type=Path, help="keep py-spy's collapsed stacks in this folder")
    ap.add_argument("--instructions", action="store_true",
                    help="count instructions under callgrind instead of profiling")
    ap.add_argument("--rounds", type=int, default=1, help="(--instructions) rounds")
    args = ap.parse_args()
    if args.instructions:
        return count_main(args)
    lines: list[str] = []
    with tempfile.TemporaryDirectory(prefix="proxy-profile-") as d, \
            _staged(args, Path(d)) as (tmp, proxies, children, client, up_port):
        for name, argv in proxies:
            env = dict(os.environ)
            prof = tmp / f"{name}.cprofile"
            if args.cprofile:
                env["PROXY_CPROFILE"] = str(prof)
            px = Child(name, [*argv, "_proxy", f"http://127.0.0.1:{up_port}"], tmp,
                       env=env)
            children.append(px)
            url = f"http://127.0.0.1:{px.wait_listening()}/v1/completions"
            for kind, conc, cmd in LOADS:
                cmd = dict(cmd, total=max(conc, int(cmd["total"] * args.scale)))
                spy_out = None if args.cprofile else tmp / f"{name}-{kind}-{conc}.txt"
                r = drive(client, url, cmd, px, spy_out, args.rate)
                per = r["events"] if kind == "stream" else r["n"]
                unit = "chunk" if kind == "stream" else "request"
                head = (f"{name}, {kind} at {conc}: {r['cpu_s'] / per * 1e6:.1f} µs of "
                        f"proxy CPU per {unit} ({per} {unit}s, {r['rate']:.0f} req/s, "
                        f"p50 {r['p50_ms']:.3f} ms, errors {r['errors']})")
                print(head, flush=True)
                lines += [f"### {head}", ""]
                if spy_out is not None and spy_out.exists() and args.raw is not None:
                    args.raw.mkdir(parents=True, exist_ok=True)
                    shutil.copy(spy_out, args.raw / spy_out.name)
                if spy_out is not None and spy_out.exists():
                    lines += render(summarise(parse_collapsed(spy_out)),
                                    r["cpu_s"] / per * 1e6, unit)
                if kind == "stream" and conc == 64:
                    print(f"  RSS {rss_mb(px):.1f} MB", flush=True)
                    lines += [f"RSS after the loads: {rss_mb(px):.1f} MB", ""]
            px.stop()
            if args.cprofile and prof.exists():
                st = pstats.Stats(str(prof))
                st.sort_stats("tottime").print_stats(40)
                st.sort_stats("cumulative").print_stats(40)
    text = "\n".join(lines)
    print(text)
    if args.out is not None:
        args.out.write_text(text + "\n")
    return 0


INSTR_LOADS: list[tuple[str, int, dict[str, Any]]] = [
    ("plain", 1, dict(body=completion(False, 1), total=300, warmup=50, concurrency=1)),
    ("plain", 64, dict(body=completion(False, 1), total=1280, warmup=128, concurrency=64)),
    ("stream", 64, dict(body=completion(True, 200), expect=200,
                        warmup_body=completion(True, 10), warmup=64, total=128,
                        concurrency=64)),
]


def count_main(args: argparse.Namespace) -> int:
    """Instructions per request and per chunk, each proxy in turn under callgrind."""
    results: dict[tuple[str, str], list[float]] = {}
    with tempfile.TemporaryDirectory(prefix="proxy-instr-") as d, \
            _staged(args, Path(d), grace=30) as (tmp, proxies, children, client, up_port):
        started = {}
        for name, argv in proxies:
            px = Child(name, ["valgrind", "--tool=callgrind", "--callgrind-out-file="
                              + str(tmp / f"{name}.cg"), *argv, "_proxy",
                              f"http://127.0.0.1:{up_port}"], tmp)
            children.append(px)
            started[name] = (px, f"http://127.0.0.1:{px.wait_listening(300)}"
                                 "/v1/completions")
        for rnd in range(args.rounds):
            for kind, conc, cmd in INSTR_LOADS:
                cmd = dict(cmd, total=max(conc, int(cmd["total"] * args.scale)))
                for name, _ in proxies:
                    px, url = started[name]
                    r = count(client, url, cmd, px.p.pid)
                    per = r["events"] if kind == "stream" else r["n"]
                    v = r["instructions"] / per
                    results.setdefault((f"{kind} at {conc}", name), []).append(v)
                    print(f"round {rnd + 1} {kind} {conc} {name}: {v:,.0f} instructions "
                          f"per {'chunk' if kind == 'stream' else 'request'} "
                          f"(errors {r['errors']}, short {r['short_streams']})",
                          flush=True)
    names = [n for n, _ in proxies]
    lines = ["| load | " + " | ".join(f"{n} (instructions)" for n in names)
             + (" | after / before |" if len(names) == 2 else " |"),
             "|---|" + "---|" * (len(names) + (1 if len(names) == 2 else 0))]
    for load in dict.fromkeys(k for k, _ in results):
        meds = [statistics.median(results[(load, n)]) for n in names]
        row = f"| {load} | " + " | ".join(f"{m:,.0f}" for m in meds)
        lines.append(row + (f" | {meds[1] / meds[0]:.2f} |" if len(meds) == 2 else " |"))
    text = "\n".join(lines)
    print(text)
    if args.out is not None:
        args.out.write_text(text + "\n")
    return 0


def rss_mb(c: Child) -> float:
    import psutil
    with contextlib.suppress(psutil.NoSuchProcess):
        return float(psutil.Process(c.p.pid).memory_info().rss) / 2**20
    return float("nan")


def render(s: dict[str, Any], per_us: float, unit: str) -> list[str]:
    total = s["total"] or 1
    out = [f"{s['total']} samples (holding the GIL); µs per {unit} = share x {per_us:.1f}.",
           "", f"| where in the {unit} (nearest marker frame) | share | µs per {unit} |",
           "|---|---|---|"]
    out += [f"| {k} | {n / total:.1%} | {n / total * per_us:.1f} |" for k, n in s["stages"]]
    out += ["", f"| layer (innermost frame's file) | share | µs per {unit} |", "|---|---|---|"]
    out += [f"| {k} | {n / total:.1%} | {n / total * per_us:.1f} |" for k, n in s["layers"]]
    out += ["", "| own (self) | share | | cumulative | share |", "|---|---|---|---|---|"]
    for i in range(len(s["cum"])):
        o = (f"`{s['own'][i][0]}` | {s['own'][i][1] / total:.1%}" if i < len(s["own"])
             else " | ")
        c = s["cum"][i]
        out.append(f"| {o} | | `{c[0]}` | {c[1] / total:.1%} |")
    return [*out, ""]


if __name__ == "__main__":
    sys.exit(main())
