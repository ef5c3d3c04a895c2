"""An engine unit's places (bays), by number.

Each bay holds one process from its spawn to its tree proven gone (`EngineSlot`,
supervisor/engine/pair/slot.py), with its own state file and guard
(supervisor/engine/effects/jobs.py) and, for an engine, its own port
(`EngineConfig.in_bay`). Roles move between the engine bays: the serving engine and its
standby swap places on a failover (supervisor/engine/pair/). The weight cache's process
keeps a bay of its own. A role that needs another engine takes another number here.
"""

from __future__ import annotations

ENGINE_BAYS = (0, 1)  # the serving engine's and its standby's, at the unit's start
WEIGHT_CACHE_BAY = 2  # the `vllm preload` process beside them (`engine.weight_cache`)
BAYS = (*ENGINE_BAYS, WEIGHT_CACHE_BAY)
