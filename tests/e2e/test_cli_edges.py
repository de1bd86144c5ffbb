"""Issue 9 (part): the CLI on a closed pipe (`elasticd status | head`) is quiet, as git, and a
start that cannot bind its metrics port leaves no run directory."""

from __future__ import annotations

import fcntl
import os
import signal
import socket
import subprocess
import sys

import pytest

from harness import FAST, ROOT, script, wait_until


@pytest.mark.parametrize("unbuffered", [True, False], ids=["unbuffered", "buffered"])
def test_status_into_a_pipe_closed_after_one_line_is_quiet(daemons, unbuffered):
    """`elasticd status --json | head -1`: the reader takes one line and leaves while the CLI
    still writes (the pipe holds one page, the JSON more), as git: no traceback, exit 141."""
    d = daemons(script("silent.py"), "--nproc-per-node", "4", *FAST, args=["60"])
    wait_until(lambda: d.worker_pids(), 60, what="the job started")
    assert len(d.status("--json").stdout) > 4096 + 64  # more than the pipe holds
    r, w = os.pipe()
    fcntl.fcntl(w, fcntl.F_SETPIPE_SZ, 4096)
    env = dict(os.environ)
    env.pop("PYTHONUNBUFFERED", None)
    if unbuffered:
        env["PYTHONUNBUFFERED"] = "1"
    cli = subprocess.Popen(
        [sys.executable, "-m", "elasticd", "status", "--json", "--socket", str(d.socket)],
        stdout=w,
        stderr=subprocess.PIPE,
        cwd=ROOT,
        env=env,
    )
    os.close(w)
    line = b""
    while not line.endswith(b"\n"):
        line += os.read(r, 1) or pytest.fail(
            "the CLI wrote no line"
        )  # byte by byte: the rest stays
    os.close(r)
    _, err = cli.communicate(timeout=30)
    assert line == b"{\n" and cli.returncode == 141 and err == b"", (
        cli.returncode,
        err.decode()[-2000:],
    )
    d.kill(signal.SIGTERM)
    assert d.wait(30) == 0


def test_a_start_whose_metrics_port_is_taken_leaves_no_run_directory(tmp_path):
    logs = tmp_path / "logs"
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        r = subprocess.run(
            [
                sys.executable,
                "-m",
                "elasticd",
                "run",
                "--log-dir",
                str(logs),
                "--socket",
                str(tmp_path / "s"),
                "--metrics-address",
                f"127.0.0.1:{port}",
                script("silent.py"),
            ],
            capture_output=True,
            text=True,
            timeout=60,
            cwd=ROOT,
        )
    assert r.returncode == 2 and "cannot be bound here" in r.stderr, r.stderr
    assert sorted(p.name for p in logs.iterdir()) == ["checkpoints"], list(logs.iterdir())
