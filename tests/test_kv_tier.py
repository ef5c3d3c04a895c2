"""The KV tier both engines of a pair share (`engine.kv_tier`, engine/process/kv_tier.py):
the engine's argument and environment, the folder kept under its bound and emptied, the
settings that refuse a shared folder or a second way to set it, and a failover through the
real daemon, its proxy and two fake engines that read and write the folder as vLLM's fs
tier does (tests/fake_kv_tier.py): the standby loads the continued streams' prompts from
the files the dead engine wrote. (vLLM's CPU build refuses KV offloading, so there is no
CPU run of the real engine; the H200 runs: docs/standby.md, "The KV tier".)"""

from __future__ import annotations

import asyncio
import json
import os
import re
import shutil
import signal
import threading
import time
import tomllib
from pathlib import Path
from typing import Any

import pytest
from structlog.testing import capture_logs

from supervisor.engine.effects import jobs
from supervisor.engine.events import Event, KvTierSeen
from supervisor.engine.process import kv_tier
from supervisor.engine.process.process import build_spawn_spec
from supervisor.front.admission import Gate
from supervisor.loop import Clock
from supervisor.settings.config import ConfigError, parse_config
from supervisor.settings.sections import EngineConfig
from supervisor.watchdog.gpu import NoGpu
from tests.continuation_streams import Seen, comp, expected_text, metrics, run
from tests.fake_tokens import prompt_ids
from tests.harness import wait_for, write_config
from tests.test_proxy import proxy_config
from tests.test_standby import standby_ready

# ---- the engine's argument and environment --------------------------------------------


def engine(**keys: Any) -> EngineConfig:
    return EngineConfig(command=["vllm", "serve", "m"], **keys)


def test_the_tier_is_one_kv_transfer_config_with_an_fs_tier_in_the_folder() -> None:
    cfg = engine(kv_tier="/dev/shm/vs/kv", kv_tier_cpu_gib=4.0, kv_tier_chunk_tokens=256)
    argv = kv_tier.argv(cfg)
    assert argv[0] == "--kv-transfer-config" and len(argv) == 2
    doc = json.loads(argv[1])
    assert doc["kv_connector"] == "OffloadingConnector" and doc["kv_role"] == "kv_both"
    # a block pruned between vLLM's lookup and its load is computed again, not failed
    assert doc["kv_load_failure_policy"] == "recompute"
    extra = doc["kv_connector_extra_config"]
    assert extra["spec_name"] == "TieringOffloadingSpec"
    assert extra["cpu_bytes_to_use"] == 4 * 2**30 and extra["block_size"] == 256
    assert extra["secondary_tiers"] == [{"type": "fs", "root_dir": "/dev/shm/vs/kv",
                                         "n_read_threads": 32, "n_write_threads": 32}]
    assert kv_tier.argv(engine()) == []


def test_every_engine_of_the_pair_gets_it_and_one_hash_seed() -> None:
    cfg = engine(kv_tier="/dev/shm/vs/kv", args=["--max-num-seqs", "8"])
    spec = build_spawn_spec(cfg, {})
    at = spec.argv.index("--kv-transfer-config")
    assert spec.argv[at + 1] == kv_tier.argv(cfg)[1] and "--max-num-seqs" in spec.argv
    standby = build_spawn_spec(cfg.in_bay(1), {})
    assert kv_tier.argv(cfg)[1] in standby.argv  # the same folder, the same chunks
    # vLLM seeds its block hash at random in each process unless PYTHONHASHSEED names
    # one: both engines get the daemon's seed (drawn once per run, not a fixed one), over
    # one the daemon itself inherited
    seed = spec.env["PYTHONHASHSEED"]
    assert seed == standby.env["PYTHONHASHSEED"] == kv_tier.SEED
    assert 0 <= int(seed) < 2**32
    assert build_spawn_spec(cfg, {"PYTHONHASHSEED": "random"}).env["PYTHONHASHSEED"] == seed
    # the operator's own seed wins; without a tier the daemon sets none
    own = engine(kv_tier="/dev/shm/vs/kv", env={"PYTHONHASHSEED": "7"})
    assert build_spawn_spec(own, {}).env["PYTHONHASHSEED"] == "7"
    assert build_spawn_spec(own.in_bay(1), {}).env["PYTHONHASHSEED"] == "7"
    plain = build_spawn_spec(engine(), {})
    assert "--kv-transfer-config" not in plain.argv and "PYTHONHASHSEED" not in plain.env


# ---- the folder ---------------------------------------------------------------------------


def block(folder: Path, name: str, size: int, mtime: float) -> Path:
    path = folder / "m_0" / name[:3] / f"{name}.bin"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"\0" * size)
    os.utime(path, (mtime, mtime))
    return path


def test_a_folder_over_its_bound_loses_its_oldest_blocks_down_to_the_low_water(tmp_path):
    folder = tmp_path / "tier"
    assert kv_tier.clear(folder) is None
    paths = [block(folder, f"{i:04x}", 1000, 1_000_000 + i) for i in range(10)]
    writing = folder / "m_0" / "000" / "ffff.bin_123.tmp"  # (vLLM writing it)
    writing.write_bytes(b"\0" * 5000)
    os.utime(writing, (2_000_000, 2_000_000))
    now = 2_000_030  # (the .tmp written 30 s ago: still being written)
    # under the bound: nothing goes (the .tmp counted)
    assert kv_tier.prune(folder, 20_000, now) == kv_tier.Usage(11, 15_000)
    usage = kv_tier.prune(folder, 10_000, now)
    # past 10,000 bytes, the oldest blocks go until 90 % of it is left: 6 of 10
    assert usage == kv_tier.Usage(5, 9_000, removed_files=6, removed_bytes=6_000)
    assert [p.exists() for p in paths] == [False] * 6 + [True] * 4
    assert writing.exists()
    # a .tmp older than a minute is one a killed engine left: removed, under the bound too
    assert kv_tier.prune(folder, 20_000, now + 60) == kv_tier.Usage(
        4, 4_000, removed_files=1, removed_bytes=5_000)
    assert not writing.exists()


def test_a_host_short_of_memory_takes_the_oldest_blocks_past_the_bound(tmp_path):
    """A tier in memory is the one consumer of the host's memory the daemon can give
    back: with the host `short` of its floor, the oldest blocks go until that much is
    given back, whatever the bound (or what the bound asks, when that is more)."""
    folder = tmp_path / "tier"
    assert kv_tier.clear(folder) is None
    paths = [block(folder, f"{i:04x}", 1000, 1_000_000 + i) for i in range(10)]
    usage = kv_tier.prune(folder, 20_000, 2_000_000, short=4_000)
    assert usage == kv_tier.Usage(6, 6_000, removed_files=4, removed_bytes=4_000,
                                  host_short_bytes=4_000)
    assert [p.exists() for p in paths] == [False] * 4 + [True] * 6
    # past the bound by more than the host lacks: the bound's prune, as without it
    assert kv_tier.prune(folder, 4_000, 2_000_000, short=1_000).bytes == 3_000
    assert usage.fields()["host_short_bytes"] == 4_000  # (in status)
    # a host short of more than the folder holds: the whole folder goes
    assert kv_tier.prune(folder, 20_000, 2_000_000, short=10**9).bytes == 0


def test_the_hosts_floor_is_eight_gib_or_a_share_of_its_memory() -> None:
    gib = kv_tier.GIB
    assert kv_tier.host_short(available=12 * gib, total=128 * gib) == 0
    floor = int(kv_tier.HOST_FLOOR_SHARE * 128 * gib)  # 10.24 GiB on 128 GiB
    assert kv_tier.host_short(available=9 * gib, total=128 * gib) == floor - 9 * gib
    assert kv_tier.host_short(available=7 * gib, total=64 * gib) == gib  # (the 8 GiB floor)


@pytest.mark.skipif(not Path("/dev/shm").is_dir(), reason="no /dev/shm on this host")
def test_the_keeper_prunes_a_tier_in_memory_while_the_host_is_short(tmp_path):
    """The keeper's look, on a folder on tmpfs (/dev/shm, its own): with the host short
    of its floor (the seam `host_short`), the oldest blocks go past the bound, status
    says how short, and the log says it at warning level."""
    folder = Path("/dev/shm") / f"vs-test-tier-{os.getpid()}-{tmp_path.name}"
    cfg = parse_config({"engine": {"command": ["true"], "port": 18999,
                                   "kv_tier": str(folder), "kv_tier_max_gib": 1},
                        "daemon": {"runtime_dir": str(tmp_path)}}, "t.toml", tmp_path)
    queue: asyncio.Queue[Event] = asyncio.Queue()
    fx = jobs.JobEffects(queue=queue, config=lambda: cfg, clock=Clock(), environ={},
                         gpu=NoGpu(), siblings=set, gate=Gate(), front=None, name="e",
                         host_short=lambda: 4_000)

    async def one_look() -> KvTierSeen:
        assert await fx._take_kv_tier(cfg.engine) is None  # (emptied, marked)
        for i in range(10):
            block(folder, f"{i:04x}", 1000, 1_000_000 + i)
        keeper = asyncio.create_task(fx._keep_kv_tier())
        try:
            while True:
                ev = await asyncio.wait_for(queue.get(), 10)
                if isinstance(ev, KvTierSeen) and ev.usage.removed_files:
                    return ev
        finally:
            keeper.cancel()

    try:
        with capture_logs() as logs:
            seen = asyncio.run(one_look())
        assert seen.usage.host_short_bytes == 4_000 and seen.usage.bytes == 6_000
        said = [e for e in logs if e["event"] == "KV tier pruned for the host's memory"]
        assert said and said[0]["short_bytes"] == 4_000 and said[0]["log_level"] == "warning"
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def test_the_keepers_prunes_are_said_summed_once_a_period() -> None:
    """Under load a tier is pruned every few seconds: the log says it once every
    `SAY_PRUNED_EVERY_S`, summed (each look at debug), and nothing when nothing went."""
    every = kv_tier.SAY_PRUNED_EVERY_S
    p = kv_tier.Pruned(since=100.0)
    cut = kv_tier.Usage(10, 5_000, removed_files=3, removed_bytes=300)
    assert p.add(cut, 101.0) is None and p.add(kv_tier.Usage(9, 4_000), 102.0) is None
    assert p.add(cut, 100.0 + every - 1) is None  # (the period not over)
    assert p.add(cut, 100.0 + every) == {"files": 9, "bytes": 900, "looks": 3,
                                         "over_s": every, "left_bytes": 5_000}
    assert p.add(kv_tier.Usage(9, 4_000), 100.0 + 3 * every) is None  # nothing went
    assert p.add(cut, 100.0 + 3 * every + 1) == {"files": 3, "bytes": 300, "looks": 1,
                                                 "over_s": 2 * every + 1,
                                                 "left_bytes": 5_000}


def test_a_folder_that_is_not_the_daemons_is_never_emptied(tmp_path):
    foreign = tmp_path / "shm"
    foreign.mkdir()
    (foreign / "someone-elses").write_text("x")
    why = kv_tier.clear(foreign)
    assert why is not None and "did not put there" in why and kv_tier.MARKER in why
    assert (foreign / "someone-elses").exists()

    ours = tmp_path / "kv"  # new: made, owner only, marked; emptied next time
    assert kv_tier.clear(ours) is None
    assert (ours.stat().st_mode & 0o777) == 0o700 and (ours / kv_tier.MARKER).exists()
    block(ours, "abcd", 10, 1.0)
    assert kv_tier.clear(ours) is None
    assert [p.name for p in ours.iterdir()] == [kv_tier.MARKER]
    gone = kv_tier.prune(tmp_path / "missing", 1, 0.0)
    assert gone.files == 0 and gone.error is not None and "is gone" in gone.error

    # a folder another user could replace or read: under a folder anyone may write to
    # without the sticky bit (/dev/shm has it), or open to others itself
    open_ = tmp_path / "open"
    open_.mkdir()
    os.chmod(open_, 0o777)
    why = kv_tier.clear(open_ / "kv")
    assert why is not None and "writable by anyone" in why, why
    os.chmod(open_, 0o1777)  # (sticky, as /dev/shm: nobody else can replace what is ours)
    assert kv_tier.clear(open_ / "kv") is None


def test_the_folder_is_one_however_it_is_written() -> None:
    assert kv_tier.folder_of(engine(kv_tier="/dev/shm/kv/")) == Path("/dev/shm/kv")
    assert kv_tier.folder_of(engine(kv_tier="/dev/shm/./kv")) == Path("/dev/shm/kv")
    assert kv_tier.folder_of(engine()) is None
    record = kv_tier.Record()
    record.saw("/dev/shm/kv", kv_tier.Usage(2, 200))
    view = record.view(engine(kv_tier="/dev/shm/kv/"))
    assert view is not None and view["folder"] == "/dev/shm/kv" and view["files"] == 2
    argv = kv_tier.argv(engine(kv_tier="/dev/shm/kv/"))
    assert '"root_dir":"/dev/shm/kv"' in argv[1]
    assert kv_tier.without(["vllm", *argv, "--x"]) == ["vllm", "--x"]


def test_status_shows_the_folder_its_last_look_and_what_the_looks_removed() -> None:
    cfg = engine(kv_tier="/x", kv_tier_max_gib=2.0)
    record = kv_tier.Record()
    assert record.view(engine()) is None
    record.saw("/old", kv_tier.Usage(9, 900))  # (a folder a reload moved away from)
    assert record.view(cfg) == {"folder": "/x", "max_bytes": 2 * 2**30, "chunk_tokens": 256,
                                "files": None, "bytes": None, "error": None,
                                "warning": None,
                                "removed_files_total": 0, "removed_bytes_total": 0,
                                "store_refusals_total": 0}
    record.saw("/x", kv_tier.Usage(3, 300, removed_files=2, removed_bytes=200))
    record.saw("/x", kv_tier.Usage(4, 400, removed_files=1, removed_bytes=100))
    view = record.view(cfg)
    assert view is not None and (view["files"], view["bytes"]) == (4, 400)
    assert (view["removed_files_total"], view["removed_bytes_total"]) == (3, 300)
    record.refused.saw(1, 5.0, 0.0)
    assert record.view(cfg)["store_refusals_total"] == 5  # type: ignore[index]
    assert record.numbers(cfg) == (400.0, 2.0 * 2**30, 300.0, 5.0)  # (the exporter's)
    assert record.numbers(engine()) == (None, None, None, None)
    assert kv_tier.Record().numbers(cfg) == (None, 2.0 * 2**30, 0.0, 0.0)


def test_vllms_refused_stores_are_summed_over_the_engines_and_said_once_a_period() -> None:
    r = kv_tier.Refused()
    assert r.saw(1, 0.0, 0.0) is None and r.total == 0  # (none refused: nothing said)
    assert r.saw(1, 3.0, 10.0) == 3  # the first refusals: said at once
    assert r.saw(1, 7.0, 20.0) is None  # then summed for a period
    assert r.saw(1, 7.0, 30.0) is None
    # a failover: the standby's own count, from 0, taken whole
    assert r.saw(2, 2.0, 40.0) is None and r.total == 9
    assert r.saw(2, 2.0, 10.0 + kv_tier.SAY_REFUSED_EVERY_S) == 6  # the period's sum
    # the first engine serves again (the thin pair's returning one): what it added since
    assert r.saw(1, 8.0, 400.0) is None and r.total == 10
    assert r.saw(1, 1.0, 500.0) is None and r.total == 11  # (a counter that went back)
    assert r.saw(1, 1.0, 10.0 + 2 * kv_tier.SAY_REFUSED_EVERY_S) == 2
    for generation in range(3, 9):  # (the engines gone are forgotten)
        r.saw(generation, 0.0, 700.0)
    assert len(r._engines) == 4
    assert "engine.kv_tier_cpu_gib = 8 GiB" in kv_tier.refused_warning(engine(), 3)


MOUNTS = """/dev/vda / ext4 rw,relatime 0 0
tmpfs /dev/shm tmpfs rw,nosuid,nodev 0 0
/dev/vdb /dev/shm/disk xfs rw 0 0
"""


def test_a_folder_in_memory_is_told_by_the_longest_mount_that_holds_it() -> None:
    assert kv_tier.in_memory(Path("/dev/shm/vs/kv"), MOUNTS)
    assert kv_tier.in_memory(Path("/dev/shm"), MOUNTS)
    assert not kv_tier.in_memory(Path("/dev/shm/disk/kv"), MOUNTS)  # (a disk inside it)
    assert not kv_tier.in_memory(Path("/dev/shmother"), MOUNTS)
    assert not kv_tier.in_memory(Path("/var/kv"), MOUNTS) and not kv_tier.in_memory(
        Path("/var/kv"), "")


def test_a_tier_that_may_take_half_the_host_is_said_with_its_numbers() -> None:
    cfg = engine(kv_tier="/dev/shm/vs/kv", kv_tier_cpu_gib=16.0, kv_tier_max_gib=32.0,
                 standby="sleep")
    gib = 2**30
    # three engines' CPU tiers and the folder's bound, in memory: 80 GiB
    assert kv_tier.host_worst_case(cfg, True) == 80 * gib
    assert kv_tier.host_worst_case(cfg, False) == 48 * gib
    assert kv_tier.host_worst_case(engine(kv_tier="/x", kv_tier_cpu_gib=4.0), False) == 8 * gib
    said = kv_tier.host_warning(cfg, Path(cfg.kv_tier), MOUNTS, 128 * gib)
    assert said is not None and "80.0 GiB" in said and "62%" in said, said
    assert "kv_tier_max_gib 32" in said and "in memory" in said
    assert kv_tier.host_warning(cfg, Path(cfg.kv_tier), MOUNTS, 256 * gib) is None
    on_disk = kv_tier.host_warning(cfg, Path("/var/kv"), MOUNTS, 64 * gib)
    assert on_disk is not None and "kv_tier_max_gib" not in on_disk  # (48 of 64 GiB)


# ---- the settings ---------------------------------------------------------------------


def load(toml: str) -> None:
    parse_config(tomllib.loads(toml), "t.toml", Path("/base"))


def problems(toml: str) -> str:
    with pytest.raises(ConfigError) as err:
        load('[engine]\ncommand = ["vllm", "serve", "m"]\n' + toml)
    return str(err.value)


@pytest.mark.parametrize("folder", ["/dev/shm", "/tmp/", "/"])
def test_a_shared_folder_is_refused_by_name(folder: str) -> None:
    said = problems(f'kv_tier = "{folder}"\n')
    assert "engine.kv_tier" in said and "other programs use" in said


def test_a_relative_folder_and_a_second_way_to_set_the_tier_are_refused() -> None:
    assert "engine.kv_tier: expected an absolute path" in problems('kv_tier = "kv"\n')
    said = problems('kv_tier = "/dev/shm/vs/kv"\nargs = ["--kv-offloading-size", "8"]\n')
    assert "engine.args: --kv-offloading-size" in said and "keep one of them" in said
    said = problems('kv_tier = "/dev/shm/vs/kv"\nkv_tier_chunk_tokens = 8\n')
    assert "kv_tier_chunk_tokens" in said
    # a non-cryptographic block hash is seeded at random in each engine: one seed asked
    said = problems('kv_tier = "/dev/shm/vs/kv"\nkv_tier_chunk_tokens = 100\n')
    assert "kv_tier_chunk_tokens: 100 is not a multiple of the engine's KV block (16" in said
    load('[engine]\ncommand = ["vllm", "serve", "m"]\nkv_tier = "/dev/shm/vs/kv"\n'
         'kv_tier_chunk_tokens = 96\nargs = ["--block-size", "32"]\n')
    assert "(32 tokens)" in problems('kv_tier = "/dev/shm/vs/kv"\nkv_tier_chunk_tokens = 48\n'
                                     'args = ["--block-size", "32"]\n')
    said = problems('kv_tier = "/dev/shm/vs/kv"\nargs = ["--kv_transfer_config", "{}"]\n'
                    'standby_args = ["--kv-offloading-size", "4"]\n')
    assert "engine.args: --kv-transfer-config" in said
    assert "engine.standby_args: --kv-offloading-size" in said
    assert "other programs use" in problems('kv_tier = "/tmp/."\n')
    # any hash algorithm: the daemon gives both engines one seed
    load('[engine]\ncommand = ["vllm", "serve", "m"]\nkv_tier = "/dev/shm/vs/kv"\n'
         'args = ["--prefix-caching-hash-algo", "xxhash"]\n')


@pytest.mark.parametrize(("a", "b", "said"), [
    ("/dev/shm/vs/kv", "/dev/shm/vs/kv/", "engine a's"),  # (one folder, two spellings)
    ("/dev/shm/vs", "/dev/shm/vs/b", "inside"),  # one inside the other: two owners of it
])
def test_two_engines_cannot_share_one_folder(a: str, b: str, said: str) -> None:
    with pytest.raises(ConfigError) as err:
        load(f"""
[engines.a]
command = ["vllm", "serve", "a"]
kv_tier = "{a}"
[engines.b]
command = ["vllm", "serve", "b"]
port = 8200
kv_tier = "{b}"
""")
    assert "engines.b.kv_tier" in str(err.value) and said in str(err.value)


# ---- through the daemon -----------------------------------------------------------------

CHUNK = 16
N = 250  # tokens a stream, at 0.02 s a token: in flight at the fault (5 s)


def tier_lines(d: Any) -> list[tuple[int, int, int]]:
    """(engine pid, chunks loaded, full chunks) of each prompt the fake engines took."""
    out = []
    for e in d.log_records():
        m = re.match(r"KV tier: (\d+) of (\d+) chunks loaded from files", str(e.get("event")))
        if m and e.get("source") == "engine":
            out.append((int(e.get("proc_pid") or 0), int(m[1]), int(m[2])))
    return out


def test_after_a_kill_the_standby_loads_the_continued_prompts_from_the_tier(daemon_factory,
                                                                            tmp_path):
    cfg = proxy_config(tmp_path, "--token-delay", "0.02", keepalive_s=0.5)
    folder = tmp_path / "kv-tier"
    cfg["engine"].update(standby="awake", drain="continue", kv_tier=str(folder),
                         kv_tier_chunk_tokens=CHUNK, kv_tier_max_gib=1.0)
    d = daemon_factory(cfg)
    d.wait_state("RUNNING")
    wait_for(lambda: standby_ready(d), 30, "the standby ready")
    first = d.status()
    assert first["kv_tier"]["folder"] == str(folder)
    assert (folder / kv_tier.MARKER).exists()
    argvs = d.engine_argvs()
    assert all("--kv-transfer-config" in a for a in argvs), argvs

    prompts = [f"stream {i} " + "words of a long system prompt " * 4 for i in range(3)]
    chunks = [len(prompt_ids({"prompt": p}, False)) // CHUNK for p in prompts]
    results: list[Seen | None] = [None] * len(prompts)
    started = [threading.Event() for _ in prompts]

    def one(i: int) -> None:
        results[i] = run(cfg, comp(prompt=prompts[i], max_tokens=N), started=started[i])

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for e in started:
        assert e.wait(30), "a stream never started"
    os.kill(first["pid"], signal.SIGKILL)
    for t in threads:
        t.join(60)
    for i, s in enumerate(results):  # every stream whole and token-exact
        assert s is not None and s.complete, s
        assert "".join(s.texts) == expected_text(prompt_ids({"prompt": prompts[i]}, False), N)
    st = d.status()
    assert st["pid"] == first["standby"]["pid"] and st["restarts"] == 1

    lines = [line for line in tier_lines(d) if line[2]]  # (not the daemon's short probes)
    served = [(n, full) for pid, n, full in lines if pid == first["pid"]]
    took_over = [(n, full) for pid, n, full in lines if pid == st["pid"]]
    # the first engine found the folder empty and computed each prompt, writing it; the
    # standby loaded every chunk of each continued prompt from its files (a continued
    # prompt is the prompt and the tokens the stream had: their chunks were never written)
    assert served and all(n == 0 for n, _ in served), lines
    assert len(took_over) >= len(prompts), lines
    assert sum(n == chunks[0] for n, _ in took_over) >= len(prompts), lines
    seen = wait_for(lambda: (v := d.status()["kv_tier"])["files"] and v, 10, "a look")
    assert seen["files"] >= sum(chunks) and seen["error"] is None, seen
    m = metrics(cfg)  # the exporter: the folder's bytes, its bound, nothing removed yet
    assert m[("vllm_supervisor_kv_tier_bytes", ())] >= sum(chunks) * 4096
    assert m[("vllm_supervisor_kv_tier_max_bytes", ())] == 2**30
    assert m[("vllm_supervisor_kv_tier_removed_bytes_total", ())] == 0

    # a reload that moves the tier: the new folder made and kept at once; the old one,
    # which the running engines write to until their next start, kept too
    moved = tmp_path / "kv-tier-2"
    cfg["engine"]["kv_tier"] = str(moved)
    write_config(d.config, cfg)
    assert d.ctl("reload").returncode == 0
    wait_for(lambda: d.status()["kv_tier"]["folder"] == str(moved)
             and (moved / kv_tier.MARKER).exists()
             and d.status()["kv_tier"]["files"] is not None, 10, "the moved tier kept")
    assert sum(1 for _ in folder.rglob("*.bin")) >= sum(chunks)

    d.signal(signal.SIGTERM)
    assert d.wait_exit(60) == 0
    for f in (folder, moved):  # both emptied at the stop
        assert [p.name for p in f.iterdir()] == [kv_tier.MARKER], f


def test_an_engine_whose_folder_is_refused_is_started_without_a_tier(daemon_factory,
                                                                     tmp_path):
    """A folder the daemon may not keep (here: someone else's files in it) is never
    handed to vLLM, which would write there with no bound: the engine serves without a
    tier, and status and the log say why."""
    cfg = proxy_config(tmp_path)
    folder = tmp_path / "shared"
    folder.mkdir()
    (folder / "someone-elses").write_text("x")
    cfg["engine"].update(kv_tier=str(folder))
    d = daemon_factory(cfg)
    d.wait_state("RUNNING")
    argvs = d.engine_argvs()
    assert argvs and all("--kv-transfer-config" not in a for a in argvs), argvs
    said = [e for e in d.log_records() if e.get("event") == "engine started without its KV tier"]
    assert said and "did not put there" in said[0]["why"], said
    st = wait_for(lambda: (v := d.status()["kv_tier"])["error"] and v, 10, "the refusal")
    assert "did not put there" in st["error"] and st["files"] == 0
    assert (folder / "someone-elses").exists() and not (folder / kv_tier.MARKER).exists()


def test_stores_the_tiers_cpu_part_refuses_are_counted_said_and_exported(daemon_factory,
                                                                          tmp_path):
    """vLLM 0.33 counts a store its KV tier could not place (its CPU part full of blocks
    still being written): those blocks are not in the tier, and a fault computes them
    again. The fake engine's CPU part holds 2 chunks a prompt here (0.25 GiB at 8 MiB a
    token, 16-token chunks); a prompt that fits is no refusal and no warning, a longer
    one is: status, the exporter and one warning that names the setting to raise."""
    cfg = proxy_config(tmp_path, "--tier-token-bytes", str(8 << 20))
    cfg["engine"].update(kv_tier=str(tmp_path / "kv-tier"), kv_tier_chunk_tokens=CHUNK,
                         kv_tier_cpu_gib=0.25)
    d = daemon_factory(cfg)
    d.wait_state("RUNNING")
    short = "a prompt of two chunks"  # (22 tokens: one full chunk)
    seen = run(cfg, comp(prompt=short, max_tokens=4))
    assert seen.complete, seen
    done = time.monotonic()

    def scraped_since() -> bool:  # (a scrape of the engine's page after that request)
        age = d.status()["signals"]["metrics_age_s"]
        return age is not None and age + 0.2 < time.monotonic() - done

    wait_for(scraped_since, 20, "a scrape after the short prompt")
    assert d.status()["kv_tier"]["store_refusals_total"] == 0
    assert not [e for e in d.log_records() if e.get("event") == "KV tier refused stores"]

    long = "a prompt of six chunks of sixteen tokens each, " * 2  # (96 tokens)
    for _ in range(2):
        seen = run(cfg, comp(prompt=long, max_tokens=4))
        assert seen.complete, seen  # (a refused store fails no request)
    st = wait_for(lambda: (v := d.status()["kv_tier"])["store_refusals_total"] == 2 and v,
                  20, "both refusals counted")
    said = [e for e in d.log_records() if e.get("event") == "KV tier refused stores"]
    assert len(said) == 1 and said[0]["refused"] >= 1, said  # (then summed for a period)
    assert "engine.kv_tier_cpu_gib = 0.25 GiB" in said[0]["detail"]
    assert said[0]["level"] == "warning"
    assert st["error"] is None
    m = metrics(cfg)
    assert m[("vllm_supervisor_kv_tier_store_refusals_total", ())] == 2
    text = d.ctl("status").stdout  # (the operator's command, over the control socket)
    assert "2 stores refused (its CPU part full: raise engine.kv_tier_cpu_gib)" in text, text
    # the engine's own line, as vLLM's scheduler says it, passes through its log
    assert any("cannot store chunks" in str(e.get("event")) for e in d.log_records()
               if e.get("source") == "engine")
