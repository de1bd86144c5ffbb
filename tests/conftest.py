import os
import subprocess
import sys
import time

import psutil
import pytest

sys.path.insert(0, os.path.dirname(__file__))

from harness import SESSION, leftover_processes

# Processes a test starts without the Daemon harness (python -c, CLI calls) inherit the tag too.
os.environ["ELASTICD_TEST_SESSION"] = SESSION
# Where a GPU exists, asking torch whether it does must not initialise CUDA in this process (the
# default check calls cuInit): the unit tests fork their ranks from it, and a fork of a process
# that initialised CUDA cannot use it (torch's own checks, such as Adam's, then fail in the rank).
os.environ.setdefault("PYTORCH_NVML_BASED_CUDA_CHECK", "1")
# The tests name only addresses and /etc/hosts names, never a name a DNS server must answer.
# torch's TCPStore looks up the name of the address at the other end of every connection, the
# client's (::ffff:127.0.0.1 here, which /etc/hosts does not list) and the store's event loop's,
# until a lookup fails (c10d formatSockAddr). A DNS server that drops one query stalled that
# connection and every client of the store 5 s (the resolver's timeout), and a test bounded
# tighter failed. No query is sent now (glibc's resolver, attempts:0): the first lookup fails at
# once and torch stops looking. cluster/reverse_dns.py says so where a node's lookups are slow;
# its test sends real queries (tests/unit/cluster/test_reverse_dns.py).
os.environ["RES_OPTIONS"] = "attempts:0"


@pytest.fixture(autouse=True)
def no_leftover_processes():
    """Every test ends with zero processes from its runs; a leak fails the test that caused it."""
    yield
    deadline = time.monotonic() + 10
    left = leftover_processes()
    while left and time.monotonic() < deadline:
        time.sleep(0.1)
        left = leftover_processes()
    if left:
        desc = []
        for p in left:
            try:
                desc.append(f"{p.pid}: {' '.join(p.cmdline())[:120]}")
            except psutil.Error:
                pass
            try:
                p.kill()
            except psutil.Error:
                pass
        pytest.fail("processes left behind:\n" + "\n".join(desc))


@pytest.fixture
def daemons(tmp_path):
    """Factory for Daemon nodes; any still running at the end are SIGKILLed (their guard cleans
    up)."""
    from harness import Daemon

    started = []

    def start(*a, **kw):
        d = Daemon(tmp_path, *a, **kw)
        started.append(d)
        return d

    yield start
    for d in started:
        d.kill()
        try:
            d.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass


@pytest.fixture
def open_dir():
    """A 0755 directory under /tmp that another user can reach (tmp_path's parents are 0700)."""
    import shutil
    import tempfile
    from pathlib import Path

    d = Path(tempfile.mkdtemp(prefix="elasticd-open-", dir="/tmp"))
    os.chmod(d, 0o755)
    yield d
    shutil.rmtree(d, ignore_errors=True)
