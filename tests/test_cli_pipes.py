"""The command lines into a pipe whose reader is gone (`vllm-supervisorctl status | head`
once head has exited): status 141, as the shell reports coreutils' tools killed by
SIGPIPE, and nothing on stderr (before: "Exception ignored ... BrokenPipeError", or a
traceback, and status 120). The real entry points, run as processes, against a running
daemon."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from supervisor.ops.pipes import EXIT_CLOSED_PIPE
from tests.harness import fake_engine_config, write_config

pytestmark = pytest.mark.component

BIN = Path(sys.executable).parent


def entry_point(name: str, module: str) -> list[str]:
    """The installed script (what an operator types), else its module."""
    script = BIN / name
    return [str(script)] if script.exists() else [sys.executable, "-m", module]


CTL = entry_point("vllm-supervisorctl", "supervisor.control.cli")
DAEMON = entry_point("vllm-supervisor", "supervisor")


def into_closed_pipe(argv: list[str], unbuffered: bool = False
                     ) -> subprocess.CompletedProcess[str]:
    """`argv` with its stdout a pipe whose read end is closed before it starts: every
    write to it fails (EPIPE), whenever it comes: at exit, stdout buffered as an operator's
    shell has it; at each write with PYTHONUNBUFFERED (systemd units, CI)."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}
    if unbuffered:
        env["PYTHONUNBUFFERED"] = "1"
    read, write = os.pipe()
    os.close(read)
    try:
        return subprocess.run(argv, stdout=write, stderr=subprocess.PIPE, text=True,
                              timeout=60, check=False, env=env)
    finally:
        os.close(write)


def argparse_exit(unbuffered: bool) -> int:
    """--help and --version into a closed pipe: argparse drops the error of its own write,
    which is where it comes unbuffered (then its exit status, 0, stands); buffered, it
    comes at the flush after it, 141 as any other output."""
    return 0 if unbuffered else EXIT_CLOSED_PIPE


@pytest.mark.parametrize("unbuffered", [False, True], ids=["buffered", "unbuffered"])
def test_ctl_into_a_closed_pipe_ends_quietly_with_141(daemon_factory, tmp_path, unbuffered):
    d = daemon_factory(fake_engine_config(tmp_path))
    d.wait_state("RUNNING", 20)
    ctl = [*CTL, "--socket", d.socket]
    for args in (["status"], ["status", "--json"], ["events", "-n", "100"],
                 ["events", "--json"], ["evidence"]):
        # (into a reader, each prints, and ends 0: the pipe is what differs)
        readable = subprocess.run([*ctl, *args], capture_output=True, text=True, timeout=60,
                                  check=False)
        assert (readable.returncode, readable.stderr) == (0, ""), args
        assert readable.stdout.strip(), args
        r = into_closed_pipe([*ctl, *args], unbuffered)
        assert (r.returncode, r.stderr) == (EXIT_CLOSED_PIPE, ""), args
    r = into_closed_pipe([*ctl, "--help"], unbuffered)
    assert (r.returncode, r.stderr) == (argparse_exit(unbuffered), "")
    # a refusal still says why on stderr, with its own status
    r = into_closed_pipe([*CTL, "--socket", str(tmp_path / "nobody.sock"), "status"],
                         unbuffered)
    assert r.returncode == 1 and r.stderr.startswith("vllm-supervisorctl: "), r.stderr
    assert "Traceback" not in r.stderr and "BrokenPipe" not in r.stderr


@pytest.mark.parametrize("unbuffered", [False, True], ids=["buffered", "unbuffered"])
def test_the_daemons_printing_commands_into_a_closed_pipe_end_quietly(tmp_path, unbuffered):
    config = write_config(tmp_path / "config.toml", fake_engine_config(tmp_path))
    r = into_closed_pipe([*DAEMON, "check", "--config", str(config)], unbuffered)
    assert (r.returncode, r.stderr) == (EXIT_CLOSED_PIPE, "")
    for args in (["--version"], ["--help"]):
        r = into_closed_pipe([*DAEMON, *args], unbuffered)
        assert (r.returncode, r.stderr) == (argparse_exit(unbuffered), ""), args
    # a bad config still says why on stderr, with EX_CONFIG
    bad = tmp_path / "bad.toml"
    bad.write_text("[engine]\nport = -1\n")
    r = into_closed_pipe([*DAEMON, "check", "--config", str(bad)], unbuffered)
    assert r.returncode == 78 and "invalid config" in r.stderr, r.stderr
