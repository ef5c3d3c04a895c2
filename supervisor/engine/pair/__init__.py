"""The serving engine's bays and the roles in them (docs/standby.md): the pair's states
and their transition tables (`pair_states.py`), the place one engine process lives in
from its spawn to its tree proven gone (`slot.py`), the standby (`standby.py`), the
handover between the serving engine and its standby (`handover.py`, a decider), and the
weight cache beside them (`weight_cache.py`). Called on the unit's task; they act through
the unit's effects and never hold the unit."""
