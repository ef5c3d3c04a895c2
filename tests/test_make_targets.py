"""`make test-fast` sets up every tool that the tests it runs need: on a fresh clone it
ran tests/test_fleet.py without vLLM's router (`scripts/setup.sh router`), and failed."""

from __future__ import annotations

import re

from tests.harness import ROOT

# a test's path to a tool: ROOT / ".tools" / "vllm-router"
TOOL = re.compile(r'"\.tools" / "([\w.-]+)"')
# scripts/setup.sh's function for a part, and the folder under .tools it installs into
SETUP = re.compile(r"^setup_(\w+)\(\) \{\n\s*local dest=\.tools/([\w.-]+)", re.MULTILINE)


def recipe(target: str) -> list[str]:
    """The commands of a Makefile target, as written."""
    lines = (ROOT / "Makefile").read_text().splitlines()
    start = lines.index(f"{target}:")
    steps = []
    for line in lines[start + 1:]:
        if not line.startswith("\t"):
            break
        steps.append(line.strip())
    return steps


def tools_of_the_tests_without_the_engine() -> dict[str, list[str]]:
    """Each folder under .tools that a test `-m "not e2e"` selects reaches for, with the
    files that name it (tests/harness.py counts for every test: all of them import it)."""
    needed: dict[str, list[str]] = {}
    for path in sorted((ROOT / "tests").glob("*.py")):
        text = path.read_text()
        if "pytestmark = pytest.mark.e2e" in text:
            continue
        for tool in TOOL.findall(text):
            needed.setdefault(tool, []).append(path.name)
    return needed


def test_test_fast_sets_up_every_tool_that_its_tests_need() -> None:
    setup = (ROOT / "scripts" / "setup.sh").read_text()
    part_of = {folder: part for part, folder in SETUP.findall(setup)}
    assert part_of == {"prometheus": "prometheus", "vllm-router": "router", "criu": "criu"}, \
        part_of
    needed = tools_of_the_tests_without_the_engine()
    assert set(needed) == {"prometheus", "vllm-router", "criu"}, needed  # (it sees them)
    steps = recipe("test-fast")
    missing = {tool: users for tool, users in needed.items()
               if f"bash scripts/setup.sh {part_of[tool]}" not in steps}
    assert missing == {}, f"make test-fast runs {steps}"
    # the tools before the tests
    run = next(i for i, s in enumerate(steps) if "pytest" in s)
    assert all(steps.index(f"bash scripts/setup.sh {part_of[t]}") < run for t in needed)
