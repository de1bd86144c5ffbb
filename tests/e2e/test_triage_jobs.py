"""Triage with real daemons and workers: a deterministic failure stops the job at its second
occurrence with exit code 6 (one node, and across two daemons on loopback, where the round's
closing decides for the job); one that differs per attempt is retried as before; a worker
OOM-killed in a memory-limited cgroup is classified oom, a plain SIGKILL killed."""

import json
import os
import signal
import uuid
from pathlib import Path

import pytest
import torch.distributed as dist

from elasticd.exit_codes import ExitCode
from harness import (
    FAST,
    FAST_NODES,
    RESTART,
    final_lines,
    free_port,
    node_flags,
    script,
    wait_until,
)

FIXED = ["--steps", "4", "--raise-at", "2", "--beat", "--step-time", "0.02"]
ONE = [*FIXED, "--rank", "0"]  # one worker: the failing rank


def events(d, name: str) -> list[dict]:
    return [e for e in d.events() if e.get("event") == name]


def test_the_same_exception_at_the_same_step_stops_after_the_second_attempt(daemons):
    d = daemons(
        script("faulty.py"), "--nproc-per-node", "1", "--max-restarts", "5", *FAST, args=ONE
    )
    assert d.wait(120) == ExitCode.DETERMINISTIC, d.stderr()[-3000:]
    assert len(d.attempt_dirs()) == 2  # not the 6 the budget allows
    (line,) = final_lines(d.stderr())
    for part in (
        "deterministic failure",
        "in attempts 1 and 2",
        "ValueError: injected failure at step N at faulty.py:",
        "(step 2)",
        "[class user]",
    ):
        assert part in line, line
    (verdict,) = events(d, "deterministic_failure")
    assert "attempts 1 and 2" in verdict["why"]
    restarting = [e for e in d.events() if e.get("new") == "RESTARTING"]
    assert [e["failure_class"] for e in restarting] == ["user", "user"]


def test_an_exception_at_another_step_each_attempt_is_retried_as_before(daemons):
    d = daemons(
        script("faulty.py"),
        "--nproc-per-node",
        "1",
        "--max-restarts",
        "2",
        *FAST,
        args=[*ONE, "--steps", "8", "--later-each-attempt"],  # steps 2, 3, 4
    )
    assert d.wait(120) == 1, d.stderr()[-3000:]
    assert len(d.attempt_dirs()) == 3
    assert not events(d, "deterministic_failure") and events(d, "restart_budget_spent")
    (line,) = final_lines(d.stderr())
    assert "job failed after 2 restart(s)" in line and "[class user]" in line, line


def test_two_nodes_stop_together_on_the_closing_verdict(daemons):
    """Rank 1 (node b) fails the same way twice: the closing of the third round (whichever node
    closes it) writes the verdict, and both daemons exit 6 after two attempts each."""
    port = free_port()
    flags = ("--nproc-per-node", "1", "--max-restarts", "5", *FAST_NODES, *node_flags(port, "2"))
    a = daemons(script("faulty.py"), *flags, name="a", args=FIXED)
    b = daemons(script("faulty.py"), *flags, name="b", args=FIXED)
    for n in (a, b):
        assert n.wait(120) == ExitCode.DETERMINISTIC, n.stderr()[-3000:]
        assert len(n.attempt_dirs()) == 2
        (line,) = final_lines(n.stderr())
        assert "deterministic failure" in line and "in attempts 1 and 2" in line, line
    # whichever node asked first (b's exception, or a's rank seeing its peer go), both restarts
    # were of class user on both nodes: the class travels in the restart request
    for n in (a, b):
        restarting = [e["failure_class"] for e in n.events() if e.get("new") == "RESTARTING"]
        assert restarting == ["user", "user"], restarting


MEMORY_ROOT = Path("/sys/fs/cgroup/memory")


@pytest.fixture
def memory_cgroup():
    """A cgroup v1 memory cgroup limited to 64 MiB, removed after the test."""
    if not os.access(MEMORY_ROOT, os.W_OK):
        pytest.skip("needs a writable cgroup v1 memory controller (root) at /sys/fs/cgroup/memory")
    path = MEMORY_ROOT / f"elasticd-test-{uuid.uuid4().hex[:8]}"
    path.mkdir()
    try:
        (path / "memory.limit_in_bytes").write_text(str(64 << 20))
        yield path
    finally:
        wait_until(lambda: not (path / "cgroup.procs").read_text().strip(), 10, what="empty")
        path.rmdir()


def test_a_worker_oom_killed_in_its_cgroup_is_classified_oom(daemons, tmp_path, memory_cgroup):
    """Rank 1 moves into a 64 MiB cgroup and allocates until the OOM killer ends it: class oom in
    status, the events and the metrics; the next attempt's worker killed with a plain SIGKILL is
    class killed."""
    prom = tmp_path / "text" / "elasticd.prom"
    prom.parent.mkdir(mode=0o755)
    d = daemons(
        script("oom_hog.py"),
        "--nproc-per-node",
        "2",
        "--max-restarts",
        "3",
        "--metrics-textfile",
        str(prom),
        *FAST,
        args=["--cgroup", str(memory_cgroup), "--steps", "100000", "--step-time", "0.05"],
    )

    def last_failure():
        assert d.proc.poll() is None, d.stderr()[-3000:]
        r = d.status("--json")
        s = json.loads(r.stdout) if r.returncode == 0 else {}
        return s if s.get("state") == "RUNNING" and s.get("last_failure") else None

    s = wait_until(last_failure, 90, what="a restart after the OOM kill")
    assert s["last_failure"]["failure_class"] == "oom", s["last_failure"]
    assert s["last_failure"]["exit_code"] == -signal.SIGKILL
    assert s["failures_by_class"] == {"oom": 1}
    wait_until(
        lambda: 'elasticd_failures_total{class="oom"' in prom.read_text(), 20, what="the metric"
    )
    assert "[class oom]" in d.status().stdout
    d.wait_for_step(1, 3, timeout=60, attempt=2)
    os.kill(d.worker_pids()[1], signal.SIGKILL)  # nothing ran out of memory this time
    wait_until(
        lambda: (last_failure() or {}).get("failures_by_class") == {"oom": 1, "killed": 1},
        60,
        what="the SIGKILL's restart",
    )
    # the OOM kill restarts the group (a class the repeat rule judges: never in place); the
    # plain SIGKILL restarts it too, or is recovered in place (--in-place auto, torch>=2.14)
    restarting = [e["failure_class"] for e in d.events() if e.get("new") == "RESTARTING"]
    replaced = [e for e in d.events() if e.get("event") == "replaced_in_place"]
    assert restarting in (["oom", "killed"], ["oom"]), restarting
    assert len(replaced) == (len(restarting) == 1), replaced


def test_the_same_exception_printing_another_float_each_attempt_is_deterministic(daemons):
    """The exception's message prints a loss that differs every attempt (0.3123, then -0.2718):
    numbers are masked as numbers, so it is the same failure and the job stops at its second
    occurrence (before: only digit runs were masked, and it ran the whole budget)."""
    args = [*ONE, "--error", "loss {loss} exceeds the bound 2.5e+01"]
    d = daemons(
        script("faulty.py"), "--nproc-per-node", "1", "--max-restarts", "5", *FAST, args=args
    )
    assert d.wait(120) == ExitCode.DETERMINISTIC, d.stderr()[-3000:]
    assert len(d.attempt_dirs()) == 2
    (line,) = final_lines(d.stderr())
    assert "RuntimeError: loss N exceeds the bound N at faulty.py:" in line, line
    assert "in attempts 1 and 2" in line, line


def test_the_first_failure_is_the_jobs_not_the_rank_that_died_of_it(daemons):
    """Rank 1 raises and closes its connections, then takes 2 s to exit; rank 0 dies at once of
    gloo's "Connection closed by peer" and is reaped first. The failure, its deterministic verdict
    and status name rank 1, its frame and its exception, rank 0's death a consequence (before:
    rank 0's, every time, and the verdict named rank 0's connection error)."""
    retries = ("--deterministic-retries", "2")  # 3 attempts: time to read status in
    d = daemons(
        script("first_failure.py"),
        *RESTART,
        "--nproc-per-node",
        "2",
        "--max-restarts",
        "5",
        *retries,
        *FAST,
    )
    first = wait_until(lambda: _last_failure(d), 60, what="the first failure in status")
    assert first["rank"] == 1 and first["exception"].startswith("ValueError: bad batch"), first
    assert first["frame"].startswith("first_failure.py:") and first["step"] == 3, first
    (then,) = first["consequences"]
    assert then.startswith("rank 0: RuntimeError: ") and "closed by peer" in then, first
    assert d.wait(120) == ExitCode.DETERMINISTIC, d.stderr()[-3000:]
    causes = [e["cause"] for e in d.events() if e.get("new") == "RESTARTING"]
    assert len(causes) == 3, causes
    for cause in causes:
        assert cause.startswith("rank 1 (node ") and "; ValueError: bad batch at step 3" in cause
    line = final_lines(d.stderr())[-1]  # after the ranks' tracebacks the tee echoed
    assert "the same failure (ValueError: bad batch at step N: loss N at first_failure.py:" in line
    assert "not restarted: rank 1 (node " in line and "then rank 0: RuntimeError" in line, line


def test_at_three_ranks_both_ranks_that_died_of_it_are_consequences(daemons):
    """Three ranks: rank 1 raises and closes its connections; ranks 0 and 2, both its neighbours
    in gloo's ring, die of its going before it exits. Every attempt's cause is rank 1's, and the
    deterministic verdict names it, the others after it."""
    d = daemons(
        script("first_failure.py"),
        *RESTART,
        "--nproc-per-node",
        "3",
        "--max-restarts",
        "3",
        "--deterministic-retries",
        "1",
        *FAST,
    )
    assert d.wait(120) == ExitCode.DETERMINISTIC, d.stderr()[-3000:]
    causes = [e["cause"] for e in d.events() if e.get("new") == "RESTARTING"]
    assert len(causes) == 2, causes
    for cause in causes:
        assert cause.startswith("rank 1 (node ") and "; ValueError: bad batch at step 3" in cause
        assert "then rank 0: " in cause or "then rank 2: " in cause, cause
    line = final_lines(d.stderr())[-1]
    assert "not restarted: rank 1 (node " in line, line


def _rank_holder(a, b, rank: str):
    for n in (a, b):
        if any(rank in e["pids"] for e in n.events() if e.get("pids")):
            return n
    return None


def _failure_of(d, rank: int) -> dict | None:
    found = _last_failure(d)
    return found if found and found["rank"] == rank else None


def _last_failure(d) -> dict | None:
    r = d.status("--json")
    found = json.loads(r.stdout).get("last_failure") if r.returncode == 0 else None
    return found if found and found.get("rank") is not None else None


def test_across_nodes_the_first_failure_takes_the_restart_request(daemons):
    """Rank 1 (node b) raises and takes 2 s to exit; rank 0 (node a) dies at once of the closed
    connection, and node a asks the restart first. Node b, told to restart, finds its rank's
    failure came first and puts it in the request's place: the round's closing judges rank 1's
    failure, and both nodes end deterministic naming rank 1 (before: rank 0's connection error)."""
    port = free_port()
    flags = ("--nproc-per-node", "1", "--max-restarts", "5", *FAST_NODES, *node_flags(port, "2"))
    flags += ("--deterministic-retries", "2")  # 3 attempts: time to read status in
    a = daemons(script("first_failure.py"), *RESTART, *flags, name="a")
    b = daemons(script("first_failure.py"), *RESTART, *flags, name="b")
    # the node holding rank 0, whose own failure was the closed connection, shows rank 1's
    zero = wait_until(lambda: _rank_holder(a, b, "0"), 60, what="rank 0 started")
    # (its own, rank 0's, until the next round's closing settled the request)
    first = wait_until(lambda: _failure_of(zero, 1), 60, what="rank 1's failure in status")
    assert "ValueError: bad batch at step 3" in first["reason"], first
    (then,) = first["consequences"]
    assert then.startswith("rank 0 (node ") and "closed by peer" in then, first
    for n in (a, b):
        assert n.wait(120) == ExitCode.DETERMINISTIC, n.stderr()[-3000:]
        line = final_lines(n.stderr())[-1]
        assert "the same failure (ValueError: bad batch at step N: loss N at " in line, line
        assert "not restarted: rank 1 (node " in line, line


@pytest.mark.parametrize("in_place", ["off", "auto"])
def test_across_nodes_a_spent_budget_names_the_first_failure(daemons, in_place):
    """The same two nodes with no deterministic rule and one restart: the job fails with its
    budget spent, and both nodes' final line and the FAILED event of the node holding rank 0 name
    rank 1's failure as the job's first (before: that node named its own rank 0's closed
    connection). In place, rank 0 does not die of it: it unwinds and waits for a generation
    while node b restarts the group for its rank's own error; node a takes b's failure as its
    own, its rank 0 a consequence (before: it named no failure, and its last line only node a)."""
    port = free_port()
    flags = ("--nproc-per-node", "1", "--max-restarts", "1", *FAST_NODES, *node_flags(port, "2"))
    flags += ("--deterministic-retries", "0", "--in-place", in_place)
    a = daemons(script("first_failure.py"), *flags, name="a")
    b = daemons(script("first_failure.py"), *flags, name="b")
    for n in (a, b):
        assert n.wait(120) == ExitCode.FAILED, n.stderr()[-3000:]
        line = final_lines(n.stderr())[-1]
        assert "job failed after 1 restart(s): rank 1 (node " in line, line
        assert "ValueError: bad batch at step 3" in line, line
    zero = _rank_holder(a, b, "0")
    (failed,) = [e for e in zero.events() if e.get("new") == "FAILED"]
    assert failed["first_failure"].startswith("rank 1 (node "), failed
    if in_place == "auto" and hasattr(dist, "_reconfigure"):  # the rank 0 holder's restart
        cause = [e for e in zero.events() if e.get("new") == "RESTARTING"][0]["cause"]
        assert cause.startswith("rank 1 (node ") and "ValueError: bad batch" in cause, cause
        assert "rank(s) 0 (node " in cause and "waited in place" in cause, cause
