"""Config validation: every kind of bad input names its key and what was expected."""

from __future__ import annotations

from pathlib import Path

import pytest

from supervisor.front import deadlines
from supervisor.front.deadlines import Deadline
from supervisor.settings.bays import BAYS, ENGINE_BAYS
from supervisor.settings.config import ConfigError, diff_keys, load_config, parse_config
from tests.harness import ROOT

MIN = {"engine": {"command": ["python", "-m", "vllm.entrypoints.openai.api_server"]}}


def problems(doc: dict) -> list[str]:
    with pytest.raises(ConfigError) as info:
        parse_config(doc, "t.toml", Path("/base"))
    return info.value.problems


def with_engine(**kw: object) -> dict:
    return {"engine": {**MIN["engine"], **kw}}


def test_demo_config_is_valid_and_paths_resolve_against_its_directory():
    cfg = load_config(ROOT / "config.toml")
    assert cfg.engine.command[0] == str(ROOT / ".venv-engine" / "bin" / "vllm")
    assert cfg.engine.served_models() == ("tiny-llama",)
    assert not cfg.engine.models_open  # no LoRA: an unknown model name is refused
    assert cfg.engine.cwd == str(ROOT)
    assert cfg.control.socket == str(ROOT / "run" / "control.sock")
    assert cfg.audit.path == str(ROOT / "var" / "events.jsonl")


def test_gpu_demo_config_is_valid_with_sleep_mode_and_loopback_dev_endpoints():
    cfg = load_config(ROOT / "config.gpu.toml")
    assert cfg.engine.command[1:] == ["serve", "meta-llama/Llama-3.1-8B-Instruct"]
    assert cfg.engine.served_models() == ("llama",)
    assert "--enable-sleep-mode" in cfg.engine.args
    assert cfg.engine.env["VLLM_SERVER_DEV_MODE"] == "1"
    assert cfg.engine.host == "127.0.0.1"  # the dev endpoints stay off the network
    assert cfg.proxy.enabled and "kv_reset" in cfg.policy.remedies
    assert cfg.gpu.sampler == "nvml" and cfg.engine.gpu_foreign_allowance_mib == 0


def test_minimal_config_takes_defaults():
    cfg = parse_config(MIN, "t.toml", Path("/base"))
    assert cfg.engine.port == 8100 and cfg.engine.host == "127.0.0.1"
    assert cfg.engine.command[0] == "python"  # a bare name is looked up on PATH, not resolved
    assert cfg.restart.boot_failures_max == 3


@pytest.mark.parametrize(("doc", "expected"), [
    (with_engine(port=70000), "engine.port: expected a value from 1 to 65535, got 70000"),
    (with_engine(port="8000"), "engine.port: expected an integer, got '8000'"),
    (with_engine(port=True), "engine.port: expected an integer, got True"),
    (with_engine(command=[]), "engine.command: expected a non-empty list"),
    (with_engine(command="vllm serve"), "engine.command: expected a list of strings"),
    (with_engine(args=["--x", 3]), "engine.args: expected a list of strings"),
    (with_engine(env={"A": 1}), "engine.env: expected a table of strings"),
    (with_engine(drain_timeout_s=-1), "engine.drain_timeout_s: expected a value from 0"),
    (with_engine(colour="blue"), "engine.colour: unknown key (known keys:"),
    (with_engine(args=["--port", "9"]), "engine.args: --port is set by the daemon"),
    (with_engine(args=["--shutdown-timeout=3"]), "engine.args: --shutdown-timeout is set"),
    ({**MIN, "log": {"level": "loud"}}, "log.level: expected one of debug, info, warning, error"),
    ({**MIN, "restart": {"backoff_initial_s": 10, "backoff_max_s": 5}},
     "restart.backoff_max_s: expected at least restart.backoff_initial_s (10), got 5"),
    ({**MIN, "restart": 3}, "restart: expected a table [restart], got 3"),
    ({**MIN, "proxy": {"max_buffered_bytes": 2 << 20, "max_body_bytes": 4 << 20}},
     "proxy.max_buffered_bytes: expected at least proxy.max_body_bytes (4194304), got 2097152"),
    ({**MIN, "proxy": {"send_timeout_s": 0}}, "proxy.send_timeout_s: expected a value from"),
    ({**MIN, "proxxy": {}}, "proxxy: unknown section"),
    ({}, "engine: required section [engine] is missing"),
    ({"engine": {}}, "engine.command: required key is missing"),
])
def test_bad_values_are_named_with_what_was_expected(doc, expected):
    found = problems(doc)
    assert any(p.startswith(expected) for p in found), found


def test_every_problem_is_reported_at_once():
    found = problems(with_engine(port=0, host="", colour=1))
    assert len(found) == 3


def test_unreadable_and_broken_files_are_config_errors(tmp_path):
    with pytest.raises(ConfigError, match="cannot read"):
        load_config(tmp_path / "missing.toml")
    bad = tmp_path / "bad.toml"
    bad.write_text("[engine\ncommand = [")
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_config(bad)
    binary = tmp_path / "bin.toml"
    binary.write_bytes(b"\xff\xfe\x00")
    with pytest.raises(ConfigError, match="not UTF-8"):
        load_config(binary)


def test_error_message_names_the_file():
    with pytest.raises(ConfigError) as info:
        parse_config(with_engine(port=0), "/etc/vllm-supervisor/config.toml", Path("/"))
    assert str(info.value).startswith("/etc/vllm-supervisor/config.toml: engine.port:")


def test_diff_keys_lists_changed_key_paths():
    a = parse_config(MIN, "t", Path("/base"))
    b = parse_config(with_engine(args=["--x"], port=9000), "t", Path("/base"))
    assert diff_keys(a, b) == ["engine.args", "engine.port"]


def test_proxy_extra_routes_are_routes_and_each_bad_one_is_named():
    doc = {**MIN, "proxy": {"extra_routes": ["/jobs/*/status", "/custom/", "/v1/../sleep",
                                             "/v1/load_lora_adapter"]}}
    assert problems(doc) == [
        "proxy.extra_routes: '/custom/' is not a route: a route is an exact path, not a "
        "prefix: drop the trailing / (use * for one segment)",
        "proxy.extra_routes: '/v1/../sleep' is not a route: dot segments ('.', '..', "
        "encoded or not) are not resolved here",
        "proxy.extra_routes: '/v1/load_lora_adapter' is not a route: an administrative "
        "route of the engine cannot be made public",
    ]
    ok = parse_config({**MIN, "proxy": {"extra_routes": ["/jobs/*/status"]}}, "t.toml",
                      Path("/base"))
    assert ok.proxy.extra_routes == ["/jobs/*/status"]


def test_lora_leaves_the_served_names_open():
    # adapters are served under their own names, loaded at run time too
    for args in (["--enable-lora"], ["--enable-lora", "--lora-modules", "sql=/a"],
                 ["--enable-lora=true"]):
        cfg = parse_config(with_engine(args=args), "t.toml", Path("/base"))
        assert cfg.engine.models_open, args


# ---- several engines: [engines.NAME] ------------------------------------------------------

def engines(**tables: dict) -> dict:
    return {"engines": {name: {"command": ["vllm", "serve", name], **t}
                        for name, t in tables.items()}}


def test_engines_tables_keep_config_order_and_each_unit_sees_its_own_engine():
    cfg = parse_config(engines(big={"port": 8101, "fallback": "small"},
                               small={"port": 8102, "models": ["tiny"]}), "t.toml", Path("/b"))
    assert list(cfg.engines) == ["big", "small"] and cfg.several
    assert cfg.engine is cfg.engines["big"]  # the first, until viewed for one engine
    small = cfg.for_engine("small")
    assert small.engine.port == 8102 and small.engine_name == "small"
    assert small.engine.served_models() == ("tiny",)  # `models` says it over the args
    assert cfg.engines["big"].served_models() == ("big",)  # `serve big`
    assert small.state_file.name == "engine-tree-small.json"
    assert cfg.engines["big"].command[0] == "vllm"


def test_one_engine_table_is_the_engine_named_default_with_todays_files():
    cfg = parse_config(MIN, "t.toml", Path("/base"))
    assert list(cfg.engines) == ["default"] and not cfg.several
    assert cfg.state_file.name == "engine-tree.json"


def test_each_bay_has_its_own_port_and_state_file():
    """The unit's places are numbered (settings/bays.py): each engine bay its port (the
    standby's `standby_port`, or the engine's + 1; a further bay the port after), each
    bay its own state file, the weight cache's named for it."""
    cfg = parse_config(with_engine(port=8100), "t.toml", Path("/base"))
    e = cfg.engine
    assert [e.in_bay(b).port for b in (0, 1, 2)] == [8100, 8101, 8102]
    assert e.in_bay(0) is e and e.in_bay(1).args == e.args
    moved = parse_config(with_engine(port=8100, standby="awake", standby_port=9000),
                         "t.toml", Path("/base")).engine
    assert [moved.in_bay(b).port for b in ENGINE_BAYS] == [8100, 9000]
    files = [cfg.state_file_of(b).name for b in BAYS]
    assert files == ["engine-tree.json", "engine-tree.bay1.json",
                     "engine-tree.weight-cache.json"]


@pytest.mark.parametrize(("doc", "expected"), [
    ({**MIN, **engines(a={})}, "engines: [engine] and [engines.NAME] cannot both be given"),
    (engines(a={"port": 8101}, b={"port": 8101}),
     "engines.b.port: 127.0.0.1:8101 is also engines.a.port (127.0.0.1:8101)"),
    (engines(a={"port": 8101, "fallback": "c"}, b={"port": 8102}),
     "engines.a.fallback: no engine named 'c' (the engines are a, b)"),
    (engines(a={"port": 8101, "fallback": "b"}, b={"port": 8102, "fallback": "a"}),
     "engines.a.fallback: a cycle (a -> b -> a)"),
    (engines(a={"port": 8101, "fallback": "a"}), "engines.a.fallback: a cycle (a -> a)"),
    (engines(a={"port": 8101, "gpus": [0, 1]}, b={"port": 8102, "gpus": [1]}),
     "engines.b.gpus: GPU 1 is engine a's too; set share_gpus = true on both"),
    (engines(a={"port": 8101, "gpus": [0], "share_gpus": True}, b={"port": 8102, "gpus": [0]}),
     "engines.b.gpus: GPU 0 is engine a's too"),
    (engines(**{"bad name": {}}), "engines.bad name: expected a name of letters"),
    (engines(a={"port": 8101, "colour": "x"}), "engines.a.colour: unknown key"),
    (engines(a={"port": 8101, "args": ["--port", "9"]}), "engines.a.args: --port is set by"),
    ({"engines": {}}, "engines: expected one or more tables [engines.NAME]"),
    (with_engine(fallback="x"), "engine.fallback: a fallback is another engine"),
    (engines(a={"port": 8101, "fallback": "b"},
             b={"port": 8102, "command": ["python", "-m", "vllm.entrypoints.openai.api_server"]}),
     "engines.a.fallback: engine b serves no model name the daemon can read"),
])
def test_engine_rules_name_the_key_and_the_problem(doc, expected):
    found = problems(doc)
    assert any(p.startswith(expected) for p in found), found


@pytest.mark.parametrize(("engine", "expected"), [
    ({"gpus": [2, 3], "env": {"CUDA_VISIBLE_DEVICES": "0"}},
     "engine.env.CUDA_VISIBLE_DEVICES: '0' disagrees with engine.gpus = [2, 3]"),
    ({"gpus": [1], "env": {"CUDA_DEVICE_ORDER": "FASTEST_FIRST"}},
     "engine.env.CUDA_DEVICE_ORDER: 'FASTEST_FIRST'; with engine.gpus the daemon sets"),
    ({"gpus": [0, 1], "args": ["--tensor-parallel-size", "2", "-pp=2"]},
     "engine.args: --tensor-parallel-size 2 x --pipeline-parallel-size 2 = 4 GPUs, but "
     "engine.gpus names 2 ([0, 1])"),
    ({"gpus": [0], "args": ["--tensor_parallel_size=2"]},
     "engine.args: --tensor-parallel-size 2 = 2 GPUs, but engine.gpus names 1"),
])
def test_gpus_the_engine_cannot_have_are_refused_naming_both_sides(engine, expected):
    found = problems(with_engine(**engine))
    assert any(p.startswith(expected) for p in found), found


def test_gpus_that_agree_with_the_environment_and_the_parallel_size_are_valid():
    cfg = parse_config(with_engine(gpus=[2, 3], env={"CUDA_VISIBLE_DEVICES": "2, 3",
                                                    "CUDA_DEVICE_ORDER": "PCI_BUS_ID"},
                                   args=["-tp", "2"]), "t.toml", Path("/b"))
    assert cfg.engine.gpus == [2, 3]
    # without gpus nothing is checked: the engine sees what the daemon sees
    parse_config(with_engine(args=["-tp", "8"], env={"CUDA_VISIBLE_DEVICES": "5"}),
                 "t.toml", Path("/b"))


def test_engines_sharing_a_gpu_when_both_allow_it_is_valid():
    cfg = parse_config(engines(a={"port": 8101, "gpus": [0], "share_gpus": True},
                               b={"port": 8102, "gpus": [0], "share_gpus": True}),
                       "t.toml", Path("/b"))
    assert cfg.engines["a"].gpus == cfg.engines["b"].gpus == [0]


def test_two_engine_demo_config_is_valid_with_the_second_the_first_ones_fallback():
    cfg = load_config(ROOT / "config.two-engines.toml")
    assert list(cfg.engines) == ["primary", "fallback"]
    assert cfg.engines["primary"].fallback == "fallback"
    assert cfg.engines["primary"].port != cfg.engines["fallback"].port


SLEEPY = {"env": {"VLLM_SERVER_DEV_MODE": "1"}}


@pytest.mark.parametrize(("engine", "expected"), [
    ({"standby": "sleep", **SLEEPY, "args": ["--gpu-memory-utilization", "0.4"]},
     'engine.args: standby = "sleep" needs --enable-sleep-mode'),
    ({"standby": "sleep", "args": ["--enable-sleep-mode"]},
     'engine.env.VLLM_SERVER_DEV_MODE: standby = "sleep" needs "1"'),
    ({"standby": "sleep", **SLEEPY, "args": ["--enable-sleep-mode",
                                             "--gpu-memory-utilization", "0.95"]},
     "engine.args: --gpu-memory-utilization 0.95 leaves no room for the sleeping standby"),
    ({"standby": "awake", "args": ["--gpu-memory-utilization=0.6"]},
     "engine.args: --gpu-memory-utilization 0.6 twice is 1.2 of the card"),
    ({"standby": "awake", "args": ["--gpu-memory-utilization", "lots"]},
     "engine.args: --gpu-memory-utilization 'lots' is not a number"),
    ({"standby": "snapshot", **SLEEPY},
     'engine.args: standby = "snapshot" needs --enable-sleep-mode'),
    ({"standby": "snapshot", "args": ["--enable-sleep-mode"]},
     'engine.env.VLLM_SERVER_DEV_MODE: standby = "snapshot" needs "1"'),
    ({"standby": "snapshot", **SLEEPY, "args": ["--enable-sleep-mode"],
      "standby_args": ["--gpu-memory-utilization", "0.3"]},
     'engine.standby_args: not with standby = "snapshot"'),
])
def test_a_standby_that_cannot_be_kept_is_refused_with_the_numbers(engine, expected):
    found = problems(with_engine(**engine))
    assert any(p.startswith(expected) for p in found), found


def test_snapshot_images_in_dev_shm_are_refused_naming_the_key(tmp_path):
    """Each copy of the standby gets a /dev/shm of its own, which hides images kept
    there from their own restore (on the H200 every copy failed, saying nothing)."""
    engine = {"standby": "snapshot", **SLEEPY, "args": ["--enable-sleep-mode"]}
    with pytest.raises(ConfigError) as e:
        parse_config(with_engine(**engine, snapshot_dir="/dev/shm/vs/snaps"), "t.toml",
                     tmp_path)
    assert "engine.snapshot_dir: /dev/shm/vs/snaps is in /dev/shm" in str(e.value)
    cfg = parse_config(with_engine(**engine, snapshot_dir="snaps"), "t.toml", tmp_path)
    assert cfg.engine.snapshot_dir == str(tmp_path / "snaps")
    parse_config(with_engine(standby="sleep", **SLEEPY, args=["--enable-sleep-mode"],
                             snapshot_dir="/dev/shm/x"), "t.toml", tmp_path)  # (unused)


@pytest.mark.parametrize(("engine", "expected"), [
    ({"standby": "awake", "rearm_window": "3am"},
     "engine.rearm_window: '3am' is not HH:MM-HH:MM"),
    ({"standby": "awake", "rearm_window": "25:00-26:00"},
     "engine.rearm_window: '25:00-26:00' is not a time of day"),
    ({"standby": "awake", "rearm_window": "03:00-03:00"},
     "engine.rearm_window: '03:00-03:00' is empty"),
    ({"rearm_window": "03:00-04:00"},
     'engine.rearm_window: needs a standby (engine.standby is "none")'),
])
def test_a_rearm_window_is_refused_naming_what_is_wrong(engine, expected):
    found = problems(with_engine(**engine))
    assert any(p.startswith(expected) for p in found), found


def test_a_daily_window_knows_its_day_across_midnight():
    from datetime import datetime

    from supervisor.settings.engine_checks import DailyWindow
    night = DailyWindow.parse("23:30-00:30")
    assert night.occurrence(datetime(2026, 11, 26, 23, 45)) == "2026-11-26"
    assert night.occurrence(datetime(2026, 11, 27, 0, 15)) == "2026-11-26"
    assert night.occurrence(datetime(2026, 11, 27, 0, 30)) is None
    day = DailyWindow.parse(" 3:00 - 04:00 ")
    assert day.occurrence(datetime(2026, 11, 26, 3, 0)) == "2026-11-26"
    assert day.occurrence(datetime(2026, 11, 26, 4, 0)) is None
    parse_config(with_engine(standby="awake", rearm_window="03:00-04:00"), "t.toml",
                 Path("/base"))


@pytest.mark.parametrize("engine", [
    {"standby": "awake"},  # (a CPU engine: no share given, nothing to check)
    {"standby": "awake", "args": ["--gpu-memory-utilization", "0.45"]},
    {"standby": "sleep", **SLEEPY, "args": ["--enable-sleep-mode"]},  # (0.9: it goes first)
    {"standby": "sleep", **SLEEPY, "command": ["vllm", "serve", "m", "--enable-sleep-mode"],
     "args": ["--gpu-memory-utilization", "0.42"]},
])
def test_a_standby_that_fits_is_valid(engine):
    parse_config(with_engine(**engine), "t.toml", Path("/base"))


@pytest.mark.parametrize(("doc", "expected"), [
    ({"fleet": {"routers": ["http://10.0.0.5:30000/"]}},
     "fleet.routers[0]: 'http://10.0.0.5:30000/': no trailing '/'"),
    ({"fleet": {"routers": ["http://r:1", "http://r:1"]}}, "fleet.routers: a router is named"),
    ({"fleet": {"routers": ["http://r:1"]}, "proxy": {"enabled": False}},
     "fleet.routers: routers send requests to the proxy, and proxy.enabled is false"),
    ({"fleet": {"routers": ["http://r:1"]}, "proxy": {"listen": "0.0.0.0:8000"}},
     "fleet.advertise: required when proxy.listen (0.0.0.0:8000) is a wildcard"),
    ({"fleet": {"advertise": "10.0.0.12:8000"}}, "fleet.advertise: '10.0.0.12:8000': expected"),
])
def test_fleet_problems_name_the_key(doc, expected):
    found = problems({**MIN, **doc})
    assert any(p.startswith(expected) for p in found), found


def test_a_fleet_member_advertises_its_proxy_address_unless_told_otherwise():
    cfg = parse_config({**MIN, "fleet": {"routers": ["http://r:1"]},
                        "proxy": {"listen": "10.0.0.12:8000"}}, "t.toml", Path("/base"))
    assert cfg.fleet.advertised(cfg.proxy.listen) == "http://10.0.0.12:8000"
    cfg = parse_config({**MIN, "fleet": {"routers": ["http://r:1"],
                                         "advertise": "http://gpu7.lan:8000"},
                        "proxy": {"listen": "0.0.0.0:8000"}}, "t.toml", Path("/base"))
    assert cfg.fleet.advertised(cfg.proxy.listen) == "http://gpu7.lan:8000"


# ---- the daemon's own listeners: each on an address of its own ---------------------------

LISTENS = "; each of the daemon's listeners needs an address of its own"


@pytest.mark.parametrize(("doc", "expected"), [
    # a new user's first standby: the engine one below the exporter, the standby on port + 1
    ({**with_engine(port=9401, standby="awake")},
     "engine.standby_port: 127.0.0.1:9402 (engine.port + 1, as standby_port is 0) is also "
     "exporter.listen (127.0.0.1:9402)" + LISTENS),
    ({**MIN, "proxy": {"listen": "127.0.0.1:9402"}},
     "exporter.listen: 127.0.0.1:9402 is also proxy.listen (127.0.0.1:9402)" + LISTENS),
    (engines(a={"port": 8101}, b={"port": 8101}),
     "engines.b.port: 127.0.0.1:8101 is also engines.a.port (127.0.0.1:8101)" + LISTENS),
    (engines(a={"port": 8101, "standby": "sleep", **SLEEPY, "args": ["--enable-sleep-mode"]},
             b={"port": 8102}),
     "engines.b.port: 127.0.0.1:8102 is also engines.a.standby_port (127.0.0.1:8102, "
     "engines.a.port + 1, as standby_port is 0)" + LISTENS),
    (engines(a={"port": 8101, "standby": "awake", "standby_port": 8200},
             b={"port": 8102, "standby": "awake", "standby_port": 8200}),
     "engines.b.standby_port: 127.0.0.1:8200 is also engines.a.standby_port"),
    (with_engine(standby="awake", standby_port=8100),
     "engine.standby_port: 127.0.0.1:8100 is also engine.port (127.0.0.1:8100)"),
    (with_engine(port=8000), "engine.port: 127.0.0.1:8000 is also proxy.listen"),
    # a wildcard overlaps every host; localhost a loopback address; IPv6 in any spelling
    ({**with_engine(host="0.0.0.0", port=8000)},
     "engine.port: 0.0.0.0:8000 is also proxy.listen (127.0.0.1:8000)"),
    ({**MIN, "proxy": {"listen": "[::]:9402"}},
     "exporter.listen: 127.0.0.1:9402 is also proxy.listen ([::]:9402)"),
    ({**MIN, "proxy": {"listen": "localhost:8100"}},
     "engine.port: 127.0.0.1:8100 is also proxy.listen (localhost:8100)"),
    ({**with_engine(host="0:0:0:0:0:0:0:1"), "exporter": {"listen": "[::1]:8100"}},
     "engine.port: [0:0:0:0:0:0:0:1]:8100 is also exporter.listen ([::1]:8100)"),
    (with_engine(port=65535, standby="awake"),
     "engine.standby_port: required when engine.port is 65535"),
])
def test_two_of_the_daemons_listeners_on_one_address_are_refused_naming_both(doc, expected):
    found = problems(doc)
    assert any(p.startswith(expected) for p in found), found


def test_each_listener_is_named_once_for_its_first_clash():
    found = problems({**with_engine(port=9402), "proxy": {"listen": "127.0.0.1:9402"}})
    assert [p.split(":", 1)[0] for p in found] == ["exporter.listen", "engine.port"]


@pytest.mark.parametrize("doc", [
    with_engine(port=9401, standby="awake", standby_port=9500),  # moved off the exporter
    with_engine(port=9401),  # no standby: nothing on 9402 but the exporter
    {**with_engine(port=8000), "proxy": {"enabled": False, "listen": "127.0.0.1:8000"}},
    {**with_engine(port=9402), "exporter": {"enabled": False}},
    {**MIN, "proxy": {"listen": "127.0.0.1:0"}, "exporter": {"listen": "127.0.0.1:0"}},
    {**with_engine(host="127.0.0.2", port=8000)},  # another loopback address
    {**with_engine(host="::1", port=9402)},  # the exporter is on 127.0.0.1
    {**with_engine(host="gpu7.lan", port=8000)},  # a name is not resolved at load
    engines(a={"port": 8101, "standby": "awake", "standby_port": 8201},
            b={"port": 8102, "standby": "awake", "standby_port": 8202}),
])
def test_listeners_on_addresses_of_their_own_are_valid(doc):
    parse_config(doc, "t.toml", Path("/base"))


@pytest.mark.parametrize("name", ["config.toml", "config.two-engines.toml", "config.gpu.toml",
                                  "config.8-gpus.toml"])
def test_every_demo_config_loads(name):
    cfg = load_config(ROOT / name)
    assert cfg.engines and cfg.source == str(ROOT / name)


def test_check_command_refuses_a_standby_on_the_exporters_port(tmp_path, capsys):
    from supervisor.cli import main
    path = tmp_path / "config.toml"
    path.write_text('[engine]\ncommand = ["vllm", "serve", "m"]\nport = 9401\n'
                    'standby = "awake"\n')
    assert main(["check", "--config", str(path)]) == 78
    err = capsys.readouterr().err
    assert "engine.standby_port: 127.0.0.1:9402" in err and "exporter.listen" in err


def test_deadlines_per_model_and_engine_are_checked_key_by_key():
    served = {"command": ["vllm", "serve", "m"], "args": ["--served-model-name", "small"]}
    ok = parse_config({"engine": served, "proxy": {"request_timeout_s": 60, "deadlines": {
        "small": {"request_timeout_s": 5}, "default": {"stall_timeout_s": 2.5}}}},
        "t.toml", Path("/base"))
    assert ok.proxy.deadlines["small"].request_timeout_s == 5.0
    assert ok.proxy.deadlines["small"].stall_timeout_s is None  # (the engine's, then 0)
    assert ok.proxy.deadlines["default"].stall_timeout_s == 2.5
    bad = problems({"engine": served, "proxy": {"deadlines": {
        "small": {"request_timeout_s": -1, "stall_s": 3},
        "empty": {}, "big": {"stall_timeout_s": True}, "flat": 3}}})
    assert bad == [
        "proxy.deadlines.small.request_timeout_s: expected a number of seconds from 0 to "
        "86400 (0: none), got -1",
        "proxy.deadlines.small.stall_s: unknown key (known keys: request_timeout_s, "
        "stall_timeout_s)",
        "proxy.deadlines.empty: expected at least one of request_timeout_s, stall_timeout_s",
        "proxy.deadlines.big.stall_timeout_s: expected a number of seconds from 0 to 3600 "
        "(0: none), got True",
        "proxy.deadlines.flat: expected a table, got 3"]
    unknown = problems({"engine": served, "proxy": {"deadlines": {
        "large": {"request_timeout_s": 5}}}})
    assert unknown == ["proxy.deadlines.large: no engine or model of that name (engines: "
                       "default; models: small)"]
    # LoRA: adapters' names are not known in advance, any name may be a model's
    lora = {**served, "args": [*served["args"], "--enable-lora"]}
    assert parse_config({"engine": lora, "proxy": {"deadlines": {
        "adapter-1": {"request_timeout_s": 5}}}}, "t.toml", Path("/base"))


def test_a_requests_deadlines_are_its_models_then_its_engines_then_the_proxys():
    named = {"small": Deadline(request_timeout_s=5.0),
             "gpu0": Deadline(request_timeout_s=50.0, stall_timeout_s=2.0)}
    assert deadlines.for_request(named, "small", "gpu0", 600.0, 0.0) == (5.0, 2.0)
    assert deadlines.for_request(named, "other", "gpu0", 600.0, 0.0) == (50.0, 2.0)
    assert deadlines.for_request(named, "small", "gpu1", 600.0, 9.0) == (5.0, 9.0)
    assert deadlines.for_request(named, None, None, 600.0, 9.0) == (600.0, 9.0)
    assert deadlines.for_request(named, ["not", "a", "name"], "gpu1", 0.0, 0.0) == (0.0, 0.0)
    # 0 in a model's table is no deadline for that model, whatever its engine says
    zero = {"small": Deadline(request_timeout_s=0.0), "gpu0": Deadline(request_timeout_s=9)}
    assert deadlines.for_request(zero, "small", "gpu0", 600.0, 0.0) == (0.0, 0.0)
