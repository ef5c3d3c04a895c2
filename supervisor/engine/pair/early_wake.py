"""Whether a failover wakes a sleeping standby's weights at once, beside the old engine
whose memory is still being released (docs/standby.md, "Its weights wake while the old
engine's memory is released"). Pure: it reads the unit's facts and the standby; the
handover (`supervisor/engine/pair/handover.py`) asks it and owns what follows."""

from __future__ import annotations

from supervisor.engine.pair.standby import Standby
from supervisor.engine.process import process as eng
from supervisor.engine.steps import PairFacts
from supervisor.settings import engine_checks

# what a sleeping standby's weights leave free on a GPU at the least, for them to be woken
# while the old engine's memory is still being released (a wake that runs out of memory
# fails, and can leave the engine wedged)
EARLY_WAKE_MARGIN_BYTES = 2**30


def weights_fit(f: PairFacts, engine: eng.EngineProcess) -> bool:
    """A sleeping standby's weights fit on the card beside the old engine, before its
    memory is released: NVML's last settled reading (`PairFacts.card_free_bytes`) leaves
    them room on every GPU, with `EARLY_WAKE_MARGIN_BYTES` to spare (an engine that has
    not slept says nothing of its weights: no)."""
    need = engine.weights_bytes
    return (need is not None and f.card_free_bytes is not None
            and f.card_free_bytes >= need + EARLY_WAKE_MARGIN_BYTES)


def armed(standby: Standby, f: PairFacts) -> bool | None:
    """`status`'s `standby.early_wake`: whether a failover now would wake the ready
    standby's weights at once (`weights_fit`); None where a failover would not wait for
    the old engine's memory (an awake standby, room beside) or no standby is ready."""
    e = standby.slot.engine
    if not standby.ready or e is None or not standby.asleep or standby.weights is not None \
            or engine_checks.side_by_side(f.config.engine):
        return None  # (its weights on the card, or on their way: nothing to wake early)
    return weights_fit(f, e)
