"""NVIDIA XID codes: what each one is called and what clears it. Pure: a table and a
lookup, no I/O, no logging, no NVML.

Names are the "Description" column of NVIDIA's Xid catalogue for Ampere and newer GPUs
(docs.nvidia.com/deploy/xid-errors/analyzing-xid-catalog.html); remedies follow its
"Resolution Bucket (Immediate Action)" column:

    RESTART_APP -> "restart"   an application (engine) restart clears it
    RESET_GPU   -> "reset"     the GPU needs a reset
    RESTART_BM  -> "reboot"    the node needs a reboot
    IGNORE      -> "info"      nothing to do for the XID itself

The catalogue's workflow buckets are mapped by what their workflow ends in (see the
entries). The policy restarts the engine for "restart" and holds it down for "reset" and
"reboot": restarting an engine on a GPU that needs a reset only loops. An XID marked
"info" can still come with an engine crash; the crash is handled as a crash.
"""

from __future__ import annotations

from dataclasses import dataclass

XID_ACTIONS = ("restart", "reset", "reboot", "info")
# the policy rule (watchdog/rules.py) that acts on an XID of each remedy: a restart clears
# it, a GPU reset or a reboot holds the engine down; "info" is only logged
RULE_OF: dict[str, str | None] = {"restart": "xid_restart", "reset": "xid_reset",
                                  "reboot": "xid_reset", "info": None}


@dataclass(frozen=True)
class Xid:
    code: int
    name: str
    remedy: str  # one of XID_ACTIONS


_CATALOGUE: dict[int, tuple[str, str]] = {
    8: ("GPU stopped processing", "restart"),
    11: ("Invalid or corrupted push buffer stream", "restart"),
    13: ("Graphics Engine Exception", "restart"),
    25: ("Invalid or illegal push buffer stream", "restart"),
    31: ("GPU memory page fault", "restart"),
    32: ("Invalid or corrupted push buffer stream", "restart"),
    37: ("Driver firmware error", "info"),
    38: ("Driver firmware error", "info"),
    39: ("Copy Engine Exception", "restart"),
    40: ("Copy Engine Exception", "restart"),
    41: ("Copy Engine Exception", "restart"),
    # the application hit a software-induced fault and had to end; "the GPU remains in
    # a healthy state"
    43: ("GPU stopped processing", "info"),
    44: ("Graphics Engine fault during context switch", "info"),
    # WORKFLOW_XID_45: logged whenever the driver tears an application down (Ctrl-C,
    # SIGKILL, a reset), so also when this supervisor kills the engine; alongside another
    # XID it follows that one, which carries its own remedy.
    45: ("Preemptive cleanup, due to previous errors", "info"),
    46: ("GPU stopped processing", "reset"),
    # WORKFLOW_XID_48: "A GPU reset or node reboot is needed to clear this error."
    48: ("Double Bit ECC Error", "reset"),
    # unused on Ampere and newer (PMU_BREAKPOINT); older catalogues call it a
    # micro-controller breakpoint or warning that tends to precede 62
    61: ("Internal micro-controller breakpoint/warning", "reset"),
    62: ("Internal micro-controller halt", "reset"),
    # row remapping did its job; the remap takes effect at the next reset, when convenient
    63: ("GPU memory remapping event", "info"),
    64: ("GPU memory remapping failure", "reset"),
    68: ("NVDEC0 Exception", "restart"),
    69: ("Graphics Engine class error", "restart"),
    # WORKFLOW_NVLINK_ERR: "A GPU reset or node reboot is needed to clear this error."
    74: ("NVLINK Error", "reset"),
    79: ("GPU has fallen off the bus", "reboot"),
    80: ("Corrupted data sent to GPU", "restart"),
    92: ("High single-bit ECC error rate", "info"),
    94: ("Contained memory error", "restart"),
    95: ("Uncontained memory error", "reset"),
    109: ("Context Switch Timeout Error", "reset"),
    110: ("Security Fault Error", "reset"),
    119: ("GSP RPC Timeout", "reset"),
    120: ("GSP Error", "reset"),
    121: ("C2C Error", "info"),
    136: ("Link Training Failed", "reset"),
    140: ("ECC Unrecovered Error", "reset"),
    143: ("GPU Initialization Error", "reset"),
    # XID_154 summarises the recovery action the XIDs beside it need ("None", "Drain
    # P2P", "Drain and Reset", "GPU Reset Required", "Node Reboot Required"). NVML's
    # event carries only the code, not that text, so the action is unknown here: treated
    # as a reset, like any XID whose remedy is unknown.
    154: ("GPU Recovery Action Changed", "reset"),
    155: ("NVLINK: SW Defined Error", "reset"),
    156: ("Resource Retirement Event", "reset"),
    157: ("Resource Retirement Failure", "info"),
    158: ("GPU Fatal Timeout", "reset"),
}


def describe(code: int) -> Xid:
    """The catalogue's entry for `code`.

    An unknown code is named "unknown XID N" and treated as needing a GPU reset: the
    cost of guessing too low is a restart loop on a broken GPU, while holding one engine
    down until an operator looks costs one engine's downtime."""
    name, remedy = _CATALOGUE.get(code, (f"unknown XID {code}", "reset"))
    return Xid(code, name, remedy)


def rule_for(remedy: str) -> str | None:
    """The rule that acts on an XID of `remedy` (an unknown remedy: a reset's, as an
    unknown code is)."""
    return RULE_OF.get(remedy, "xid_reset")

