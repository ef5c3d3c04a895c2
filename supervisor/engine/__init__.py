"""One engine's unit: the task that owns its lifecycle (`unit.py`), its state and the one
executor of its steps (`unit_state.py`), its events, deciders, watchdog half, commands
and views, here; what it holds in folders: the bays and their roles (`pair/`), one
engine process and its tree (`process/`), what a start is given (`startup/`), and its
effects with the jobs that do them (`effects/`).
"""
