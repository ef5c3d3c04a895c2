"""A woken standby's pinned host cache emptied (supervisor/engine/process/host_cache.py,
docs/standby.md "Its weights on the card ahead of a fault"): every engine that can sleep
gets the daemon's worker extension and its folder on PYTHONPATH (unless it names its own);
once a standby's weights are on the card ahead of a fault, the daemon asks its workers,
through `/collective_rpc`, to empty torch's pinned host cache, so that its death later
gives the card back at once. The argv and environment; the worker's method in a real
interpreter (with a stand-in torch); the HTTP call's answers; the decider over the
recording effects. The real vLLM loads the extension in tests/test_e2e_standby.py."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from supervisor.engine.events import Exited, HostCacheEmptied
from supervisor.engine.process import host_cache
from supervisor.engine.process.process import build_spawn_spec
from supervisor.settings.config import parse_config
from tests.test_early_wake import audited
from tests.test_weights_ahead import asked_ahead, gpu_world, on_card

SLEEPY = ["vllm", "serve", "m", "--enable-sleep-mode"]


def test_an_engine_that_can_sleep_gets_the_extension_and_its_folder_last_on_its_path(
        ) -> None:
    argv, env = host_cache.argv_env(SLEEPY, {"PYTHONPATH": "/opt/mine"})
    assert argv == ["--worker-extension-cls", "vllm_supervisor_worker.HostCache"]
    assert env == {"PYTHONPATH": f"/opt/mine:{host_cache.FOLDER}"}  # (the operator's first)
    assert host_cache.argv_env(SLEEPY, {})[1] == {"PYTHONPATH": host_cache.FOLDER}
    # already there (a restart of the same environment): not twice
    assert host_cache.argv_env(SLEEPY, {"PYTHONPATH": host_cache.FOLDER})[1] == {}
    assert host_cache.why_not([*SLEEPY, *argv]) is None
    # the folder holds the module and nothing a Python path could trip over
    assert sorted(p.name for p in Path(host_cache.FOLDER).glob("*.py")) == [
        "__init__.py", "vllm_supervisor_worker.py"]


@pytest.mark.parametrize(("argv", "why"), [
    (["vllm", "serve", "m"], "it cannot sleep"),
    ([*SLEEPY, "--worker-extension-cls", "mine.Ext"], "a worker extension of their own"),
    ([*SLEEPY, "--worker_extension_cls=mine.Ext"], "a worker extension of their own"),
])
def test_no_extension_where_it_cannot_sleep_or_names_its_own(argv: list[str],
                                                             why: str) -> None:
    assert host_cache.argv_env(argv, {}) == ([], {})
    said = host_cache.why_not(argv)
    assert said is not None and why in said


@pytest.mark.parametrize("weights", ["gpu", "host"])
def test_the_spawn_spec_of_an_engine_that_can_sleep_carries_it_whatever_standby_weights(
        tmp_path: Path, weights: str) -> None:
    """Whatever `standby_weights` says (a reload of it changes nothing that runs), and
    the same each time it is built (a standby built again still `fits`)."""
    cfg = parse_config({"engine": {"command": ["vllm", "serve", "m"],
                                   "args": ["--enable-sleep-mode"], "standby": "sleep",
                                   "standby_weights": weights,
                                   "env": {"VLLM_SERVER_DEV_MODE": "1"}},
                        "daemon": {"runtime_dir": str(tmp_path)}}, "t.toml", tmp_path)
    spec = build_spawn_spec(cfg.engine, {"PYTHONPATH": "/opt/mine", "PATH": "/usr/bin"})
    i = spec.argv.index("--worker-extension-cls")
    assert spec.argv[i + 1] == host_cache.EXTENSION
    assert spec.env["PYTHONPATH"] == f"/opt/mine:{host_cache.FOLDER}"
    again = build_spawn_spec(cfg.engine, {"PYTHONPATH": "/opt/mine", "PATH": "/usr/bin"})
    assert again == spec


TORCH = {"with": "class _C:\n    @staticmethod\n    def _host_emptyCache():\n"
                 "        open(__import__('os').environ['EMPTIED'], 'w').write('1')\n"
                 "__version__ = '2.11.0+cu130'\n",
         "without": "class _C:\n    pass\n__version__ = '2.13.0+cpu'\n"}


@pytest.mark.parametrize("torch", ["with", "without"])
def test_the_workers_method_empties_the_cache_where_torch_has_one(
        tmp_path: Path, torch: str) -> None:
    """In an interpreter of its own, as the engine's worker imports it: the module from
    the folder put on the path, a stand-in torch beside it."""
    (tmp_path / "torch.py").write_text(TORCH[torch])
    mark = tmp_path / "emptied"
    out = subprocess.run(
        [sys.executable, "-c", "import json, vllm_supervisor_worker as m; "
         "print(json.dumps(m.HostCache().vs_empty_host_cache()))"],
        env={"PYTHONPATH": f"{tmp_path}:{host_cache.FOLDER}", "EMPTIED": str(mark)},
        capture_output=True, text=True, timeout=60, check=True)
    got = json.loads(out.stdout)
    if torch == "with":
        assert got["emptied"] is True and got["seconds"] >= 0 and mark.exists()
    else:
        assert got == {"emptied": False, "why": "torch 2.13.0+cpu has no pinned host cache "
                       "to empty (torch._C._host_emptyCache)"} and not mark.exists()


def ask(handler: object) -> host_cache.Emptied:
    async def run() -> host_cache.Emptied:
        transport = httpx.MockTransport(handler)  # type: ignore[arg-type]
        async with httpx.AsyncClient(transport=transport) as client:
            return await host_cache.empty(client, "http://127.0.0.1:1", 5.0)
    return asyncio.run(run())


def test_every_workers_answer_is_read_and_one_that_did_not_empty_says_why() -> None:
    asked: list[dict[str, object]] = []

    def two_workers(request: httpx.Request) -> httpx.Response:
        asked.append({"path": request.url.path, **json.loads(request.content)})
        return httpx.Response(200, json={"results": [
            {"emptied": True, "seconds": 0.4}, {"emptied": True, "seconds": 0.7}]})

    got = ask(two_workers)
    assert got.emptied and got.worker_s == 0.7 and got.error is None
    assert asked == [{"path": "/collective_rpc", "method": "vs_empty_host_cache",
                      "timeout": 5.0}]
    one_not = ask(lambda r: httpx.Response(200, json={"results": [
        {"emptied": True, "seconds": 0.4}, {"emptied": False, "why": "no cache"}]}))
    assert not one_not.emptied and one_not.error == "no cache"


@pytest.mark.parametrize(("answer", "said"), [
    (httpx.Response(404, json={"detail": "Not Found"}), "HTTP 404"),
    (httpx.Response(200, text="<html>"), "unexpected answer"),
    (httpx.Response(200, json={"results": []}), "unexpected answer"),
    (httpx.Response(200, json={"results": ["x"]}), "unexpected answer"),
    (httpx.Response(500, text="AttributeError: no method"), "HTTP 500"),
])
def test_an_engine_without_the_route_or_the_method_or_a_garbled_answer_is_no_emptying(
        answer: httpx.Response, said: str) -> None:
    got = ask(lambda r: answer)
    assert not got.emptied and got.error is not None and said in got.error


# ---- the decider ----------------------------------------------------------------------------

def test_a_standby_whose_weights_went_ahead_has_its_cache_emptied_and_status_says_so(
        tmp_path: Path) -> None:
    w = gpu_world(tmp_path)
    try:
        _, spare = on_card(w)
        assert w.fx.last("empty_host_cache") == {"pid": spare.pid}
        assert w.sup.status()["standby"]["host_cache"] == "asked"
        w.feed(HostCacheEmptied(spare.generation, True, 0.52, 0.5))
        assert w.sup.status()["standby"]["host_cache"] == "emptied"
        done = audited(tmp_path, "standby_host_cache_emptied")[-1]
        assert (done["pid"], done["worker_s"]) == (spare.pid, 0.5)
    finally:
        w.loop.close()


def test_a_cache_the_engine_could_not_empty_is_kept_and_status_says_why(
        tmp_path: Path) -> None:
    w = gpu_world(tmp_path)
    try:
        _, spare = on_card(w)
        w.feed(HostCacheEmptied(spare.generation, False, 0.01, None,
                                "POST /collective_rpc: HTTP 404: Not Found"))
        st = w.sup.status()["standby"]
        assert st["host_cache"] == "kept: POST /collective_rpc: HTTP 404: Not Found"
        assert st["state"] == "ready" and st["weights"] == "gpu"  # (nothing else changes)
        assert audited(tmp_path, "standby_host_cache_kept")[-1]["pid"] == spare.pid
    finally:
        w.loop.close()


def test_no_cache_asked_before_the_weights_are_back_nor_of_an_engine_with_its_own_extension(
        tmp_path: Path) -> None:
    w = gpu_world(tmp_path)
    try:
        asked_ahead(w)
        assert "empty_host_cache" not in w.fx.names()  # (not while they are coming)
    finally:
        w.loop.close()
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    w = gpu_world(theirs, args=("--worker-extension-cls", "mine.Ext"))
    try:
        on_card(w)
        assert "empty_host_cache" not in w.fx.names()
        assert "a worker extension of their own" in w.sup.status()["standby"]["host_cache"]
    finally:
        w.loop.close()


def test_an_answer_after_the_standby_took_over_changes_nothing(tmp_path: Path) -> None:
    w = gpu_world(tmp_path)
    try:
        first, spare = on_card(w)
        w.feed(Exited(first.generation, -9))  # it serves now
        assert w.sup.engine is spare
        w.feed(HostCacheEmptied(spare.generation, True, 0.5, 0.5))
        assert not audited(tmp_path, "standby_host_cache_emptied")
        assert w.sup.status()["standby"].get("host_cache") is None
    finally:
        w.loop.close()

