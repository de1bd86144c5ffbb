"""In-place recovery (--in-place auto, daemon/inplace.py, worker/reconfigure.py): kill -9 of one
rank of three replaces that rank alone; the survivors unwind their unchanged script, re-form the
group in their own processes and resume from the in-memory state they hold, and the run ends
bit for bit where a fault-free one does. Needs a torch that can re-form a group (2.14 on);
CI runs this file in its second environment (.ci/run)."""

from __future__ import annotations

import json
import os
import re
import signal

import pytest
import torch
import torch.distributed as dist

from e2e.test_resume import final_state, tensors
from harness import bench, leftover_processes, script, wait_until

pytestmark = pytest.mark.skipif(
    not hasattr(dist, "_reconfigure"),
    reason=f"torch {torch.__version__} cannot re-form a group in place (needs torch>=2.14)",
)

ARGS = ["--steps", "60", "--checkpoint-every", "5", "--log-every", "1", "--samples", "1024"]
FLAGS = ("--nproc-per-node", "3", "--in-place", "auto", "--max-restarts", "3")


def events(d, name):
    return [e for e in d.events() if e.get("event") == name]


def test_kill_9_of_one_rank_of_three_recovers_in_place(daemons, tmp_path):
    common = [*ARGS, "--hidden", "32", "--memory-every", "1"]
    clean = daemons(
        "entrypoints.train", *FLAGS, "--checkpoint-dir", str(tmp_path / "clean"),
        name="clean", args=common,
    )  # fmt: skip
    hit = daemons(
        "entrypoints.train", *FLAGS, "--checkpoint-dir", str(tmp_path / "hit"),
        name="hit", args=[*common, "--step-delay", "0.05"],
    )  # fmt: skip
    wait_until(lambda: re.search(r"^step 12/60", hit.log_text(0, 1), re.M), 90, what="step 12")
    before = hit.worker_pids()
    os.kill(before[1], signal.SIGKILL)
    assert hit.wait(120) == 0, hit.stderr()[-3000:]
    assert clean.wait(120) == 0, clean.stderr()[-3000:]
    path = events(hit, "recovery_path")
    assert [e["path"] for e in path] == ["in_place"], path
    replaced = events(hit, "replaced_in_place")
    assert len(replaced) == 1 and replaced[0]["ranks"] == [1], replaced
    # the survivors never left their processes: the same pids ran to the end, and no restart
    assert sorted(replaced[0]["survivors"]) == sorted([before[0], before[2]])
    assert not events(hit, "in_place_refused") and len(hit.attempt_dirs()) == 1
    assert not [e for e in events(hit, "state") if e.get("new") == "RESTARTING"]
    log0 = hit.log_text(0, 1)
    assert "re_entered" in log0 and "in_place_fallback" not in log0
    # they resumed from the in-memory state they held: at most the step in flight lost
    resumed = [int(m) for m in re.findall(r"resumed from step (\d+)", log0)]
    assert len(resumed) == 1 and resumed[0] >= 11, resumed
    assert len(events(hit, "recovered")) == 1
    a, b = final_state(tmp_path / "clean"), final_state(tmp_path / "hit")
    for part in ("model", "optimizer"):
        ta, tb = dict(tensors(a[part])), dict(tensors(b[part]))
        assert ta.keys() == tb.keys() and ta
        assert all(torch.equal(ta[k], tb[k]) for k in ta), part
    assert not leftover_processes()


def restarted_after_kill(daemons, *flags: str):
    """inplace_faults.py with `flags`, rank 1 SIGKILLed at step 10, until the group restarted
    (then stopped): the daemon, which replaced the rank in place first."""
    d = daemons(
        script("inplace_faults.py"), *FLAGS, "--restart-backoff", "0",
        args=["--steps", "2000", *flags],
    )  # fmt: skip
    wait_until(lambda: re.search(r"^step 10\b", d.log_text(0, 1), re.M), 90, what="step 10")
    os.kill(d.worker_pids()[1], signal.SIGKILL)
    wait_until(lambda: len(d.attempt_dirs()) > 1, 60, what="the restart")
    d.kill(signal.SIGTERM)
    d.wait(60)
    assert len(events(d, "replaced_in_place")) == 1
    return d


def test_a_survivor_that_cannot_vouch_for_itself_falls_back_to_the_restart(daemons):
    """A thread the script started still runs when the script unwound: the survivor cannot
    say what it will do when the script runs again, so it ends, with one line saying why, and
    the group restarts as today."""
    d = restarted_after_kill(daemons, "--thread")
    text = d.log_text(0, 1) + d.log_text(2, 1)
    assert text.count("in_place_fallback") == 2 and "threads still run: ticker" in text, text
    assert not leftover_processes()


def test_a_rank_that_never_gives_its_handle_is_killed_and_replaced_in_place(daemons):
    """Rank 0 catches the failed collective and goes on: it never comes to re-form (as a
    survivor blocked in a collective that no abort ends). The daemon waits about a step for its
    handle (1 s before the job's step times are learned), kills it and starts rank 0 again into
    the generation forming, with one line naming it; the group goes on in place, no restart."""
    d = daemons(
        script("inplace_faults.py"), *FLAGS, "--restart-backoff", "0",
        args=["--steps", "2000", "--swallow"],
    )  # fmt: skip
    wait_until(lambda: re.search(r"^step 10\b", d.log_text(0, 1), re.M), 90, what="step 10")
    before = d.worker_pids()
    os.kill(before[1], signal.SIGKILL)
    wait_until(lambda: events(d, "in_place_unstuck"), 30, what="rank 0 killed and replaced")
    # every rank steps again in the re-formed group: rank 2 in its own process
    _rank_2_re_entered_then_stop(d)
    unstuck = events(d, "in_place_unstuck")
    assert len(unstuck) == 1 and unstuck[0]["ranks"] == [0], unstuck
    assert unstuck[0]["killed"] == [before[0]] and "gave no handle" in unstuck[0]["why"]
    assert "ignored:" in d.log_text(0, 1)
    assert len(d.attempt_dirs()) == 1 and not events(d, "in_place_refused")
    assert before[2] in events(d, "replaced_in_place")[0]["survivors"]
    assert not leftover_processes()


def test_a_hung_rank_is_killed_and_replaced_the_others_re_enter(daemons):
    """Rank 1 sleeps outside the step's collective while ranks 0 and 2 wait in it: past the
    heartbeat timeout the daemon names rank 1 hung, kills it and replaces it in place; the
    others' collective fails, they re-enter in their own processes, and no restart follows."""
    d = daemons(
        script("inplace_faults.py"), *FLAGS, "--heartbeat-timeout", "3",
        args=["--steps", "2000", "--hang-at", "15"],
    )  # fmt: skip
    wait_until(lambda: re.search(r"^step 14\b", d.log_text(1, 1), re.M), 90, what="step 14")
    before = d.worker_pids()
    wait_until(lambda: events(d, "replaced_in_place"), 30, what="the hung rank replaced")
    # status and metrics count it: in place, not a restart, and it is the last failure
    shown = json.loads(d.status("--json").stdout)
    assert shown["in_place_by_cause"]["hang"] == 1, shown["in_place_by_cause"]
    assert sum(shown["restarts_by_cause"].values()) == 0, shown
    assert shown["failures_by_class"].get("hang") == 1, shown["failures_by_class"]
    assert "hung" in shown["last_failure"]["reason"], shown["last_failure"]
    assert "recovered in place by cause: hang 1" in d.status().stdout
    _rank_2_re_entered_then_stop(d)
    replaced = events(d, "replaced_in_place")
    assert len(replaced) == 1 and replaced[0]["ranks"] == [1], replaced
    assert "hung" in replaced[0]["cause"] and "rank 1" in replaced[0]["cause"]
    assert sorted(replaced[0]["survivors"]) == sorted([before[0], before[2]])
    assert len(d.attempt_dirs()) == 1 and not events(d, "in_place_refused")
    assert "re_entered" in d.log_text(0, 1)
    assert not leftover_processes()


def test_recoveries_in_place_spend_the_job_s_restart_budget(daemons):
    """--max-restarts 1: the first kill is recovered in place and spends the budget (status
    shows it), so the second goes to the restart, whose closing finds the budget spent and ends
    the job (before, in-place recoveries had a budget of their own, on top of the restarts)."""
    d = daemons(
        script("inplace_faults.py"), "--nproc-per-node", "3", "--in-place", "auto",
        "--max-restarts", "1", "--restart-backoff", "0", args=["--steps", "2000"],
    )  # fmt: skip
    wait_until(lambda: re.search(r"^step 10\b", d.log_text(0, 1), re.M), 90, what="step 10")
    os.kill(d.worker_pids()[1], signal.SIGKILL)
    wait_until(lambda: events(d, "replaced_in_place"), 30, what="rank 1 replaced in place")
    shown = json.loads(d.status("--json").stdout)
    assert (shown["restarts"], shown["budget_left"]) == (1, 0), shown
    wait_until(
        lambda: re.search(r"re_entered.*\n(.*\n)*step 3\b", d.log_text(2, 1)), 60,
        what="rank 2 stepping after re-entry",
    )  # fmt: skip
    os.kill(d.worker_pids()[0], signal.SIGKILL)  # a survivor's own process, this time
    assert d.wait(90) == 1, d.stderr()[-3000:]
    refused = events(d, "in_place_refused")
    assert len(refused) == 1, refused
    assert "restart budget is spent (1 of --max-restarts 1" in refused[0]["why"], refused
    assert events(d, "restart_budget_spent"), [e.get("event") for e in d.events()][-20:]
    assert not leftover_processes()


def test_the_recovery_bench_reports_the_in_place_timeline():
    """bench/recovery.py's smoke run: two kills, both recovered, at least one with every
    survivor's pid kept (a survivor blocked where no abort reaches, about 1 kill in 6, is killed
    and replaced in place: in_place_unstuck), and the timeline's phases printed, median / p90."""
    r = bench(
        "recovery.py", "--nproc", "3", "--launchers", "elasticd-in-place", "--trials", "2",
        "--warmup", "1.5", "--trial-timeout", "20", timeout=240,
    )  # fmt: skip
    # the first N/2 is "recovered" (the steps lost, median/max, may end in /2 too)
    row = re.search(r"^elasticd-in-place +([\d.]+) .*? (\d+)/2 .* (\d+)$", r.stdout, re.M)
    assert row and row[2] == "2" and int(row[3]) >= 1, r.stdout
    for phase in ("seen", "unwound", "replaced", "reformed", "new.reformed", "first_step"):
        assert re.search(rf"^  {re.escape(phase)} +[\d.]+ / [\d.]+", r.stdout, re.M), r.stdout
    assert not leftover_processes()


def test_the_nccl_probe_re_forms_a_survivor_in_place_on_gloo():
    """bench/inplace_nccl.py (bench/gpu.sh PARTS=inplace: what a GPU node answers before in place
    is built on NCCL) in its CPU form: the survivor unwinds at once, re-forms with a fresh rank,
    sums right in its own process, with and without the watcher's abort."""
    r = bench(
        "inplace_nccl.py", "--backend", "gloo", "--handling", "3", "--abort", "none,watcher",
        "--trials", "1", timeout=120,
    )  # fmt: skip
    rows = [json.loads(line) for line in r.stdout.splitlines() if line.startswith("{")]
    assert [row["abort"] for row in rows] == ["none", "watcher"], r.stdout
    for row in rows:
        assert row["outcome"] == "re-formed in place" and row["summed_right"], row
        assert row["unwound_s"] < row["reformed_s"] <= row["first_step_s"], row
        assert set(row["replacement"]) >= {"import", "context", "init", "form"}, row
    assert rows[1]["watcher_saw_announcement_s"] is not None, rows[1]
    assert r.stdout.count("1/1 re-formed in place") == 2, r.stdout
    assert not leftover_processes()


@pytest.mark.parametrize(
    "flags, error",
    [
        ([], "ValueError: bad sample at step 10"),
        # a Python socket's "Connection reset by peer" in its chain is no collective's: taken
        # for a peer's going, the rank waited for a generation nobody announced, and its abort
        # closed the others' connections (their failures then taken for the first)
        (
            ["--loader-died-of", "Segmentation fault"],
            "RuntimeError: DataLoader worker (pid 4242) is killed by signal: Segmentation fault",
        ),
    ],
    ids=["value_error", "over_a_reset_socket"],
)
def test_a_rank_s_own_error_exits_at_once_and_restarts_the_group(daemons, flags, error):
    """Rank 1 raises an error of its own (not a collective's failure): it exits with it at
    once, as under torchrun, rather than waiting for a generation (15 s, before), and the daemon
    restarts the group, where the replay and the repeat rule judge errors; the survivors, whose
    collective failed of its going, are not the cause."""
    d = daemons(
        script("inplace_faults.py"), *FLAGS, "--restart-backoff", "0",
        args=["--steps", "2000", "--raise-at", "10", *flags],
    )  # fmt: skip
    wait_until(lambda: len(d.attempt_dirs()) > 1, 30, what="the restart")
    refused = events(d, "in_place_refused")
    assert len(refused) == 1 and "a failure of the rank's own" in refused[0]["why"], refused
    assert error in refused[0]["cause"], refused
    assert not events(d, "replaced_in_place")
    # it ended at once: from its error to the restart's decision well under GENERATION_WAIT
    failed = [e for e in events(d, "state") if e.get("new") == "RESTARTING"][0]
    assert "rank 1" in failed["cause"]
    text = d.log_text(1, 1)
    assert "in_place_fallback" not in text and "no generation announced" not in text, text
    wait_until(lambda: re.search(r"^step 3\b", d.log_text(0, 2), re.M), 60, what="restarted")
    d.kill(signal.SIGTERM)
    assert d.wait(60) == 0, d.stderr()[-3000:]
    assert not leftover_processes()


@pytest.mark.parametrize("said", ["killed_by_signal", "exited_unexpectedly"])
def test_a_rank_whose_dataloader_worker_was_killed_is_replaced_in_place(daemons, said):
    """torch's DataLoader raises "worker ... is killed by signal: Killed." in the rank whose
    loader was SIGKILLed (the OOM killer's, or someone's): no error of the code's, so with no OOM
    counter up it is an outside kill (class killed), recovered in place like a kill -9 of the rank
    itself; it restarted the group as the rank's own error before, in 5 of 9 such faults of the
    chaos soak. Where torch's own check reaped the worker first, its error is "exited
    unexpectedly", no cause named (a real loader, its worker killed): the bootstrap adds the
    worker's exit status from torch's frame (worker/loader_exits.py), and the same holds; the
    group restarted as the rank's own error before, in 2 of 10 chaos loader kills."""
    fault = (
        ["--loader-died-of", "Killed"] if said == "killed_by_signal"
        else ["--loader-killed-unseen"]
    )  # fmt: skip
    d = daemons(
        script("inplace_faults.py"), *FLAGS, "--restart-backoff", "0",
        args=["--steps", "40", "--raise-at", "10", *fault],
    )  # fmt: skip
    wait_until(lambda: re.search(r"^step 9\b", d.log_text(1, 1), re.M), 60, what="step 9")
    before = d.worker_pids()
    assert d.wait(90) == 0, d.stderr()[-3000:]
    replaced = events(d, "replaced_in_place")
    assert len(replaced) == 1 and replaced[0]["ranks"] == [1], replaced
    assert "is killed by signal: Killed" in replaced[0]["cause"], replaced
    if said == "exited_unexpectedly":
        assert "exited unexpectedly" in replaced[0]["cause"], replaced
    assert sorted(replaced[0]["survivors"]) == sorted([before[0], before[2]])
    assert not events(d, "in_place_refused") and len(d.attempt_dirs()) == 1
    assert replaced[0]["failure_class"] == "killed", replaced
    assert not leftover_processes()


def test_a_survivor_that_finishes_while_a_generation_forms_restarts_the_group(daemons):
    """Rank 1 dies past the last step; rank 0, past its last collective, sees no failure and
    returns. The rank started for rank 1 could never join it (it waited without end, before:
    the chaos soak's last fault): the survivor's exit 0 while the generation forms ends it, and
    the group restarts and finishes."""
    d = daemons(
        script("inplace_faults.py"), "--nproc-per-node", "2", "--in-place", "auto",
        "--max-restarts", "3", "--restart-backoff", "0",
        args=["--steps", "15", "--die-at-end"],
    )  # fmt: skip
    assert d.wait(90) == 0, d.stderr()[-3000:]
    assert len(events(d, "replaced_in_place")) == 1
    restarts = [e for e in events(d, "state") if e.get("new") == "RESTARTING"]
    assert len(restarts) == 1 and "finished its script (returned)" in restarts[0]["cause"], restarts
    assert re.search(r"^step 15\b", d.log_text(1, 2), re.M)
    assert not leftover_processes()


def _rank_2_re_entered_then_stop(d) -> None:
    """Rank 2, a survivor, steps again in the re-formed group in its own process; then stop."""
    wait_until(
        lambda: re.search(r"re_entered.*\n(.*\n)*step 3\b", d.log_text(2, 1)), 60,
        what="rank 2 stepping after re-entry",
    )  # fmt: skip
    d.kill(signal.SIGTERM)
    d.wait(60)
