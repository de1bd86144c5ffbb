"""The control socket over real Unix sockets: protocol, admission, socket lifecycle, slow
clients."""

from __future__ import annotations

import grp
import json
import os
import socket
import stat
import threading
import time
from pathlib import Path

import pytest

from elasticd.control import access, client, paths, protocol
from elasticd.control.server import ControlServer, Deferred
from harness import as_user

NOBODY = 65534


@pytest.fixture(autouse=True)
def no_server_thread_left():
    """Every test ends with its server threads gone (close() must join them)."""
    yield
    deadline = time.monotonic() + 5
    while (
        any(t.name == "elasticd-control" for t in threading.enumerate())
        and time.monotonic() < deadline
    ):
        time.sleep(0.01)
    assert not [t for t in threading.enumerate() if t.name == "elasticd-control"]


@pytest.fixture
def serve(tmp_path):
    """Start ControlServers that are closed at the end whatever happens."""
    servers = []

    def start(
        path=None,
        snapshot=lambda: {"state": "RUNNING"},
        command=lambda r: {"ok": True, "accepted": "stop"},
        operators_group=None,
    ):
        s = ControlServer(
            path or tmp_path / "c.sock",
            snapshot=snapshot,
            command=command,
            operators_group=operators_group,
        )
        servers.append(s)
        s.start()
        return s

    yield start
    for s in servers:
        s.close()


def raw(path, data: bytes, timeout: float = 5.0, shut: bool = False) -> dict:
    """Send raw bytes, return the one-line JSON reply."""
    with socket.socket(socket.AF_UNIX) as s:
        s.settimeout(timeout)
        s.connect(str(path))
        s.sendall(data)
        if shut:
            s.shutdown(socket.SHUT_WR)
        buf = b""
        while not buf.endswith(b"\n"):
            chunk = s.recv(65536)
            if not chunk:
                break
            buf += chunk
    return json.loads(buf)


def status(path, **kw) -> dict:
    return client.request(path, {"version": 1, "command": "status"}, **kw)


# --- protocol --------------------------------------------------------------------------------


def test_status_round_trip_serves_the_latest_snapshot(serve, tmp_path):
    published = {"snap": {"state": "RENDEZVOUS", "workers": []}}
    server = serve(snapshot=lambda: published["snap"])
    assert status(server.path) == {
        "ok": True,
        "version": 1,
        "status": {"state": "RENDEZVOUS", "workers": []},
    }
    published["snap"] = {"state": "RUNNING", "workers": [{"rank": 0, "pid": 123}]}
    assert status(server.path)["status"]["workers"] == [{"rank": 0, "pid": 123}]
    # EOF-terminated request (no newline) works as well as newline-terminated
    assert (
        raw(server.path, b'{"version": 1, "command": "status"}', shut=True)["status"]["state"]
        == "RUNNING"
    )


def test_large_snapshot_arrives_whole(serve):
    big = {
        "state": "RUNNING",
        "blob": "x" * (3 << 20),
    }  # larger than a socket buffer: partial writes
    server = serve(snapshot=lambda: big)
    assert status(server.path, timeout=10)["status"] == big


def test_stop_is_forwarded_to_the_command_callback(serve):
    seen = []
    server = serve(command=lambda req: seen.append(req) or {"ok": True, "accepted": "stop"})
    reply = client.request(server.path, {"version": 1, "command": "stop", "timeout": 7.5})
    assert reply == {"ok": True, "version": 1, "accepted": "stop"}
    assert (
        client.request(server.path, {"version": 1, "command": "stop", "timeout": None})["accepted"]
        == "stop"
    )
    assert client.request(server.path, {"version": 1, "command": "stop"})["ok"] is True
    assert [r.get("timeout") for r in seen] == [7.5, None, None]
    assert seen[0] == {"version": 1, "command": "stop", "timeout": 7.5}
    for bad in (-1, "soon", True, [3]):
        reply = client.request(server.path, {"version": 1, "command": "stop", "timeout": bad})
        assert reply["ok"] is False and "timeout" in reply["error"], reply
    assert len(seen) == 3  # bad requests never reach the daemon


def test_protocol_errors_name_the_problem(serve):
    server = serve()
    cases = [
        (b"not json\n", "not a JSON object"),
        (b"[1, 2]\n", "not a JSON object (got list)"),
        (b'{"command": "status"}\n', 'no "version"'),
        (b'{"version": 2, "command": "status"}\n', "unsupported protocol version 2"),
        (b'{"version": true, "command": "status"}\n', "unsupported protocol version True"),
        (b'{"version": 1, "command": "reboot"}\n', "unknown command 'reboot'"),
        (b'{"version": 1}\n', "unknown command None"),
        (b"\n", "empty request"),
    ]
    for data, expected in cases:
        reply = raw(server.path, data)
        assert reply["ok"] is False and expected in reply["error"], (data, reply)
    reply = raw(server.path, b"x" * (protocol.MAX_REQUEST + 10))
    assert reply["ok"] is False and "larger than" in reply["error"]
    assert status(server.path)["ok"] is True  # still serving


def test_failing_callbacks_become_error_replies(serve):
    def boom(_req):
        raise RuntimeError("inbox closed")

    server = serve(snapshot=lambda: 1 / 0, command=boom)
    assert "internal error" in status(server.path)["error"]
    reply = client.request(server.path, {"version": 1, "command": "stop"})
    assert reply["ok"] is False and "inbox closed" in reply["error"]
    with pytest.raises(protocol.ControlError, match="inbox closed"):
        client.ensure_ok(reply)


def test_deferred_reply_waits_without_holding_up_the_server(serve):
    """A command the loop answers later (stacks): its client waits, others are served meanwhile,
    the reply arrives once given, and one never given gets an error at its deadline."""
    handed = []

    def command(req):
        handed.append(Deferred(timeout=float(req.get("timeout") or 5)))
        return handed[-1]

    server = serve(command=command)
    result = {}
    asking = threading.Thread(
        target=lambda: result.update(
            client.request(server.path, {"version": 1, "command": "stacks"}, timeout=10)
        )
    )
    asking.start()
    deadline = time.monotonic() + 5
    while not handed and time.monotonic() < deadline:
        time.sleep(0.01)
    t0 = time.monotonic()
    assert status(server.path, timeout=3)["ok"] is True and time.monotonic() - t0 < 0.5
    assert asking.is_alive()  # still waiting for the loop
    handed[0].give({"ok": True, "stacks": [{"rank": 0, "text": "x"}]})
    asking.join(5)
    assert result == {"ok": True, "version": 1, "stacks": [{"rank": 0, "text": "x"}]}
    t0 = time.monotonic()
    reply = client.request(
        server.path, {"version": 1, "command": "stacks", "timeout": 0.5}, timeout=5
    )
    assert reply["ok"] is False and "did not answer within 0.5s" in reply["error"], reply
    assert 0.4 < time.monotonic() - t0 < 2.5
    handed[1].give({"ok": True})  # too late: nobody is waiting any more, nothing breaks
    assert status(server.path)["ok"] is True


# --- client errors ---------------------------------------------------------------------------


def test_client_says_no_daemon_when_nothing_listens(tmp_path):
    with pytest.raises(protocol.NoDaemon, match="no elasticd listens at"):
        status(tmp_path / "missing.sock")
    with pytest.raises(protocol.NoDaemon):
        status(tmp_path / "no-such-dir" / "c.sock")
    stale = tmp_path / "stale.sock"
    with socket.socket(socket.AF_UNIX) as s:
        s.bind(str(stale))  # a socket file nobody listens on: connection refused
    with pytest.raises(protocol.NoDaemon):
        status(stale)


def test_client_distinguishes_a_silent_peer_and_a_foreign_one(tmp_path):
    path = tmp_path / "silent.sock"
    with socket.socket(socket.AF_UNIX) as listener:
        listener.bind(str(path))
        listener.listen(1)  # accepts (backlog) but never answers
        t0 = time.monotonic()
        with pytest.raises(protocol.ProtocolError, match="did not answer within 0.3s"):
            status(path, timeout=0.3)
        assert time.monotonic() - t0 < 2
    path = tmp_path / "foreign.sock"
    with socket.socket(socket.AF_UNIX) as listener:
        listener.bind(str(path))
        listener.listen(1)

        def garbage():
            conn, _ = listener.accept()
            with conn:
                conn.sendall(b"HTTP/1.0 400 nope\n")

        t = threading.Thread(target=garbage, daemon=True)
        t.start()
        with pytest.raises(protocol.ProtocolError, match="not JSON"):
            status(path)
        t.join(5)
        assert not t.is_alive()


# --- socket lifecycle --------------------------------------------------------------------------


def test_socket_is_0600_right_after_start_and_nothing_else_is_left(serve, tmp_path):
    server = serve()
    st = os.lstat(server.path)
    assert (
        stat.S_ISSOCK(st.st_mode)
        and stat.S_IMODE(st.st_mode) == 0o600
        and st.st_uid == os.geteuid()
    )
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c.sock"]  # the private bind dir is gone


def test_operators_group_gets_a_0660_socket(serve, tmp_path):
    group = grp.getgrgid(NOBODY).gr_name
    server = serve(operators_group=group)
    st = os.lstat(server.path)
    assert stat.S_IMODE(st.st_mode) == 0o660 and st.st_gid == NOBODY
    with pytest.raises(protocol.ControlError, match="groupadd no-such-group-xyz"):
        ControlServer(tmp_path / "d.sock", dict, dict, operators_group="no-such-group-xyz").start()


def test_missing_parent_is_created_private_and_runtime_dir_goes_to_operators(
    serve, tmp_path, monkeypatch
):
    server = serve(path=tmp_path / "run" / "elasticd" / "c.sock")
    assert stat.S_IMODE(os.stat(server.path.parent).st_mode) == 0o700
    runtime = tmp_path / "runtime"
    runtime.mkdir(mode=0o750)
    monkeypatch.setenv("RUNTIME_DIRECTORY", f"{runtime}:/elsewhere")
    serve(path=runtime / "control.sock", operators_group=grp.getgrgid(NOBODY).gr_name)
    st = os.stat(runtime)
    assert st.st_gid == NOBODY and stat.S_IMODE(st.st_mode) == 0o750


def test_unsafe_parent_directories_are_refused(tmp_path):
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    os.chown(foreign, NOBODY, NOBODY)
    with pytest.raises(protocol.ControlError, match="belongs to uid 65534"):
        ControlServer(foreign / "c.sock", dict, dict).start()
    open_dir = tmp_path / "open"
    open_dir.mkdir()
    os.chmod(open_dir, 0o777)  # world-writable without the sticky bit
    with pytest.raises(protocol.ControlError, match="sticky"):
        ControlServer(open_dir / "c.sock", dict, dict).start()
    (tmp_path / "file").write_text("")
    with pytest.raises(protocol.ControlError, match="is not a socket"):
        ControlServer(tmp_path / "file", dict, dict).start()
    with pytest.raises(protocol.ControlError, match="longer than"):
        ControlServer(tmp_path / ("x" * 120), dict, dict).start()


def test_stale_socket_file_is_replaced_on_start(serve, tmp_path):
    path = tmp_path / "c.sock"
    with socket.socket(socket.AF_UNIX) as s:
        s.bind(str(path))  # left behind by a daemon that was SIGKILLed
    server = serve(path=path, snapshot=lambda: {"state": "NEW"})
    assert status(path)["status"]["state"] == "NEW"
    assert server.running


def test_second_server_on_a_live_path_is_refused(serve, tmp_path):
    first = serve(snapshot=lambda: {"state": "FIRST"})
    second = ControlServer(first.path, snapshot=dict, command=dict)
    with pytest.raises(
        protocol.AlreadyRunning, match=f"another elasticd is running at {first.path}"
    ):
        second.start()
    second.close()
    assert status(first.path)["status"]["state"] == "FIRST"  # the live one is untouched


def test_close_unlinks_ends_the_thread_and_is_idempotent(tmp_path):
    server = ControlServer(tmp_path / "c.sock", snapshot=dict, command=dict)
    server.start()
    thread = server._thread
    assert server.path.exists() and thread.is_alive()
    t0 = time.monotonic()
    server.close()
    assert time.monotonic() - t0 < 1.0  # woken, not polled out
    assert not server.path.exists() and not thread.is_alive() and not server.running
    server.close()
    with pytest.raises(protocol.NoDaemon):
        status(server.path)


def test_close_leaves_a_successors_socket_alone(serve, tmp_path):
    old = ControlServer(tmp_path / "c.sock", snapshot=lambda: {"state": "OLD"}, command=dict)
    old.start()
    os.unlink(old.path)  # someone removed it; a new daemon took the path
    serve(snapshot=lambda: {"state": "NEW"})
    old.close()
    assert status(tmp_path / "c.sock")["status"]["state"] == "NEW"


def test_never_started_server_closes_quietly(tmp_path):
    ControlServer(tmp_path / "c.sock", dict, dict).close()


# --- slow and hostile clients ------------------------------------------------------------------


def test_a_silent_client_does_not_block_another(serve, monkeypatch):
    monkeypatch.setattr("elasticd.control.server.READ_TIMEOUT", 1.0)
    server = serve()
    with socket.socket(socket.AF_UNIX) as silent, socket.socket(socket.AF_UNIX) as drip:
        silent.connect(str(server.path))
        drip.connect(str(server.path))
        drip.sendall(b'{"version"')
        t0 = time.monotonic()
        assert status(server.path, timeout=3)["ok"] is True
        assert time.monotonic() - t0 < 0.7  # served while the others still hold connections
        # the dripping client does not get a fresh deadline per byte: the whole request is bounded
        drip.settimeout(0.05)
        reply = b""
        while b"\n" not in reply and time.monotonic() - t0 < 3:
            try:
                drip.sendall(b" ")
                reply += drip.recv(4096)
            except (TimeoutError, BrokenPipeError, ConnectionResetError):
                pass
        assert b"not received within 1s" in reply and time.monotonic() - t0 < 2.0
        silent.settimeout(3)
        assert b"not received within 1s" in silent.recv(4096)


# --- admission ---------------------------------------------------------------------------------


def test_admission_policy():
    me = 1000
    assert access.admitted(0, 0, me, None)
    assert access.admitted(me, 5, me, None)
    assert not access.admitted(1001, 5, me, None)
    assert not access.admitted(1001, 5, me, None, groups=[5])  # no operators group: nobody else
    assert access.admitted(1001, 42, me, 42)  # primary group
    assert access.admitted(1001, 5, me, 42, groups=[5, 42])  # supplementary group
    assert not access.admitted(1001, 5, me, 42, groups=[5, 7])
    assert 0 in access.peer_groups(0, 0)
    assert access.peer_groups(4_000_000_000, 77) == frozenset({77})  # unknown user: its gid only
    assert "in group ops" in access.refusal(1001, "ops")
    assert access.refusal(1001, None).startswith("permission denied: uid 1001 is not root")


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to run a client as another uid")
def _request_as(uid: int, gid: int, path: Path) -> dict:
    """control.request as another user (harness.as_user)."""

    def ask():
        try:
            return client.request(path, {"version": 1, "command": "status"}, timeout=3)
        except protocol.ControlError as e:
            return {"raised": type(e).__name__, "message": str(e)}

    return as_user(uid, ask, gid=gid, timeout=10)


def test_other_uid_is_refused_by_credentials_not_file_mode(serve, open_dir):
    server = serve(path=open_dir / "c.sock")
    os.chmod(
        server.path, 0o666
    )  # let the file mode through: the credential check alone must refuse
    reply = _request_as(NOBODY, NOBODY, server.path)
    assert reply == {
        "ok": False,
        "version": 1,
        "error": "permission denied: uid 65534 is not root or the daemon's user "
        "(set operators_group to admit a group)",
    }, reply
    assert status(server.path)["ok"] is True  # root still is


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to run a client as another uid")
def test_operators_group_member_is_admitted_and_file_mode_guards_the_rest(serve, open_dir):
    group = grp.getgrgid(NOBODY).gr_name
    server = serve(path=open_dir / "c.sock", operators_group=group)
    assert _request_as(NOBODY, NOBODY, server.path)["status"] == {"state": "RUNNING"}
    # uid 65533 in gid 65533 is not in the group: the 0660 socket file stops it before the server
    # does
    reply = _request_as(65533, 65533, server.path)
    assert (
        reply.get("raised") == "PermissionDenied"
        and "permission denied connecting" in reply["message"]
    ), reply


# --- default path ------------------------------------------------------------------------------


def test_default_socket_path(monkeypatch):
    for var in ("ELASTICD_SOCKET", "RUNTIME_DIRECTORY", "XDG_RUNTIME_DIR"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr(os, "geteuid", lambda: 0)
    assert paths.default_socket_path() == Path("/run/elasticd/control.sock")
    monkeypatch.setattr(os, "geteuid", lambda: 1234)
    assert paths.default_socket_path() == Path("/tmp/elasticd-1234/control.sock")
    monkeypatch.setenv("XDG_RUNTIME_DIR", "/run/user/1234")
    assert paths.default_socket_path() == Path("/run/user/1234/elasticd/control.sock")
    monkeypatch.setenv("RUNTIME_DIRECTORY", "/run/elasticd:/run/other")
    assert paths.default_socket_path() == Path("/run/elasticd/control.sock")
    monkeypatch.setenv("ELASTICD_SOCKET", "/srv/e.sock")
    assert paths.default_socket_path() == Path("/srv/e.sock")


def test_find_daemons_looks_in_the_users_and_the_services_directory(serve, tmp_path, monkeypatch):
    for var in ("ELASTICD_SOCKET", "RUNTIME_DIRECTORY"):
        monkeypatch.delenv(var, raising=False)
    user, system = tmp_path / "user", tmp_path / "system"
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(user))
    monkeypatch.setattr(paths, "SYSTEM_DIR", system)
    monkeypatch.setattr(os, "geteuid", lambda: 1234)  # an operator, not root
    assert paths.find_daemons() == []
    mine = serve(path=user / "elasticd" / "control-job7.sock")
    service = serve(path=system / "control.sock")
    stale = socket.socket(socket.AF_UNIX)
    stale.bind(str(user / "elasticd" / "control.sock"))  # a SIGKILLed daemon's file: nobody listens
    stale.close()
    (user / "elasticd" / "notes.sock.txt").write_text("")
    assert paths.find_daemons() == [mine.path, service.path]
    assert paths.second_socket_path(paths.default_socket_path(), "job7") == mine.path
    monkeypatch.setenv("ELASTICD_SOCKET", str(tmp_path / "elsewhere.sock"))
    assert paths.find_daemons() == [tmp_path / "elsewhere.sock"]
