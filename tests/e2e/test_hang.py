"""Hang detection: stopped, spinning and deadlocked ranks are found in seconds, with stacks."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest
import torch

from harness import RESTART, script, wait_until

HB = (
    "--heartbeat-timeout",
    "2",
    "--startup-timeout",
    "60",
    "--restart-grace",
    "0.5",
    "--max-restarts",
    "2",
)


def hang_events(d):
    """The job's recoveries, each with its cause: a restart, or (--in-place auto, the default on
    torch>=2.14) the hung rank killed and replaced in place."""
    return [
        e
        for e in d.events()
        if (e.get("event") == "state" and e.get("new") == "RESTARTING")
        or e.get("event") == "replaced_in_place"
    ]


def restart_time(d) -> float:
    from datetime import datetime

    e = hang_events(d)[0]
    return datetime.fromisoformat(e["timestamp"].replace("Z", "+00:00")).timestamp()


def test_sigstop_past_the_heartbeat_timeout_is_a_hang(daemons):
    """A stopped worker is judged by its silence (the heartbeat timeout), never by its state."""
    d = daemons(script("hang.py"), *RESTART, "--nproc-per-node", "2", *HB, args=["--steps", "40"])
    d.wait_for_step(1, 3, timeout=60)
    pid = d.worker_pids()[1]
    t0 = time.time()
    os.kill(pid, signal.SIGSTOP)
    assert d.wait(90) == 0, d.stderr()[-3000:]
    cause = hang_events(d)[0]["cause"]
    assert "hung: no heartbeat for" in cause, cause  # rank 0 waits in all_reduce: silent as long
    assert 2 - 0.5 < restart_time(d) - t0 < 2 + 1  # the heartbeat timeout, not the state
    stacks = (d.run_dir() / "attempt1" / "rank1.stacks.txt").read_text()
    assert "most recent call first" in stacks and "hang.py" in stacks


def test_debugger_attach_and_a_short_stop_never_restart(daemons):
    """gdb -p, strace -p, py-spy dump --native: a ptrace attach stops the worker (state t) for as
    long as someone looks. Neither that nor a SIGSTOP shorter than the heartbeat timeout before the
    job's deadline is learned (daemon/deadlines.py: 50 steps) restarts anything: same pids,
    training goes on."""
    d = daemons(
        script("hang.py"),
        "--nproc-per-node",
        "2",
        "--heartbeat-timeout",
        "6",
        "--max-restarts",
        "0",
        args=["--steps", "150"],  # 7.5 s: still training after the looks
    )
    d.wait_for_step(1, 3, timeout=60)
    pids = d.worker_pids()
    holds = [
        subprocess.Popen(
            [sys.executable, script("ptrace_hold.py"), str(pids[rank]), "3", how],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for rank, how in ((1, "attach"), (0, "seize"))
    ]
    for held in holds:
        out, err = held.communicate(timeout=30)
        assert held.returncode == 0 and "detached" in out, err
        looks = out.splitlines()[:-1]
        assert looks and all(
            ln.startswith("state t tracer ") and not ln.endswith(" 0") for ln in looks
        ), looks
    # a step after the looks, so the stop's 3 s are its whole silence (not the looks' 3 s as well)
    last = max(int(n) for n in re.findall(r"^step (\d+)\b", d.log_text(1), re.M))
    d.wait_for_step(1, last + 1, timeout=30)
    os.kill(pids[1], signal.SIGSTOP)
    time.sleep(3)
    os.kill(pids[1], signal.SIGCONT)
    assert d.worker_pids() == pids and not hang_events(d)
    assert d.wait(90) == 0, d.stderr()[-3000:]
    assert not hang_events(d) and "done" in d.log_text(1)


def test_endless_loop_detected_within_timeout(daemons):
    d = daemons(
        script("hang.py"),
        *RESTART,
        "--nproc-per-node",
        "2",
        *HB,
        args=["--steps", "10", "--mode", "loop", "--at", "3"],
    )
    wait_until(lambda: "entering an endless loop" in d.log_text(1, 1), 60, what="the loop to start")
    t0 = time.time()
    assert d.wait(90) == 0, d.stderr()[-3000:]
    cause = hang_events(d)[0]["cause"]
    assert "hung: no heartbeat for" in cause, cause
    assert restart_time(d) - t0 < 2 + 1 + 0.5
    stacks = (d.run_dir() / "attempt1" / "rank1.stacks.txt").read_text()
    assert "hang.py" in stacks and "in main" in stacks


def test_deadlock_detected_with_stacks_of_every_rank(daemons):
    d = daemons(
        script("hang.py"),
        "--nproc-per-node",
        "2",
        *HB,
        args=["--steps", "8", "--mode", "deadlock", "--at", "3"],
    )
    assert d.wait(120) == 0, d.stderr()[-3000:]
    ev = hang_events(d)[0]
    assert "hung: no heartbeat" in ev["cause"] and "stacks" in ev["cause"]
    for rank in (0, 1):
        text = (d.run_dir() / "attempt1" / f"rank{rank}.stacks.txt").read_text()
        assert "elasticd stack dump" in text and "hang.py" in text
    assert "in recv" in (d.run_dir() / "attempt1" / "rank1.stacks.txt").read_text()
    assert "all_reduce" in (d.run_dir() / "attempt1" / "rank0.stacks.txt").read_text()


def test_script_that_never_beats_is_not_judged(daemons):
    d = daemons(
        script("silent.py"),
        "--nproc-per-node",
        "1",
        "--heartbeat-timeout",
        "0.5",
        "--startup-timeout",
        "0.5",
        args=["3"],
    )
    assert d.wait(60) == 0, d.stderr()[-3000:]
    assert not hang_events(d)


def test_require_heartbeat_judges_a_silent_script(daemons):
    d = daemons(
        script("silent.py"),
        "--nproc-per-node",
        "1",
        "--startup-timeout",
        "1",
        "--require-heartbeat",
        "--max-restarts",
        "0",
        args=["30"],
    )
    assert d.wait(60) == 1
    assert "no heartbeat within startup timeout" in d.stderr()


def test_slow_interpreter_exit_is_not_a_hang(daemons):
    """After the entrypoint returns no optimizer step reports progress; a teardown longer than
    the heartbeat timeout (atexit, destroy_process_group, module GC) is not judged hung."""
    d = daemons(
        script("hang.py"),
        "--nproc-per-node",
        "2",
        "--heartbeat-timeout",
        "1",
        "--max-restarts",
        "0",
        args=["--steps", "3", "--step-time", "0.05", "--exit-delay", "3"],
    )
    assert d.wait(90) == 0, d.stderr()[-3000:]
    assert not hang_events(d)


def _learned(d) -> dict | None:
    found = [e for e in d.events() if e.get("event") == "hang_deadline_learned"]
    return found[0] if found else None


def test_at_the_defaults_a_sigstop_is_found_at_the_deadline_learned_from_the_job(daemons):
    """No --heartbeat-timeout (300 s, the ceiling): after 50 steps the deadline is learned from
    the job's step gaps (the floor, 1 s, for 20 ms steps), and a SIGSTOP of rank 1 is a hang
    at a stopped rank's own deadline (2 x the p99 step gap less a tick, at least 0.2 s: within
    the learned one), put on rank 1 as stopped (before: not found for 300 s)."""
    d = daemons(
        script("hang.py"),
        *RESTART,
        "--nproc-per-node",
        "2",
        "--restart-grace",
        "0.5",
        args=["--steps", "300", "--step-time", "0.02"],
    )
    learned = wait_until(lambda: _learned(d), 60, what="the deadline learned")
    assert 1.0 <= learned["seconds"] < 5 and learned["ceiling"] == 300, learned

    def shown_learned() -> dict | None:
        # status publishes every 0.5 s: the event can come before the next snapshot
        shown = json.loads(d.status("--json").stdout)
        return shown if shown["hang_deadline_basis"].startswith("the job's deadline ") else None

    shown = wait_until(shown_learned, 10, what="status showing the learned deadline")
    assert 1.0 <= shown["hang_deadline"] < 300, shown
    pid = d.worker_pids()[1]
    t0 = time.time()
    os.kill(pid, signal.SIGSTOP)
    wait_until(lambda: hang_events(d), 30, what="the hang")
    cause = hang_events(d)[0]["cause"]
    assert cause.startswith("rank 1 (node ") and "a stopped rank's deadline" in cause, cause
    assert "2 x p99" in cause, cause
    assert "stopped by a signal (state T)" in cause, cause
    took = restart_time(d) - t0
    print(f"SIGSTOP found after {took:.2f}s (deadline {learned['seconds']}s)")
    assert took < learned["seconds"] + 2.0, (took, learned)
    assert d.wait(90) == 0, d.stderr()[-3000:]


def test_heavy_tailed_step_jitter_raises_no_false_hang(daemons):
    """300 steps whose every rank sleeps a log-normal extra each step (median 10 ms, sigma 1: a
    few steps ten times the median): the deadline is learned (after 25 steps a rank) and no hang
    is declared in the 275 it judges (10,000 such steps: bench/detection.py's false alarms)."""
    d = daemons(
        script("hang.py"),
        "--nproc-per-node",
        "2",
        "--max-restarts",
        "0",
        args=["--steps", "300", "--step-time", "0.005", "--jitter", "0.01,1.0"],
    )
    assert d.wait(120) == 0, d.stderr()[-3000:]
    assert _learned(d) and not hang_events(d)


def _culprit(d) -> dict:
    return wait_until(
        lambda: next((e for e in d.events() if e.get("event") == "hang_culprit"), None),
        90,
        what="the hang's verdict",
    )


# the collectives' evidence: torch's Flight Recorder (its default; the backend's own entries), or
# our dispatcher hook where the user turned the recorder off (worker/collective_hook.py); on gloo,
# and on NCCL where there is a GPU (the ranks may share one: tests/scripts/one_gpu.py)
GPU = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU (NCCL)")
OFF = {"TORCH_FR_BUFFER_SIZE": "0"}
RECORDERS = pytest.mark.parametrize(
    ("backend", "recorder", "env"),
    [
        ("gloo", "gloo", {}),
        ("gloo", "elasticd", OFF),
        pytest.param("nccl", "nccl", {}, marks=GPU),
        pytest.param("nccl", "elasticd", OFF, marks=GPU),
    ],
    ids=["flight_recorder", "recorder_off", "nccl-flight_recorder", "nccl-recorder_off"],
)


@RECORDERS
def test_a_desync_names_the_rank_both_ops_and_the_seq(daemons, backend, recorder, env):
    """Three ranks: at step 3 rank 2 calls all_gather where ranks 0 and 1 call all_reduce. The
    ranks' own collectives (torch's Flight Recorder, or our hook where it is off; asked before
    anything is killed) name rank 2, both ops and the sequence number, in the cause's first
    words and its fields."""
    d = daemons(
        script("hang.py"),
        "--nproc-per-node",
        "3",
        *HB,
        args=["--steps", "6", "--mode", "desync", "--at", "3", "--rank", "2", "--backend", backend],
        env=env,
    )
    ev = _culprit(d)
    assert ev["collectives"] == "desync" and ev["seq"] == 3 and ev["culprits"] == [2], ev
    assert ev["desync"] is True, ev
    said = (
        "desync at seq 3: rank 2 called all_gather ([[1]] Float) while the others (ranks 0, 1) "
        "called all_reduce ([[1]] Float)"
    )
    assert ev["verdict"].startswith(said), ev
    # the stacks never blame the ranks that called the right collective (on NCCL they wait in
    # the loss's read, the odd rank in its all_gather's wait)
    assert "rank 0 was" not in ev["verdict"] and "rank 1 was" not in ev["verdict"], ev
    cause = wait_until(lambda: hang_events(d), 30, what="the restart")[0]["cause"]
    assert cause.startswith("rank 2 (node ") and said in cause, cause
    dump = json.loads((d.run_dir() / "attempt1" / "rank2.collectives.json").read_text())
    # a build with NCCL too (torch 2.14.1's CUDA build) dumps a list: the CPU recorder's, NCCL's
    entries = [
        e
        for x in (dump if isinstance(dump, list) else [dump])
        for e in x.get("entries", [])
        if e["profiling_name"].startswith(f"{recorder}:")
    ]
    assert entries[-1]["profiling_name"] == f"{recorder}:all_gather", entries[-1]
    assert d.wait(90) == 0, d.stderr()[-3000:]


@RECORDERS
def test_a_hang_in_a_collective_names_who_never_arrived(daemons, backend, recorder, env):
    """Two ranks: at step 3 rank 1 sleeps in a data read while rank 0 waits in all_reduce. The
    sequence numbers name rank 1 as never arrived at seq 3 (its last: seq 2)."""
    d = daemons(
        script("hang.py"),
        "--nproc-per-node",
        "2",
        *HB,
        args=[
            *("--steps", "6", "--mode", "stuck", "--at", "3", "--step-time", "0.02"),
            *("--backend", backend),
        ],
        env=env,
    )
    ev = _culprit(d)
    assert ev["collectives"] == "never_arrived" and ev["culprits"] == [1], ev
    said = (
        "rank 1 (its last seq 2, all_reduce) never arrived at seq 3 (all_reduce ([[1]] Float)) "
        "while 1 rank waited in it; rank 1 was in `read_batch`"
    )
    assert ev["verdict"].startswith(said), ev
    cause = wait_until(lambda: hang_events(d), 30, what="the restart")[0]["cause"]
    assert cause.startswith("rank 1 (node ") and said in cause, cause
    assert d.wait(90) == 0, d.stderr()[-3000:]
