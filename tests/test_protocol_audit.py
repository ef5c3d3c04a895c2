"""The control protocol's framing and the audit trail's rotation, without a daemon."""

from __future__ import annotations

import json

import pytest

from supervisor.control import protocol
from supervisor.control.server import is_authorised
from supervisor.ops.audit import AuditTrail


def test_request_roundtrip():
    req = protocol.decode_request(protocol.encode_request("restart", {"reason": "x"}))
    assert req.cmd == "restart" and req.args == {"reason": "x"}


@pytest.mark.parametrize(("raw", "message"), [
    (b"nope", "not JSON"),
    (b"[1]", "expected a JSON object"),
    (b'{"v": 2, "cmd": "status"}', "unsupported protocol version 2"),
    (b'{"v": 1, "cmd": 5}', "'cmd' must be a string"),
    (b'{"v": 1, "cmd": "reboot"}', "unknown command 'reboot'"),
    (b'{"v": 1, "cmd": "status", "args": []}', "'args' must be an object"),
    (b'{"v": 1, "cmd": "status", "sudo": true}', "unknown field 'sudo'"),
])
def test_malformed_requests_are_named(raw, message):
    with pytest.raises(protocol.ProtocolError, match=message):
        protocol.decode_request(raw)


def test_error_reply_raises_with_the_daemons_message():
    with pytest.raises(protocol.ProtocolError, match="busy"):
        protocol.decode_reply(protocol.encode_error("busy"))
    assert protocol.decode_reply(protocol.encode_ok({"a": 1})) == {"a": 1}


def test_oversized_reply_is_replaced_by_an_error():
    line = protocol.encode_ok({"x": "y" * protocol.MAX_MESSAGE_BYTES})
    assert len(line) < protocol.MAX_MESSAGE_BYTES
    assert json.loads(line)["ok"] is False


@pytest.mark.parametrize(("uid", "groups", "allowed_gid", "ok"), [
    (0, {0}, None, True),          # root
    (1000, {1000}, None, True),    # the daemon's own user
    (1001, {1001}, None, False),   # a stranger
    (1001, {1001, 50}, 50, True),  # a member of control.group (supplementary)
    (1001, {1001}, 50, False),
])
def test_peer_authorisation(uid, groups, allowed_gid, ok):
    assert is_authorised(uid, groups, own_uid=1000, allowed_gid=allowed_gid) is ok


def test_audit_rotates_by_size_and_tail_reads_across_files(tmp_path):
    trail = AuditTrail(str(tmp_path / "events.jsonl"), max_bytes=4096, backups=2)
    for i in range(200):
        assert trail.append({"event": "state", "i": i, "pad": "x" * 40}) is None
    files = sorted(p.name for p in tmp_path.iterdir())
    assert files == ["events.jsonl", "events.jsonl.1", "events.jsonl.2"]
    assert all(p.stat().st_size <= 4096 for p in tmp_path.iterdir())
    last = trail.tail(100)
    assert [r["i"] for r in last] == list(range(200 - len(last), 200))
    assert len(last) == 100
    assert len(trail.tail(1000)) < 200  # the oldest were rotated away


def test_audit_tail_skips_damaged_lines_and_reports_write_errors(tmp_path):
    path = tmp_path / "events.jsonl"
    path.write_text('{"event": "a"}\n{broken\n{"event": "b"}\n')
    trail = AuditTrail(str(path), 1 << 20, 1)
    assert [r["event"] for r in trail.tail(10)] == ["a", "b"]
    blocked = AuditTrail(str(tmp_path / "events.jsonl" / "x"), 1 << 20, 1)
    assert blocked.append({"event": "c"}) is not None and blocked.write_errors == 1
