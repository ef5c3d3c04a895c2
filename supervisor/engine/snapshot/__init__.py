"""Engines kept as files and brought back as copies (docs/standby.md, "The snapshot route")."""
