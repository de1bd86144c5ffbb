"""Issue 7: a health check's edges, with real checks (shell scripts) and real daemons: its output
is kept to its last 64 KiB, its own exit is waited for (what it leaves running in its session is
killed and said), and a worker crash's teardown leaves a running check's processes alone."""

from __future__ import annotations

import json
import signal

import psutil

from harness import FAST, script, wait_until


def events(d, name: str) -> list[dict]:
    return [e for e in d.events() if e.get("event") == name]


def no_traceback(d) -> None:
    err = d.stderr()
    assert "Traceback" not in err, err[-4000:]


def check_script(tmp_path, body: str):
    path = tmp_path / "check.sh"
    path.write_text("#!/bin/sh\n" + body)
    path.chmod(0o755)
    return path


def worker_script(tmp_path, body: str) -> str:
    path = tmp_path / "worker.py"
    path.write_text(body)
    return str(path)


def test_a_health_check_printing_100_mb_costs_the_daemon_64_kib(daemons, tmp_path):
    check = check_script(
        tmp_path, "head -c 100000000 /dev/zero | tr '\\0' x\necho\necho 'all good'\n"
    )
    d = daemons(
        script("silent.py"),
        "--nproc-per-node",
        "1",
        *FAST,
        "--health-check",
        str(check),
        "--health-check-interval",
        "0",
        args=["30"],
    )
    wait_until(lambda: d.worker_pids(), 60, what="the job started")
    s = json.loads(d.status("--json").stdout)
    assert s["health"]["last"]["ok"] and s["health"]["last"]["output"] == "all good", s["health"]
    status = dict(ln.split(":", 1) for ln in open(f"/proc/{d.pid}/status"))
    peak, now = (int(status[k].split()[0]) >> 10 for k in ("VmHWM", "VmRSS"))
    assert peak - now < 50, f"the daemon's peak RSS {peak} MiB, now {now} MiB"
    d.kill(signal.SIGTERM)
    assert d.wait(30) == 0, d.stderr()[-3000:]


def test_a_health_check_that_exits_0_leaving_a_child_passes_and_its_child_is_killed(
    daemons, tmp_path
):
    pidfile = tmp_path / "child.pid"
    check = check_script(tmp_path, f"sleep 60 &\necho $! > {pidfile}\necho 'all good'\n")
    d = daemons(
        script("silent.py"),
        "--nproc-per-node",
        "1",
        *FAST,
        "--health-check",
        str(check),
        "--health-check-timeout",
        "5",
        args=["0.5"],
    )
    assert d.wait(60) == 0, d.stderr()[-3000:]
    passed = events(d, "health_check_passed")
    assert passed and passed[0]["seconds"] < 2, passed
    (left,) = events(d, "health_check_left_processes")
    child = int(pidfile.read_text())
    assert left["pids"] == [child] and not psutil.pid_exists(child)
    no_traceback(d)


def test_a_worker_crash_teardown_spares_a_running_health_check(daemons, tmp_path):
    """A periodic check runs (its `sleep` carries the daemon's token) when a worker crashes: the
    teardown's sweep leaves the check's session alone, the check passes, the job goes on."""
    count, marker = tmp_path / "count", tmp_path / "checking"
    check = check_script(
        tmp_path,
        f"n=$(cat {count} 2>/dev/null || echo 0)\necho $((n + 1)) > {count}\n"
        f"if [ $n -ge 1 ]; then touch {marker}; sleep 3 || {{ echo 'my sleep was "
        "killed'; exit 1; }; fi\necho 'all good'\n",
    )
    worker = worker_script(
        tmp_path,
        "import os, sys, time\n"
        "if os.environ['TORCHELASTIC_RESTART_COUNT'] == '0':\n"
        "    deadline = time.monotonic() + 30\n"
        f"    while not os.path.exists({str(marker)!r}) and time.monotonic() < deadline:\n"
        "        time.sleep(0.05)\n"
        "    sys.exit(3)\n"
        "print('done', flush=True)\n",
    )
    d = daemons(
        worker,
        "--nproc-per-node",
        "1",
        *FAST,
        "--health-check",
        str(check),
        "--health-check-interval",
        "0.5",
        "--health-check-timeout",
        "20",
    )
    assert d.wait(60) == 0, d.stderr()[-3000:]
    assert not events(d, "health_check_failed"), events(d, "health_check_failed")
    assert [e for e in events(d, "state") if e.get("new") == "RESTARTING"]
    assert "done" in d.log_text(0)
