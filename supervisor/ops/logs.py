"""Logging: structlog configured once, in main(), after its production recipe.

JSON lines on stdout by default (journald collects them), a console renderer only on a
TTY; standard-library records (httpx, asyncio) routed through the same processors so
every line has the same shape. Nothing else in the project configures logging.
"""

from __future__ import annotations

import logging
import sys
from typing import Any

import structlog

_LEVELS = {"debug": logging.DEBUG, "info": logging.INFO, "warning": logging.WARNING,
           "error": logging.ERROR}


def configure_logging(level: str = "info", fmt: str = "auto") -> None:
    console = fmt == "console" or (fmt == "auto" and sys.stdout.isatty())
    shared: list[Any] = [
        structlog.contextvars.merge_contextvars,
        structlog.stdlib.add_log_level,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
    ]
    renderer: Any = (structlog.dev.ConsoleRenderer() if console
                     else structlog.processors.JSONRenderer())
    structlog.configure(
        processors=[*shared, structlog.stdlib.ProcessorFormatter.wrap_for_formatter],
        logger_factory=structlog.stdlib.LoggerFactory(),
        wrapper_class=structlog.stdlib.BoundLogger,
        cache_logger_on_first_use=True,
    )
    formatter = structlog.stdlib.ProcessorFormatter(
        foreign_pre_chain=[*shared, structlog.stdlib.ExtraAdder()],
        processors=[
            structlog.stdlib.ProcessorFormatter.remove_processors_meta,
            structlog.processors.dict_tracebacks if not console else _drop_empty,
            renderer,
        ],
    )
    handler = logging.StreamHandler(sys.stdout)
    handler.setFormatter(formatter)
    root = logging.getLogger()
    root.handlers[:] = [handler]
    set_level(level)
    # httpx logs every request at INFO; the health probe would flood the journal.
    logging.getLogger("httpx").setLevel(logging.WARNING)
    logging.getLogger("httpcore").setLevel(logging.WARNING)


def set_level(level: str) -> None:
    logging.getLogger().setLevel(_LEVELS[level])


def _drop_empty(_: Any, __: str, event: Any) -> Any:
    """On the console, a field with no value (None, "") is noise: drop it. The JSON
    lines keep every field, so that their shape stays the same for jq."""
    if isinstance(event, dict):
        return {k: v for k, v in event.items() if v is not None and v != ""}
    return event
