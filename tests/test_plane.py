"""The front door over two processes (`proxy.workers = 2`), through the real daemon and
the fake engine: the workers share the public port and one gate, a dead worker is
started again with its slots given back, and the daemon's death takes the workers with
it. (The proxy, continuation and fleet tests run with two workers as well as one:
tests/conftest.py's `proxy_workers`.)"""

from __future__ import annotations

import os
import signal
import socket
import threading
import time
from typing import Any

import httpx
import psutil

from tests.harness import wait_for
from tests.test_proxy import complete, metrics, proxy_config, url


def workers_of(d: Any) -> list[psutil.Process]:
    """The daemon's proxy workers, by their command line (its own children only)."""
    return [p for p in psutil.Process(d.pid).children()
            if "supervisor.plane.worker" in " ".join(p.cmdline())]


def opened(d: Any) -> None:
    d.wait_state("RUNNING")
    wait_for(lambda: d.status()["admission"]["held"] is None, 10, "the gate to open")


def test_two_workers_share_the_port_and_one_gate(daemon_factory, tmp_path):
    cfg = proxy_config(tmp_path, "--token-delay", "0.02", max_concurrency=3, workers=2)
    d = daemon_factory(cfg)
    opened(d)
    assert len(workers_of(d)) == 2
    (tmp_path / "max-running").unlink(missing_ok=True)
    out: list[int] = []
    # one connection each: the kernel spreads them over the two workers' sockets
    threads = [threading.Thread(target=lambda: out.append(complete(cfg, 20).status_code))
               for _ in range(24)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert out == [200] * 24
    # the limit is the host's: never more than 3 at the engine, whichever worker
    # admitted them (the canary may run beside them)
    assert 3 <= int((tmp_path / "max-running").read_text()) <= 3 + 1
    # (each worker writes its request's line once it has answered: waited for)
    access = wait_for(lambda: len(lines := [r for r in d.log_records()
                                            if r.get("event") == "request"]) >= 24 and lines,
                      10, "24 access lines")
    assert len(access) == 24 and {r["worker"] for r in access} == {0, 1}, access
    # the exporter adds the workers' counters up, as of the scrape (a request is counted
    # as its worker finishes it, after its client has the answer: waited for)
    key = ("vllm_supervisor_client_request_duration_seconds_count", (("model", "fake"),))
    m = wait_for(lambda: (m := metrics(d)).get(key) == 24 and m, 10, "24 requests counted")
    assert m[("vllm_supervisor_proxy_responses_total", (("code", "200"),))] == 24
    assert m[("vllm_supervisor_client_request_duration_seconds_count",
              (("model", "fake"),))] == 24
    cpu = [m[("vllm_supervisor_proxy_worker_cpu_seconds_total", (("worker", w),))]
           for w in ("0", "1")]
    assert all(c > 0 for c in cpu) and m[("vllm_supervisor_proxy_worker_restarts_total", ())] == 0
    assert d.status()["admission"]["in_flight"] == 0


def test_a_dead_worker_gives_its_slots_back_and_is_started_again(daemon_factory, tmp_path):
    cfg = proxy_config(tmp_path, "--token-delay", "0.05", max_concurrency=2, workers=2)
    d = daemon_factory(cfg)
    opened(d)
    before = {p.pid for p in workers_of(d)}
    body = {"model": "fake", "prompt": "hi", "max_tokens": 400, "stream": True}
    errors: list[BaseException] = []

    def long_stream() -> None:
        try:
            with httpx.stream("POST", url(cfg), json=body, timeout=30) as r:
                for _ in r.iter_lines():
                    pass
        except httpx.HTTPError as exc:
            errors.append(exc)

    streams = [threading.Thread(target=long_stream) for _ in range(2)]
    for t in streams:
        t.start()
    wait_for(lambda: d.status()["admission"]["in_flight"] == 2, 10, "both slots taken")
    for pid in before:  # (its connections go with it, as the one process's would)
        os.kill(pid, signal.SIGKILL)
    for t in streams:
        t.join(30)
    assert len(errors) == 2  # cut, not ended as if whole
    # their slots came back at once, not when the engine finished the streams
    wait_for(lambda: d.status()["admission"]["in_flight"] == 0, 5, "the slots given back")
    wait_for(lambda: len(workers_of(d)) == 2 and not before & {p.pid for p in workers_of(d)},
             20, "both workers started again")
    wait_for(lambda: complete(cfg).status_code == 200, 20, "a request served again")
    assert [complete(cfg).status_code for _ in range(6)] == [200] * 6
    lines = [r for r in d.log_records() if r.get("event") == "proxy worker ended; "
             "starting it again"]
    assert len(lines) == 2, lines
    adm = d.status()["admission"]
    assert adm["workers"] == 2 and adm["worker_restarts"] == 2
    assert "2 worker processes, 2 restarted" in d.ctl("status").stdout


def test_the_daemons_death_takes_its_workers_with_it(daemon_factory, tmp_path):
    cfg = proxy_config(tmp_path, workers=2)
    d = daemon_factory(cfg)
    opened(d)
    workers = workers_of(d)
    assert len(workers) == 2
    os.kill(d.pid, signal.SIGKILL)
    # each sees its link to the daemon close, and ends: nothing admits requests any more
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline and any(p.is_running() and
                                              p.status() != psutil.STATUS_ZOMBIE
                                              for p in workers):
        time.sleep(0.1)
    alive = [p.pid for p in workers if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
    assert not alive, alive


def test_the_connection_cap_holds_for_the_host_not_each_worker(daemon_factory, tmp_path):
    """proxy.max_connections = 4 over two workers: two each. 24 idle connections (never a
    byte sent): each worker keeps the two it accepted last, each new one taking the place
    of its oldest idle one (evicted, counted); a client that comes then is served, in the
    place of an idle one, never refused."""
    cfg = proxy_config(tmp_path, max_connections=4, workers=2)
    d = daemon_factory(cfg)
    opened(d)
    port = int(cfg["proxy"]["listen"].rsplit(":", 1)[1])
    evicted = ("vllm_supervisor_proxy_rejections_total", (("reason", "connections_evicted"),))
    refused = ("vllm_supervisor_proxy_rejections_total", (("reason", "connections"),))
    # (SO_REUSEPORT spreads them by a hash of each one's address: that a worker gets
    # fewer than two of 24 is a chance of 25 in 2**23)
    held = [socket.create_connection(("127.0.0.1", port), timeout=5) for _ in range(24)]
    try:
        def open_at_workers() -> list[int]:
            return sorted(sum(1 for c in p.net_connections(kind="tcp") if c.laddr
                              and c.laddr.port == port and c.status == "ESTABLISHED")
                          for p in workers_of(d))

        # every worker took what its socket queued: two open at each, the rest evicted
        wait_for(lambda: open_at_workers() == [2, 2] and metrics(d).get(evicted) == 24 - 4,
                 10, "two open at each worker, 20 evicted")
        assert complete(cfg).status_code == 200  # in the place of an idle one
        m = wait_for(lambda: (m := metrics(d)).get(evicted) == 24 - 3 and m, 10,
                     "the newcomer counted as an eviction")
        assert m.get(refused, 0) == 0
        # (the newcomer's closed: one fewer where it came)
        wait_for(lambda: open_at_workers() == [1, 2], 5, "one open where the newcomer came")
    finally:
        for s in held:
            s.close()
    wait_for(lambda: complete(cfg).status_code == 200, 10, "served once the flood is gone")


# Loaded first by every Python of the daemon's tree (on its PYTHONPATH): in worker 0's
# first process alone, once `go` exists, the next counters it reports are followed by a
# frame of garbage, a pickle that would create `ran` if it were unpickled (as the pickled
# wire did). The worker's own code is unchanged: the test plays a worker taken over
# through the bytes it parses.
TAKEN_OVER = '''
import os, pickle, struct
def _arm():
    argv = open("/proc/self/cmdline", "rb").read().split(b"\\0")
    if b"supervisor.plane.worker" not in argv or argv[argv.index(b"--index") + 1] != b"0":
        return
    here = os.environ["PLANE_TAKEN_OVER"]
    if os.path.exists(os.path.join(here, "fired")):
        return
    class Runs:
        def __reduce__(self):
            return (open, (os.path.join(here, "ran"), "w"))
    body = pickle.dumps(Runs())
    from supervisor.plane import wire
    send = wire.Link.send
    def taken_over(self, message):
        send(self, message)
        kind = message[0] if isinstance(message, tuple) else type(message).__name__
        if kind in ("stats", "Stats") and os.path.exists(os.path.join(here, "go")) \\
                and not os.path.exists(os.path.join(here, "fired")):
            open(os.path.join(here, "fired"), "w").close()
            self._transport.write(struct.pack("!I", len(body)) + body)
    wire.Link.send = taken_over
_arm()
'''


def test_a_worker_that_sends_garbage_is_refused_ended_and_started_again(daemon_factory,
                                                                        tmp_path):
    """What a worker sends is data of the wire's types, never code: a frame that is not
    one (here a pickle that would create a file) refuses its link, logged with its kind
    and size; the worker is ended at once, its slots given back, and started again;
    the other worker's streams go on, and requests are served after."""
    hook = tmp_path / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(TAKEN_OVER)
    path = os.pathsep.join(p for p in (str(hook), os.environ.get("PYTHONPATH")) if p)
    cfg = proxy_config(tmp_path, "--token-delay", "0.05", workers=2)
    d = daemon_factory(cfg, env={"PYTHONPATH": path, "PLANE_TAKEN_OVER": str(hook)})
    opened(d)
    pids = {int(p.cmdline()[p.cmdline().index("--index") + 1]): p.pid for p in workers_of(d)}
    assert sorted(pids) == [0, 1]
    body = {"model": "fake", "prompt": "hi", "max_tokens": 200, "stream": True}
    whole: list[bool] = []

    def one_stream() -> None:  # (10 s of tokens: under way when worker 0 is ended)
        try:
            with httpx.stream("POST", url(cfg), json=body, timeout=60) as r:
                whole.append(r.status_code == 200 and any(
                    line == "data: [DONE]" for line in r.iter_lines()))
        except httpx.HTTPError:
            whole.append(False)

    streams = [threading.Thread(target=one_stream) for _ in range(12)]
    for t in streams:
        t.start()
    wait_for(lambda: d.status()["admission"]["in_flight"] == 12, 10, "12 streams admitted")
    (hook / "go").touch()
    refused = wait_for(lambda: [r for r in d.log_records() if r.get("event") ==
                                "the proxy workers' link refused a message, and closed"],
                       10, "the garbage refused")
    for t in streams:
        t.join(60)
    assert not (hook / "ran").exists()  # never unpickled: nothing of it ran
    [line] = refused
    assert line["worker"] == 0 and line["kind"] == "?" and line["size"] > 0, line
    assert "not JSON" in line["why"] and "ran" not in line["why"], line
    # the other worker's streams went on to their end; worker 0's were cut with it (the
    # kernel spread the 12 connections: that all went to one worker is a chance of 1 in
    # 2,048)
    # (a worker writes a request's line once its client has the answer: waited for)
    assert 0 < whole.count(True) < 12, whole
    served = wait_for(lambda: len(lines := [r for r in d.log_records() if r.get("event")
                                            == "request"]) >= whole.count(True) and lines,
                      10, "the access lines of the streams served")
    assert {r["worker"] for r in served} == {1} and len(served) == whole.count(True), \
        (whole, served)
    assert all(r["status"] == 200 for r in served), served
    wait_for(lambda: d.status()["admission"]["in_flight"] == 0, 5, "the slots given back")
    ended = [r for r in d.log_records()
             if r.get("event") == "proxy worker ended; starting it again"]
    assert [r["worker"] for r in ended] == [0] and ended[0]["code"] == -signal.SIGKILL, ended
    now = wait_for(lambda: len(w := workers_of(d)) == 2 and pids[0] not in
                   {p.pid for p in w} and w, 20, "worker 0 started again")
    assert pids[1] in {p.pid for p in now}  # (the other one never stopped)
    wait_for(lambda: complete(cfg).status_code == 200, 20, "a request served again")
    assert [complete(cfg).status_code for _ in range(8)] == [200] * 8
    assert d.status()["admission"]["worker_restarts"] == 1
