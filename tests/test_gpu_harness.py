"""The GPU harness's parts (`tests/gpu_vllm.py` and the modules it is made of) load as the
GPU machine runs them: as scripts, from the checkout, with the supervisor taken from an
installed site when there is one. Their phases run on the GPU machine only; this is what
CI can hold them to (a split or a renamed helper that breaks an import is found here, not
after a staging on the lent machine)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SCRIPTS = ("gpu_vllm", "gpu_host", "gpu_cold", "gpu_plane")


def _run(args: list[str], tmp_path: Path) -> subprocess.CompletedProcess[str]:
    # (an empty site: the checkout's supervisor is the one imported, as on a machine
    # where the wheel was not installed; WORK apart from any real run's)
    env = {"PATH": "/usr/bin:/bin", "SUP_SITE": str(tmp_path / "site"),
           "WORK": str(tmp_path / "work"), "HOME": str(tmp_path)}
    return subprocess.run([sys.executable, *args], capture_output=True, text=True,
                          cwd=str(tmp_path), env=env, timeout=120)


def test_each_harness_script_imports_as_the_gpu_machine_runs_it(tmp_path: Path) -> None:
    code = (f"import sys; sys.path.insert(0, {str(ROOT)!r})\n"
            + "".join(f"import tests.{m}\n" for m in SCRIPTS)
            + "import supervisor; print(supervisor.__file__)")
    r = _run(["-c", code], tmp_path)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == str(ROOT / "supervisor" / "__init__.py")


def test_an_unknown_phase_is_refused_with_the_list_of_phases(tmp_path: Path) -> None:
    r = _run([str(ROOT / "tests" / "gpu_vllm.py"), "kv-rest"], tmp_path)
    assert r.returncode == 1
    assert "unknown phase ['kv-rest']: one of continue," in r.stderr
    assert "kv-reset" in r.stderr.splitlines()[-1]
    assert "python3 tests/gpu_vllm.py start" in r.stderr  # (the usage, from the docstring)
    assert not (tmp_path / "work").exists()  # nothing started
