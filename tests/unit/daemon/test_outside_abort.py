"""daemon/outside_abort.py against a real process blocked in a receive on a TCP connection whose
peer stays silent (a partition closes nothing): the daemon's shutdown of that socket, from
outside the process, ends the receive at once; sockets of the generation announced, or an fd
reused since, are left alone."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import textwrap
import time

import pytest

from elasticd import names
from elasticd.daemon import outside_abort

# connects to the port given, names the connection as generation 4's pair (as worker/reconfigure.py
# does), then waits in recv for a peer that never sends: prints what ended the wait
BLOCKED = textwrap.dedent(
    """
    import os, socket, sys, time
    port, heartbeat = int(sys.argv[1]), sys.argv[2]
    s = socket.create_connection(("127.0.0.1", port))
    ino = os.fstat(s.fileno()).st_ino
    with open(heartbeat + ".pairs", "w") as f:
        f.write(f"4 {s.fileno()}:{ino}\\n")
    print("waiting", flush=True)
    t0 = time.monotonic()
    got = s.recv(1)
    print(f"ended {got!r} after {time.monotonic() - t0:.2f}", flush=True)
    """
)


@pytest.fixture
def blocked(tmp_path):
    listener = socket.create_server(("127.0.0.1", 0))
    heartbeat = tmp_path / "rank1.heartbeat"
    proc = subprocess.Popen(
        [sys.executable, "-c", BLOCKED, str(listener.getsockname()[1]), str(heartbeat)],
        stdout=subprocess.PIPE,
        text=True,
    )
    peer, _ = listener.accept()  # the silent peer: holds its end open, sends nothing
    assert proc.stdout.readline().strip() == "waiting"
    yield proc, heartbeat
    proc.kill()
    proc.wait(10)
    peer.close()
    listener.close()


def test_a_survivor_waiting_on_a_silent_peer_is_unblocked_from_outside(blocked):
    proc, heartbeat = blocked
    assert outside_abort.pairs(heartbeat)[0] == 4
    assert outside_abort.shut(proc.pid, heartbeat, 4) == 0  # its own generation: kept
    time.sleep(0.2)
    assert proc.poll() is None  # still waiting
    t0 = time.monotonic()
    assert outside_abort.shut(proc.pid, heartbeat, 5) == 1
    assert proc.wait(5) == 0
    assert proc.stdout.read().startswith("ended b''")  # as if its peer had closed
    assert time.monotonic() - t0 < 2


def test_an_fd_reused_since_is_left_alone(blocked, tmp_path):
    proc, heartbeat = blocked
    gen, pairs = outside_abort.pairs(heartbeat)
    ((fd, ino),) = pairs.items()
    path = names.pairs_file(str(heartbeat))
    with open(path, "w") as f:
        f.write(f"{gen} {fd}:{ino + 1}\n")  # another socket's inode: the fd was reused since
    assert outside_abort.shut(proc.pid, heartbeat, 5) == 0
    with open(path, "w") as f:
        f.write("garbled 3:x\n")
    assert outside_abort.pairs(heartbeat) is None
    assert outside_abort.shut(proc.pid, heartbeat, 5) == 0
    time.sleep(0.2)
    assert proc.poll() is None


def test_a_worker_gone_or_without_pairs_is_nothing_to_do(tmp_path):
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait(10)
    heartbeat = tmp_path / "rank0.heartbeat"
    assert outside_abort.shut(gone.pid, heartbeat, 1) == 0  # no pairs file
    heartbeat.with_name("rank0.heartbeat.pairs").write_text(f"0 {os.open(os.devnull, 0)}:1\n")
    assert outside_abort.shut(gone.pid, heartbeat, 1) == 0  # the process is gone
