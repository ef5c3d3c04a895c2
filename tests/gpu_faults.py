"""The faults the GPU harness (`tests/gpu_vllm.py`) makes and measures: KV resets (under a
small load, and under `vllm bench serve` with `kv-reset-streams`), a crash of the API
server, a hung core, a hung RPC, and `continue`: a core SIGKILL, SIGSTOP or `restart`
under vLLM's own bench client with every stream checked whole (and `kills`,
`kill-swapback`, `kill-twice` built on it); `throughput` through the proxy and direct.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from tests import gpu_spy, gpu_waits
from tests.gpu_daemon import (
    PROXY,
    WORK,
    Timeline,
    core_of,
    ctl,
    engine_addr,
    engine_running,
    events,
    exporter_series,
    host_memory,
    is_pair,
    nvml_processes,
    protected_again,
    result,
    running,
    running_at,
    spy,
    status,
    wait,
)
from tests.gpu_load import (
    HANDOVER_EVENTS,
    Load,
    Tap,
    bench,
    complete,
    cost_row,
    handover_times,
    main_run_began,
    served_summary,
)


def phase_kv_reset() -> None:
    runs = []
    with Load() as load:
        time.sleep(3)
        for _ in range(3):
            before = status()["signals"].get("engine_gpu_memory_bytes")
            r = ctl("kv-reset")
            assert r.returncode == 0, r.stdout + r.stderr
            ev = [e for e in events() if e["event"] == "remedy"][-1]
            runs.append({"duration_s": ev["duration_s"], "steps_s": ev["steps_s"],
                         "held": ev["held"], "idle_counts": ev.get("idle_counts"),
                         "engine_gpu_mib_before":
                         round(before / 2**20) if before else None})
            time.sleep(3)
    # memory actually dropped while asleep: sleep alone, read NVML, wake
    core = core_of(status()["pid"])
    full = nvml_processes().get(core.pid)
    base = "http://127.0.0.1:8100"
    urllib.request.urlopen(urllib.request.Request(base + "/sleep?level=1", method="POST"),
                           timeout=60).read()
    asleep = nvml_processes().get(core.pid)
    urllib.request.urlopen(urllib.request.Request(base + "/wake_up", method="POST"),
                           timeout=60).read()
    awake = nvml_processes().get(core.pid)
    assert complete() == 200
    st = status()
    result("kv-reset", runs=runs, load=load.summary(), restarts=st["restarts"],
           core_host_mib=host_memory(core.pid),
           core_gpu_mib={"before": round((full or 0) / 2**20),
                         "asleep": round((asleep or 0) / 2**20),
                         "awake": round((awake or 0) / 2**20)})
    assert load.summary()["failed"] == 0 and st["restarts"] == 0


def phase_crash() -> None:
    st = status()
    main = st["pid"]
    core = core_of(main)
    with Load(clients=4, max_tokens=16) as load:
        time.sleep(2)
        t0 = time.monotonic()
        os.kill(main, signal.SIGKILL)
        orphan_ppid: int | str = "not seen"
        while time.monotonic() - t0 < 2:  # the core, orphaned, until the daemon kills it
            try:
                ppid = core.ppid()
            except Exception:  # gone already
                break
            if ppid != main:
                orphan_ppid = ppid
                break
        # the core's end and its NVML release, watched together from the kill (each
        # observed at most one poll, ~0.2 s, after it happened)
        seen: dict[str, float] = {}

        def both() -> bool:
            if "gone" not in seen and not running(core.pid):
                seen["gone"] = time.monotonic()
            if "released" not in seen and core.pid not in nvml_processes():
                seen["released"] = time.monotonic()
            return len(seen) == 2

        wait(both, 120, "the core gone and its GPU memory released")
        gone, released = seen["gone"], seen["released"]
        released_wall = time.time() - (time.monotonic() - released)
        st2 = wait(lambda: status()["state"] == "RUNNING" and status()["restarts"] >= 1
                   and status(), 540, "RUNNING again")
        back = time.monotonic()
        time.sleep(3)
    evs = events()
    reaped = [e for e in evs if e["event"] == "reaped"][-1]
    spawn = [e for e in evs if e["event"] == "spawn"][-1]
    from datetime import datetime

    spawn_wall = datetime.fromisoformat(spawn["time"].replace("Z", "+00:00")).timestamp()
    reaped_wall = datetime.fromisoformat(reaped["time"].replace("Z", "+00:00")).timestamp()
    # The daemon's own proof: its take-down reports no problem only once NVML lists none
    # of the tree's pids, and the next spawn comes after that report.
    proved = reaped["problem"] is None and spawn_wall >= reaped_wall
    result("crash", orphan_ppid=orphan_ppid, core_pid=core.pid,
           daemon_proved_release_before_spawn=proved,
           seen_released_before_spawn=released_wall <= spawn_wall,
           core_gone_after_s=round(gone - t0, 2), nvml_released_after_s=round(released - t0, 2),
           running_again_after_s=round(back - t0, 1), reaped=reaped, next_spawn=spawn,
           last_exit=st2["last_exit"], load=load.summary())
    assert proved and load.summary()["failed"] == 0


def phase_hang() -> None:
    st = status()
    core = core_of(st["pid"])
    restarts = st["restarts"]
    with Load(clients=4, max_tokens=16) as load:
        time.sleep(2)
        t0 = time.monotonic()
        core.send_signal(signal.SIGSTOP)
        decided = wait(lambda: status()["state"] != "RUNNING" and time.monotonic(), 120,
                       "the hang verdict")
        st2 = wait(lambda: status()["state"] == "RUNNING"
                   and status()["restarts"] > restarts and status(), 540, "RUNNING again")
        back = time.monotonic()
        time.sleep(3)
    decision = [e for e in events() if e["event"] == "decision"][-1]
    result("hang", detected_after_s=round(decided - t0, 1),
           running_again_after_s=round(back - t0, 1), decision=decision,
           state_reason=st2["reason"], load=load.summary())
    assert decision["rule"] == "hang"


def phase_hang_rpc(seconds: float = 600.0) -> None:
    """A hang with the process running (HANG_EXT=1 at `start`): `/collective_rpc` calls
    the worker's `vs_hang`, which blocks the core's loop, as a stuck kernel would; its
    other threads run on (vLLM 0.33's watchdog can dump them, which a SIGSTOP cannot give).
    The daemon's verdict, the handover, and the evidence bundle (its files to $OUT)."""
    st = status()
    base, decisions = engine_addr(), len([e for e in events() if e["event"] == "decision"])
    body = json.dumps({"method": "vs_hang", "args": [str(seconds)]}).encode()

    def call_hang() -> None:
        req = urllib.request.Request(f"http://{base}/collective_rpc", data=body,
                                     headers={"content-type": "application/json"})
        with contextlib.suppress(Exception):  # cut when the engine is taken down
            urllib.request.urlopen(req, timeout=seconds + 30).read()

    with Load(clients=4, max_tokens=16) as load:
        time.sleep(2)
        t0 = time.monotonic()
        threading.Thread(target=call_hang, daemon=True).start()
        decided = wait(lambda: len([e for e in events() if e["event"] == "decision"])
                       > decisions and time.monotonic(), 180, "the hang verdict")
        wait(lambda: status()["state"] == "RUNNING" and status()["pid"] != st["pid"], 560,
             "another engine serving")
        back = time.monotonic()
        time.sleep(3)
    evs = events()
    decision = [e for e in evs if e["event"] == "decision"][-1]
    evidence = [e for e in evs if e["event"] == "evidence"]
    bundle = Path(evidence[-1]["path"]) if evidence else None
    files = ({f.name: f.stat().st_size for f in sorted(bundle.iterdir())}
             if bundle and bundle.is_dir() else {})
    out = os.environ.get("OUT")
    if out and bundle and bundle.is_dir():
        subprocess.run(["tar", "czf", str(Path(out) / "hang-evidence.tgz"), "-C",
                        str(bundle.parent), bundle.name], check=False)
    result("hang-rpc", detected_after_s=round(decided - t0, 1),
           serving_again_after_s=round(back - t0, 1), decision=decision,
           evidence=evidence[-1] if evidence else None, bundle_files=files,
           load=load.summary())
    assert decision["rule"] in ("hang", "progress", "canary") or decision


# `late`: the fault 5 s after 64 run at the engine, or after this long into the main run
LATE_BY_S = 8.0


def phase_continue(fault: str, when: str, tag: str | None = None, prompts: int = 3000,
                   second_after: float | None = None,
                   protected_timeout: float = 420, input_len: int = 32) -> dict[str, Any]:
    """Issue 20's procedure: 3000 streams of 256 tokens through the proxy at 128 at a
    time; once the client says its main run started, the core is SIGKILLed (or
    SIGSTOPped) `late` (5 s after the engine runs >= 64) or `early` (as soon as it runs
    all 128, in their first tokens). Four raw streams ride along (two started a second
    before the fault, two just before it, in their prefill). Every stream must end whole:
    0 failed, the tokens generated equal to those asked for, none short.

    With an asymmetric pair (`start thin`) the fault waits until the pair is protected
    again, and the time from the fault to protected again is measured (`Timeline`);
    `second_after`: the core that serves then (the thin one) is SIGKILLed too, that many
    seconds after the first kill (no assertion on the streams: it is a cold start).

    `fault` "none": the same load and moment, nothing done (the baseline of a `cost` row);
    `input_len`: the prompts' tokens (issue 51). The result's `cost` is the row of
    docs/standby.md's table of what a fault costs (`cost_row`)."""
    conc, want = 128, 256
    tag = tag or f"continue-{fault}-{when}"
    pair = is_pair(status())
    if pair:
        wait(lambda: protected_again(status()), 540, "protected again")
    elif (status().get("standby") or {}).get("state", "none") not in ("none", "no_room"):
        wait(lambda: status()["standby"]["state"] == "ready", 400, "the standby ready")
    st = status()
    restarts = st["restarts"]
    core = core_of(st["pid"])
    log_at = (WORK / "daemon.log").stat().st_size
    events_at = len(events())
    before = exporter_series("vllm_supervisor_proxy_continuations_total")
    waits_before = exporter_series(gpu_waits.SERIES)
    fired: dict[str, float] = {}
    second: dict[str, Any] = {}
    taps: list[Tap] = []
    timeline: list[Timeline] = []

    def fault_once() -> None:
        fired["main"] = main_run_began(tag)
        if when == "early":
            wait(lambda: engine_running() >= conc - 8, 60, "the 128 running at the engine")
            taps.extend(Tap(f"fresh{i}", want).start() for i in range(2))
            time.sleep(0.05)
        else:
            # 64 running as the engine's page says, or LATE_BY_S into the main run: under
            # long prompts that page took over 2 s to answer and a kill fired anywhere
            # from 8 to 46 s in (issue 51, 2026-11-29): the time bounds where it lands
            late_by = time.monotonic() + LATE_BY_S
            wait(lambda: time.monotonic() >= late_by or running_at(engine_addr(), 5.0) >= 64,
                 300, "64 requests running at the engine")
            time.sleep(4.0)
            taps.extend(Tap(f"midway{i}", want).start() for i in range(2))
            time.sleep(0.95)
            taps.extend(Tap(f"fresh{i}", want).start() for i in range(2))
            time.sleep(0.05)
        fired["running"] = engine_running()
        fired["t"] = time.monotonic()
        if fault == "none":
            return
        if pair:
            timeline.append(Timeline(fired["t"], st["pid"]))
        if fault == "restart":  # an operator's restart (a swap with a standby)
            threading.Thread(target=ctl, args=("restart", "--reason", "gpu test"),
                             daemon=True).start()
        else:
            core.send_signal(signal.SIGKILL if fault == "kill" else signal.SIGSTOP)
        if second_after is not None:
            time.sleep(second_after)
            now = status()
            core2 = core_of(now["pid"])
            core2.send_signal(signal.SIGKILL)
            # (timed at the kill itself: a /metrics read before it took seconds under load)
            second.update(at_s=round(time.monotonic() - fired["t"], 2), pid=now.get("pid"),
                          core_pid=core2.pid, state=now["state"],
                          standby=now.get("standby"))

    watcher = threading.Thread(target=fault_once, daemon=True)
    watcher.start()
    doc = bench(PROXY, conc, prompts, tag, detailed=True, input_len=input_len)
    watcher.join(5)
    back = wait(lambda: status()["state"] == "RUNNING"
                and (fault == "none" or status()["restarts"] > restarts)
                and status(), 300, "RUNNING again")
    bench_done = time.monotonic()
    protected_s = timeline[0].wait(protected_timeout) if timeline else None
    if timeline:
        back = timeline[0].last or status()
    tapped = [t.summary() for t in taps]
    for t in taps:
        t.save(tag)
    lens = doc.get("output_lens") or []
    errors = [e for e in doc.get("errors") or [] if e]
    texts = doc.get("generated_texts") or []
    lines = (WORK / "daemon.log").read_bytes()[log_at:].decode(errors="replace").splitlines()
    logged = [json.loads(x) for x in lines if x.startswith("{")]
    continued = [e for e in logged if e.get("event") == "stream continued"]
    served = [e for e in logged if e.get("event") == "request"
              and e.get("path") == "/v1/completions"]
    after = exporter_series("vllm_supervisor_proxy_continuations_total")
    waits = gpu_waits.wait_summary(waits_before, exporter_series(gpu_waits.SERIES))
    audit = [e for e in events()[events_at:] if e.get("event") in HANDOVER_EVENTS]
    ttfts = sorted(x for x in doc.get("ttfts") or [] if x is not None)
    held = sorted(e.get("held_s") or 0.0 for e in served)
    # the daemon's own complaints meanwhile (not the engines' lines)
    bad = [e for e in logged if e.get("level") in ("error", "critical")
           and e.get("source") != "engine"]
    engine_bad = [e for e in logged if e.get("level") in ("error", "critical")
                  and e.get("source") == "engine"]
    out = dict(prompts=prompts, concurrency=conc, standby_at_fault=st.get("standby"),
               # what the new requests waited (issue 35: held at the swap until the standby
               # served), as the client saw it (its TTFTs, in s) and as the proxy held them
               held={"max_ttft_s": round(ttfts[-1], 3) if ttfts else None,
                     "ttft_over_1s": len([x for x in ttfts if x > 1.0]),
                     "proxy_held": len([x for x in held if x > 0]),
                     "proxy_max_held_s": round(held[-1], 3) if held else None,
                     **handover_times(audit)},
               running_at_fault=fired.get("running"),
               fault_after_main_s=round(fired["t"] - fired["main"], 1) if "t" in fired else None,
               completed=doc.get("completed"), failed=doc.get("failed"),
               errors=sorted(set(errors))[:5], total_output_tokens=doc.get("total_output_tokens"),
               tokens_asked=prompts * want, short_streams=len([n for n in lens if n < want]),
               empty_texts=len([x for x in texts if not x]),
               **served_summary(doc, served, continued, want, before, after),
               gate_waits=waits,
               running_again_after_kill_s=round(time.monotonic() - fired["t"], 1)
               if "t" in fired else None,
               taps=tapped, state_reason=back["reason"], standby_after=back.get("standby"),
               handover=audit, input_len=input_len, cost=cost_row(doc, fired.get("t")))
    if pair:
        out.update(
            protected_again_after_s=protected_s,
            bench_ended_after_fault_s=round(bench_done - fired["t"], 1) if "t" in fired
            else None,
            pid_at_fault=st["pid"], pid_after=back.get("pid"),
            admission_after=back.get("admission"),
            timeline=timeline[0].changes if timeline else None,
            # the longest the proxy held a request that came after the fault, and p99
            # TTFT in s (the brief's columns)
            p99_ttft_s=round(doc["p99_ttft_ms"] / 1000, 3) if doc.get("p99_ttft_ms")
            else None)
    if second_after is not None:
        out["second_kill"] = second
    out.update(daemon_errors=[{k: e.get(k) for k in ("timestamp", "level", "event", "error",
                                                      "reason")} for e in bad][:10],
               daemon_error_count=len(bad), engine_error_lines=len(engine_bad),
               engine_error_first=[str(e.get("event"))[:300] for e in engine_bad][:5])
    result(tag, **out)
    if second_after is not None:
        return out
    assert doc.get("completed") == prompts and not errors
    assert doc.get("total_output_tokens") == prompts * want
    assert not [n for n in lens if n < want]
    assert all(t["usage_completion_tokens"] == want and t["token_events"] and t["done"]
               and not t["errors"] for t in tapped)
    assert not pair or fault == "none" or protected_s is not None, "not protected again"
    return out


def phase_kills(n: int = 3) -> None:
    """Issue 35's H100 criterion (a): `continue kill late` `n` times in a row on an
    asymmetric pair, each as soon as the pair is protected again; each kill's longest
    client gap and the time from the kill to protected again. KILLS_BUDGET_S (default
    560): a kill is begun only if, by the last one's length, it ends within it (the
    machine's calls last 10 minutes; the daemon lives on, so the rest go in the next)."""
    budget = float(os.environ.get("KILLS_BUDGET_S", "560"))
    first = int(os.environ.get("KILLS_FIRST", "1"))  # (the tag's number, across calls)
    t0 = time.monotonic()
    rows: list[dict[str, Any]] = []
    last = 0.0
    for i in range(first, first + n):
        if rows and time.monotonic() - t0 + last * 1.1 > budget:
            break
        t1 = time.monotonic()
        out = phase_continue("kill", "late", tag=f"continue-kill-late-{i}")
        last = time.monotonic() - t1
        held = out["held"]
        rows.append({"kill": i, "failed": out["failed"], "completed": out["completed"],
                     "tokens": out["total_output_tokens"], "asked": out["tokens_asked"],
                     "short": out["short_streams"], "running": out["running_at_fault"],
                     "max_gap_s": out["max_gap_s"], "max_itl_s": out["max_itl_s"],
                     "p99_ttft_s": out.get("p99_ttft_s"), "max_ttft_s": held["max_ttft_s"],
                     "proxy_max_held_s": held["proxy_max_held_s"],
                     "failover_done_s": held.get("failover_done_s"),
                     "protected_again_after_s": out["protected_again_after_s"],
                     "daemon_errors": out["daemon_error_count"],
                     "phase_s": round(last, 1)})
    result("kills", done=len(rows), asked=n, rows=rows)


def phase_kill_swapback(prompts: int = 8000) -> None:
    """Issue 35 with an asymmetric pair: `continue kill late` with a load long enough
    that the full-size engine is proven and takes over again (the swap back) while the
    thin one still serves streams: every stream whole across both handovers, and the
    longest client gap is the larger of the two."""
    out = phase_continue("kill", "late", tag="continue-kill-swapback", prompts=prompts)
    ended, armed = out.get("bench_ended_after_fault_s"), out.get("protected_again_after_s")
    result("kill-swapback", swap_back_under_load=bool(ended and armed and armed < ended),
           protected_again_after_s=armed, bench_ended_after_fault_s=ended,
           max_itl_s=out["max_itl_s"], max_gap_s=out["max_gap_s"], failed=out["failed"],
           # (the swap back is audited as a failover whose reason is the upgrade's)
           short=out["short_streams"], upgrades=[
               e for e in out["handover"] if e.get("event") == "upgrade"
               or str(e.get("reason", "")).startswith("upgrade")])


def phase_kill_twice(delay: float = 10.0) -> None:
    """Issue 35's (b): under the same load a second SIGKILL `delay` s after the first, of
    the core that serves then (the thin one, while the full-size engine starts beside
    it): no standby is ready, so a cold start, clients held. Reported as it happens."""
    out = phase_continue("kill", "late", tag="kill-twice", prompts=1500, second_after=delay,
                         protected_timeout=float(os.environ.get("PROTECTED_TIMEOUT_S", "240")))
    result("kill-twice-summary", failed=out["failed"], completed=out["completed"],
           tokens=out["total_output_tokens"], asked=out["tokens_asked"],
           short=out["short_streams"], held=out["held"], max_gap_s=out["max_gap_s"],
           max_itl_s=out["max_itl_s"], p99_ttft_s=out.get("p99_ttft_s"),
           protected_again_after_s=out.get("protected_again_after_s"),
           second_kill=out.get("second_kill"), errors=out["errors"])


def phase_throughput(concurrencies: list[int]) -> None:
    """Output tokens/s through the proxy against direct to the engine, alternating runs."""
    rows = []
    for conc in concurrencies:
        prompts = {1: 6, 8: 64, 32: 192}.get(conc, conc * 3)
        runs: dict[str, list[float]] = {"direct": [], "proxy": []}
        for i in range(2):
            for where, base in (("direct", engine_addr()), ("proxy", PROXY)):
                doc = bench(base, conc, prompts, f"tp-{conc}-{where}-{i}")
                runs[where].append(round(float(doc["output_throughput"]), 1))
        ratio = sum(runs["proxy"]) / sum(runs["direct"])
        rows.append({"concurrency": conc, "prompts": prompts, **runs,
                     "ratio": round(ratio, 3)})
        result("throughput", **rows[-1])


def phase_kv_reset_streams(conc: int = 256, prompts: int = 3000, resets: int = 3,
                           input_len: int = 32, tag: str | None = None) -> dict[str, Any]:
    """Issue 35, point 3: `vllm bench serve` through the proxy at `conc` streams of 256
    tokens, and `vllm-supervisorctl kv-reset` `resets` times during it (the first 4 s
    after the engine runs most of them, each next 3 s after the last ended). With
    `drain = "continue"` the streams in flight are paused for continuation, not drained:
    per reset the remedy's duration, steps and held requests, the streams paused; over
    the run every stream whole, the longest gap a client saw."""
    want = 256
    tag = tag or f"kv-reset-streams-{conc}"
    st = status()
    restarts = st["restarts"]
    log_at = (WORK / "daemon.log").stat().st_size
    events_at = len(events())
    before = exporter_series("vllm_supervisor_proxy_continuations_total")
    waits_before = exporter_series(gpu_waits.SERIES)
    runs: list[dict[str, Any]] = []
    spied: list[list[Any]] = []
    marks: dict[str, float] = {}

    def resets_during() -> None:
        marks["main"] = main_run_began(tag)
        wait(lambda: engine_running() >= min(conc, 256) * 3 // 4, 120,
             "most streams running at the engine")
        time.sleep(4.0)
        for i in range(resets):
            running = engine_running()
            spying = spy(f"{tag}-{i}")
            t0 = time.monotonic()
            marks.setdefault("first", t0)
            r = ctl("kv-reset")
            wall = time.monotonic() - t0
            # (the KV resets' own entries: a policy remedy meanwhile is not one of them)
            ev = [e for e in events()[events_at:] if e["event"] == "remedy"
                  and e.get("rung") == "kv_reset"]
            row: dict[str, Any] = {"rc": r.returncode, "running_before": running,
                                   "at_s": round(t0 - marks["main"], 1),
                                   "ctl_wall_s": round(wall, 3)}
            if r.returncode != 0:
                row["out"] = (r.stdout + r.stderr)[-500:]
            if len(ev) > i:
                row.update({k: ev[i].get(k) for k in ("outcome", "duration_s", "steps_s",
                                                      "held", "error", "idle_counts")})
            runs.append(row)
            spied.append(spying)
            time.sleep(3.0)
        marks["done"] = time.monotonic()
        for row, spying in zip(runs, spied, strict=True):
            if spying:  # (SPY=1: where the API server and the core spent the reset)
                row["spy"] = gpu_spy.finish(spying)

    watcher = threading.Thread(target=resets_during, daemon=True)
    watcher.start()
    doc = bench(PROXY, conc, prompts, tag, detailed=True, input_len=input_len)
    watcher.join(120)
    lines = (WORK / "daemon.log").read_bytes()[log_at:].decode(errors="replace").splitlines()
    logged = [json.loads(x) for x in lines if x.startswith("{")]
    paused = [e.get("paused") for e in logged
              if e.get("event") == "streams paused, to go on after it"]
    for row, n in zip(runs, paused, strict=False):
        row["streams_paused"] = n
    continued = [e for e in logged if e.get("event") == "stream continued"]
    served = [e for e in logged if e.get("event") == "request"
              and e.get("path") == "/v1/completions"]
    after = exporter_series("vllm_supervisor_proxy_continuations_total")
    waits = gpu_waits.wait_summary(waits_before, exporter_series(gpu_waits.SERIES))
    lens = doc.get("output_lens") or []
    errors = [e for e in doc.get("errors") or [] if e]
    ttfts = sorted(x for x in doc.get("ttfts") or [] if x is not None)
    st2 = status()
    out = dict(prompts=prompts, concurrency=conc, resets=runs, input_len=input_len,
               cost=cost_row(doc, marks.get("first")))
    result(tag, **out,
           resets_within_run=bool(marks.get("done")) and len(runs) == resets,
           completed=doc.get("completed"), failed=doc.get("failed"),
           errors=sorted(set(errors))[:5], total_output_tokens=doc.get("total_output_tokens"),
           tokens_asked=prompts * want, short_streams=len([n for n in lens if n < want]),
           max_ttft_s=round(ttfts[-1], 3) if ttfts else None,
           **served_summary(doc, served, continued, want, before, after),
           gate_waits=waits,
           restarts=st2["restarts"] - restarts, state=st2["state"],
           # what else the daemon did meanwhile (a policy decision: a restart)
           decisions=[e for e in events()[events_at:] if e["event"] == "decision"],
           other_remedies=[e for e in events()[events_at:] if e["event"] == "remedy"
                           and e.get("rung") != "kv_reset"])
    assert doc.get("completed") == prompts and not errors
    assert doc.get("total_output_tokens") == prompts * want
    assert len(runs) == resets and all(r["rc"] == 0 for r in runs)
    assert st2["restarts"] == restarts
    return out
