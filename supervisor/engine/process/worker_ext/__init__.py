"""Code that runs inside a vLLM engine's worker, not in the daemon: this folder is put on
the engine's PYTHONPATH (`supervisor/engine/process/host_cache.py`), so it holds nothing
but the module named there, which imports nothing of the daemon's."""
