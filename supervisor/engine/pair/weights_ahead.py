"""A sleeping standby's weights on the card ahead of a fault (`engine.standby_weights =
"gpu"`, docs/standby.md "Its weights on the card ahead of a fault").

A failover to a sleeping standby wakes its weights (copied back from host memory: 0.8-0.9
s for 8B beside a dying engine on an H200) and its KV cache (mapped: 0.26 s). Where the
card has room for the weights beside the serving engine, they can be woken long before
any fault: vLLM 0.26 and later wake by tag and stay asleep until the rest is back, so the
standby keeps sleeping, its weights on the card, and a failover wakes only the KV cache.

The room is NVML's: the last settled reading of the card (taken while the serving engine
served with all its memory, none being released, since the standby became ready:
`PairFacts.card_free_bytes`) must leave the weights and `AHEAD_MARGIN_BYTES` free. The
card's spare memory is then the standby's: if a later reading leaves less than
`FLOOR_BYTES` free (the serving engine grew past its share), or the daemon is about to
start an engine beside it, the standby is taken down (vLLM cannot put woken weights back
to sleep: its allocator's sleep unmaps every allocation again), a new one starts with its
weights on the host, and none is woken ahead again until the serving engine's next cold
start. A wake that fails takes the standby down the same way.

A decider over the standby (its `weights`: None, "asked", "back"; `weights_off`, why none
is woken ahead until the next cold start; `why_not`, what status says): the handover
(`supervisor/engine/pair/handover.py`) calls it at each tick and with each answer, and
carries its steps out.
"""

from __future__ import annotations

import structlog

from supervisor.engine import steps as do
from supervisor.engine.events import HostCacheEmptied, Woken
from supervisor.engine.pair.standby import Standby
from supervisor.engine.process import host_cache
from supervisor.engine.states import State
from supervisor.engine.steps import PairFacts
from supervisor.watchdog.remedy import WEIGHTS

log = structlog.get_logger("supervisor")

GIB = 2**30
# what the standby's weights leave free on each GPU at the least, for them to be woken
# ahead beside a serving engine: the early wake's margin. (A serving engine's memory is
# taken at its start, its allocations past its share included: ~0.75 GiB on the H200.
# A woken copy that serves holds a little more than a fresh engine, and 2 GiB kept the
# weights of a copy re-armed after a failover at 0.85 off the card: docs/standby.md.)
AHEAD_MARGIN_BYTES = GIB
# below this free on a GPU with the weights there, they are taken back (the standby down)
FLOOR_BYTES = GIB // 2


def steps(standby: Standby, f: PairFacts, idle: bool) -> list[do.Step]:
    """At a tick: the ready sleeping standby's weights woken ahead where the card has room
    for them (`idle`: no handover under way), or taken back where it no longer has."""
    e = standby.slot.engine
    if e is None or not standby.ready or not standby.asleep or standby.slot.taking_down:
        return []
    if standby.weights == "back":
        why = _why_back(f, idle)
        return _take_back(standby, f, why) if why is not None else []
    if (f.config.engine.standby_weights != "gpu" or standby.weights is not None
            or f.thin_pair or why_not(standby, f, idle) is not None):
        return []
    standby.weights = "asked"
    log.info("standby's weights woken onto the card ahead of a fault", pid=e.pid,
             weights_bytes=e.weights_bytes, free_bytes=f.card_free_bytes)
    return [do.Wake(e, WEIGHTS)]


def why_not(standby: Standby, f: PairFacts, idle: bool) -> str | None:
    """With `standby_weights = "gpu"`: why the ready sleeping standby's weights are not on
    the card now, nor on their way (`status`'s `standby.weights_off`); None when they are,
    when they go at the next tick, or where the setting or the standby says nothing."""
    e = standby.slot.engine
    if f.config.engine.standby_weights != "gpu":
        return None
    if standby.weights_off is not None:  # (until the next cold start, whatever standby)
        return standby.weights_off
    if e is None or not standby.ready or not standby.asleep or standby.weights is not None:
        return None
    if e.weights_bytes is None:
        return "their size is not known yet (the standby's sleep says it)"
    free = f.card_free_bytes
    if free is None:
        return ("no settled reading of the card yet (NVML, taken with the engine serving "
                "since the standby became ready)")
    if free < e.weights_bytes + AHEAD_MARGIN_BYTES:
        return (f"the card leaves {free / GIB:.2f} GiB free; they need "
                f"{e.weights_bytes / GIB:.2f} GiB and {AHEAD_MARGIN_BYTES / GIB:g} GiB more")
    if not idle or f.state is not State.RUNNING:
        return "a handover or a start is under way"
    return None


def _why_back(f: PairFacts, idle: bool) -> str | None:
    """Why weights on the card must go back (None: they stay)."""
    if f.config.engine.standby_weights != "gpu":
        return 'engine.standby_weights is no longer "gpu"'
    if f.card_free_bytes is not None and f.card_free_bytes < FLOOR_BYTES:
        return (f"they left {f.card_free_bytes / GIB:.2f} GiB free on the card, under "
                f"{FLOOR_BYTES / GIB:g} GiB: the serving engine needs the room")
    if idle and f.state in (State.STARTING, State.BACKOFF):
        return "an engine starts beside the standby: its start needs the card's room"
    return None


def _take_back(standby: Standby, f: PairFacts, why: str) -> list[do.Step]:
    """The standby down (its woken weights cannot sleep again), and none woken ahead
    again until the serving engine's next cold start (unless the setting changed)."""
    e = standby.slot.engine
    if f.config.engine.standby_weights == "gpu":
        standby.weights_off = why
    log.warning("standby's weights taken off the card: the standby is replaced", why=why,
                pid=e.pid if e is not None else None)
    audit = do.Audit("standby_weights_taken_back",
                     {"why": why, "pid": e.pid if e is not None else None})
    return [audit, *standby.retire(f"its weights on the card: {why}", graceful=False,
                                   deadline=f.standby_deadline())]


def woken(standby: Standby, f: PairFacts, ev: Woken) -> list[do.Step]:
    """The answer of the wake of a ready standby's weights ahead of a fault."""
    e = standby.slot.current(ev.generation)
    if e is None or standby.weights != "asked" or standby.slot.taking_down:
        return []  # (stale: the standby went meanwhile)
    if ev.error is not None:
        standby.weights, standby.weights_off = None, f"their wake failed: {ev.error}"
        log.warning("standby's weights not woken ahead: the standby is replaced",
                    pid=e.pid, error=ev.error)
        # (a failed wake can leave an engine wedged: a new standby, its weights on the host)
        return [do.Audit("standby_weights_not_woken", {"pid": e.pid, "error": ev.error}),
                *standby.retire(f"the wake of its weights failed: {ev.error}",
                                graceful=False, deadline=f.standby_deadline())]
    standby.weights = "back"
    fields = {"pid": e.pid, "seconds": round(ev.seconds, 3), "vllm_s": ev.vllm_s,
              "weights_bytes": e.weights_bytes}
    log.info("standby's weights on the card: a failover wakes only its KV cache", **fields)
    out: list[do.Step] = [do.Audit("standby_weights_on_card", fields)]
    # their backup stays in torch's pinned host cache, which the engine's death would
    # unpin before the card's memory comes back: emptied now, while it serves nobody
    standby.host_cache = host_cache.why_not(e.spec.argv) or "asked"
    if standby.host_cache == "asked":
        out.append(do.EmptyHostCache(e))
    return out


def host_cache_emptied(standby: Standby, ev: HostCacheEmptied) -> list[do.Step]:
    """The answer of the standby's pinned host cache emptied (`woken` asked it)."""
    e = standby.slot.current(ev.generation)
    if e is None or standby.host_cache != "asked":
        return []  # (stale: the standby went, or took over, meanwhile)
    fields = {"pid": e.pid, "seconds": round(ev.seconds, 3), "worker_s": ev.worker_s}
    if not ev.emptied:
        standby.host_cache = f"kept: {ev.error}"
        log.warning("standby's pinned host cache not emptied: its death gives the card "
                    "back later", error=ev.error, **fields)
        return [do.Audit("standby_host_cache_kept", {**fields, "error": ev.error})]
    standby.host_cache = "emptied"
    log.info("standby's pinned host cache emptied: its death gives the card back at once",
             **fields)
    return [do.Audit("standby_host_cache_emptied", fields)]
