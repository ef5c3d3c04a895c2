"""Component tests: the real daemon, in its own session, driving the fake engine, with
real signals and the real control socket."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from supervisor.control.client import recv_line
from supervisor.watchdog import hostmem
from tests.harness import (
    ROOT,
    Daemon,
    alive,
    fake_engine_config,
    free_port,
    kill_if_alive,
    wait_for,
    write_config,
)

pytestmark = pytest.mark.component


def test_starting_to_running_when_health_answers(daemon_factory, tmp_path):
    d = daemon_factory(fake_engine_config(tmp_path, "--startup-delay", "0.5"))
    st = d.wait_state("RUNNING", 20)
    assert st["pid"] == d.engine_pids()[0]
    assert st["restarts"] == 0 and st["throttle_level"] == 0
    assert st["last_decision"]["action"] == "start"
    out = d.ctl("status")
    assert out.returncode == 0 and "RUNNING" in out.stdout
    as_json = json.loads(d.ctl("status", "--json").stdout)
    for key in ("state", "pid", "restarts", "uptime_s", "throttle_level", "last_decision",
                "signals"):
        assert key in as_json
    # psutil's view of the engine tree: memory at once, CPU from the second look on
    sig = wait_for(lambda: (s := d.status()["signals"])["engine_cpu_percent"] is not None
                   and s, 15, "two looks at the engine tree")
    assert sig["engine_rss_bytes"] > 1 << 20 and sig["engine_cpu_percent"] >= 0
    # the host's memory pressure, read for real with each look (unknown without PSI)
    if os.path.exists(hostmem.PSI_MEMORY):
        assert 0.0 <= sig["host_memory_stall_percent"] <= 100.0
    else:
        assert sig["host_memory_stall_percent"] is None


def test_running_to_backoff_when_engine_exits_zero_unasked(daemon_factory, tmp_path):
    # (3 s: a loaded machine can take most of a second from the spawn to RUNNING, its
    # dev routes probed first; with 1 s the first engine was sometimes gone unseen)
    d = daemon_factory(fake_engine_config(tmp_path, "--child", "--crash-after", "3",
                                          "--exit-code", "0"))
    st = d.wait_state("RUNNING", 20)
    first = d.engine_pids()
    assert st["restarts"] == 0 and st["pid"] == first[0], (st["pid"], first)
    st = d.wait_state("RUNNING", 30, extra=lambda s: s["restarts"] >= 1)
    assert st["pid"] not in first
    assert alive(first) == []  # the old tree, child included, is gone
    events = d.events()
    exits = [e for e in events if e["event"] == "exit"]
    assert exits and exits[0]["exit_code"] == 0 and exits[0]["asked"] is False
    assert any(e["event"] == "state" and e["from"] == "RUNNING" and e["to"] == "BACKOFF"
               for e in events)
    # Detection comes from the exit itself: nothing polls a RUNNING engine (health is
    # probed only while STARTING), so the crash is the only way to BACKOFF here.
    recs = d.log_records()
    crash_at = next(i for i, r in enumerate(recs)
                    if r.get("event") == "engine core died (fake crash)")
    backoff_at = next(i for i, r in enumerate(recs) if r.get("to") == "BACKOFF")
    assert crash_at < backoff_at


def test_sigkill_of_the_main_pid_is_seen_though_its_orphan_holds_the_pipes(daemon_factory,
                                                                         tmp_path):
    """As when vLLM's API server is SIGKILLed: its EngineCore lives on, orphaned, holding
    the stdout and stderr it inherited. The exit is seen at once all the same (asyncio's
    own wait() would wait for the pipes to close, that is for ever), and the orphan is
    killed before the next start."""
    d = daemon_factory(fake_engine_config(tmp_path, "--child"))
    d.wait_state("RUNNING", 20)
    main, child = d.engine_pids()
    os.kill(main, signal.SIGKILL)
    st = d.wait_state("RUNNING", 30, extra=lambda s: s["restarts"] >= 1)
    assert alive([main, child]) == []
    assert st["last_exit"] == "killed by SIGKILL"
    exits = [e for e in d.events() if e["event"] == "exit"]
    assert exits[0]["signal"] == "SIGKILL" and exits[0]["asked"] is False


def test_running_to_backoff_when_the_core_dies_before_its_api_server(daemon_factory,
                                                                     tmp_path):
    """vLLM's API server outlives its dead EngineCore by seconds (8 s on the H100): the
    core's death is the crash, seen the moment it happens, and the API server still up
    is taken down with the rest of the tree."""
    d = daemon_factory(fake_engine_config(tmp_path, "--child"))
    d.wait_state("RUNNING", 20)
    main, core = d.engine_pids()
    os.kill(core, signal.SIGKILL)
    wait_for(lambda: d.status()["state"] != "RUNNING", 5, "the crash seen")
    events = d.events()
    seen = next(e for e in events if e["event"] == "core_exit")
    assert seen["pid"] == main and seen["core_pid"] == core
    # the API server was alive when the crash was seen: its exit came from the take-down
    exits = [e for e in events if e["event"] == "exit"]
    assert all(e["asked"] for e in exits)
    st = d.wait_state("RUNNING", 30, extra=lambda s: s["restarts"] >= 1)
    assert alive([main, core]) == []
    assert st["pid"] != main and st["last_exit"] == f"lost its core (pid {core})"


def test_boot_failures_end_in_fatal_and_restart_leaves_it(daemon_factory, tmp_path):
    cfg = fake_engine_config(tmp_path, "--fail-boot",
                             restart={"boot_failures_max": 3, "backoff_initial_s": 0.1})
    d = daemon_factory(cfg)
    st = d.wait_state("FATAL", 30)
    assert "3 boot failures" in st["fatal_reason"]
    assert any("fake boot failure" in line for line in st["last_engine_errors"])
    assert d.proc.poll() is None  # the daemon stays up and answers
    out = d.ctl("status")
    assert "FATAL" in out.stdout and "fake boot failure" in out.stdout
    # fix the config, then `restart` leaves FATAL
    cfg["engine"]["command"] = [sys.executable, str(ROOT / "tests" / "fake_engine.py")]
    write_config(d.config, cfg)
    assert d.ctl("reload").returncode == 0
    r = d.ctl("restart", "--reason", "fixed the flags")
    assert r.returncode == 0, r.stderr
    st = d.wait_state("RUNNING", 20)
    assert st["last_decision"]["reason"] == "fixed the flags"


def test_starting_to_backoff_when_never_healthy(daemon_factory, tmp_path):
    cfg = fake_engine_config(tmp_path, "--never-healthy",
                             engine={"startup_timeout_s": 1.0},
                             restart={"boot_failures_max": 2})
    d = daemon_factory(cfg)
    st = d.wait_state("FATAL", 30)
    assert "not healthy within 1 s" in st["fatal_reason"]
    # FATAL is declared at once; the take-down of the last engine finishes in its bounds
    wait_for(lambda: alive(d.engine_pids()) == []
             and any(e["event"] == "reaped" for e in d.events()), 15,
             "the last engine to be reaped")


def test_stop_sigkills_an_engine_that_ignores_sigterm(daemon_factory, tmp_path):
    d = daemon_factory(fake_engine_config(tmp_path, "--ignore-sigterm", "--child",
                                          engine={"drain_timeout_s": 0.5,
                                                  "stop_grace_s": 0.5}))
    d.wait_state("RUNNING", 20)
    pids = d.engine_pids()
    r = d.ctl("stop")
    assert r.returncode == 0, r.stderr
    assert d.wait_exit(20) == 0
    assert alive(pids) == []
    reaped = [e for e in d.events_from_file() if e["event"] == "reaped"][-1]
    assert reaped["sigkilled"] is True


def test_stop_answers_once_the_daemon_has_let_go_of_its_ports(daemon_factory, tmp_path):
    """`vllm-supervisorctl stop` returns once the daemon's front door and exporter are
    closed, so a daemon started right after it can listen on them (on a GPU host the next
    daemon's start found the exporter's port still taken, the old one still closing its
    proxy workers)."""
    proxy = f"127.0.0.1:{free_port()}"
    cfg = fake_engine_config(tmp_path, proxy={"enabled": True, "listen": proxy, "workers": 2})
    d = daemon_factory(cfg)
    d.wait_state("RUNNING", 20)
    host, port = proxy.rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=5) as slow:
        # a client half-way through its body: the front door gives it its grace at close
        slow.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"
                     b"Content-Type: application/json\r\nContent-Length: 100\r\n\r\n{")
        r = d.ctl("stop")
    assert r.returncode == 0, r.stderr
    for address in (cfg["exporter"]["listen"], proxy):
        host, port = address.rsplit(":", 1)
        with socket.socket() as s:  # (as a new daemon's listener binds: SO_REUSEADDR)
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind((host, int(port)))  # EADDRINUSE while the old daemon still listens
            s.listen()
    assert d.wait_exit(20) == 0


def test_second_sigterm_skips_to_force(daemon_factory, tmp_path):
    d = daemon_factory(fake_engine_config(tmp_path, "--ignore-sigterm",
                                          engine={"drain_timeout_s": 60, "stop_grace_s": 60}))
    d.wait_state("RUNNING", 20)
    pids = d.engine_pids()
    d.signal(signal.SIGTERM)
    wait_for(lambda: any(r.get("to") == "STOPPING" for r in d.log_records()), 10, "STOPPING")
    d.signal(signal.SIGTERM)
    assert d.wait_exit(15) == 0  # far less than the 120 s drain + grace
    assert alive(pids) == []
    assert any(r.get("event") == "second stop request: skipping to SIGKILL"
               for r in d.log_records())


def test_sigkill_of_daemon_leaves_no_engine_process(daemon_factory, tmp_path):
    d = daemon_factory(fake_engine_config(tmp_path, "--child", "--ignore-sigterm"))
    d.wait_state("RUNNING", 20)
    pids = d.engine_pids()
    assert len(pids) == 2 and alive(pids) == pids
    os.kill(d.pid, signal.SIGKILL)
    d.proc.wait(5)
    wait_for(lambda: alive(pids) == [], 10, "the engine tree to die with the daemon")


def test_restart_drains_then_starts_a_new_engine(daemon_factory, tmp_path):
    d = daemon_factory(fake_engine_config(tmp_path, "--child"))
    d.wait_state("RUNNING", 20)
    old = d.engine_pids()
    r = d.ctl("restart", "--reason", "operator test")
    assert r.returncode == 0, r.stderr
    st = d.wait_state("RUNNING", 20, extra=lambda s: s["restarts"] == 1)
    assert alive(old) == []
    assert st["pid"] not in old
    states = [(e["from"], e["to"]) for e in d.events() if e["event"] == "state"]
    assert ("RUNNING", "DRAINING") in states and ("DRAINING", "STARTING") in states
    exits = [e for e in d.events() if e["event"] == "exit"]
    assert exits[0]["asked"] is True


def test_restart_while_draining_is_refused_with_a_reason(daemon_factory, tmp_path):
    # an engine that ignores SIGTERM stays in DRAINING for drain + grace (6 s: room for
    # the second call; each stop of it, the teardown's too, takes as long)
    d = daemon_factory(fake_engine_config(tmp_path, "--ignore-sigterm",
                                          engine={"drain_timeout_s": 3, "stop_grace_s": 3}))
    d.wait_state("RUNNING", 20)
    assert d.ctl("restart").returncode == 0
    r = d.ctl("restart")
    assert r.returncode == 1
    assert r.stderr.strip() == "vllm-supervisorctl: a restart is already in progress"
    d.wait_state("RUNNING", 30, extra=lambda s: s["restarts"] == 1)


def test_port_taken_is_refused_naming_the_holder(daemon_factory, tmp_path):
    port = free_port()
    holder = subprocess.Popen([sys.executable, "-c",
                               "import socket,time;s=socket.socket();"
                               "s.setsockopt(socket.SOL_SOCKET,socket.SO_REUSEADDR,1);"
                               f"s.bind(('127.0.0.1',{port}));s.listen();time.sleep(60)"],
                              start_new_session=True)
    try:
        wait_for(lambda: _connects(port), 10, "the port holder to listen")
        d = daemon_factory(fake_engine_config(tmp_path, port=port,
                                              restart={"boot_failures_max": 2}))
        st = d.wait_state("FATAL", 20)
        assert f"pid {holder.pid}" in st["fatal_reason"]
        assert "import socket" in st["fatal_reason"]
        assert d.engine_pids() == []  # nothing was started
    finally:
        holder.kill()
        holder.wait()


def test_leftovers_of_an_earlier_run_are_killed_before_start(daemon_factory, tmp_path):
    cfg = fake_engine_config(tmp_path, "--child", "--ignore-sigterm")
    first = daemon_factory(cfg, sub="first")
    first.wait_state("RUNNING", 20)
    pids = [int(x) for x in (tmp_path / "engine.pids").read_text().split()]
    # SIGKILL the daemon *and* its guard: only the state file now knows the tree.
    guard = next(r for r in first.log_records() if r.get("event") == "engine unit started")
    try:
        os.kill(guard["guard_pid"], signal.SIGKILL)
        os.kill(first.pid, signal.SIGKILL)
        first.proc.wait(5)
        assert alive(pids) != []  # pdeathsig SIGTERM is ignored by this engine
        second = daemon_factory(cfg, sub="second")
        second.wait_state("RUNNING", 20)
        assert alive(pids) == []
        assert any(r.get("event") == "killed a process left by an earlier run"
                   for r in second.log_records())
    finally:
        for pid in pids:
            kill_if_alive(pid)


def test_bad_config_exits_78_and_starts_nothing(tmp_path):
    port = free_port()
    cfg = fake_engine_config(tmp_path, port=port)
    cfg["engine"]["port"] = 70000
    cfg["engine"]["colour"] = "blue"
    path = write_config(tmp_path / "bad.toml", cfg)
    r = subprocess.run([sys.executable, "-m", "supervisor", "run", "--config", str(path)],
                       capture_output=True, text=True, timeout=30)
    assert r.returncode == 78
    assert "engine.port: expected a value from 1 to 65535, got 70000" in r.stderr
    assert "engine.colour: unknown key" in r.stderr
    assert not (tmp_path / "engine.pids").exists()


def test_reload_applies_a_valid_file_and_refuses_a_broken_one(daemon_factory, tmp_path):
    cfg = fake_engine_config(tmp_path)
    d = daemon_factory(cfg)
    d.wait_state("RUNNING", 20)
    cfg["engine"]["args"] = ["--startup-delay", "0.2"]
    write_config(d.config, cfg)
    r = d.ctl("reload")
    assert r.returncode == 0 and "engine.args" in r.stdout
    assert any(r.get("event") == "engine settings take effect at the next start"
               for r in d.log_records())
    d.config.write_text("[engine]\nport = 'eighty'\n")
    r = d.ctl("reload")
    assert r.returncode == 1
    assert "engine.port: expected an integer" in r.stderr
    d.signal(signal.SIGHUP)  # SIGHUP goes the same way
    wait_for(lambda: sum(r.get("event") == "reload refused; the running config stays in force"
                         for r in d.log_records()) == 2, 10, "SIGHUP reload refusal")
    # the old config stays in force: a restart uses the args reloaded earlier
    d.ctl("restart")
    d.wait_state("RUNNING", 20, extra=lambda s: s["restarts"] == 1)
    spawned = [r for r in d.log_records() if r.get("event") == "engine spawned"][-1]
    # (then the flag that keeps vLLM's own access log off, engine.access_log = false)
    assert spawned["argv"][-3:] == ["--startup-delay", "0.2", "--disable-uvicorn-access-log"]


def test_control_socket_refuses_garbage_and_keeps_answering(daemon_factory, tmp_path):
    d = daemon_factory(fake_engine_config(tmp_path))
    d.wait_state("RUNNING", 20)

    def raw(payload: bytes) -> dict:
        with socket.socket(socket.AF_UNIX) as s:
            s.settimeout(10)
            s.connect(d.socket)
            s.sendall(payload)
            return json.loads(recv_line(s))

    assert "not JSON" in raw(b"\x00\xffgarbage\n")["error"]
    assert "unsupported protocol version" in raw(b'{"cmd": "status"}\n')["error"]
    assert "unknown command" in raw(b'{"v": 1, "cmd": "rm -rf"}\n')["error"]
    assert "exceeds" in raw(b"x" * 200_000 + b"\n")["error"]
    bad_n = raw(b'{"v": 1, "cmd": "events", "args": {"n": "all"}}\n')
    assert bad_n["ok"] is False and "n must be an integer" in bad_n["error"]
    assert raw(b'{"v": 1, "cmd": "status"}\n')["result"]["state"] == "RUNNING"
    assert d.ctl("status").returncode == 0


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to act as another user")
def test_control_socket_refuses_an_unauthorised_peer(daemon_factory, tmp_path):
    d = daemon_factory(fake_engine_config(tmp_path))
    d.wait_state("RUNNING", 20)
    # Open the file mode so that the kernel lets `nobody` connect: the refusal must then
    # come from the daemon's SO_PEERCRED check, not from the file system.
    os.chmod(d.socket, 0o666)
    os.chmod(Path(d.socket).parent, 0o755)
    # The interpreter starts as root (nobody may not read this venv) and drops to
    # nobody before connecting: SO_PEERCRED records the credentials of connect().
    code = ("import os,socket,sys;os.setgroups([]);os.setgid(65534);os.setuid(65534);"
            "s=socket.socket(socket.AF_UNIX);s.settimeout(10);"
            f"s.connect({d.socket!r})\n"
            "try: s.sendall(b'{\"v\":1,\"cmd\":\"stop\"}\\n')\n"
            "except BrokenPipeError: pass\n"
            "sys.stdout.write(s.recv(65536).decode())")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       timeout=20)
    assert r.returncode == 0, r.stderr
    reply = json.loads(r.stdout)
    assert reply["ok"] is False and "unauthorised: uid 65534" in reply["error"]
    assert d.status()["state"] == "RUNNING"


def _connects(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


Daemon.events_from_file = lambda self: [  # type: ignore[attr-defined]
    json.loads(line) for line in (self.tmp / "events.jsonl").read_text().splitlines()]


def test_status_shows_scraped_signals_and_survives_a_garbled_metrics_page(daemon_factory,
                                                                          tmp_path):
    page = tmp_path / "metrics.txt"
    saturated = (ROOT / "tests" / "fixtures" / "vllm-0.32-cpu-metrics" / "kv-saturated.txt")
    page.write_text(saturated.read_text())
    d = daemon_factory(fake_engine_config(tmp_path, "--metrics-file", str(page),
                                          metrics={"period_s": 0.1}))
    d.wait_state("RUNNING", 20)
    sig = wait_for(lambda: (s := d.status()["signals"])["kv_cache_usage"] is not None and s,
                   10, "a first scrape")
    assert (sig["kv_cache_usage"], sig["requests_waiting"], sig["requests_running"]) == (
        1.0, 15.0, 4.0)
    # the same page over and over while 4 requests run: the metrics are frozen
    wait_for(lambda: d.status()["signals"]["metrics_staleness_s"] > 0.5, 10, "staleness")
    page.write_text("<html>502 Bad Gateway</html>")
    wait_for(lambda: d.status()["signals"]["scrape_failures_total"] >= 5, 10, "5 failures")
    assert d.status()["state"] == "RUNNING"
    page.write_text(saturated.read_text())
    wait_for(lambda: any(r.get("event") == "metrics scrape recovered"
                         for r in d.log_records()), 10, "recovery")
    failed = [r for r in d.log_records() if r.get("event") == "metrics scrape failed"]
    assert len(failed) == 1 and "not a Prometheus text page" in failed[0]["error"]
