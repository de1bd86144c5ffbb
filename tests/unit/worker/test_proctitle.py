"""A worker's /proc/PID/cmdline reads as the command torchrun would run (real processes, real
/proc). The daemon-level checks, cold, forked and fresh spares, are in test_core and
test_forkserver."""

from __future__ import annotations

import json
import subprocess
import sys

import psutil
import pytest

from elasticd.worker import proctitle

# Shows a title in a process started as `command`, then reports what the kernel and psutil say.
SHOW = """
import json, os, sys
import psutil
from elasticd.worker import proctitle
shown = json.loads(os.environ["SHOWN"])
first, again = proctitle.show(shown), proctitle.show(shown)
print(json.dumps({"first": first, "again": again, "argv": sys.argv,
                  "raw": open("/proc/self/cmdline", "rb").read().decode(),
                  "psutil": psutil.Process().cmdline()}))
"""


@pytest.mark.parametrize(
    "script, args",
    [("/a/long/path/to/some/train.py", ["--lr", "0.1", "--name", "x y"]), ("a.py", [])],
    ids=["padded", "short"],
)
def test_title_is_what_torchrun_shows(tmp_path, script, args):
    (tmp_path / "show_title.py").write_text(SHOW)
    shown = proctitle.title(script, args)
    assert shown == [sys.executable, "-u", script, *args]
    command = proctitle.command("show_title", shown)
    got = _run_in(tmp_path, command, shown)
    assert (
        got["first"] is True and got["again"] is False
    )  # once only: the area is no longer the original
    assert got["argv"][1:] == []  # Python's own view is untouched
    if not args:  # the command is longer than the title: one string, as setproctitle(3) writes it
        assert command == [sys.executable, "-Pm", "show_title"]
        assert got["raw"] == " ".join(shown) + "\0"
    else:  # padded to the title's length: NUL for NUL what `python -u train.py ...` shows
        flags = command[1]
        assert flags.startswith("-P") and set(flags[2:-1]) == {"u"} and flags[-1] == "m"
        assert got["raw"] == "\0".join(shown) + "\0"
    assert got["psutil"] == shown


def test_title_longer_than_the_area_is_cut_and_never_runs_past_it(tmp_path):
    (tmp_path / "show_title.py").write_text(SHOW)
    shown = [sys.executable, "-u", "/x/" + "y" * 300 + ".py", "--flag"]
    got = _run_in(tmp_path, [sys.executable, "-m", "show_title"], shown)
    area = len(sys.executable) + len("-m show_title") + 2
    assert got["first"] is True
    assert got["raw"] == " ".join(shown)[: area - 2] + "\0"  # nothing of the environment after it


def test_module_title_and_pgrep_finds_the_script(tmp_path):
    (tmp_path / "show_title.py").write_text(
        SHOW + "\nimport time; print(flush=True); time.sleep(30)\n"
    )
    shown = proctitle.title("my_pkg.train_module", ["--epochs", "5"])
    assert shown == [sys.executable, "-u", "-m", "my_pkg.train_module", "--epochs", "5"]
    proc = subprocess.Popen(
        proctitle.command("show_title", shown),
        stdout=subprocess.PIPE,
        text=True,
        env={"SHOWN": json.dumps(shown), "PYTHONPATH": str(tmp_path)},
    )
    try:
        assert proc.stdout is not None and proc.stdout.readline()
        found = subprocess.run(
            ["pgrep", "-f", "my_pkg.train_module --epochs 5"],
            capture_output=True,
            text=True,
            timeout=10,
        ).stdout.split()
        assert str(proc.pid) in found
        assert psutil.Process(proc.pid).cmdline() == shown
    finally:
        proc.kill()
        proc.wait(10)


def _run_in(tmp_path, command: list[str], shown: list[str]) -> dict:
    out = subprocess.run(
        command,
        env={"SHOWN": json.dumps(shown), "PYTHONPATH": str(tmp_path)},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)
