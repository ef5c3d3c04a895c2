"""NVIDIA XID codes: what each one means and what clears it. Pure data.

Names and remedies follow NVIDIA's XID catalogue ("Resolution Bucket (Immediate
Action)": RESTART_APP -> "restart", RESET_GPU -> "reset", RESTART_BM (node reboot) ->
"reboot", IGNORE -> "info"). The policy restarts the engine for "restart" and holds it
down for "reset" and "reboot": restarting an engine on a GPU that needs a reset only
loops.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Xid:
    code: int
    name: str
    remedy: str  # "restart", "reset", "reboot" or "info"


_CATALOGUE: dict[int, tuple[str, str]] = {
    8: ("GPU stopped processing", "restart"),
    13: ("Graphics Engine Exception", "restart"),
    31: ("GPU memory page fault", "restart"),
    32: ("Invalid or corrupted push buffer stream", "restart"),
    38: ("Driver firmware error", "reset"),
    43: ("GPU stopped processing (channel reset)", "restart"),
    45: ("Preemptive cleanup, due to previous errors", "info"),
    48: ("Double Bit ECC Error", "reset"),
    61: ("Internal micro-controller breakpoint/warning", "reset"),
    62: ("Internal micro-controller halt", "reset"),
    63: ("ECC page retirement or row remapping recording event", "reset"),
    64: ("ECC page retirement or row remapper recording failure", "reset"),
    68: ("NVDEC0 Exception", "restart"),
    69: ("Graphics Engine class error", "restart"),
    74: ("NVLINK Error", "reset"),
    79: ("GPU has fallen off the bus", "reboot"),
    92: ("High single-bit ECC error rate", "info"),
    94: ("Contained ECC error", "restart"),
    95: ("Uncontained ECC error", "reset"),
    109: ("Context Switch Timeout Error", "restart"),
    119: ("GSP RPC Timeout", "reset"),
    120: ("GSP Error", "reset"),
    140: ("Unrecovered ECC Error", "reset"),
    154: ("GPU Recovery Action Changed", "reset"),
}


def describe(code: int) -> Xid:
    """The catalogue's entry; an unknown code is treated as needing a GPU reset: holding
    one engine down for an operator to look at costs less than a restart loop on a
    broken GPU."""
    name, remedy = _CATALOGUE.get(code, (f"unknown XID {code}", "reset"))
    return Xid(code, name, remedy)
