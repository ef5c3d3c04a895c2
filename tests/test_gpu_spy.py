"""The GPU harness's py-spy summary (`tests/gpu_spy.py`): which processes of an engine it
records, and what it makes of py-spy's raw stacks. The records themselves run on the GPU
machine only (`SPY=1`)."""

from __future__ import annotations

from dataclasses import dataclass, field

from tests import gpu_spy


@dataclass
class Proc:
    pid: int
    title: str
    argv: list[str] = field(default_factory=list)
    gone: bool = False

    def name(self) -> str:
        if self.gone:
            raise ProcessLookupError(self.pid)
        return self.title

    def cmdline(self) -> list[str]:
        return self.argv


def test_the_api_server_and_the_core_are_found_in_a_spawned_and_in_a_copys_tree() -> None:
    serve = ["/venv/bin/python3", "-m", "vllm.entrypoints.cli.main", "serve", "/m8b"]
    spawned = [Proc(10, "python3", serve), Proc(11, "VLLM::EngineCore"),
               Proc(12, "python3", ["python3", "-c", "from multiprocessing..."])]
    assert gpu_spy.targets(spawned) == {"api": 10, "core": 11}
    # a copy: its namespace's init and CRIU above it, a process gone meanwhile
    copy = [Proc(20, "unshare", ["unshare", "--pid", "--fork"]), Proc(21, "criu", ["criu"]),
            Proc(22, "python3", serve, gone=True), Proc(23, "VLLM::APIServer", serve),
            Proc(24, "VLLM::EngineCore")]
    assert gpu_spy.targets(copy) == {"api": 23, "core": 24}
    # the seccomp wrapper's own line, before its exec, is not the API server
    wrapper = ["python3", "/sup/no_io_uring.py", "python3", "-m", "vllm", "serve"]
    assert gpu_spy.targets([Proc(30, "python3", wrapper)]) == {}


def test_raw_stacks_are_summed_by_their_innermost_frames() -> None:
    raw = "\n".join([
        "main (a.py:1);run (b.py:2);step (c.py:3);forward (d.py:4) 30",
        "main (a.py:1);other (b.py:9);step (c.py:3);forward (d.py:4) 10",
        "main (a.py:1);loop (e.py:5);select (f.py:6) 60",
        "not a stack line",
    ])
    out = gpu_spy.summary(raw, top=2, frames=2)
    assert out["samples"] == 100
    assert out["top"] == [{"share": 0.6, "stack": "select (f.py:6) < loop (e.py:5)"},
                          {"share": 0.4, "stack": "forward (d.py:4) < step (c.py:3)"}]
    assert gpu_spy.summary("") == {"samples": 0, "top": []}
