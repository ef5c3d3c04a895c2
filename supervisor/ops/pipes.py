"""A command line whose output's reader went away (`vllm-supervisorctl events | head -1`).

Python ignores SIGPIPE, so a write to a pipe nobody reads any more raises
BrokenPipeError: a traceback on stderr, or at exit "Exception ignored ... BrokenPipeError"
and status 120. coreutils' tools keep SIGPIPE's default and die of it, quietly, and the
shell reports 128 + 13 = 141 (`seq 100000 | head -1; echo ${PIPESTATUS[0]}`). The commands
here do the same without dying of the signal: nothing on stderr, status 141, so that a
script under `set -o pipefail` sees what it sees from `cat` or `seq`, and a truncated
listing is never mistaken for a whole one (0) nor for the daemon's refusal (1).

SIGPIPE itself stays ignored: the control client writes to a socket, and a daemon that
closes it must be an error to report, not a silent death.
"""

from __future__ import annotations

import os
import signal
import sys
from collections.abc import Callable

EXIT_CLOSED_PIPE = 128 + signal.SIGPIPE


def printing(command: Callable[[], int]) -> int:
    """`command()`'s exit status, its output flushed before it is returned (where a
    closed pipe can still be caught, not at the interpreter's exit); EXIT_CLOSED_PIPE,
    quietly, when stdout's reader went away before it had it all. argparse's exits
    (--help, --version, a usage error) go through, their output flushed first."""
    try:
        try:
            code = command()
        except SystemExit:
            sys.stdout.flush()
            raise
        sys.stdout.flush()
        return code
    except BrokenPipeError:
        return closed()


def closed() -> int:
    """stdout pointed at /dev/null (what is still buffered for it goes there: the
    interpreter flushes it at exit, which would raise again), and EXIT_CLOSED_PIPE."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, sys.stdout.fileno())
    finally:
        os.close(devnull)
    return EXIT_CLOSED_PIPE
