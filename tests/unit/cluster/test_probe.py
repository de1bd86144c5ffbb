"""The probe of a silent node's address (cluster/probe.py) on real loopback sockets: a listener
whose owner never accepts still answers (a stopped daemon is not gone), a closed port refuses."""

import socket

from elasticd.cluster import probe


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_listener_answers_even_unaccepted_and_a_closed_port_refuses():
    sock = probe.listen("127.0.0.1", 0)
    assert sock is not None
    try:
        port = sock.getsockname()[1]
        closed = _free_port()
        for _ in range(3):  # queued, never accepted: the kernel still answers
            got = probe.probe([("127.0.0.1", port), ("127.0.0.1", closed)], wait=2.0)
            assert got == {("127.0.0.1", port): "answered", ("127.0.0.1", closed): "refused"}
        probe.drain(sock)  # the queue emptied, without blocking
        probe.drain(None)
    finally:
        sock.close()
    assert probe.probe([("127.0.0.1", port)], wait=2.0) == {("127.0.0.1", port): "refused"}


def test_a_taken_port_gives_no_listener():
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))  # bound, not listening: as bench/detection.py holds it
        assert probe.listen("127.0.0.1", held.getsockname()[1]) is None
