"""The in-memory state's directory on a full tmpfs (security, round 4, point 4): create() turned
the state off without a word and left its directory and lock file behind. Now one
`memory_state_off` warning says why and what to do, and nothing is left. Run in a mount
namespace of its own (a 4 KiB tmpfs, filled), so the host's mounts are never touched."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from harness import ROOT

_CHILD = r"""
import json, os, sys
import structlog
from elasticd.checkpoint.memory import directory
shm = sys.argv[1]
directory.ROOT = shm
with open(os.path.join(shm, "fill"), "wb") as f:
    f.write(b"\0" * 4096)
with structlog.testing.capture_logs() as logs:
    made = directory.create("job")
print(json.dumps({"made": made, "logs": logs, "left": sorted(os.listdir(shm)),
                  "locks": len(directory._locks)}))
"""


def test_a_full_tmpfs_is_one_warning_and_leaves_nothing(tmp_path):
    shm = tmp_path / "shm"
    shm.mkdir()
    mount = f'mount -t tmpfs -o size=4k tmpfs "{shm}" || exit 97; exec "$@"'
    try:
        r = subprocess.run(
            ["unshare", "-m", "--propagation", "private", "sh", "-c", mount, "sh"]
            + [sys.executable, "-c", _CHILD, str(shm)],
            capture_output=True,
            text=True,
            timeout=60,
            cwd=ROOT,
        )
    except OSError:
        pytest.skip("no unshare here")
    if r.returncode == 97 or "unshare failed" in r.stderr:
        pytest.skip(f"cannot mount a tmpfs here: {r.stderr.strip()}")
    assert r.returncode == 0, r.stderr
    got = json.loads(r.stdout.splitlines()[-1])
    assert got["made"] is None and got["left"] == ["fill"] and got["locks"] == 0, got
    (off,) = got["logs"]
    assert off["event"] == "memory_state_off" and off["log_level"] == "warning", off
    assert f"cannot create its directory in {shm} (No space left on device)" in off["reason"]
    assert f"free space in {shm}" in off["fix"] and "--no-memory-state" in off["fix"], off
