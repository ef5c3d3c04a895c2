"""The front door over several processes at a big host's rate (`make bench-plane`;
issue 38): tokens/s through 1, 2, 4... proxy workers against direct, in one run.

K synthetic engines (`bench/synthetic_upstream.py`, each its own process, paced as vLLM
sends: one event per stream per step of `--step-ms`), each with its own client process
keeping `--streams` streams open (proxy_paced.py's client: it counts every event it
receives and the gaps between them). Paths, alternating within each round (the order
rotating), medians over the rounds:

- **direct**: each client to its engine;
- **wN**: through the front door over N processes: `WorkerPool` (N > 1) or `FrontProxy`
  (N = 1) alone in its own process group, the K engines behind it with their gates open
  and unlimited, each client's model routed to its engine (as a host of K engines does);
- **nginxN** (where nginx runs; `--nginx-workers N`, 0: none): nginx with N worker
  processes (`reuseport`, keep-alive to the engines, `proxy_buffering off`), one port per
  engine (it cannot route by the body's `model`): what a hop through a proxy written in C
  costs on the same host, the same run;
- **wN-before** (`--baseline REF`): the same front door at commit REF (a worktree; or
  `--baseline-dir DIR`, that commit's tree already out), before and after in one run.

Reported per path: the events/s all clients received together, against direct's in the
same round (ratio), the front door's CPU per chunk (utime + stime of every process of
it, workers included), the gap between a stream's events (median of the clients'
medians, the largest p99), and every stream counted: errors and short streams.

The default is issue 38's: 8 engines x 256 streams at a 16 ms step (8 H100s serving an
8B model: about 128,000 chunks/s), which wants a machine of 16 cores or more.

    .venv/bin/python bench/plane_scale.py [--engines 8] [--streams 256] [--step-ms 16]
        [--workers 1,2,4,8] [--rounds 2] [--baseline REF] [--out docs/benchmarks.md]
    .venv/bin/python bench/plane_scale.py _pool N URL[=MODEL]...   # the front door alone
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import signal
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
    free_port,
    nginx_config,
    nginx_runs,
)
from bench.proxy_paced import machine_busy  # noqa: E402
from bench.report import write_section  # noqa: E402

# ---- the front door alone --------------------------------------------------------------

async def run_pool(workers: int, upstreams: list[str]) -> None:
    """The front door over `workers` processes before these engines (URL=MODEL: the
    model name routed to it; one engine without a name takes every name), gates open and
    unlimited, until SIGTERM."""
    from supervisor.front.admission import Gate, GateLimits
    from supervisor.front.dispatch import Backend
    from supervisor.front.exchange import ProxySettings
    from supervisor.front.proxy import FrontProxy
    from supervisor.ops.logs import configure_logging
    from supervisor.plane.pool import WorkerPool

    configure_logging("warning", "json")  # (no access line: the bench measures the path)
    first = upstreams[0].split("=", 1)[0]
    settings = ProxySettings(listen_host="127.0.0.1", listen_port=0, upstream=first,
                             max_connections=1 << 16)
    front: FrontProxy | WorkerPool = FrontProxy(settings) if workers == 1 \
        else WorkerPool(settings, workers, "warning", "json")
    for i, spec in enumerate(upstreams):
        url, _, model = spec.partition("=")
        gate = Gate(GateLimits(concurrency=100000, max_wait_s=60, queue_max=100000))
        gate.release()
        gate.unhealthy = None
        front.add_engine(Backend(f"e{i}", gate, lambda: True, url,
                                 (model,) if model else (), models_open=not model))
    await front.start()
    print(f"LISTENING {front.port}", flush=True)
    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
    await stop.wait()
    await front.close()


# ---- the run --------------------------------------------------------------------------

def own_cpu_s(front: Child) -> float:
    """CPU seconds of the front door's first process alone: the daemon's part (with
    workers, every slot's decision; with one process, everything)."""
    import psutil
    try:
        t = psutil.Process(front.p.pid).cpu_times()
    except psutil.NoSuchProcess:
        return float("nan")
    return float(t.user + t.system)


def measure(args: argparse.Namespace, tmp: Path) -> dict[str, list[dict[str, Any]]]:
    children: list[Child] = []
    clients: list[Client] = []
    base = args.baseline_dir.resolve() if args.baseline_dir else tmp / "baseline"
    try:
        ups = [Child(f"up{i}", [PY, str(ROOT / "bench" / "synthetic_upstream.py"),
                                "--uvloop"], tmp) for i in range(args.engines)]
        children += ups
        up_ports = [u.wait_listening() for u in ups]
        specs = [f"http://127.0.0.1:{p}=m{i}" for i, p in enumerate(up_ports)]
        fronts = {f"w{n}": Child(f"w{n}", [PY, __file__, "_pool", str(n), *specs], tmp)
                  for n in args.workers}
        if args.baseline:
            if args.baseline_dir is None:
                subprocess.run(["git", "worktree", "add", "--detach", str(base),
                                args.baseline], cwd=ROOT, check=True, capture_output=True)
            before = str(base / "bench" / "plane_scale.py")
            # (in that tree: its workers, `python -m supervisor.plane.worker`, are its own)
            fronts |= {f"w{n}-before": Child(f"w{n}-before",
                                             [PY, before, "_pool", str(n), *specs], tmp,
                                             cwd=base)
                       for n in args.workers}
        children += fronts.values()
        ports: dict[str, int | list[int]] = {name: c.wait_listening(120)
                                             for name, c in fronts.items()}
        if args.nginx_workers and nginx_runs():
            name = f"nginx{args.nginx_workers}"
            ng_ports = [free_port() for _ in up_ports]
            ng = Child(name, [NGINX, "-e", str(tmp / "nginx-error.log"), "-p", str(tmp),
                              "-c", str(nginx_config(
                                  tmp, list(zip(ng_ports, up_ports, strict=True)),
                                  args.nginx_workers, connections=16384, keepalive=1024,
                                  listen_opts=" reuseport backlog=4096",
                                  name="nginx-plane.conf"))], tmp)
            children.append(ng)
            for p in ng_ports:
                ng.wait_port(p)
            fronts[name] = ng
            ports[name] = ng_ports
        paths = ["direct", *fronts]
        clients = [Client(str(ROOT / "bench" / "proxy_paced.py"))
                   for _ in range(args.engines)]
        out: dict[str, list[dict[str, Any]]] = {p: [] for p in paths}
        for rnd in range(args.rounds):
            k = rnd % len(paths)
            for path in paths[k:] + paths[:k]:
                front = fronts.get(path)
                cpu0 = front.cpu_s() if front else 0.0
                own0 = own_cpu_s(front) if front else 0.0
                busy0 = machine_busy()
                for i, c in enumerate(clients):
                    at = ports.get(path)
                    port = up_ports[i] if path == "direct" else \
                        at[i] if isinstance(at, list) else at
                    assert c.p.stdin is not None
                    c.p.stdin.write(json.dumps({
                        "url": f"http://127.0.0.1:{port}/v1/completions"
                               f"?step_ms={args.step_ms}",
                        "concurrency": args.streams, "tokens": args.tokens,
                        "spread": args.spread,
                        "total": args.streams * args.waves, "model": f"m{i}"}) + "\n")
                    c.p.stdin.flush()
                runs = []
                for c in clients:
                    assert c.p.stdout is not None
                    runs.append(json.loads(c.p.stdout.readline()))
                busy1 = machine_busy()
                r = {"events": sum(x["events"] for x in runs),
                     "elapsed_s": max(x["elapsed_s"] for x in runs),
                     "errors": sum(x["errors"] for x in runs),
                     "short": sum(x["short_streams"] for x in runs),
                     "streams": sum(x["n"] for x in runs),
                     "gap_p50_ms": statistics.median(x["gap_p50_ms"] for x in runs),
                     "gap_p99_ms": max(x["gap_p99_ms"] for x in runs),
                     "first_p50_ms": statistics.median(x["first_p50_ms"] for x in runs),
                     "first_max_ms": max(x["first_max_ms"] for x in runs),
                     "cpu_s": (front.cpu_s() - cpu0) if front else float("nan"),
                     "own_cpu_s": (own_cpu_s(front) - own0) if front else float("nan"),
                     "busy": (busy1[0] - busy0[0]) / max(1.0, busy1[1] - busy0[1])}
                r["events_per_s"] = r["events"] / r["elapsed_s"]
                out[path].append(r)
                print(f"round {rnd + 1} {path:<7} {r['events_per_s']:>9.0f} ev/s "
                      f"cpu/chunk {r['cpu_s'] / max(1, r['events']) * 1e6:5.1f} us "
                      f"gap p50 {r['gap_p50_ms']:.1f} p99 {r['gap_p99_ms']:.1f} ms "
                      f"first p50 {r['first_p50_ms']:.1f} max {r['first_max_ms']:.1f} ms "
                      f"busy {r['busy']:.0%} streams {r['streams']} errors {r['errors']} "
                      f"short {r['short']}", flush=True)
        return out
    finally:
        for c in clients:
            c.close()
        for ch in reversed(children):
            ch.stop()
        if args.baseline and args.baseline_dir is None:
            subprocess.run(["git", "worktree", "remove", "--force", str(base)],
                           cwd=ROOT, check=False, capture_output=True)


def render(args: argparse.Namespace, res: dict[str, list[dict[str, Any]]]) -> str:
    rev = os.environ.get("PROXY_BENCH_REV") or _output(["git", "rev-parse", "--short", "HEAD"])
    cores = len(os.sched_getaffinity(0))
    direct = res["direct"]
    lines = [
        "## The front door over several processes (`make bench-plane`)",
        "",
        f"{date.today().isoformat()}, commit {rev}, {platform.machine()}, {cores} cores, "
        f"Python {platform.python_version()}. {args.engines} synthetic engines paced at "
        f"{args.step_ms:g} ms x {args.streams} streams of "
        + (f"{args.tokens} tokens each " if not args.spread else
           f"{round(args.tokens * (1 - args.spread))}-{round(args.tokens * (1 + args.spread))}"
           f" tokens (mean {args.tokens}) ")
        + f"({args.engines * args.streams * 1000 / args.step_ms:,.0f} chunks/s offered), "
        f"{args.streams * args.waves} streams per engine and run, {args.rounds} rounds, "
        "medians; ratio: against direct in the same round. CPU: every process of the front "
        "door (workers included) per chunk delivered."
        + (f" wN-before: the front door at commit {args.baseline}." if args.baseline else ""),
        "",
        "| path | chunks/s | ratio to direct | CPU per chunk | of it, the daemon's | CPU "
        "(cores) | gap p50 / p99 (ms) | first event p50 / max (ms) | machine busy | streams | "
        "errors | short |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for path, runs in res.items():
        rate = statistics.median(r["events_per_s"] for r in runs)
        ratio = statistics.median(r["events_per_s"] / d["events_per_s"]
                                  for r, d in zip(runs, direct, strict=True))
        cpu = statistics.median(r["cpu_s"] / max(1, r["events"]) for r in runs) * 1e6
        own = statistics.median(r["own_cpu_s"] / max(1, r["events"]) for r in runs) * 1e6
        cores_used = statistics.median(r["cpu_s"] / r["elapsed_s"] for r in runs)
        p50 = statistics.median(r["gap_p50_ms"] for r in runs)
        p99 = statistics.median(r["gap_p99_ms"] for r in runs)
        f50 = statistics.median(r["first_p50_ms"] for r in runs)
        fmax = statistics.median(r["first_max_ms"] for r in runs)
        busy = statistics.median(r["busy"] for r in runs)
        lines.append(
            f"| {path} | {rate:,.0f} | {ratio:.3f} | "
            + ("- | " if path == "direct" else "")
            + ("-" if path == "direct" else f"{cpu:.1f} us | "
               + ("-" if path.startswith("nginx") else f"{own:.1f} us")) + " | "
            + ("-" if path == "direct" else f"{cores_used:.2f}")
            + f" | {p50:.1f} / {p99:.1f} | {f50:.1f} / {fmax:.1f} | {busy:.0%} | "
            f"{sum(r['streams'] for r in runs)} | "
            f"{sum(r['errors'] for r in runs)} | {sum(r['short'] for r in runs)} |")
    return "\n".join(lines) + "\n"


def main() -> int:
    if sys.argv[1:2] == ["_pool"]:
        from supervisor import loop
        loop.run(run_pool(int(sys.argv[2]), sys.argv[3:]))
        return 0
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--engines", type=int, default=8)
    ap.add_argument("--streams", type=int, default=256, help="open streams per engine")
    ap.add_argument("--step-ms", type=float, default=16.0)
    ap.add_argument("--tokens", type=int, default=200)
    ap.add_argument("--waves", type=int, default=2, help="streams per run: streams x this")
    ap.add_argument("--spread", type=float, default=0.0,
                    help="stream lengths spread this fraction either way of --tokens "
                         "(0: all one length, so that the streams start and end in waves)")
    ap.add_argument("--workers", type=lambda s: [int(x) for x in s.split(",")],
                    default=[1, 2, 4, 8])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--nginx-workers", type=int, default=8,
                    help="the nginx path's worker processes (0: no nginx path)")
    ap.add_argument("--baseline", metavar="REF",
                    help="also the front door at this commit (wN-before), same run")
    ap.add_argument("--baseline-dir", type=Path, metavar="DIR",
                    help="with --baseline: that commit's tree, already checked out here")
    ap.add_argument("--out", type=Path, help="rewrite this section of the file")
    args = ap.parse_args()
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="plane-scale-") as d:
        res = measure(args, Path(d))
    text = render(args, res)
    print(text)
    print(f"total: {time.monotonic() - t0:.0f} s")
    if args.out is not None:
        write_section(args.out, "plane-scale", text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
