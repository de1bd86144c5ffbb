"""Issue 23's parts one by one, without a job: the heartbeat's running figures, the figures
(steps lost, goodput), the straggler rule, the metrics' names and exposition, the settings, the
deploy/ files and the example GPU check."""

from __future__ import annotations

import os
import subprocess
import sys

from harness import ROOT


def _cli(*args, env=None):
    return subprocess.run(
        [sys.executable, "-m", "elasticd", *args],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
        env=dict(os.environ, **(env or {})),
    )


def test_bad_metrics_and_health_flags_exit_2_with_one_line(tmp_path, open_dir):
    import socket

    os.chmod(open_dir, 0o777)
    common = ("run", "--log-dir", str(tmp_path / "logs"), "--socket", str(tmp_path / "s"))
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        cases = [
            (["--metrics-address", "0.0.0.0:9400"], "--metrics-all-interfaces"),
            (
                ["--health-check", "/no/such/check --now"],
                "'/no/such/check' is not an executable file",
            ),
            (
                ["--metrics-address", f"127.0.0.1:{port}"],
                f"--metrics-address 127.0.0.1:{port} cannot be bound here",
            ),
            (
                ["--metrics-textfile", str(tmp_path / "none" / "m.prom")],
                "directory " + str(tmp_path / "none") + " does not exist",
            ),
            (
                ["--metrics-textfile", str(open_dir / "m.prom")],
                "is writable by other users without the sticky bit",
            ),
        ]
        for flags, needle in cases:
            r = _cli(*common, *flags, "tests/scripts/faulty.py")
            lines = [ln for ln in r.stderr.splitlines() if ln.strip() and not ln.startswith("{")]
            assert r.returncode == 2 and len(lines) == 1 and needle in lines[0], (
                flags,
                r.returncode,
                r.stderr,
            )
