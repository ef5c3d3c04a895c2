"""systemd's notify protocol, written without libsystemd.

One datagram per message to the AF_UNIX socket named by $NOTIFY_SOCKET (a path, or an
abstract name written with a leading '@'). Without NOTIFY_SOCKET every call is a no-op,
so the daemon runs the same in a terminal. Sending never blocks and never raises: a
lost notification is counted in `failures`, never fatal. Sends wait at most
SEND_TIMEOUT_S for room in the receiver's queue (a datagram socket queues only a few
messages): READY=1 dropped because the queue was briefly full would fail the unit's start.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Mapping

SEND_TIMEOUT_S = 0.25


class Notifier:
    def __init__(self, environ: Mapping[str, str] | None = None) -> None:
        env = os.environ if environ is None else environ
        addr = env.get("NOTIFY_SOCKET", "")
        self._address: str | bytes | None = None
        if addr.startswith("@"):
            self._address = b"\0" + addr[1:].encode()
        elif addr.startswith("/"):
            self._address = addr
        self.failures = 0
        self.watchdog_interval_s = _watchdog_interval(env)

    @property
    def enabled(self) -> bool:
        return self._address is not None

    def notify(self, *fields: str) -> bool:
        """Send `KEY=VALUE` fields in one datagram. Returns whether it was sent."""
        if self._address is None:
            return False
        payload = "\n".join(fields).encode()
        try:
            with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as s:
                s.settimeout(SEND_TIMEOUT_S)
                s.sendto(payload, self._address)
        except OSError:
            self.failures += 1
            return False
        return True

    def ready(self, status: str) -> bool:
        return self.notify("READY=1", f"STATUS={status}", f"MAINPID={os.getpid()}")

    def status(self, status: str) -> bool:
        return self.notify(f"STATUS={status}")

    def watchdog(self) -> bool:
        return self.notify("WATCHDOG=1")

    def extend_timeout(self, seconds: float) -> bool:
        return self.notify(f"EXTEND_TIMEOUT_USEC={int(seconds * 1_000_000)}")

    def stopping(self, status: str) -> bool:
        return self.notify("STOPPING=1", f"STATUS={status}")


def _watchdog_interval(env: Mapping[str, str]) -> float | None:
    """Half of WatchdogSec, if systemd asked this very process for keep-alives."""
    usec = env.get("WATCHDOG_USEC")
    if not usec or not usec.isdigit() or int(usec) == 0:
        return None
    pid = env.get("WATCHDOG_PID")
    if pid and pid != str(os.getpid()):
        return None
    return int(usec) / 2 / 1_000_000
