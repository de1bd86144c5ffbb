"""A Rich progress bar under `elasticd run` with the daemon on a terminal (a pty): as visible as a
tqdm bar (one prefixed line per redraw, while it runs) and no escape sequence of the worker's
reaches the terminal (daemon/tee.py: display_env, echo_line)."""

from __future__ import annotations

import importlib.util
import os
import pty
import re
import select
import subprocess
import sys
import time

import pytest

from harness import FAST, ROOT, script

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("rich") is None, reason="needs rich: pip install -e '.[integrations]'"
)


def test_a_rich_bar_shows_while_it_runs_without_moving_the_cursor(tmp_path):
    main, side = pty.openpty()
    cmd = [sys.executable, "-m", "elasticd", "run", "--log-dir", str(tmp_path / "logs")]
    cmd += ["--socket", str(tmp_path / "s.sock"), *FAST, "--nproc-per-node", "1"]
    cmd += [script("rich_progress.py"), "--", "40", "4"]
    env = {k: v for k, v in os.environ.items() if not k.startswith("TTY_")}
    with open(tmp_path / "stderr.txt", "wb") as err:
        proc = subprocess.Popen(
            cmd, stdout=side, stderr=err, stdin=subprocess.DEVNULL, cwd=ROOT, env=env
        )
    os.close(side)
    out, seen_running = b"", []  # bar lines echoed before the script printed "done"
    deadline = time.monotonic() + 90
    try:
        while time.monotonic() < deadline:
            ready, _, _ = select.select([main], [], [], 0.2)
            if ready:
                try:
                    chunk = os.read(main, 65536)
                except OSError:  # the pty closed: every process holding it exited
                    break
                if not chunk:
                    break
                out += chunk
                if b"done" not in out:
                    seen_running = re.findall(rb"\[rank0\]: train .*?\d+%", out)
            elif proc.poll() is not None:
                break
        assert proc.wait(timeout=30) == 0, (tmp_path / "stderr.txt").read_text()[-3000:]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)
        os.close(main)
    assert b"\x1b" not in out and b"\x9b" not in out, out[-500:]
    lines = out.decode().replace("\r\n", "\n").splitlines()
    assert lines and all(ln.startswith("[rank0]: ") for ln in lines), lines[:5]
    assert "[rank0]: done" in lines
    # about 2 a second over the bar's 4 s (at most one per 0.5 s): live, not only the final state
    assert 3 <= len(seen_running) <= 12, (len(seen_running), lines)
