"""Which engine a request goes to, by its `model` field: pure decisions over a snapshot of
the engines as the front door sees them.

- A model no engine serves is refused at once (404, with the models there are), never
  held for a restart that cannot help.
- Among the engines serving the model now, the one with the fewest requests outstanding
  takes it (the first in config order on a tie).
- While none of them serves, the first of them (in config order) whose `fallback` engine
  serves sends it there, under the fallback's own model name.
- Otherwise the request is held until an engine of its model serves.

Today the daemon runs one engine, so the proxy asks only whether a model is served;
several engines and their fallbacks use the same function (issue 11).

Pure: no I/O, no clock.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class BackendView:
    """One engine as the router sees it at one moment."""

    name: str
    models: tuple[str, ...]  # the names it serves (its --served-model-name, else --model)
    serving: bool  # running, and its gate lets requests through
    outstanding: int = 0  # requests the proxy has at it now
    fallback: str | None = None  # the engine that takes its models' requests while down


@dataclass(frozen=True)
class Route:
    """Where a request goes: `engine` None means hold it (no engine of its model serves
    now); `model` is the name to send, the fallback's own when `substituted`."""

    engine: str | None
    model: str
    substituted: bool = False


class UnknownModel(Exception):
    """No engine serves this model; `models` are the names there are."""

    def __init__(self, model: object, models: Sequence[str]) -> None:
        shown = model if isinstance(model, str) else repr(model)
        super().__init__(f"the model `{shown[:200]}` does not exist here; models: "
                         + ", ".join(models))
        self.models = tuple(models)


def served_models(engines: Sequence[BackendView]) -> list[str]:
    """Every model name served by some engine, each once, in config order."""
    return list(dict.fromkeys(m for e in engines for m in e.models))


def route(model: object, engines: Sequence[BackendView]) -> Route:
    """The engine for a request naming `model`; raises UnknownModel when none serves it."""
    if not isinstance(model, str):
        raise UnknownModel(model, served_models(engines))
    own = [e for e in engines if model in e.models]
    if not own:
        raise UnknownModel(model, served_models(engines))
    live = [e for e in own if e.serving]
    if live:
        best = min(live, key=lambda e: e.outstanding)  # min keeps the first on a tie
        return Route(best.name, model)
    by_name = {e.name: e for e in engines}
    for e in own:
        fb = by_name.get(e.fallback) if e.fallback is not None else None
        if fb is not None and fb.serving and fb.models:
            return Route(fb.name, fb.models[0], substituted=True)
    return Route(None, model)
