"""When a reloaded key takes effect (supervisor/settings/reload.py): every key has one answer."""

from __future__ import annotations

import pytest

from supervisor.settings import reload
from supervisor.settings.reload import DAEMON_RESTART, NEXT_START, NOW


def test_every_config_key_has_exactly_one_answer() -> None:
    keys = reload.config_keys()
    assert len(keys) == len(set(keys)) > 80
    for key in keys:
        assert reload.when(key) in (NOW, NEXT_START, DAEMON_RESTART), key


def test_every_entry_of_the_table_names_keys_that_exist() -> None:
    keys = reload.config_keys()
    for prefix, _ in reload.WHEN:
        assert any(k == prefix or (prefix.endswith(".") and k.startswith(prefix))
                   for k in keys), prefix
    # and each entry decides at least one key (none hidden behind an earlier prefix)
    decided = {next(p for p, _ in reload.WHEN
                    if k == p or (p.endswith(".") and k.startswith(p))) for k in keys}
    assert decided == {p for p, _ in reload.WHEN}


def test_a_key_the_table_does_not_know_is_an_error_not_applied() -> None:
    with pytest.raises(KeyError):
        reload.when("newsection.key")


@pytest.mark.parametrize(("key", "when"), [
    ("engine.port", NEXT_START), ("engine.args", NEXT_START), ("metrics.period_s", NEXT_START),
    ("canary.enabled", NEXT_START), ("canary.period_s", NOW), ("canary.model", NOW),
    ("proxy.max_concurrency", NOW), ("proxy.extra_routes", NOW), ("proxy.keepalive_s", NOW),
    ("proxy.listen", DAEMON_RESTART), ("proxy.max_body_bytes", DAEMON_RESTART),
    ("signals.rate_window_s", NOW), ("gpu.period_s", NOW), ("gpu.sampler", DAEMON_RESTART),
    ("throttle.level_factors", NOW), ("log.level", NOW), ("log.format", DAEMON_RESTART),
    ("evidence.log_lines", NEXT_START), ("evidence.keep", NOW),
    ("exporter.listen", DAEMON_RESTART), ("control.socket", DAEMON_RESTART),
])
def test_when_each_kind_of_key_applies(key: str, when: str) -> None:
    assert reload.when(key) == when


def test_a_reload_plan_lists_each_change_once_under_its_time() -> None:
    p = reload.plan(["proxy.listen", "engine.port", "proxy.max_concurrency"])
    assert p.applied_now == ("proxy.max_concurrency",)
    assert p.next_engine_start == ("engine.port",)
    assert p.next_daemon_start == ("proxy.listen",)
    assert sorted(p.as_dict()["changed"]) == sorted(
        ["proxy.listen", "engine.port", "proxy.max_concurrency"])
