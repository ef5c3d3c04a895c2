"""One engine process and its tree: spawning it and relaying its output (`process.py`),
taking it down within its deadline and what a start checks first (`takedown.py`),
finding, killing and proving gone its process tree (`proctree.py`), the death of its core
the moment it happens (`corewatch.py`), vLLM's own log lines parsed (`enginelog.py`), and
the shared-memory files its tree leaves (`shm_files.py`), the folder of the KV tier its
pair shares (`kv_tier.py`). Effects and pure parsing only:
nothing here decides or holds a unit's state."""
