"""Held connections to a watched daemon (cluster/links.py), against a real process holding the
other end: killed, it is gone at once; stopped, closed in order, or turning us away, it is not."""

import os
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest

from elasticd.cluster import links

# a daemon's side: its links listening on loopback, the port printed, then held until killed
HOLDER = """
import socket, struct, sys, time
from elasticd.cluster import links
made = links.Links(links.listen("127.0.0.1"), lambda: None)
print(made.port, flush=True)
said = sys.stdin.readline().strip()
if said == "close":
    made.close()
    time.sleep(30)
elif said == "reset":  # every held connection reset, the daemon alive (as a middlebox would)
    # once its thread took the connection (the watcher's connect returns at the handshake: on a
    # loaded host, before it; a reset of none left it held, the test's flake)
    until = time.monotonic() + 10
    while not made._accepted and time.monotonic() < until:
        time.sleep(0.01)
    with made._lock:
        conns, made._accepted = list(made._accepted.values()), {}
    for c in conns:
        c.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        c.close()
    print("reset", flush=True)
    time.sleep(30)
"""


@pytest.fixture
def holder():
    procs = []

    def start():
        p = subprocess.Popen(
            [sys.executable, "-c", HOLDER], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
        )
        procs.append(p)
        return p, int(p.stdout.readline())

    yield start
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGCONT)
            p.kill()
        p.wait(10)


def watcher():
    woke = threading.Event()
    return links.Links(links.listen("127.0.0.1"), woke.set), woke


def held(made, node, timeout=10.0):
    deadline = time.monotonic() + timeout
    while node not in made._held and time.monotonic() < deadline:
        time.sleep(0.01)
    return node in made._held


def killed_while_held(holder, made, woke) -> None:
    """Node b's daemon held by `made`, then SIGKILLed: the link's end seen."""
    p, port = holder()
    made.watch({"b": ("127.0.0.1", port)})
    assert held(made, "b")
    os.kill(p.pid, signal.SIGKILL)
    assert woke.wait(10), "the link's end was not seen"


def test_a_killed_daemon_is_gone_at_once(holder):
    made, woke = watcher()
    try:
        killed_while_held(holder, made, woke)
        assert "b" in made.gone and "died" in made.gone["b"][1]
    finally:
        made.close()


def test_a_node_back_in_a_new_round_is_forgiven_and_held_again(holder):
    """Its connection ended with no word (a partition past the keepalive ends it as a death
    does): gone. It arrives for a new round (Peers.new_round forgives the members): no longer
    gone, and a connection to it is held again, so that its real death is seen again."""
    made, woke = watcher()
    try:
        killed_while_held(holder, made, woke)
        assert "b" in made.gone
        back, port2 = holder()  # its daemon (here a new one) listening again
        made.watch({"b": ("127.0.0.1", port2)})
        time.sleep(0.3)
        assert "b" in made.gone and not held(made, "b", 0.2)  # gone: never tried again alone
        made.forgive(["b"])
        assert "b" not in made.gone and held(made, "b")
        woke.clear()
        os.kill(back.pid, signal.SIGKILL)
        assert woke.wait(10) and "b" in made.gone  # and its death is seen again
    finally:
        made.close()


def test_a_stopped_daemon_or_one_closing_in_order_is_not_gone(holder):
    stopped, port1 = holder()
    closing, port2 = holder()
    made, woke = watcher()
    try:
        made.watch({"s": ("127.0.0.1", port1), "c": ("127.0.0.1", port2)})
        assert held(made, "s") and held(made, "c")
        os.kill(stopped.pid, signal.SIGSTOP)
        closing.stdin.write("close\n")
        closing.stdin.flush()
        deadline = time.monotonic() + 10
        while "c" in made._held and time.monotonic() < deadline:
            time.sleep(0.01)
        assert "c" not in made._held, "the orderly end was not seen"
        time.sleep(0.5)
        assert made.gone == {} and not woke.is_set()
        assert "s" in made._held
    finally:
        made.close()


def test_over_the_cap_a_watcher_is_turned_away_in_order(holder):
    _, port = holder()
    made, woke = watcher()
    conns = []
    try:
        for _ in range(links.MAX_HELD):  # the holder's cap, filled by others
            conns.append(socket.create_connection(("127.0.0.1", port), timeout=5))
        made.watch({"b": ("127.0.0.1", port)})
        deadline = time.monotonic() + 10
        while made._tried.get("b", 0) < links.CONNECT_TRIES and time.monotonic() < deadline:
            time.sleep(0.01)
        assert made._tried["b"] == links.CONNECT_TRIES and "b" not in made._held
        assert made.gone == {} and not woke.is_set(), "turned away, taken for a death"
    finally:
        made.close()
        for c in conns:
            c.close()


def test_a_connection_reset_with_its_daemon_alive_is_held_again(holder):
    """A firewall's or a NAT's reset of an idle connection is not a death: the daemon's port
    still takes a new connection, which is held from then on."""
    p, port = holder()
    made, woke = watcher()
    try:
        made.watch({"b": ("127.0.0.1", port)})
        assert held(made, "b")
        first = made._held["b"]
        p.stdin.write("reset\n")
        p.stdin.flush()
        assert p.stdout.readline().strip() == "reset"
        deadline = time.monotonic() + 10
        while made._held.get("b") in (None, first) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert made._held.get("b") not in (None, first), "not held again"
        assert made.gone == {} and not woke.is_set(), "a reset taken for a death"
    finally:
        made.close()


def test_held_connections_are_kept_alive_both_ways(holder):
    """Each held connection, ours and a watcher's, has TCP keepalive at our settings: a
    firewall that forgets idle connections keeps it, a host gone without a word ends it."""
    _, port = holder()
    made, _ = watcher()
    theirs = socket.create_connection(("127.0.0.1", made.port), timeout=5)
    try:
        made.watch({"b": ("127.0.0.1", port)})
        assert held(made, "b")
        deadline = time.monotonic() + 10
        while not made._accepted and time.monotonic() < deadline:
            time.sleep(0.01)
        for s in (made._held["b"], *made._accepted.values()):
            assert s.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE) == 1
            tcp = socket.IPPROTO_TCP
            assert s.getsockopt(tcp, socket.TCP_KEEPIDLE) == links.KEEPALIVE_IDLE
            assert s.getsockopt(tcp, socket.TCP_KEEPINTVL) == links.KEEPALIVE_INTERVAL
            assert s.getsockopt(tcp, socket.TCP_KEEPCNT) == links.KEEPALIVE_PROBES
    finally:
        theirs.close()
        made.close()
