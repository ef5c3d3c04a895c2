"""One engine's unit: its lifecycle state (`unit.py`), events, effects, and the process
tree it spawns and takes down.
"""
