"""Drive the real daemon as operators do: a subprocess in its own session, real signals,
the real control socket. Waits are on conditions with deadlines, never fixed sleeps."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import httpx
import psutil

from supervisor.control.client import ControlClientError, call

ROOT = Path(__file__).resolve().parent.parent
FAKE_ENGINE = ROOT / "tests" / "fake_engine.py"
T = TypeVar("T")


def wait_for(cond: Callable[[], T], timeout: float, what: str, interval: float = 0.05) -> T:
    deadline = time.monotonic() + timeout
    last_exc: Exception | None = None
    while True:
        try:
            value = cond()
            if value:
                return value
        except Exception as exc:  # conditions may race with the process under test
            last_exc = exc
        if time.monotonic() >= deadline:
            raise AssertionError(f"timed out after {timeout:g} s waiting for {what}"
                                 + (f" (last error: {last_exc!r})" if last_exc else ""))
        time.sleep(interval)


async def until(cond: Callable[[], T], wait_s: float = 5.0, what: str = "the condition",
                interval: float = 0.01) -> T:
    """`cond()`'s first truthy value, polled every `interval` within `wait_s`: `wait_for`
    for a test's own event loop, where what it reads (a gate's count, a server's set of
    connections, another process) has no event to await. Past the bound, an assertion
    naming `what`: a condition with a deadline, never a sleep that stands in for one."""
    import asyncio

    loop = asyncio.get_running_loop()
    deadline = loop.time() + wait_s
    while not (value := cond()):
        if loop.time() >= deadline:
            raise AssertionError(f"timed out after {wait_s:g} s waiting for {what}")
        await asyncio.sleep(interval)
    return value


class Checked(threading.Thread):
    """A thread whose failure reaches the test: what its target raises (an assertion
    included) `result` raises again in the test's own thread, and one still running
    after the wait is a failure too. (A plain thread's exception is printed, and lost.)"""

    def __init__(self, target: Callable[[], object], name: str) -> None:
        super().__init__(name=name, daemon=True)
        self._run = target
        self._error: BaseException | None = None

    def run(self) -> None:
        try:
            self._run()
        except BaseException as exc:  # (handed to the test's thread: `result`)
            self._error = exc

    def result(self, timeout: float) -> None:
        self.join(timeout)
        if self.is_alive():
            raise AssertionError(f"{self.name}: still running after {timeout:g} s")
        if self._error is not None:
            raise self._error  # (its traceback still shows where, in the thread)


_HANDED_OUT: set[int] = set()


def _below_ephemeral() -> range:
    """Ports no outgoing connection takes: below the kernel's ephemeral range (a port
    picked from inside it may be taken by any client's connect() before the daemon
    binds it)."""
    try:
        low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768
    return range(10000, low) if low > 12000 else range(0)


_RUN_CACHES: Path | None = None


def run_caches() -> Path:
    """This test run's own compile and JIT caches, empty at its first use and removed at
    its end (issue 48): vLLM's cache root (`vllm/`), torch inductor's (`inductor/`, and
    its precompiled headers under the temp folder, `tmp/`), Triton's and the rest of
    `~/.cache` (`xdg/`). Nothing an earlier run (or another program of the machine)
    compiled can hide a cold start's cost from the tests; the engines of one run share
    them, as one host's restarts do. A short path: vLLM puts its sockets in `tmp/`."""
    global _RUN_CACHES
    if _RUN_CACHES is None:
        import atexit
        import shutil

        _RUN_CACHES = Path(tempfile.mkdtemp(prefix="vsc-", dir="/tmp"))
        for sub in ("vllm", "inductor", "triton", "xdg", "tmp"):
            (_RUN_CACHES / sub).mkdir()
        atexit.register(shutil.rmtree, _RUN_CACHES, True)
    return _RUN_CACHES


def cache_env(root: Path) -> dict[str, str]:
    """An engine's environment that puts every cache it fills under `root`
    (`run_caches()`'s layout)."""
    return {"VLLM_CACHE_ROOT": str(root / "vllm"),
            "TORCHINDUCTOR_CACHE_DIR": str(root / "inductor"),
            "TRITON_CACHE_DIR": str(root / "triton"),
            "XDG_CACHE_HOME": str(root / "xdg"), "TMPDIR": str(root / "tmp")}


async def next_event(queue: Any, kind: type[Any], guard_s: float) -> Any:
    """The next item of `kind` on an asyncio queue (others are dropped), within a hang
    guard of `guard_s` (not a timing assertion)."""
    import asyncio

    async with asyncio.timeout(guard_s):
        while True:
            ev = await queue.get()
            if isinstance(ev, kind):
                return ev


def free_port() -> int:
    """A free loopback port not handed out before in this run, nor next to one that was
    (a standby takes its engine's port + 1 by default, and the daemon rightly refuses a
    config whose listeners meet), and outside the ephemeral range where it can."""
    import random
    import socket

    ports = _below_ephemeral()
    for _ in range(200):
        want = random.choice(ports) if ports else 0
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", want))
            except OSError:
                continue
            port = int(s.getsockname()[1])
        if port < 65535 and not _HANDED_OUT & {port - 1, port, port + 1}:
            _HANDED_OUT.add(port)
            return port
    raise AssertionError("no free loopback port found in 200 tries")


def toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int | float):
        return repr(v)
    if isinstance(v, str):
        return json.dumps(v)
    if isinstance(v, list):
        return "[" + ", ".join(toml_value(x) for x in v) + "]"
    if isinstance(v, dict):
        return "{ " + ", ".join(f"{json.dumps(k)} = {toml_value(x)}" for k, x in v.items()) + " }"
    raise TypeError(v)


def write_config(path: Path, sections: dict[str, dict[str, Any]]) -> Path:
    lines = []
    for name, table in sections.items():
        lines.append(f"[{name}]")
        lines.extend(f"{k} = {toml_value(v)}" for k, v in table.items())
        lines.append("")
    path.write_text("\n".join(lines))
    return path


def fake_engine_config(tmp: Path, *fake_args: str, port: int | None = None,
                       **overrides: dict[str, Any]) -> dict[str, dict[str, Any]]:
    sections: dict[str, dict[str, Any]] = {
        "engine": {"command": [sys.executable, str(FAKE_ENGINE), *fake_args],
                   "port": port or free_port(), "drain_timeout_s": 2.0, "stop_grace_s": 2.0,
                   "reap_timeout_s": 5.0, "health_interval_s": 0.1, "startup_timeout_s": 20.0,
                   "env": {"FAKE_ENGINE_PIDFILE": str(tmp / "engine.pids"),
                           "FAKE_ENGINE_ARGVFILE": str(tmp / "engine.argv")}},
        "restart": {"backoff_initial_s": 0.2, "backoff_max_s": 1.0},
        # unix socket paths are limited to 108 bytes: keep the runtime dir short
        "daemon": {"runtime_dir": tempfile.mkdtemp(prefix="vs-", dir="/tmp")},
        "audit": {"path": str(tmp / "events.jsonl")},
        "log": {"format": "json", "level": "debug"},
        # each daemon its own exporter port; no GPU sampling unless a test scripts it
        "exporter": {"listen": f"127.0.0.1:{free_port()}"},
        "gpu": {"sampler": "off"},
        "proxy": {"enabled": False},  # the proxy's tests turn it on
    }
    for name, table in overrides.items():
        sections.setdefault(name, {}).update(table)
    return sections


# the proxy workers of each daemon a test starts with its proxy on, unless it says (1)
PROXY_WORKERS = "VS_TEST_PROXY_WORKERS"


class Daemon:
    """A running `vllm-supervisor run` with helpers; always cleaned up by pid/group."""

    def __init__(self, tmp: Path, sections: dict[str, dict[str, Any]],
                 env: dict[str, str] | None = None) -> None:
        self.tmp = tmp
        workers = os.environ.get(PROXY_WORKERS, "1")
        proxy = sections.get("proxy", {})
        if proxy.get("enabled") and "workers" not in proxy:
            # the front door over that many processes (tests/conftest.py's
            # `proxy_workers`); one unless a test asks, whatever cores the machine has
            sections = {**sections, "proxy": {**proxy, "workers": int(workers)}}
        self.sections = sections
        self.config = write_config(tmp / "config.toml", sections)
        self.socket = str(Path(sections["daemon"]["runtime_dir"]) / "control.sock")
        self.log_path = tmp / "daemon.log"
        self._log = self.log_path.open("wb")
        full_env = {k: v for k, v in os.environ.items() if k != "NOTIFY_SOCKET"}
        full_env.update(env or {})
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "supervisor", "run", "--config", str(self.config)],
            stdout=self._log, stderr=subprocess.STDOUT, env=full_env, cwd=str(tmp),
            start_new_session=True)
        self.pid = self.proc.pid

    # -- talking to it
    def ctl(self, *args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "supervisor.control.cli", "--socket", self.socket, *args],
            capture_output=True, text=True, timeout=timeout)

    def call(self, cmd: str, args: dict[str, Any] | None = None,
             timeout: float = 30) -> dict[str, Any]:
        try:
            return call(self.socket, cmd, args, timeout_s=timeout)
        except ControlClientError as exc:
            code = self.proc.poll()
            if code is None:
                raise
            raise ControlClientError(f"{exc} (the daemon exited {code}; its log ends:\n"
                                     f"{self.log_tail(15)})") from exc

    def status(self) -> dict[str, Any]:
        return self.call("status")

    def wait_state(self, state: str, timeout: float = 30,
                   extra: Callable[[dict[str, Any]], bool] | None = None) -> dict[str, Any]:
        def check() -> dict[str, Any] | None:
            try:
                st = self.status()
            except ControlClientError:
                return None
            return st if st["state"] == state and (extra is None or extra(st)) else None

        try:
            return wait_for(check, timeout, f"state {state}")
        except AssertionError as exc:  # (the log as it is now, at the timeout)
            raise AssertionError(f"{exc}; log:\n{self.log_tail(40, polls=False)}") from None

    def events(self, n: int = 200) -> list[dict[str, Any]]:
        return list(self.call("events", {"n": n})["events"])

    def log_records(self) -> list[dict[str, Any]]:
        out = []
        for line in self.log_path.read_text(errors="replace").splitlines():
            try:
                out.append(json.loads(line))
            except ValueError:
                continue
        return out

    def log_tail(self, n: int = 30, polls: bool = True) -> str:
        """The log's last `n` lines (without `polls`: less the control requests, such as
        a test's own polls of `status`)."""
        try:
            lines = self.log_path.read_text(errors="replace").splitlines()
        except OSError:
            return ""
        if not polls:
            lines = [x for x in lines if '"event": "control request"' not in x]
        return "\n".join(lines[-n:])

    @property
    def exporter_url(self) -> str:
        return "http://" + self.sections["exporter"]["listen"]

    def decisions(self) -> list[dict[str, Any]]:
        return [e for e in self.events() if e["event"] == "decision"]

    def remedies(self) -> list[dict[str, Any]]:
        """The audit's `remedy` entries: one per rung tried."""
        return [e for e in self.events() if e["event"] == "remedy"]

    def engine_argvs(self) -> list[list[str]]:
        """The argv of each fake engine started so far (FAKE_ENGINE_ARGVFILE)."""
        path = self.tmp / "engine.argv"
        if not path.exists():
            return []
        return [json.loads(line) for line in path.read_text().splitlines() if line]

    def engine_pids(self) -> list[int]:
        path = self.tmp / "engine.pids"
        if not path.exists():
            return []
        return [int(x) for x in path.read_text().split()]

    def wait_exit(self, timeout: float) -> int:
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"daemon did not exit within {timeout} s; log:\n"
                                 f"{self.log_tail()}") from None

    def signal(self, sig: int) -> None:
        os.kill(self.pid, sig)

    def close(self) -> None:
        """Leave nothing behind: the daemon's group, then every engine pid it recorded."""
        if self.proc.poll() is None:
            self.signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(self.pid, signal.SIGKILL)
                self.proc.wait(timeout=10)
        for pid in self.engine_pids():
            kill_if_alive(pid)
        self._log.close()


def kill_if_alive(pid: int) -> None:
    """SIGKILL a fake engine the test started, if it is still there (and still ours:
    the command line guards against a recycled pid)."""
    try:
        p = psutil.Process(pid)
        if p.status() != psutil.STATUS_ZOMBIE and str(FAKE_ENGINE) in " ".join(p.cmdline()):
            os.kill(pid, signal.SIGKILL)
    except (psutil.NoSuchProcess, ProcessLookupError, PermissionError):
        pass


def alive(pids: list[int]) -> list[int]:
    out = []
    for pid in pids:
        try:
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                out.append(pid)
        except psutil.NoSuchProcess:
            pass
    return out


def path_tricks(route: str) -> list[str]:
    """Request targets that aim at `route` (an engine route such as /sleep) by ways URL
    libraries and servers read differently: dot segments (plain and encoded), encoded
    slashes, doubled slashes, backslashes, encoded letters, case, a trailing dot."""
    n = route.lstrip("/")
    return [f"/v1/../{n}", f"/v1/./../{n}", f"/v1/%2e%2e/{n}", f"/v1%2F..%2F{n}",
            f"/v1/..%2F{n}", f"//{n}", f"/v1//../{n}", f"/v1\\..\\{n}", f"/%76%31/../{n}",
            f"/V1/../{n.upper()}", f"/{n.upper()}", f"/{n}/.", f"/v1/{n}", f"/{n}"]


def raw_request(address: str, method: str, target: str, body: bytes = b"",
                timeout: float = 30) -> tuple[int, bytes]:
    """One HTTP/1.1 request with `target` on the request line exactly as given (a client
    library would normalise it first); (status, body)."""
    import socket

    host, port = address.rsplit(":", 1)
    head = (f"{method} {target} HTTP/1.1\r\nHost: {address}\r\nConnection: close\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n")
    with socket.create_connection((host, int(port)), timeout=timeout) as s:
        s.sendall(head.encode("latin-1") + body)
        data = b""
        while chunk := s.recv(65536):
            data += chunk
    status_line, _, rest = data.partition(b"\r\n")
    return int(status_line.split()[1]), rest.partition(b"\r\n\r\n")[2]


ROUTER = ROOT / ".tools" / "vllm-router"


class RouterProcess:
    """vllm-router 0.1.17 on loopback (`scripts/setup.sh router`), in its own session,
    with short health checks and breaker timeout; stopped by its pid."""

    def __init__(self, port: int, metrics_port: int, log: Path) -> None:
        self.port, self.metrics_port, self.log = port, metrics_port, log
        self.url = f"http://127.0.0.1:{port}"
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        exe = ROUTER / "bin" / "vllm-router"
        assert exe.exists(), f"{exe} is missing: run `bash scripts/setup.sh router`"
        self.proc = subprocess.Popen(
            [str(exe), "--host", "127.0.0.1", "--port", str(self.port),
             "--prometheus-port", str(self.metrics_port), "--policy", "round_robin",
             "--health-check-interval-secs", "1", "--health-failure-threshold", "2",
             "--health-success-threshold", "1", "--worker-startup-timeout-secs", "10",
             "--worker-startup-check-interval", "1", "--cb-timeout-duration-secs", "5"],
            stdout=self.log.open("ab"), stderr=subprocess.STDOUT, start_new_session=True,
            env={**os.environ, "PYTHONPATH": str(ROUTER)})
        wait_for(lambda: self._up(), 20, "the router listening")

    def _up(self) -> bool:
        try:
            return httpx.get(f"{self.url}/liveness", timeout=1).status_code == 200
        except httpx.HTTPError:
            return False

    def workers(self) -> dict[str, bool]:
        doc = httpx.get(f"{self.url}/workers", timeout=5).json()
        return {w["url"]: w["is_healthy"] for w in doc["workers"]}

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        self.proc = None
