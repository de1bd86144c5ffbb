"""A local user who binds the rendezvous port on the store host's address first (security,
round 4, point 6) made the host's daemon that user's client, and its failure line, after
--join-timeout, blamed the network. The host now sees that another user holds its port and says
so in one line at once (exit 2). The squatter is a real unprivileged process (uid 65534)."""

from __future__ import annotations

import os
import signal
import socket
import time

import pytest

from harness import final_lines, free_port, node_flags, script

NOBODY = 65534


def _squat(port: int) -> int:
    """The pid of a child of uid 65534 listening on 127.0.0.1:port."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            os.close(r)
            os.setgroups([])
            os.setgid(NOBODY)
            os.setuid(NOBODY)
            s = socket.socket()
            s.bind(("127.0.0.1", port))
            s.listen()
            os.write(w, b"ok")
            time.sleep(120)  # the test kills it sooner
        finally:
            os._exit(0)
    os.close(w)
    got = os.read(r, 2)
    os.close(r)
    assert got == b"ok", "the squatter could not bind"
    return pid


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to act as another uid")
def test_a_port_taken_by_another_user_is_said_at_once(daemons):
    port = free_port()
    squatter = _squat(port)
    try:
        d = daemons(
            script("ddp_tutorial.py"),
            "--nproc-per-node",
            "1",
            "--join-timeout",
            "60",
            *node_flags(port, "2"),
            args=["--steps", "5"],
        )
        t0 = time.monotonic()
        code = d.wait(50)  # well before --join-timeout: the old line came after it
        took = time.monotonic() - t0
    finally:
        os.kill(squatter, signal.SIGKILL)
        os.waitpid(squatter, 0)
    lines = final_lines(d.stderr())
    assert code == 2, (code, d.stderr()[-3000:])
    assert len(lines) == 1 and lines[0].startswith("elasticd: error: "), lines
    for needle in (
        f"port {port} on 127.0.0.1 is taken by another user's process",
        f"uid {NOBODY}",
        f"pid {squatter}",
        "the store's host must bind it itself",
        "--rdzv-endpoint",
    ):
        assert needle in lines[0], lines[0]
    print(f"refused in {took:.1f} s")
