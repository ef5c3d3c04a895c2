"""Logging: structlog configured once, in main(), after its production recipe.

JSON lines on stdout by default (journald collects them), a console renderer only on a
TTY; standard-library records (httpx, asyncio) routed through the same processors so
every line has the same shape. Nothing else in the project configures logging.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import logging
import sys
from typing import Any

import structlog
import structlog.tracebacks

_LEVELS = {"debug": logging.DEBUG, "info": logging.INFO, "warning": logging.WARNING,
           "error": logging.ERROR}


# For lines written once per request (the proxy's access line), set by configure_logging
# for JSON lines: the line structlog's processors would render (`_render_json`), written
# to the handler's stream under the handler's lock, without the standard library's
# record and formatter in between (the same bytes, at about a tenth of the CPU).
_direct: Any = None
_handler: logging.StreamHandler[Any] | None = None
_processors: list[Any] = []  # what configure_logging gave structlog: still in force?


def configure_logging(level: str = "info", fmt: str = "auto") -> None:
    global _direct, _handler, _processors
    console = fmt == "console" or (fmt == "auto" and sys.stdout.isatty())
    shared: list[Any] = [
        structlog.contextvars.merge_contextvars,
        structlog.stdlib.add_log_level,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
    ]
    # Tracebacks without their frames' locals (structlog shows them by default): a
    # local may hold a client's request body, its prompt or its credentials.
    renderer: Any = (structlog.dev.ConsoleRenderer(
        exception_formatter=structlog.dev.plain_traceback) if console
        else structlog.processors.JSONRenderer())
    _processors = [*shared, structlog.stdlib.ProcessorFormatter.wrap_for_formatter]
    structlog.configure(
        processors=_processors,
        logger_factory=structlog.stdlib.LoggerFactory(),
        wrapper_class=structlog.stdlib.BoundLogger,
        cache_logger_on_first_use=True,
    )
    formatter = structlog.stdlib.ProcessorFormatter(
        foreign_pre_chain=[*shared, structlog.stdlib.ExtraAdder()],
        processors=[
            structlog.stdlib.ProcessorFormatter.remove_processors_meta,
            _TRACEBACKS if not console else _drop_empty,
            renderer,
        ],
    )
    handler = logging.StreamHandler(sys.stdout)
    handler.setFormatter(formatter)
    root = logging.getLogger()
    root.handlers[:] = [handler]
    # (the processors above and the formatter's, in their order: the same bytes)
    _handler = handler
    _direct = None if console else _render_json
    set_level(level)
    # httpx logs every request at INFO; the health probe would flood the journal.
    logging.getLogger("httpx").setLevel(logging.WARNING)
    logging.getLogger("httpcore").setLevel(logging.WARNING)


_TRACEBACKS = structlog.processors.ExceptionRenderer(
    structlog.tracebacks.ExceptionDictTransformer(show_locals=False))


def set_level(level: str) -> None:
    logging.getLogger().setLevel(_LEVELS[level])


def _drop_empty(_: Any, __: str, event: Any) -> Any:
    """On the console, a field with no value (None, "") is noise: drop it. The JSON
    lines keep every field, so that their shape stays the same for jq."""
    if isinstance(event, dict):
        return {k: v for k, v in event.items() if v is not None and v != ""}
    return event


class RequestLog:
    """A logger for the lines written once per request (the proxy's access line): with
    JSON lines configured, they go straight to stdout as structlog renders them, the
    bytes the standard library's path would write, filtered by the same level
    (`set_level`); otherwise (the console, a test capturing logs, before
    configure_logging) through structlog as every other line."""

    def __init__(self, name: str) -> None:
        self._std = logging.getLogger(name)
        self._log = structlog.get_logger(name)

    def enabled(self) -> bool:
        """Whether an info line would be written (False: the caller need not build its
        fields). True wherever it cannot tell cheaply."""
        if _direct is None or _handler is None or not _still_configured():
            return True
        return self._std.isEnabledFor(logging.INFO)

    def info(self, event: str, **fields: Any) -> None:
        direct, handler = _direct, _handler
        if direct is None or handler is None or "exc_info" in fields \
                or not _still_configured():
            self._log.info(event, **fields)
            return
        if not self._std.isEnabledFor(logging.INFO):
            return
        line = direct(event, fields) + handler.terminator
        try:
            with handler.lock or contextlib.nullcontext():
                handler.stream.write(line)
                handler.stream.flush()
        except (OSError, ValueError):  # stdout gone: as the standard library handles it
            self._log.info(event, **fields)


def _fallback(obj: Any) -> Any:
    """What structlog's JSONRenderer writes for a value JSON has no form for."""
    try:
        return obj.__structlog__()
    except AttributeError:
        return repr(obj)


_encode = json.JSONEncoder(default=_fallback).encode  # (json.dumps(default=...), kept)


def _render_json(event: str, fields: dict[str, Any]) -> str:
    """One info line as configure_logging's JSON processors render it, in their order:
    the fields, the event, the bound context variables, the level, the time."""
    fields["event"] = event
    structlog.contextvars.merge_contextvars(None, "info", fields)
    fields["level"] = "info"
    fields["timestamp"] = datetime.datetime.now(tz=datetime.UTC).isoformat().replace(
        "+00:00", "Z")
    return _encode(fields)


def _still_configured() -> bool:
    """structlog still has configure_logging's processors (a test's capture_logs puts
    its own in the same list, ending with its LogCapture)."""
    procs = structlog.get_config()["processors"]
    return (procs is _processors and bool(procs)
            and procs[-1] is structlog.stdlib.ProcessorFormatter.wrap_for_formatter)
