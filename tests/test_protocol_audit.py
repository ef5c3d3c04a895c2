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


# ---- garbage on the control socket (issue 33: a parse failure gets the promised reply) ---

def test_json_nested_past_the_parsers_limit_is_a_protocol_error():
    """Before: RecursionError escaped decode_request and the server dropped the
    connection without the error reply the protocol promises."""
    for depth in (5_000, 100_000):
        with pytest.raises(protocol.ProtocolError, match="nested too deeply"):
            protocol.decode_request(b"[" * depth + b"]" * depth)
        deep_args = b'{"v": 1, "cmd": "status", "args": {"a": ' + b"[" * depth \
            + b"]" * depth + b"}}"
        with pytest.raises(protocol.ProtocolError, match="nested too deeply"):
            protocol.decode_request(deep_args)


def test_an_error_quotes_at_most_a_bounded_prefix_of_what_the_client_sent():
    for raw in (b'{"v": 1, "cmd": "' + b"x" * 60_000 + b'"}',
                b'{"v": 1, "cmd": "status", "' + b"y" * 60_000 + b'": 1}',
                b'{"v": [' + b"7," * 20_000 + b'7], "cmd": "status"}'):
        with pytest.raises(protocol.ProtocolError) as info:
            protocol.decode_request(raw)
        quoted = max(str(info.value).split(" "), key=len)
        assert len(str(info.value)) < 200 and len(quoted) <= protocol.QUOTE_CHARS + 2


def test_the_control_server_answers_garbage_with_an_error_and_keeps_the_connection(tmp_path):
    import asyncio

    from structlog.testing import capture_logs

    from supervisor.control.server import ControlServer
    from supervisor.settings.sections import ControlConfig

    async def submit(cmd, args):
        return {"state": "RUNNING"}

    secret = b"SECRET-BODY-BYTES"
    # each under the line limit: a parse error, then the connection serves on
    garbage = [secret + b"[" * 20_000 + b"]" * 20_000,
               b"[" * 30_000 + secret + b"]" * 30_000,
               b'{"v": 1, "cmd": "' + secret * 1000 + b'"}',
               b"\xff\xfe" + secret,
               b'{"v": 1, "cmd": "status", "args": {"x": ' + b"[" * 20_000 + b"]" * 20_000
               + b"}}"]

    async def main():
        server = ControlServer(ControlConfig(socket=str(tmp_path / "c.sock")), submit)
        await server.start()
        try:
            reader, writer = await asyncio.open_unix_connection(str(tmp_path / "c.sock"))
            for line in garbage:
                writer.write(line + b"\n")
                await writer.drain()
                reply = json.loads(await asyncio.wait_for(reader.readline(), 10))
                assert reply["ok"] is False and reply["error"].startswith(
                    ("malformed request", "unknown command")), reply
                assert len(reply["error"]) < 300
            writer.write(protocol.encode_request("status"))
            await writer.drain()
            reply = json.loads(await asyncio.wait_for(reader.readline(), 10))
            assert reply == {"v": 1, "ok": True, "result": {"state": "RUNNING"}}
            writer.close()
        finally:
            await server.close()

    with capture_logs() as logs:
        asyncio.run(main())
    assert len([r for r in logs if r["event"] == "control request refused"]) == len(garbage)
    for r in logs:  # at most a bounded prefix of what a client sent, and no traceback
        assert "exc_info" not in r and "exception" not in r
        assert str(r).count("SECRET-BODY-BYTES") <= 2


def test_a_command_that_only_reads_is_logged_at_debug_and_one_that_acts_at_info(tmp_path):
    """A monitor polling `status` twice a second does not fill the log (issue 52); who
    asked for a restart, a drain or a stop still shows at info."""
    import asyncio

    from structlog.testing import capture_logs

    from supervisor.control.server import ControlServer
    from supervisor.settings.sections import ControlConfig

    async def submit(cmd, args):
        return {"done": cmd}

    async def main():
        server = ControlServer(ControlConfig(socket=str(tmp_path / "c.sock")), submit)
        await server.start()
        try:
            reader, writer = await asyncio.open_unix_connection(str(tmp_path / "c.sock"))
            for cmd in ("status", "events", "pause-policy", "status"):
                writer.write(protocol.encode_request(cmd))
                await writer.drain()
                reply = json.loads(await asyncio.wait_for(reader.readline(), 10))
                assert reply["ok"] is True and reply["result"] == {"done": cmd}
            writer.close()
        finally:
            await server.close()

    with capture_logs() as logs:
        asyncio.run(main())
    levels = [(r["cmd"], r["log_level"]) for r in logs if r["event"] == "control request"]
    assert levels == [("status", "debug"), ("events", "debug"), ("pause-policy", "info"),
                      ("status", "debug")]
    assert protocol.READS.issubset(protocol.COMMANDS)


def test_the_control_server_replies_when_serving_a_connection_fails(tmp_path, monkeypatch):
    import asyncio

    from structlog.testing import capture_logs

    from supervisor.control import server as server_module
    from supervisor.control.server import ControlServer
    from supervisor.settings.sections import ControlConfig

    def broken(line):
        raise MemoryError  # whatever decode_request should never raise

    monkeypatch.setattr(server_module.protocol, "decode_request", broken)

    async def submit(cmd, args):
        return {}

    async def main():
        server = ControlServer(ControlConfig(socket=str(tmp_path / "c.sock")), submit)
        await server.start()
        try:
            reader, writer = await asyncio.open_unix_connection(str(tmp_path / "c.sock"))
            writer.write(b"anything\n")
            await writer.drain()
            reply = json.loads(await asyncio.wait_for(reader.readline(), 10))
            assert reply["ok"] is False and "MemoryError" in reply["error"]
            writer.close()
        finally:
            await server.close()

    with capture_logs() as logs:
        asyncio.run(main())
    assert all("exc_info" not in r for r in logs)
