"""systemd's notify protocol, on real datagram sockets: the Notifier alone, then the
daemon's whole conversation with a stand-in for systemd."""

from __future__ import annotations

import json
import os
import socket
import threading
import uuid
from pathlib import Path

import pytest

from supervisor.ops.sdnotify import Notifier
from tests.harness import fake_engine_config, wait_for


class NotifySocket:
    def __init__(self, address: str) -> None:
        self.address = address
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind("\0" + address[1:] if address.startswith("@") else address)
        self.sock.settimeout(0.05)
        self.messages: list[str] = []
        # Read continuously, as systemd does: a datagram socket queues only a few messages.
        self._stop = threading.Event()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        while not self._stop.is_set():
            try:
                self.messages.append(self.sock.recv(4096).decode())
            except TimeoutError:
                continue
            except OSError:
                return

    def drain(self) -> list[str]:
        return list(self.messages)

    def wait(self, field: str, timeout: float = 5) -> list[str]:
        """All fields so far, once `field` is among them."""
        return wait_for(lambda: self.fields() if field in self.fields() else None, timeout,
                        f"{field} on the notify socket")

    def fields(self) -> list[str]:
        return [f for m in self.drain() for f in m.split("\n")]

    def close(self) -> None:
        self._stop.set()
        self._reader.join(1)
        self.sock.close()


@pytest.fixture
def path_socket(tmp_path: Path):
    s = NotifySocket(str(tmp_path / "notify.sock"))
    yield s
    s.close()


def test_notifier_is_a_no_op_without_notify_socket():
    n = Notifier({})
    assert not n.enabled and n.ready("x") is False and n.watchdog_interval_s is None


def test_notifier_sends_to_a_path_socket(path_socket):
    n = Notifier({"NOTIFY_SOCKET": path_socket.address})
    assert n.ready("serving")
    assert n.extend_timeout(30)
    path_socket.wait("EXTEND_TIMEOUT_USEC=30000000")
    msgs = path_socket.drain()
    assert msgs[0].split("\n")[:2] == ["READY=1", "STATUS=serving"]
    assert msgs[1] == "EXTEND_TIMEOUT_USEC=30000000"


def test_notifier_sends_to_an_abstract_socket():
    s = NotifySocket(f"@vllm-supervisor-test-{uuid.uuid4().hex}")
    try:
        n = Notifier({"NOTIFY_SOCKET": s.address})
        assert n.stopping("bye")
        s.wait("STOPPING=1")
        assert s.drain() == ["STOPPING=1\nSTATUS=bye"]
    finally:
        s.close()


def test_notifier_counts_a_vanished_socket_instead_of_raising(tmp_path):
    n = Notifier({"NOTIFY_SOCKET": str(tmp_path / "gone.sock")})
    assert n.status("x") is False and n.failures == 1


def test_watchdog_interval_honours_watchdog_usec_and_pid():
    assert Notifier({"WATCHDOG_USEC": "30000000"}).watchdog_interval_s == 15.0
    assert Notifier({"WATCHDOG_USEC": "30000000",
                     "WATCHDOG_PID": str(os.getpid())}).watchdog_interval_s == 15.0
    assert Notifier({"WATCHDOG_USEC": "30000000", "WATCHDOG_PID": "1"}).watchdog_interval_s is None
    assert Notifier({"WATCHDOG_USEC": "0"}).watchdog_interval_s is None


def test_daemon_speaks_the_notify_protocol(daemon_factory, tmp_path, path_socket):
    cfg = fake_engine_config(tmp_path, "--startup-delay", "2.5")
    cfg["engine"]["env"]["FAKE_ENGINE_ENVFILE"] = str(tmp_path / "engine-env.json")
    d = daemon_factory(cfg, env={"NOTIFY_SOCKET": path_socket.address,
                                 "WATCHDOG_USEC": "1000000"})
    d.wait_state("RUNNING", 20)
    fields = path_socket.wait("READY=1")
    ready_at = fields.index("READY=1")
    assert "EXTEND_TIMEOUT_USEC=30000000" in fields[:ready_at]  # while the engine started
    assert any(f.startswith("STATUS=STARTING") for f in fields[:ready_at])
    assert fields.count("READY=1") == 1
    wait_for(lambda: path_socket.fields().count("WATCHDOG=1") >= 3, 10, "watchdog pings")
    # the engine never sees the daemon's notify socket or watchdog
    env = json.loads((tmp_path / "engine-env.json").read_text())
    assert "NOTIFY_SOCKET" not in env and "WATCHDOG_USEC" not in env
    assert d.ctl("stop").returncode == 0
    d.wait_exit(20)
    fields = path_socket.wait("STOPPING=1")
    assert "STOPPING=1" in fields
    assert any(f.startswith("STATUS=STOPPED") for f in fields)


def test_daemon_sends_ready_with_fatal_so_systemd_start_returns(daemon_factory, tmp_path,
                                                                path_socket):
    cfg = fake_engine_config(tmp_path, "--fail-boot", restart={"boot_failures_max": 1})
    d = daemon_factory(cfg, env={"NOTIFY_SOCKET": path_socket.address})
    d.wait_state("FATAL", 20)
    fields = path_socket.wait("READY=1")
    i = fields.index("READY=1")
    assert fields[i + 1].startswith("STATUS=FATAL")


def test_ready_waits_for_every_engine_to_serve_or_give_up(daemon_factory, tmp_path,
                                                          path_socket):
    from tests.test_engines import engines_config

    cfg = engines_config(tmp_path, quick={}, slow={"fake": ["--startup-delay", "2"]},
                         broken={"fake": ["--fail-boot"]})
    cfg["restart"] = {"backoff_initial_s": 0.1, "backoff_max_s": 0.2, "boot_failures_max": 2}
    d = daemon_factory(cfg, env={"NOTIFY_SOCKET": path_socket.address})
    fields = path_socket.wait("READY=1", timeout=30)
    status = fields[fields.index("READY=1") + 1]
    # sent once "slow" served (and "broken" gave up), with every engine in its status
    assert status.startswith("STATUS=quick: RUNNING"), status
    assert "slow: RUNNING" in status and "broken: FATAL" in status
    lines = {e["name"]: e["state"] for e in d.status()["engines"]}
    assert lines == {"quick": "RUNNING", "slow": "RUNNING", "broken": "FATAL"}
