"""The replay's verdict on a local worker's failure, in the restart: where the failed rank left a
repro bundle (elasticd.checkpoint.bundle: a script using CheckpointManager under --ledger), the
daemon re-runs the failed step in one process on this node once the group is down
(`elasticd replay`, ops/replay.py) and reads its exit code.

Why: the repeat rule (lifecycle/triage.py) needs the same failure twice and guesses from the
message; a replay that fails the same way from the certified pre-step state, the same samples
and the same RNG shows the failure is the code's or the data's: the job ends as deterministic
(exit code 6) after one failure (`Failure.replayed`, which the restart request carries to the
next closing, cluster/closing.py). A replay whose step completes calls the failure transient: the
job restarts as before. Anything else (no bundle, a refused or undecided replay, the time out)
decides nothing, with one `replay_undecided` line, and the repeat rule stays the judge.

What it cannot tell: hardware (a failure that replays on another node but not on this one needs
the replay elsewhere, not done yet), nor a failure at a world of one where the step needs the
world's gradients (docs/replay.md).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

from elasticd import repro
from elasticd.lifecycle import triage
from elasticd.lifecycle.states import Failure, RestartCause
from elasticd.lifecycle.triage import FailureClass

VERDICTS = {0: "reproduced", 1: "transient"}  # `elasticd replay`'s exit codes that decide
SLACK = 10.0  # seconds past the replay's own --timeout before the daemon kills it


def bundle_of(why: Failure, attempt_dir: Path | None) -> Path | None:
    """The failed rank's bundle, where its failure is an exception of the user's code (not a
    death of another rank's going: on another node, its own replay would only delay its join)."""
    if (
        attempt_dir is None
        or why.kind is not RestartCause.CRASH
        or why.failure_class != FailureClass.USER.value
        or why.rank is None
        or not why.exception
        or triage.consequence(why.exception)  # died of another's going: its step replays clean
    ):
        return None
    path = attempt_dir / f"rank{why.rank}{repro.SUFFIX}"
    return path if path.is_file() else None


def judge(
    why: Failure,
    path: Path,
    timeout: float,
    idle: Callable[[float, Callable[[], bool]], None],
    event: Callable[..., None],
) -> Failure:
    """Run the replay of `path` (its output in rankR.replay.log beside it), waiting through the
    agent's loop (`idle`), and return `why` with its verdict ("" where it decided nothing)."""
    log = path.with_name(path.name.replace(repro.SUFFIX, ".replay.log"))
    cmd = [sys.executable, "-P", "-m", "elasticd", "replay", str(path), "--timeout", f"{timeout:g}"]
    t0 = time.monotonic()
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            start_new_session=True,
        )  # fmt: skip
        idle(t0 + timeout + SLACK, lambda: proc.poll() is not None)
        if proc.poll() is None:  # past its own timeout, or a stop came
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
        code = proc.wait()
    said = _last_line(log)
    verdict = VERDICTS.get(code, "")
    fields = {"rank": why.rank, "bundle": str(path), "seconds": round(time.monotonic() - t0, 2)}
    if verdict:
        event("replay_verdict", level="error" if code == 0 else "info", verdict=verdict,
              said=said, **fields)  # fmt: skip
    else:
        event("replay_undecided", level="warning", said=said or f"exit {code}", **fields,
              action="the repeat rule judges it")  # fmt: skip
    return dataclasses.replace(why, replayed=verdict)


def _last_line(log: Path) -> str:
    """The replay's verdict line (`elasticd replay: ...`), the last one it printed."""
    try:
        with open(log, "rb") as f:
            f.seek(max(0, f.seek(0, os.SEEK_END) - 8192))
            lines = f.read().decode(errors="replace").splitlines()
    except OSError:
        return ""
    found = [line for line in lines if line.startswith("elasticd replay:")]
    return found[-1][:500] if found else ""
