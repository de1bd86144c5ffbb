"""How a worker's end reads: a rank killed by a signal after its script returned (SIGABRT from
interpreter teardown) does not fail or restart a finished job; the same death before the script
returned still restarts; a script's uncaught exception shows the traceback `python script.py`
shows, from the script's first frame."""

from __future__ import annotations

import json
import re

from harness import FAST, final_lines, script


def _states(d) -> list[str]:
    return [e["new"] for e in d.events() if e.get("event") == "state"]


def test_death_after_the_script_returned_ends_the_job_with_one_warning(daemons):
    d = daemons(
        script("faulty.py"),
        "--nproc-per-node",
        "2",
        *FAST,
        args=["--steps", "2", "--step-time", "0", "--abort-at-exit"],
    )
    assert d.wait(90) == 0, d.stderr()[-3000:]
    warned = [e for e in d.events() if e.get("event") == "died_after_return"]
    assert len(warned) == 1 and warned[0]["level"] == "warning", warned
    assert warned[0]["rank"] == 1 and warned[0]["exit"] == "killed by SIGABRT", warned
    assert "RESTARTING" not in _states(d) and _states(d)[-1] == "SUCCEEDED"
    assert "done" in d.log_text(1)


def test_death_before_the_script_returned_still_restarts(daemons):
    d = daemons(
        script("faulty.py"),
        "--nproc-per-node",
        "2",
        *FAST,
        args=["--steps", "3", "--step-time", "0", "--abort-at", "2", "--only-first-attempt"],
    )
    assert d.wait(90) == 0, d.stderr()[-3000:]
    causes = [e["cause"] for e in d.events() if e.get("new") == "RESTARTING"]
    assert len(causes) == 1 and "rank 1" in causes[0] and "SIGABRT" in causes[0], causes
    assert not [e for e in d.events() if e.get("event") == "died_after_return"]


def test_traceback_begins_at_the_script(daemons):
    """Was 7 frames of runpy, the fork server and the bootstrap before the script's (issue 31)."""
    d = daemons(
        script("faulty.py"),
        "--nproc-per-node",
        "2",
        "--max-restarts",
        "0",
        *FAST,
        args=["--steps", "3", "--step-time", "0", "--raise-at", "1"],
    )
    assert d.wait(90) == 1, d.stderr()[-3000:]
    log = d.log_text(1)  # through torch's excepthook, which prefixes [rank1]: as under torchrun
    frames = re.findall(r'^(?:\[rank1\]: )?  File "([^"]+)"', log, re.M)
    assert log.count("Traceback (most recent call last):") == 1, log[-3000:]
    assert frames and set(frames) == {script("faulty.py")}, log  # main(), then the raise
    error = json.loads((d.run_dir() / "attempt1" / "rank1.error.json").read_text())
    stack = error["message"]["extraInfo"]["py_callstack"]
    assert re.findall(r'^  File "([^"]+)"', stack, re.M) == frames, stack
    assert any("injected failure at step 1" in line for line in final_lines(d.stderr()))
