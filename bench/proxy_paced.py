"""The front proxy under streams paced as vLLM sends them, beside direct and nginx, in one
run (`make bench-proxy-paced`; issue 38).

`bench/proxy_bench.py`'s streaming part writes each stream's chunks back to back, so one
read carries dozens of events and the cost of a read is shared. vLLM writes one event
per stream per engine step, so at the proxy nearly every read is one event. Here the
synthetic upstream (`bench/synthetic_upstream.py`, on uvloop) paces every stream: one
vLLM-shaped completion chunk per step (`?step_ms=N`), every open stream of a step
getting its event at the same tick, as an engine step's outputs do. Configurations:
256 streams at 20 ms and 64 streams at 5 ms, 200 tokens each.

Paths, alternating within each round (the order rotating), medians over the rounds:
**direct**; **proxy**, the proxy as `make bench-proxy` runs it (`FrontProxy` alone in its
own process, the daemon's loop, gate open; continuable streams: it asks for token ids
and keeps the transcript); **nginx** (one worker, `proxy_buffering off`); with
`--baseline REF`, **proxy-before**, the same runner at REF (before and after, same run).

Reported per configuration and path: the server's CPU per chunk (utime + stime from
/proc of every process of it: the proxy's one process; nginx's master and worker), the
chunks/s the client received against direct, the client-observed gap between a stream's
consecutive events (median, p99; the first event's wait is not a gap) and what the path
adds to it (path minus direct, paired within a round), and chunks per client read.

    .venv/bin/python bench/proxy_paced.py [--rounds 3] [--baseline REF] [--out docs/benchmarks.md]
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import platform
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

from bench.proxy_bench import (  # noqa: E402
    NGINX,
    PY,
    Child,
    Client,
    _output,
    completion,
    free_port,
    nginx_conf,
    nginx_runs,
)
from bench.report import write_section  # noqa: E402

HEADERS = {"Content-Type": "application/json"}
# (step in ms, concurrent streams, tokens per stream, streams per run)
CONFIGS: tuple[tuple[int, int, int, int], ...] = ((20, 256, 200, 512), (5, 64, 200, 384))


# ---- the client (its own process) -----------------------------------------------------

def lengths(tokens: int, spread: float, n: int = 64) -> list[int]:
    """Stream lengths around `tokens` (`spread`: the fraction either way; 0: all equal),
    evenly spaced and in a fixed shuffled order, so that every path gets the same ones."""
    if spread <= 0:
        return [tokens]
    lo, hi = tokens * (1 - spread), tokens * (1 + spread)
    out = [max(1, round(lo + (hi - lo) * i / (n - 1))) for i in range(n)]
    return [out[(i * 37) % n] for i in range(n)]  # (37 is prime to 64: a permutation)


async def client_run(cmd: dict[str, Any]) -> dict[str, Any]:
    """`total` streams of `tokens` (or, with `spread`, of lengths around it: `lengths`),
    `concurrency` at a time; every gap between a stream's consecutive events as the
    client saw them (events that came in one read: 0)."""
    import aiohttp

    url, conc, tokens = cmd["url"], int(cmd["concurrency"]), int(cmd["tokens"])
    spread = float(cmd.get("spread", 0.0))
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector,
                                     timeout=aiohttp.ClientTimeout(total=300)) as session:

        async def batch(total: int, n_tokens: int, spread: float = 0.0) -> dict[str, Any]:
            sizes = lengths(n_tokens, spread)
            bodies = {n: json.dumps(completion(True, n, model=cmd.get("model", "synthetic"))
                                    ).encode() for n in set(sizes)}
            gaps: list[float] = []
            firsts: list[float] = []  # request sent to its first event
            counts: list[int] = []
            errors = reads = short = 0
            todo = iter(range(total))

            async def worker() -> None:
                nonlocal errors, reads, short
                for i in todo:
                    want = sizes[i % len(sizes)]
                    body = bodies[want]
                    try:
                        sent = time.perf_counter()
                        async with session.post(url, data=body, headers=HEADERS) as r:
                            n, tail, last_t = 0, b"", 0.0
                            async for chunk in r.content.iter_any():
                                t = time.perf_counter()
                                reads += 1
                                # events end with a blank line; JSON holds no newline
                                k = (tail + chunk[:1]).count(b"\n\n") + chunk.count(b"\n\n")
                                tail = chunk[-1:]
                                if k:
                                    if n:  # (a stream's first event ends no gap)
                                        gaps.append(t - last_t)
                                    else:
                                        firsts.append(t - sent)
                                    gaps.extend([0.0] * (k - 1))
                                    n += k
                                    last_t = t
                            if r.status != 200:
                                errors += 1
                            counts.append(n - 1)  # less the [DONE]
                            short += n - 1 < want
                    except (aiohttp.ClientError, TimeoutError):
                        errors += 1

            gc.collect()
            gc.disable()  # the client's collector pauses are not the path's latency
            t0 = time.perf_counter()
            await asyncio.gather(*(worker() for _ in range(conc)))
            elapsed = time.perf_counter() - t0
            gc.enable()
            gaps.sort()
            q = (lambda p: gaps[min(len(gaps) - 1, int(p * len(gaps)))] * 1e3) \
                if gaps else (lambda p: float("nan"))
            return {"n": len(counts), "errors": errors, "elapsed_s": elapsed,
                    "events": sum(counts), "events_per_s": sum(counts) / elapsed,
                    "reads": reads, "short_streams": short,
                    "gap_p50_ms": q(0.5), "gap_p90_ms": q(0.9), "gap_p99_ms": q(0.99),
                    "first_p50_ms": statistics.median(firsts) * 1e3 if firsts else float("nan"),
                    "first_max_ms": max(firsts) * 1e3 if firsts else float("nan")}

        await batch(conc, 10)  # warm-up: every connection opened, the paths warm
        return await batch(int(cmd["total"]), tokens, spread)


def client_main() -> None:
    """Reads one JSON command a line, answers one JSON result a line."""
    async def loop() -> None:
        for line in sys.stdin:
            if line.strip():
                print(json.dumps(await client_run(json.loads(line))), flush=True)
    asyncio.run(loop())


# ---- the run --------------------------------------------------------------------------

def machine_busy() -> tuple[float, float]:
    """(busy, total) jiffies of every core so far, from /proc/stat: the machine's load
    over a run, ours and everyone else's (the cores are shared)."""
    fields = [float(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0.0)  # idle + iowait
    return sum(fields) - idle, sum(fields)


def paced_rounds(client: Client, servers: dict[str, Child], ports: dict[str, int],
                 rounds: int, scale: float) -> dict[str, Any]:
    """Every configuration on every path, `rounds` times, the paths alternating within a
    round and their order rotating: each run's result (with the server's CPU over it and
    the machine's load), by configuration and path."""
    paths = tuple(servers)
    results: dict[str, Any] = {}
    for rnd in range(rounds):
        k = rnd % len(paths)
        for step, conc, tokens, total in CONFIGS:
            for path in paths[k:] + paths[:k]:
                cpu0, busy0 = servers[path].cpu_s(), machine_busy()
                r = client.run(url=f"http://127.0.0.1:{ports[path]}/v1/completions"
                                   f"?step_ms={step}", concurrency=conc,
                               tokens=tokens, total=max(conc, int(total * scale)))
                r["server_cpu_s"] = servers[path].cpu_s() - cpu0
                busy1 = machine_busy()
                r["machine_busy"] = (busy1[0] - busy0[0]) / max(1.0, busy1[1] - busy0[1])
                results.setdefault(f"{step}-{conc}", {}).setdefault(path, []).append(r)
                print(f"round {rnd + 1} {step} ms x {conc:>3} {path:<12} "
                      f"{r['events_per_s']:.0f} ev/s cpu/chunk "
                      f"{r['server_cpu_s'] / max(1, r['events']) * 1e6:.1f} us gap p50 "
                      f"{r['gap_p50_ms']:.2f} p99 {r['gap_p99_ms']:.2f} ms "
                      f"reads {r['reads']} busy {r['machine_busy']:.0%} "
                      f"errors {r['errors']} "
                      f"short {r['short_streams']}", flush=True)
    return results


def measure(args: argparse.Namespace, tmp: Path) -> tuple[tuple[str, ...], dict[str, Any]]:
    children: list[Child] = []
    client = None
    base = args.baseline_dir.resolve() if args.baseline_dir else tmp / "baseline"
    try:
        up = Child("upstream", [PY, str(ROOT / "bench" / "synthetic_upstream.py"),
                                "--uvloop"], tmp)
        children.append(up)
        upstream = f"http://127.0.0.1:{up.wait_listening()}"
        runner = str(ROOT / "bench" / "proxy_bench.py")
        servers: dict[str, Child] = {"direct": up}
        servers["proxy"] = Child("proxy", [PY, runner, "_proxy", upstream], tmp)
        if args.baseline:
            if args.baseline_dir is None:
                subprocess.run(["git", "worktree", "add", "--detach", str(base),
                                args.baseline], cwd=ROOT, check=True, capture_output=True)
            servers["proxy-before"] = Child(
                "proxy-before", [PY, str(base / "bench" / "proxy_bench.py"), "_proxy",
                                 upstream], tmp)
        children += [s for k, s in servers.items() if k != "direct"]
        ports = {k: (int(upstream.rsplit(":", 1)[1]) if k == "direct" else s.wait_listening())
                 for k, s in servers.items()}
        if nginx_runs():
            ports["nginx"] = free_port()
            ng = Child("nginx", [NGINX, "-e", str(tmp / "nginx-error.log"), "-p", str(tmp),
                                 "-c", str(nginx_conf(tmp, ports["nginx"],
                                                      ports["direct"]))], tmp)
            children.append(ng)
            ng.wait_port(ports["nginx"])
            servers["nginx"] = ng
        paths = tuple(servers)
        client = Client(__file__)
        results = paced_rounds(client, servers, ports, args.rounds, args.scale)
        return paths, results
    finally:
        if client is not None:
            client.close()
        for c in reversed(children):
            c.stop()
        if args.baseline and args.baseline_dir is None:
            subprocess.run(["git", "worktree", "remove", "--force", str(base)],
                           cwd=ROOT, check=False, capture_output=True)


# ---- the report -----------------------------------------------------------------------

def cpu_per_chunk(runs: list[dict[str, Any]]) -> float:
    return statistics.median(r["server_cpu_s"] / max(1, r["events"]) for r in runs) * 1e6


def render(args: argparse.Namespace, paths: tuple[str, ...], res: dict[str, Any]) -> str:
    rev = os.environ.get("PROXY_BENCH_REV") or _output(["git", "rev-parse", "--short", "HEAD"])
    ng = _output([NGINX, "-v"], stderr=True).replace("nginx version: ", "") \
        if "nginx" in paths else "no nginx here"
    out = [
        "## The front proxy under paced streams (`bench/proxy_paced.py`)", "",
        f"Run by `make bench-proxy-paced` on {date.today().isoformat()}, "
        f"{platform.machine()}, {os.cpu_count()} cores (shared, noisy; nothing pinned), "
        f"loopback. Python {platform.python_version()}, {ng}, proxy at commit {rev}"
        + (f", proxy-before at {args.baseline}" if args.baseline else "") + ".", "",
        "What vLLM sends: the synthetic upstream (on uvloop) paces every stream, one "
        "vLLM-shaped completion chunk per engine step, every open stream getting its event "
        "at the same tick, so nearly every read at a proxy is one event (the burst rows "
        "above share each read among dozens). Paths: **direct**, **proxy** (`FrontProxy` "
        "alone in its own process as in the section above: the daemon's loop, gate open, "
        "continuable streams with their transcript), "
        + ("**proxy-before** (the same runner at the baseline commit), " if args.baseline
           else "")
        + "**nginx** (one worker, `proxy_buffering off`). One client process (aiohttp) "
        f"drives them all, alternating within each of {args.rounds} rounds (the order "
        "rotating); every figure is the median over the rounds. CPU per chunk: utime + "
        "stime from /proc of every process of the server (the proxy's one; nginx's master "
        "and worker) over the run, divided by the chunks the client received. The gap is "
        "the time between a stream's consecutive events at the client (events that came "
        "in one read count 0; the first event's wait is not a gap); added = path minus "
        "direct, paired within a round.", "",
    ]
    targets: list[str] = []
    for step, conc, tokens, _ in CONFIGS:
        data = res[f"{step}-{conc}"]
        n = data["direct"][0]["n"]
        out += [f"### {conc} streams, one event every {step} ms, {tokens} tokens each", "",
                f"{n} streams per run after a warm-up wave of short ones.", "",
                "| path | CPU per chunk (µs) | runs (µs) | CPU vs nginx | chunks/s | "
                "vs direct | gap p50 (ms) | gap p99 (ms) | added p50 (ms) | added p99 (ms) "
                "| chunks per client read |",
                "|---|---|---|---|---|---|---|---|---|---|---|"]
        nginx_cpu = cpu_per_chunk(data["nginx"]) if "nginx" in data else None
        direct_rate = statistics.median(r["events_per_s"] for r in data["direct"])
        for path in paths:
            runs = data[path]
            cpu = "—" if path == "direct" else f"{cpu_per_chunk(runs):.1f}"
            each = "—" if path == "direct" else ", ".join(
                f"{r['server_cpu_s'] / max(1, r['events']) * 1e6:.1f}" for r in runs)
            vs = "—" if path == "direct" or not nginx_cpu else \
                f"{cpu_per_chunk(runs) / nginx_cpu:.2f}"
            rate = statistics.median(r["events_per_s"] for r in runs)
            add = {q: statistics.median(r[f"gap_{q}_ms"] - d[f"gap_{q}_ms"]
                                        for r, d in zip(runs, data["direct"], strict=True))
                   for q in ("p50", "p99")}
            added = "— | —" if path == "direct" else f"{add['p50']:+.2f} | {add['p99']:+.2f}"
            per_read = statistics.median(r["events"] / max(1, r["reads"]) for r in runs)
            out.append(f"| {path} | {cpu} | {each} | {vs} | {rate:.0f} | "
                       f"{rate / direct_rate:.3f} | "
                       f"{statistics.median(r['gap_p50_ms'] for r in runs):.2f} | "
                       f"{statistics.median(r['gap_p99_ms'] for r in runs):.2f} | "
                       f"{added} | {per_read:.2f} |")
            if path == "proxy" and nginx_cpu:
                ratio = cpu_per_chunk(runs) / nginx_cpu
                targets.append(f"issue 38: proxy CPU per chunk <= 2x nginx's at {conc} x "
                               f"{step} ms: {'met' if ratio <= 2 else 'NOT met'} "
                               f"({cpu_per_chunk(runs):.1f} µs against "
                               f"{nginx_cpu:.1f}: {ratio:.2f}x)")
        bad = sum(r["errors"] + r["short_streams"] for p in paths for r in data[p])
        busy = statistics.median(r["machine_busy"] for p in paths for r in data[p])
        out += ["", f"Failed or short streams over all runs: {bad}. The machine's cores "
                f"were {busy:.0%} busy during these runs (median; every process, from "
                "/proc/stat).", ""]
    out += ["### Target", ""] + [f"- {t}" for t in targets]
    return "\n".join(out) + "\n"


def main() -> int:
    if sys.argv[1:2] == ["_client"]:
        client_main()
        return 0
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, help="rewrite the paced section of this file")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--scale", type=float, default=1.0, help="streams per run x this")
    ap.add_argument("--baseline", metavar="REF",
                    help="the proxy at this git commit as well (proxy-before)")
    ap.add_argument("--baseline-dir", type=Path, metavar="DIR",
                    help="with --baseline: that commit's tree, already checked out here")
    args = ap.parse_args()
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="proxy-paced-") as d:
        paths, res = measure(args, Path(d))
    text = render(args, paths, res)
    print(text)
    print(f"total: {time.monotonic() - t0:.0f} s")
    if args.out is not None:
        write_section(args.out, "proxy-paced", text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
