"""Issue 4: what someone who reaches the metrics port can do to the daemon, with real sockets and
real daemons."""

from __future__ import annotations

import json
import signal
import subprocess
import sys

from harness import ROOT


def test_teardown_that_cannot_read_proc_says_so_and_carries_on(tmp_path):
    """workers.stop with every file descriptor in use (psutil cannot open /proc): the workers'
    sessions are still killed, one line says the sweep failed, nothing raises."""
    code = f"""
import json, os, resource, subprocess, sys, time
from pathlib import Path
from elasticd import logs, workers
logs.setup("json")
token = "t" * 32
proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], start_new_session=True,
                        env=dict(os.environ, ELASTICD_AGENT=token))
time.sleep(0.2)
p = Path({str(tmp_path)!r})
w = workers.Worker(0, 0, proc, p / "log", p / "err", p / "st", p / "hb", time.monotonic())
resource.setrlimit(resource.RLIMIT_NOFILE, (64, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
held = []
try:
    while True:
        held.append(os.open("/dev/null", os.O_RDONLY))
except OSError:
    pass
stuck = workers.stop([w], token, grace=0.5, kill_timeout=1.0)
for fd in held:
    os.close(fd)
print(json.dumps({{"stuck": stuck, "exit": w.exit_code}}))
"""
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=30, cwd=ROOT)
    assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr[-3000:]
    result = json.loads(r.stdout.strip().splitlines()[-1])
    assert result == {"stuck": [], "exit": -signal.SIGTERM}, result
    failed = [json.loads(ln) for ln in r.stderr.splitlines() if "teardown_sweep_failed" in ln]
    assert len(failed) == 1 and "Too many open files" in failed[0]["error"], r.stderr
