"""The snapshot relay under streams paced as vLLM sends them, beside direct, in one run
(`make bench-relay`; issue 49's route 3).

A copy of an engine restored in namespaces of its own is reached through its relay
(`supervisor/engine/snapshot/relay.py`: a process that accepts on the daemon's loopback
and connects each connection to the copy's port, bytes both ways). Once a copy takes
over, every token of every stream crosses it. This measures what that costs: the
synthetic upstream (`bench/synthetic_upstream.py`, on uvloop) paces every stream, one
vLLM-shaped chunk per engine step (`bench/proxy_paced.py`'s configurations: 256 streams at
20 ms, 64 at 5 ms, 200 tokens each), and the same client process drives **direct** and
**relay** (the relay run exactly as the daemon runs it, `nsenter` into the upstream's
namespaces: the host's here, no copy needed), alternating within each round (the order
rotating); every figure is the median over the rounds.

Reported per configuration: chunks/s against direct, the gap between a stream's
consecutive events at the client and what the relay adds to it (paired within a round),
the relay's CPU per chunk (utime + stime of its process), failed or short streams.

    .venv/bin/python bench/relay_bench.py [--rounds 3] [--scale 1.0] [--out docs/benchmarks.md]
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import tempfile
import time
from datetime import date
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.proxy_bench import PY, Child, Client, _output  # noqa: E402
from bench.proxy_paced import CONFIGS, paced_rounds  # noqa: E402
from bench.report import write_section  # noqa: E402
from supervisor.engine.snapshot import relay  # noqa: E402

PATHS = ("direct", "relay")


def measure(args: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    children: list[Child] = []
    client = None
    try:
        up = Child("upstream", [PY, str(ROOT / "bench" / "synthetic_upstream.py"),
                                "--uvloop"], tmp)
        children.append(up)
        upstream = up.wait_listening()
        listening = relay.bind_free()
        port = listening.getsockname()[1]
        fd = listening.fileno()
        relayed = Child("relay", relay.argv(up.p.pid, fd, upstream), tmp, pass_fds=(fd,))
        listening.close()  # (the relay has it)
        children.append(relayed)
        relayed.wait_port(port)
        servers = {"direct": up, "relay": relayed}
        ports = {"direct": upstream, "relay": port}
        client = Client(str(ROOT / "bench" / "proxy_paced.py"))
        results = paced_rounds(client, servers, ports, args.rounds, args.scale)
        return results
    finally:
        if client is not None:
            client.close()
        for c in reversed(children):
            c.stop()


def render(args: argparse.Namespace, res: dict[str, Any]) -> str:
    rev = os.environ.get("PROXY_BENCH_REV") or _output(["git", "rev-parse", "--short", "HEAD"])
    out = [
        "## The snapshot relay under paced streams (`bench/relay_bench.py`)", "",
        f"Run by `make bench-relay` on {date.today().isoformat()}, {platform.machine()}, "
        f"{os.cpu_count()} cores (shared, noisy; nothing pinned), loopback, Python "
        f"{platform.python_version()}, at commit {rev}; {args.rounds} rounds, medians.", "",
        "A copy restored in namespaces of its own is reached through its relay; once it "
        "serves, every token crosses it. **direct**: the synthetic upstream (uvloop, paced "
        "one vLLM-shaped chunk per stream per engine step); **relay**: the same through "
        "the relay as the daemon starts it (`nsenter` into the upstream's namespaces). "
        "Added = relay minus direct, paired within a round. CPU per chunk: the relay "
        "process's utime + stime over the run, divided by the chunks received.", "",
        "| streams x step | direct chunks/s | relay chunks/s | relay vs direct | gap p50 "
        "direct / relay (ms) | gap p99 direct / relay (ms) | added p50 / p99 (ms) | relay "
        "CPU per chunk (µs) | failed or short |",
        "|---|---|---|---|---|---|---|---|---|"]
    for step, conc, _, _ in CONFIGS:
        data = res[f"{step}-{conc}"]
        d, r = data["direct"], data["relay"]

        def med(runs: list[dict[str, Any]], key: str) -> float:
            return statistics.median(x[key] for x in runs)

        add = {q: statistics.median(a[f"gap_{q}_ms"] - b[f"gap_{q}_ms"]
                                    for a, b in zip(r, d, strict=True)) for q in ("p50", "p99")}
        cpu = statistics.median(x["server_cpu_s"] / max(1, x["events"]) for x in r) * 1e6
        bad = sum(x["errors"] + x["short_streams"] for x in d + r)
        out.append(
            f"| {conc} x {step} ms | {med(d, 'events_per_s'):.0f} | "
            f"{med(r, 'events_per_s'):.0f} | "
            f"{med(r, 'events_per_s') / med(d, 'events_per_s'):.3f} | "
            f"{med(d, 'gap_p50_ms'):.2f} / {med(r, 'gap_p50_ms'):.2f} | "
            f"{med(d, 'gap_p99_ms'):.2f} / {med(r, 'gap_p99_ms'):.2f} | "
            f"{add['p50']:+.2f} / {add['p99']:+.2f} | {cpu:.1f} | {bad} |")
    busy = statistics.median(x["machine_busy"] for c in res.values() for p in c.values()
                             for x in p)
    out += ["", f"The machine's cores were {busy:.0%} busy during these runs (median; every "
            "process, from /proc/stat)."]
    return "\n".join(out) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, help="rewrite the relay section of this file")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--scale", type=float, default=1.0, help="streams per run x this")
    args = ap.parse_args()
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="relay-bench-") as d:
        res = measure(args, Path(d))
    text = render(args, res)
    print(text)
    print(f"total: {time.monotonic() - t0:.0f} s")
    if args.out is not None:
        write_section(args.out, "relay", text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
