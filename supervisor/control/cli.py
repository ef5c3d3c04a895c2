"""`vllm-supervisorctl`: talk to a running daemon over its control socket.

Exit status 0 on success; 1 with a one-line reason on stderr when the daemon refuses or
cannot be reached; 2 for a usage error (argparse); 141, quietly, when the output's reader
went away before it had it all (`| head`, as coreutils' tools).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

from supervisor.control.client import ControlClientError, call
from supervisor.ops import pipes
from supervisor.settings.config import ConfigError, load_config

DEFAULT_SOCKET = "/run/vllm-supervisor/control.sock"


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="vllm-supervisorctl",
                                description="Control a running vllm-supervisor daemon.")
    where = p.add_mutually_exclusive_group()
    where.add_argument("--socket", help="control socket path (default: $VLLM_SUPERVISOR_SOCKET"
                                        f" or {DEFAULT_SOCKET})")
    where.add_argument("--config", help="take the socket path from this config file")
    p.add_argument("--timeout", type=float, default=None,
                   help="seconds to wait for the reply (default: 30; stop: 3600; kv-reset: 600)")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")
    # every command takes --engine: with several engines, one acting on an engine needs it
    one = argparse.ArgumentParser(add_help=False)
    one.add_argument("--engine", metavar="NAME", default=None,
                     help="the engine ([engines.NAME]); status and events: only this one")

    def add(name: str, **kw: Any) -> argparse.ArgumentParser:
        return sub.add_parser(name, parents=[one], **kw)

    s = add("status", help="engine state, pid, restarts, last decision")
    s.add_argument("--json", action="store_true", help="machine-readable output")
    r = add("restart", help="drain and restart the engine (also leaves FATAL)")
    r.add_argument("--reason", default=None, help="recorded in the log and audit trail")
    add("stop", help="stop the engine and the daemon; waits until done")
    add("reload", help="re-read the config file; says what applies now, at the next "
                                  "engine start, or only at a daemon restart")
    add("drain", help="hold new requests at the proxy (in-flight ones finish)")
    add("resume", help="release held requests, without a restart")
    t = add("throttle", help="admission limits scaled down to LEVEL (live with the "
                                        "proxy; a drained relaunch without it)")
    t.add_argument("level", type=int, metavar="LEVEL")
    add("unthrottle", help="throttle level 0")
    add("pause-policy", help="maintenance: the watchdog takes no action until resumed")
    add("resume-policy", help="the watchdog acts again")
    add("kv-reset", help="empty the KV cache in place (a pause, vLLM 0.26+; else sleep "
                         "mode), new requests held meanwhile; returns when done")
    add("rearm", help="protection back now: a standby waiting out its backoff starts; "
                      "one with no room beside the engine comes back by a drained restart, "
                      "the standby first (requests held through both starts)")
    v = add("evidence", help="the evidence bundles captured before fault kills")
    v.add_argument("--json", action="store_true", help="machine-readable output")
    e = add("events", help="the audit trail's latest entries")
    e.add_argument("-n", type=int, default=20, help="how many (default 20)")
    e.add_argument("--json", action="store_true", help="one JSON object per line")
    return p


def _socket_path(ns: argparse.Namespace) -> str:
    if ns.socket:
        return str(ns.socket)
    if ns.config:
        return load_config(ns.config).control.socket
    return os.environ.get("VLLM_SUPERVISOR_SOCKET", DEFAULT_SOCKET)


def _carries(standby: int | None, engine: int | None) -> str:
    """What the standby's KV cache carries of streams after a failover, against the
    serving engine's: ", 50,048 KV tokens (20 % of the engine's)"."""
    if not standby:
        return ""
    share = f" ({standby / engine:.0%} of the engine's)" if engine else ""
    return f", {standby:,} KV tokens{share}"


def _duration(s: float | None) -> str:
    if s is None:
        return "-"
    s = int(s)
    h, rem = divmod(s, 3600)
    m, sec = divmod(rem, 60)
    return f"{h}h{m:02d}m{sec:02d}s" if h else (f"{m}m{sec:02d}s" if m else f"{sec}s")


def human_bytes(n: float) -> str:
    sign, n = ("-" if n < 0 else ""), abs(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024:
            return f"{sign}{n:.0f} {unit}" if unit == "B" else f"{sign}{n:.1f} {unit}"
        n /= 1024
    return f"{sign}{n:.2f} TiB"


def human_seconds(s: float) -> str:
    if abs(s) < 1:
        return f"{s * 1000:.0f} ms"
    if abs(s) < 60:
        return f"{s:.1f} s"
    return _duration(s)


# signals whose name does not say their unit (the names are the rules' public ones)
_PERCENT = ("kv_cache_usage", "prefix_cache_hit_rate", "prefix_cache_hit_rate_baseline",
            "spec_decode_acceptance_rate", "gpu_power_ratio", "gpu_utilization")
_YES_NO = ("gpu_thermal_throttled", "gpu_power_capped")


def format_signal(name: str, value: float | int | bool) -> str:
    """One signal in human units (status --json keeps the raw numbers)."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return str(value)
    if name in _PERCENT:
        return f"{100 * value:.1f} %"
    if name in _YES_NO:
        return "yes" if value else "no"
    if name == "generation_tokens_per_s":
        return f"{value:.4g} tokens/s"
    if name == "preemption_rate":
        return f"{value:.3g} preemptions/s"
    if name == "ttft_p99":
        return human_seconds(value)
    if name == "prefix_cache_hit_rate_ratio":
        return f"{value:.2f} x its baseline"
    if name.startswith("kv_blocks"):
        return f"{value:.4g} blocks"
    if name == "kv_tier_store_refusals_per_s":
        return f"{value:.3g} stores refused/s"
    if name.endswith("_bytes_per_s"):
        return human_bytes(value) + "/s"
    if name.endswith("_bytes_per_h"):
        return human_bytes(value) + "/h"
    if name.endswith("_bytes"):
        return human_bytes(value)
    if name.endswith("_s"):
        return human_seconds(value)
    if name.endswith("_c"):
        return f"{value:.0f} C"
    if name.endswith("_w"):
        return f"{value:.0f} W"
    if name.endswith("_percent"):
        return f"{value:.1f} %"
    return f"{value:.4g}" if isinstance(value, float) else str(value)


def format_engines(st: dict[str, Any]) -> str:
    """Several engines: one line each, then each one's details."""
    lines = [f"{'ENGINE':<16} {'STATE':<9} {'PID':>8} {'PORT':>6} {'UP':>9} {'RESTARTS':>8}  "
             "MODELS (FALLBACK)"]
    for e in st.get("engines", []):
        fb = f" (-> {e['fallback']})" if e.get("fallback") else ""
        lines.append(f"{e['name']:<16} {e['state']:<9} {e.get('pid') or '-':>8} "
                     f"{e.get('port')!s:>6} {_duration(e.get('uptime_s')):>9} "
                     f"{e.get('restarts')!s:>8}  {', '.join(e.get('models', []))}{fb}")
    for name, detail in (st.get("detail") or {}).items():
        lines += ["", f"== {name}", format_status(detail)]
    return "\n".join(lines)


def format_status(st: dict[str, Any]) -> str:
    if "detail" in st:
        return format_engines(st)
    eng = st.get("engine", {})
    lines = [f"state      {st['state']} for {_duration(st.get('state_for_s'))}: {st.get('reason')}"]
    pid = st.get("pid")
    lines.append(f"engine     {'pid ' + str(pid) if pid else 'not running'}, "
                 f"{eng.get('processes', 0)} processes, {eng.get('host')}:{eng.get('port')}, "
                 f"up {_duration(st.get('uptime_s'))}")
    start = st.get("start")
    if start:
        phase = (f"{start['phase']} for {_duration(start.get('phase_for_s'))}"
                 if start.get("phase") else "launching")
        last = (f"; the last start took {_duration(start['last_start_s'])}"
                if start.get("last_start_s") is not None else "")
        if start.get("eta_s") is not None:  # (learned from the past starts)
            last += (f"; about {_duration(start['eta_s'])} left of the usual "
                     f"{_duration(start.get('expected_s'))}"
                     + (", but a cold start: another vLLM version" if start.get("cold")
                        else ""))
        lines.append(f"starting   {phase} ({_duration(start.get('for_s'))} so far{last})")
    lines.append(f"restarts   {st.get('restarts')}")
    cache = st.get("compile_cache")
    if cache:
        size = (f"{cache['bytes'] / 2**20:.1f} MiB" if cache.get("bytes") is not None
                else "size not yet measured")
        lines.append(f"cache      {cache['dir']} (vLLM {cache.get('vllm_version') or 'unknown'}"
                     f", {size})")
    dumps = st.get("stack_dumps")
    if dumps:  # (vLLM 0.33+: its own stack dumps of a stalled core and its workers)
        lines.append(f"dumps      {dumps['dir']} (vLLM's own, after {dumps['timeout_s']} s "
                     f"stalled; {'the daemon' if dumps['owner'] == 'daemon' else 'yours'})"
                     if dumps.get("dir") else "dumps      off (your --watchdog-config)")
    adm = st.get("admission")
    if adm:
        lines.append(f"proxy      {adm['listen']}: {adm['in_flight']} in flight "
                     f"(max {adm['max_concurrency']}), {adm['waiting']} waiting"
                     + (f", held: {adm['held']}" if adm.get("held") else "")
                     + (", KV breaker open" if adm.get("kv_breaker_open") else "")
                     + (f"; {adm['workers']} worker processes"
                        + (f", {adm['worker_restarts']} restarted"
                           if adm.get("worker_restarts") else "")
                        if adm.get("workers") else ""))
    over = st.get("overrides") or {}
    lines.append(f"throttle   {st.get('throttle_level')}" + (
        "; engine args: " + " ".join(f"{k} {v if v is not None else '(removed)'}"
                                     for k, v in over.items()) if over else ""))
    pol = st.get("policy")
    if pol:
        mode = ("off" if not pol.get("enabled") else "paused" if pol.get("paused")
                else "dry-run" if pol.get("dry_run") else "acting")
        lines.append(f"policy     {mode}, {pol.get('restarts_last_hour')}/"
                     f"{pol.get('max_restarts_per_hour')} restarts in the last hour")
    d = st.get("last_decision")
    if d:
        lines.append(f"decision   {d['action']} at {d['time']}: {d['reason']}")
    if st.get("last_exit"):
        lines.append(f"last exit  {st['last_exit']}")
    sb = st.get("standby") or {}
    if sb.get("state", "none") != "none":
        where = f" (pid {sb['pid']}, port {sb['port']})" if sb.get("pid") else ""
        why = f": {sb['reason']}" if sb.get("reason") else ""  # (ready: kept awake)
        asleep = ", asleep" if sb.get("asleep") else ""
        if sb.get("weights") in ("gpu", "waking"):  # (engine.standby_weights = "gpu")
            asleep += (" (its weights on the GPU)" if sb["weights"] == "gpu"
                       else " (its weights waking onto the GPU)")
        elif sb.get("early_wake"):  # (a failover wakes its weights while the old one goes)
            asleep += " (its weights wake early)"
        rss = f", {sb['rss_bytes'] / 2**30:.1f} GiB host memory" if sb.get("rss_bytes") else ""
        kv = _carries(sb.get("kv_tokens"), (st.get("engine") or {}).get("kv_tokens"))
        lines.append(f"standby    {sb['state']}{asleep}{where} for {sb.get('for_s', 0):.0f} s"
                     f"{rss}{kv}{why}")
        if sb.get("weights_off"):  # (engine.standby_weights = "gpu", and why not now)
            lines.append(f"           its weights stay on the host: {sb['weights_off']}")
        kept = sb.get("host_cache") or ""
        if kept.startswith("kept: "):  # (their backup still pinned: engine/process/host_cache.py)
            lines.append(f"           its weights' host backup kept ({kept[6:]}): its "
                         f"death gives the card back later")
        if sb.get("unprotected_for_s") is not None:
            lines.append(f"protected  no, for {_duration(sb['unprotected_for_s'])}: the next "
                         f"crash or restart is a cold start (`rearm` brings a standby back)")
    off = st.get("off") or {}
    if off:  # (what the engine cannot do that the daemon would use, and why)
        lines.append("off        " + "; ".join(f"{k.replace('_', ' ')}: {v}"
                                               for k, v in off.items()))
    wc = st.get("weight_cache")
    if wc:
        where = f" (pid {wc['pid']}, health port {wc['port']})" if wc.get("pid") else ""
        lines.append(f"weights    cache {wc['state']}{where} for "
                     f"{_duration(wc.get('for_s'))}: {wc.get('reason')}")
        last = wc.get("last_engine_start")
        if last:
            lines.append(f"           the engine's last start (pid {last['pid']}) loaded "
                         f"them from {last['weights']}"
                         + (f": {last['why']}" if last.get("why") else ""))
        if wc.get("last_error"):
            lines.append(f"           last error: {wc['last_error']}")
    tier = st.get("kv_tier")
    if tier:
        lines.append(format_kv_tier(tier))
    if st.get("backoff_remaining_s") is not None:
        lines.append(f"backoff    next start in {st['backoff_remaining_s']:.1f} s")
    if st.get("stop_deadline_in_s") is not None:
        lines.append(f"deadline   the old engine gone within {st['stop_deadline_in_s']:.1f} s")
    if st.get("fatal_reason"):
        lines.append(f"fatal      {st['fatal_reason']}")
        for err in st.get("last_engine_errors", []):
            lines.append(f"  engine: {err}")
    for k, v in sorted(st.get("signals", {}).items()):
        if v is not None:  # unknown signals (no GPU, no spec decode...) stay out of the way
            lines.append(f"signal     {k} = {format_signal(k, v)}")
    lines.extend(format_gpu(g) for g in st.get("gpus") or [])
    lines.append(f"daemon     pid {st.get('daemon_pid')}, "
                 f"up {_duration(st.get('daemon_uptime_s'))}")
    return "\n".join(lines)


def format_kv_tier(t: dict[str, Any]) -> str:
    """The KV tier's line (docs/standby.md, "The KV tier"): its folder, how full, what
    the keeper removed, and the stores vLLM refused; then its error or warning."""
    used = (f"{human_bytes(t['bytes'])} of {human_bytes(t['max_bytes'])} "
            f"({t['files']:,} files)" if t.get("bytes") is not None else "not yet looked at")
    line = f"kv tier    {t['folder']}: {used}"
    if t.get("removed_bytes_total"):
        line += f", {human_bytes(t['removed_bytes_total'])} removed to keep it there"
    if t.get("store_refusals_total"):
        line += (f"; {t['store_refusals_total']:,} stores refused (its CPU part full: raise "
                 "engine.kv_tier_cpu_gib)")
    for key in ("error", "warning"):
        if t.get(key):
            line += f"\n           {key}: {t[key]}"
    return line


def format_gpu(g: dict[str, Any]) -> str:
    """One GPU of the engine on one line: what is known of it, in its units."""
    parts = []
    if g.get("temperature_c") is not None:
        slowdown = g.get("slowdown_temperature_c")
        parts.append(f"{g['temperature_c']:.0f} C" + (
            f" (slowdown at {slowdown:.0f} C)" if slowdown is not None else ""))
    if g.get("power_w") is not None:
        limit = g.get("power_limit_w")
        parts.append(f"{g['power_w']:.0f} W" + (f" of {limit:.0f} W" if limit else ""))
    if g.get("utilization_ratio") is not None:
        parts.append(f"{100 * g['utilization_ratio']:.0f} % busy")
    if g.get("memory_used_bytes") is not None:
        parts.append(f"{g['memory_used_bytes'] / 2**30:.1f} GiB used")
    if g.get("engine_memory_bytes") is not None:
        parts.append(f"engine {g['engine_memory_bytes'] / 2**30:.1f} GiB")
    if g.get("thermal_throttled"):
        parts.append("thermal slowdown")
    if g.get("xids"):
        parts.append("XID " + ", ".join(str(x) for x in g["xids"]))
    return f"gpu {g.get('index')}      " + (", ".join(parts) or "no readings")


def format_event(ev: dict[str, Any]) -> str:
    parts = [str(ev.get("time", "?")), str(ev.get("event", "?"))]
    if "from" in ev or "to" in ev:
        parts.append(f"{ev.get('from')} -> {ev.get('to')}")
    rest = {k: v for k, v in ev.items() if k not in ("time", "event", "from", "to")}
    parts.extend(f"{k}={v}" for k, v in rest.items() if v is not None)
    return "  ".join(parts)


def format_evidence(result: dict[str, Any]) -> str:
    bundles = result.get("bundles", [])
    if not bundles:
        return f"no evidence bundles in {result.get('dir')}"
    lines = []
    for b in bundles:
        stacks = b.get("stacks") or {}
        dumped = sum(1 for v in stacks.values() if str(v).startswith("ok"))
        lines.append(f"{b['path']}  {b.get('time')}  {b.get('rule')}  {b.get('bytes')} bytes, "
                     f"stacks of {dumped}/{len(stacks)} processes: {b.get('reason')}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Status 141 (128 + SIGPIPE, as the shell reports coreutils' tools), and nothing on
    stderr, when stdout's reader went away first (`| head`): supervisor/ops/pipes.py."""
    return pipes.printing(lambda: _command(argv))


def _command(argv: list[str] | None) -> int:
    ns = _parser().parse_args(argv)
    try:
        path = _socket_path(ns)
    except ConfigError as exc:
        print(f"vllm-supervisorctl: {exc}", file=sys.stderr)
        return 1
    args: dict[str, Any] = {}
    if ns.engine is not None:
        args["engine"] = ns.engine
    if ns.command == "restart" and ns.reason:
        args["reason"] = ns.reason
    if ns.command == "events":
        args["n"] = ns.n
    if ns.command == "throttle":
        args["level"] = ns.level
    # (a KV reset waits up to the drain timeout for in-flight requests, then sleeps and wakes)
    long = {"stop": 3600.0, "kv-reset": 600.0}
    timeout = ns.timeout if ns.timeout is not None else long.get(ns.command, 30.0)
    try:
        result = call(path, ns.command, args, timeout_s=timeout)
    except ControlClientError as exc:
        print(f"vllm-supervisorctl: {exc}", file=sys.stderr)
        return 1
    if ns.command == "status":
        print(json.dumps(result, indent=2) if ns.json else format_status(result))
    elif ns.command == "events":
        for ev in result.get("events", []):
            print(json.dumps(ev) if ns.json else format_event(ev))
    elif ns.command == "evidence":
        print(json.dumps(result, indent=2) if ns.json else format_evidence(result))
    elif ns.command == "reload":
        changed = result.get("changed", [])
        print("reloaded; changed: " + (", ".join(changed) if changed else "nothing"))
        for key, when in (("applied_now", "applied now"),
                          ("next_engine_start", "at the next engine start"),
                          ("next_daemon_start", "only when the daemon restarts")):
            if result.get(key):
                print(f"  {when}: " + ", ".join(result[key]))
    elif ns.command == "restart":
        print(f"restarting: {result.get('reason')}")
    elif ns.command == "stop":
        print(f"stopped (daemon exit status {result.get('exit_code')})")
    elif ns.command == "drain":
        print(f"new requests held; {result.get('in_flight')} in flight, "
              f"{result.get('waiting')} waiting")
    elif ns.command == "resume":
        print(f"released {result.get('released')} held requests")
    elif ns.command in ("throttle", "unthrottle"):
        how = "live at the proxy" if result.get("live") else "by a drained relaunch"
        print(f"throttle level {result.get('throttle_level')} ({how}; at most "
              f"{result.get('max_concurrency')} requests in flight)")
    elif ns.command in ("pause-policy", "resume-policy"):
        now = "paused" if result.get("policy_paused") else "acting"
        print(f"policy {now}" + ("" if result.get("changed") else " (already)"))
    elif ns.command == "rearm":
        print(f"re-arming: {result.get('rearm')}")
    elif ns.command == "kv-reset":
        steps = ", ".join(f"{k} {v:.3f} s" for k, v in (result.get("steps_s") or {}).items())
        own = ", ".join(f"{k} {v:.3f} s" for k, v in (result.get("vllm_s") or {}).items())
        print(f"KV reset {result.get('outcome')} in {result.get('duration_s')} s ({steps}"
              + (f"; vLLM's own: {own}" if own else "") + ")"
              + (f": {result.get('error')}" if result.get("error") else ""))
        if result.get("outcome") != "ok":
            return 1
    if ns.command == "stop" and result.get("exit_code"):
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
