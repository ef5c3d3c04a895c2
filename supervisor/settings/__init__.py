"""The operator's configuration, in one place: the TOML file's sections with their
defaults and bounds (`sections.py`), checking a table against its declaration
(`schema.py`), loading the file into one `Config` (`config.py`), the rules across keys
and sections (`checks.py`; those that read an engine's vLLM arguments in
`engine_checks.py` and `weight_cache_argv.py`), and when each reloaded key takes effect
(`reload.py`). It says what the settings are and whether they hold; it never starts,
stops or changes a running part (the engine units and the host apply a reload). This
file imports nothing, so the foundations may use `schema.py` without loading the rest.
"""
