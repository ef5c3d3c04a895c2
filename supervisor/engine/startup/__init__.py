"""What an engine's start is given and what it is expected to take: the compile cache
kept across restarts (`compile_cache.py`), the folders each start gets (`start_dirs.py`),
and how long starts took before (`start_times.py`)."""
