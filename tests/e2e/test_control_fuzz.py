"""Fuzzing the control protocol over real Unix sockets: random bytes, random JSON, requests with
random field values, truncated and deeply nested ones, against an in-process ControlServer wired
to the agent's own command callback and, fewer, against a running daemon. The server must answer
every one with a well-formed reply (or close cleanly an oversized one), never drop a connection
or die, and still serve status afterwards."""

from __future__ import annotations

import json
import socket

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from structlog.testing import capture_logs

from elasticd.control import client, commands, protocol
from elasticd.control.server import ControlServer
from elasticd.daemon.serve import _accept_command
from harness import script, wait_until

FAILURES = ("control_connection_failed", "control_server_crashed", "control_request_failed")

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=20),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=12,
)


def _encode(value) -> bytes:
    return json.dumps(value).encode()  # NaN and Infinity as the JSON extensions Python reads


@st.composite
def requests(draw) -> bytes:
    """One request's bytes, of every kind a client could send."""
    kind = draw(st.sampled_from(["bytes", "json", "fields", "truncated", "nested", "number"]))
    if kind == "bytes":
        return draw(st.binary(max_size=300))
    if kind == "json":
        return _encode(draw(json_values))
    field = st.one_of(json_values, st.sampled_from([1, 1.0, True, "1", *commands.COMMANDS]))
    req = {}
    for key in ("version", "command", "timeout"):
        if draw(st.booleans()):
            req[key] = draw(field)
    req.update(draw(st.dictionaries(st.text(max_size=8), json_values, max_size=2)))
    data = _encode(req)
    if kind == "fields":
        return data
    if kind == "truncated":
        return data[: draw(st.integers(0, len(data)))]
    if kind == "nested":
        depth = draw(st.integers(1, 30000))
        opener = draw(st.sampled_from(["[", '{"a":']))
        closer = "]" if opener == "[" else "}"
        deep = opener * depth + "1" + closer * depth * draw(st.sampled_from([0, 1]))
        return (
            f'{{"version": 1, "command": "status", "x": {deep}}}' if draw(st.booleans()) else deep
        ).encode()
    digits = draw(st.integers(1, 5000))
    number = draw(
        st.sampled_from(["9" * digits, "1e999", "-1e999", "NaN", "Infinity", f"0.{'1' * digits}"])
    )
    return f'{{"version": {number}, "command": "status", "timeout": {number}}}'.encode()


def exchange(path, data: bytes, newline: bool, timeout: float = 5.0) -> bytes:
    """Send a request (ended by a newline, or by EOF), return every byte of the reply."""
    with socket.socket(socket.AF_UNIX) as s:
        s.settimeout(timeout)
        s.connect(str(path))
        try:
            s.sendall(data + b"\n" if newline else data)
            s.shutdown(socket.SHUT_WR)
        except (BrokenPipeError, ConnectionResetError):
            pass  # it answered (an oversized request) before reading it all
        buf = b""
        try:
            while chunk := s.recv(65536):
                buf += chunk
        except ConnectionResetError:  # closed with our oversized request unread: check_reply judges
            pass
    return buf


def check_reply(reply: bytes, sent: bytes) -> dict | None:
    """The reply object, checked; None for a clean close of an oversized or empty request."""
    if not reply:
        assert len(sent) > protocol.MAX_REQUEST or not sent, sent[:200]
        return None
    assert reply.endswith(b"\n") and reply.count(b"\n") == 1, reply[:200]
    obj = json.loads(reply)
    assert obj["version"] == 1 and isinstance(obj["ok"], bool), obj
    if obj["ok"]:
        assert "status" in obj or "accepted" in obj or "stacks" in obj, obj
    else:
        assert isinstance(obj["error"], str) and obj["error"] and len(obj["error"]) < 400, obj
    return obj


class FakeAgent:
    """What _accept_command needs: an inbox. The loop answers stacks at once (another path
    through the server: a Deferred given before its wake-up was installed)."""

    def __init__(self):
        self.posted = []

    def post(self, item):
        self.posted.append(item)
        if item[0] == "stacks":
            item[1].give({"ok": True, "stacks": []})


@pytest.fixture
def server(tmp_path):
    agent = FakeAgent()
    s = ControlServer(
        tmp_path / "c.sock",
        snapshot=lambda: {"state": "RUNNING", "workers": []},
        command=lambda req: _accept_command(agent, req),
    )
    s.start()
    yield s
    s.close()


def test_random_requests_always_get_a_well_formed_reply(server):
    with capture_logs() as logs:

        @settings(
            max_examples=1500,
            deadline=None,
            derandomize=True,
            database=None,
            suppress_health_check=list(HealthCheck),
        )
        @given(data=requests(), newline=st.booleans())
        def one(data, newline):
            check_reply(exchange(server.path, data, newline), data)

        one()
    assert server.running
    assert not [e for e in logs if e["event"] in FAILURES], [
        e for e in logs if e["event"] in FAILURES
    ][:3]
    assert client.request(server.path, {"version": 1, "command": "status"})["ok"] is True


def test_hostile_requests_get_the_error_that_names_the_problem(server):
    cases = [
        (b"\xff\xfe{}", "not UTF-8"),
        (b"[" * 30000, "nested too deeply"),
        (
            b'{"version": 1, "command": "status", "x": ' + b"[" * 20000 + b"]" * 20000 + b"}",
            "nested too deeply",
        ),
        (b'{"version": ' + b"9" * 5000 + b', "command": "status"}', "this daemon reads"),
        (b'{"version": 1e999, "command": "status"}', "unsupported protocol version inf"),
        (b'{"version": 1.0, "command": "status"}', "unsupported protocol version 1.0"),
        (b'{"version": 1, "command": ["status"]}', "unknown command ['status']"),
        (b'{"version": 1, "command": "' + b"x" * 60000 + b'"}', "unknown command 'xxxx"),
        (
            b'{"version": 1, "command": {"a": {"b": {"c": 1}}}}',
            "unknown command {'a': {'b': {...}}}",
        ),
        (
            b'{"version": 1, "command": "status", "error": "not a reply"}',
            None,
        ),  # extra fields are fine
        (b'{"version": 1, "command": "stop", "timeout": "soon"}', "timeout"),
        (b'{"version": 1, "command": "status"', "not a JSON object"),  # truncated
        (b"   ", "empty request"),
    ]
    for data, expected in cases:
        for newline in (True, False):
            obj = check_reply(exchange(server.path, data, newline), data)
            if expected is None:
                assert obj["ok"] is True, obj
            else:
                assert obj["ok"] is False and expected in obj["error"], (data[:80], obj)
    for size in (protocol.MAX_REQUEST + 1, 4 * protocol.MAX_REQUEST):
        obj = check_reply(exchange(server.path, b"x" * size, True), b"x" * size)
        assert obj is None or "larger than" in obj["error"]
    assert server.running and client.request(server.path, {"version": 1, "command": "status"})["ok"]


def test_a_running_daemon_survives_random_requests(daemons):
    d = daemons(script("silent.py"), "--nproc-per-node", "1", "--no-warm-spawn", args=["60"])
    wait_until(lambda: d.status().returncode == 0, 30, what="the daemon's socket")

    @settings(
        max_examples=200,
        deadline=None,
        derandomize=True,
        database=None,
        suppress_health_check=list(HealthCheck),
    )
    @given(data=requests(), newline=st.booleans())
    def one(data, newline):
        req, error = commands.parse_request(data.split(b"\n", 1)[0])
        if error is None and req["command"] in ("stop", "stacks"):
            return  # a valid stop ends the daemon, stacks signals its worker: not what this tests
        check_reply(exchange(d.socket, data, newline), data)

    one()
    r = d.status()
    assert r.returncode == 0 and "RUNNING" in r.stdout, r.stderr
    d.kill(15)
    assert d.wait(30) == 0
    assert not [e for e in d.events() if e.get("event") in FAILURES]
