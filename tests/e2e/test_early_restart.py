"""A crash in a job's first minute, on a loaded machine: the restart never waits for the probe
that learns the job's imports (it runs at idle priority, and a busy machine starves it). The new
workers are spares forked before the kill, also while the probe runs (a restart just after the
learning ends takes spares forked with what was learned instead); the restart says in one
line why it may be slower than later ones, and the learning survives the restarts."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import psutil

from harness import FAST, RESTART, script, wait_until

# seconds from the kill's detection to every rank's first step: a bound against a restart that
# waits for the probe, not a speed target (bench/recovery.py measures that): the whole suite and
# the busy loops share 2 cores here, and the new ranks still import scipy themselves (3.1-4.6 s)
BOUND = 20.0


def _busy(n: int) -> list[subprocess.Popen]:
    """Processes that keep `n` cores busy at normal priority (the probe's is idle), as other
    jobs and their data loaders do on a shared node."""
    return [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(n)]


def _recovered(d, count: int) -> dict:
    return wait_until(
        lambda: (
            (r := [e for e in d.events() if e.get("event") == "recovered"])[count - 1 :]
            and r[count - 1]
        ),
        60,
        what=f"recovery {count}",
    )


def _kill_and_time(d, rank: int, count: int) -> tuple[float, list[int]]:
    """kill -9 a rank; the recovery's seconds and the pids of the ranks that replaced them."""
    killed_at = time.time()
    os.kill(d.worker_pids()[rank], signal.SIGKILL)
    recovered = _recovered(d, count)
    pids = list(d.worker_pids().values())
    return recovered["first_step"], [p for p in pids if psutil.Process(p).create_time() > killed_at]


def _learned_before_restart(d, count: int) -> bool:
    """Whether preload_learned was said before restart `count` started its ranks: the spares
    waiting then were let go for ones forked with the learned modules, maybe after the kill."""
    events = d.events()
    started = next(
        i
        for i, e in enumerate(events)
        if e.get("event") == "state" and e.get("new") == "RUNNING" and e.get("restart") == count
    )
    return any(e.get("event") == "preload_learned" for e in events[:started])


def test_restart_while_the_imports_are_learned_takes_warm_spares(daemons, tmp_path):
    busy = _busy(len(os.sched_getaffinity(0)))  # every core: the probe (idle priority) waits
    try:
        d = daemons(
            script("early_crash.py"),
            *RESTART,
            *FAST,
            "--nproc-per-node",
            "2",
            "--max-restarts",
            "5",
            args=["scipy.optimize", "--steps", "100000", "--step-time", "0.05"],
        )
        names = wait_until(
            lambda: list(d.run_dir().glob("preload-learned1.txt")), 120, what="learning asked"
        )
        assert names
        seconds, cold = [], []
        for count in (1, 2):
            learned = [e for e in d.events() if e.get("event") == "preload_learned"]
            took, started_after = _kill_and_time(d, 1, count)
            seconds.append(took)
            if not _learned_before_restart(d, count):  # a restart while the imports are learned
                cold.append(started_after)
            print(
                f"restart {count}: every rank stepping {took:.3f} s after the kill's detection"
                f" (learning done before: {bool(learned)})"
            )
        unlearned = [e for e in d.events() if e.get("event") == "restart_before_learned"]
        assert unlearned and unlearned[0]["modules"] > 0, [e.get("event") for e in d.events()]
    finally:
        for p in busy:
            p.kill()
            p.wait()
    # every new rank of a restart while learning was a spare waiting before the kill (the first
    # restart is one: restart_before_learned; the second too unless learning ended just then)
    assert cold and all(pids == [] for pids in cold), cold
    assert max(seconds) < BOUND, seconds
    report = wait_until(
        lambda: [e for e in d.events() if e.get("event") == "preload_learned"], 120, what="learned"
    )
    assert not report[0].get("error"), report[0]  # the probe survived the restarts' sweeps
    d.kill(signal.SIGTERM)
    assert d.wait(60) == 0, d.stderr()[-3000:]
