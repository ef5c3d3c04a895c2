"""The layers of `supervisor/` (docs/architecture.md), read from the source itself: the
import graph, `TYPE_CHECKING` imports included, has no cycle, and no module imports one
of a higher layer."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "supervisor"

# lowest first; a module may import its own layer's modules and those below
LAYERS: list[tuple[str, tuple[str, ...]]] = [
    # the settings folder but its generic table checking, which the foundations use
    ("foundations", ("loop", "ops", "front", "plane", "watchdog", "fleet",
                     "control.protocol", "control.client", "settings.schema")),
    ("settings", ("settings",)),
    # the unit and its folders (pair, process, startup, effects): one layer
    ("engine unit", ("engine",)),
    ("host", ("host", "control.handlers", "control.server", "control.cli")),
    ("command line", ("cli", "__main__", "__init__")),
]


def module_name(path: Path) -> str:
    rel = path.relative_to(PACKAGE).with_suffix("")
    parts = rel.parts[:-1] if rel.name == "__init__" and len(rel.parts) > 1 else rel.parts
    return ".".join(parts)


def imports_of(path: Path, modules: set[str]) -> set[str]:
    """The project modules `path` imports, wherever the import statement is."""
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        names: list[str] = []
        if isinstance(node, ast.ImportFrom) and node.module \
                and node.module.split(".")[0] == "supervisor":
            base = node.module.removeprefix("supervisor").lstrip(".")
            for alias in node.names:
                full = f"{base}.{alias.name}" if base else alias.name
                names.append(full if full in modules else base)
        elif isinstance(node, ast.Import):
            names = [a.name.removeprefix("supervisor").lstrip(".") for a in node.names
                     if a.name.split(".")[0] == "supervisor"]
        out.update(n for n in names if n in modules)
    return out


def graph() -> dict[str, set[str]]:
    files = {module_name(p): p for p in PACKAGE.rglob("*.py")}
    modules = set(files)
    return {m: imports_of(p, modules) - {m} for m, p in files.items()}


def layer_of(module: str) -> int:
    best: tuple[int, int] | None = None  # (prefix length, layer): the longest prefix wins
    for i, (_, prefixes) in enumerate(LAYERS):
        for prefix in prefixes:
            matches = module == prefix or module.startswith(prefix + ".")
            if matches and (best is None or len(prefix) > best[0]):
                best = (len(prefix), i)
    if best is None:
        raise AssertionError(f"module supervisor.{module} is in no layer: add it to LAYERS "
                             "and to docs/architecture.md")
    return best[1]


def find_cycle(g: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}  # 1: on the path, 2: done
    path: list[str] = []

    def visit(m: str) -> list[str] | None:
        state[m] = 1
        path.append(m)
        for d in sorted(g.get(m, ())):
            if state.get(d) == 1:
                return [*path[path.index(d):], d]
            if d not in state and (found := visit(d)) is not None:
                return found
        path.pop()
        state[m] = 2
        return None

    for m in sorted(g):
        if m not in state and (found := visit(m)) is not None:
            return found
    return None


def test_the_import_graph_has_no_cycle() -> None:
    cycle = find_cycle(graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])


def test_no_module_imports_a_higher_layer() -> None:
    upward = [f"supervisor.{m} ({LAYERS[layer_of(m)][0]}) imports supervisor.{d} "
              f"({LAYERS[layer_of(d)][0]})"
              for m, deps in sorted(graph().items()) for d in sorted(deps)
              if layer_of(d) > layer_of(m)]
    assert not upward, "\n".join(upward)


def test_the_checks_see_a_cycle_and_an_upward_import() -> None:
    """The checks themselves: a made-up graph with both faults is caught."""
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None
    assert layer_of("engine.unit") > layer_of("settings.config") > layer_of("watchdog.policy")
    assert layer_of("settings.schema") == layer_of("front.deadlines")
    assert layer_of("engine.pair.handover") == layer_of("engine.unit") \
        == layer_of("engine.process.proctree")
    with pytest.raises(AssertionError, match="in no layer"):
        layer_of("nowhere")


def test_type_checking_imports_count(tmp_path: Path) -> None:
    src = tmp_path / "m.py"
    src.write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                   "    from supervisor.host import Host\n")
    assert imports_of(src, {"host"}) == {"host"}


def test_no_module_outside_the_unit_touches_its_private_members() -> None:
    """The unit owns its state: other modules use its public members only."""
    reaches = []
    for path in PACKAGE.rglob("*.py"):
        if path.name == "unit.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if (isinstance(node, ast.Attribute) and node.attr.startswith("_")
                    and not node.attr.startswith("__")
                    and isinstance(node.value, ast.Name)
                    and node.value.id in ("unit", "sup", "u")):
                reaches.append(f"{module_name(path)}:{node.lineno} {node.value.id}.{node.attr}")
    assert not reaches, "\n".join(reaches)
