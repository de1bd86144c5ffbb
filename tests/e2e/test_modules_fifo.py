"""A worker's imports report (`rank<N>.modules`, worker/imported.py) is the user's file, read by
the daemon's loop (daemon/learning.py): a FIFO there wedged the loop (security, round 4, point
7a), so a crash was never acted on and `elasticd stop` was never answered. It is read without
blocking now: a report that is not a regular file names nothing."""

from __future__ import annotations

import time

import pytest

from harness import FAST, final_lines, run_cli, script, wait_until


@pytest.mark.parametrize("end", ["crash", "stop"])
def test_a_fifo_as_the_imports_report_wedges_nothing(daemons, end):
    seconds, code = ("3", "3") if end == "crash" else ("120", "0")
    d = daemons(
        script("fifo_modules.py"),
        "--nproc-per-node",
        "1",
        "--max-restarts",
        "0",
        *FAST,
        args=[seconds, code],
    )
    wait_until(lambda: "fifo made" in d.log_text(0), 60, what="the worker's FIFO")
    time.sleep(1.5)  # the loop looks at the workers' reports every monitor interval (0.1 s)
    if end == "stop":
        r = run_cli("stop", "--socket", str(d.socket), "--timeout", "5", timeout=30)
        assert r.returncode == 0, (r.stdout, r.stderr)
        assert d.wait(30) == 0
        assert any(e.get("new") == "STOPPED" for e in d.events() if e.get("event") == "state")
    else:
        assert d.wait(30) == 1, d.stderr()[-3000:]
        lines = final_lines(d.stderr())
        assert any("job failed" in ln and "3" in ln for ln in lines), lines
