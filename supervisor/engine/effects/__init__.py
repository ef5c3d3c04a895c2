"""A unit's effects on the world: their protocol (`protocol.py`: `Effects`, which tests
replace with a recording fake) and the daemon's implementation as jobs that report back
only by events (`jobs.py`; those that talk to a running engine over HTTP `http_jobs.py`,
the daemon's own requests to an engine `probes.py`). Nothing here changes a unit's state."""
