"""The core supervisor: real daemons, real workers, real signals (gloo on CPU)."""

from __future__ import annotations

import json
import os
import re
import signal
import sys
from datetime import datetime

import psutil
import pytest

from elasticd.daemon import spawn as spawn_mod
from harness import FAST_STOP5 as FAST
from harness import RESTART, gone, leftover_processes, script, wait_until


def test_unmodified_torchrun_script_completes(daemons, tmp_path):
    snap = tmp_path / "snapshot.pt"
    d = daemons(
        script("ddp_tutorial.py"),
        "--nproc-per-node",
        "2",
        *FAST,
        args=["--steps", "12", "--snapshot", str(snap)],
    )
    assert d.wait(120) == 0, d.stderr()[-3000:]
    out = d.stdout()
    assert "[rank0]: done world_size=2 rank=0 restart=0" in out
    assert "[rank1]: done world_size=2 rank=1 restart=0" in out
    assert snap.exists()
    # per-rank logs on disk too
    assert "done world_size=2" in d.log_text(1)
    # structured events carry run id and node
    states = [e for e in d.events() if e.get("event") == "state"]
    assert [e["new"] for e in states][-1] == "SUCCEEDED"
    assert all("run_id" in e and "node" in e for e in states)


@pytest.mark.parametrize("spawn", [(), ("--no-warm-spawn",)], ids=["warm", "cold"])
def test_worker_environment_matches_torchrun(daemons, tmp_path, spawn):
    out = tmp_path / "env.json"
    d = daemons("tests.scripts.dump_env", "--nproc-per-node", "2", *spawn, args=[str(out)])
    assert d.wait(60) == 0, d.stderr()[-3000:]
    envs = [json.loads(line) for line in out.read_text().splitlines()]
    assert sorted(int(e["RANK"]) for e in envs) == [0, 1]
    for e in envs:
        for key in (
            "LOCAL_RANK",
            "GROUP_RANK",
            "ROLE_RANK",
            "ROLE_NAME",
            "LOCAL_WORLD_SIZE",
            "WORLD_SIZE",
            "GROUP_WORLD_SIZE",
            "ROLE_WORLD_SIZE",
            "MASTER_ADDR",
            "MASTER_PORT",
            "TORCHELASTIC_RESTART_COUNT",
            "TORCHELASTIC_MAX_RESTARTS",
            "TORCHELASTIC_RUN_ID",
            "TORCHELASTIC_USE_AGENT_STORE",
            "TORCH_NCCL_ASYNC_ERROR_HANDLING",
            "TORCHELASTIC_ERROR_FILE",
        ):
            assert key in e, key
        assert (
            e["WORLD_SIZE"] == "2" and e["LOCAL_WORLD_SIZE"] == "2" and e["ROLE_NAME"] == "default"
        )
        assert e["TORCHELASTIC_USE_AGENT_STORE"] == "True" and e["OMP_NUM_THREADS"] == "1"
        assert e["MASTER_ADDR"] == spawn_mod.master_name("127.0.0.1")  # torchrun's host name
        assert "NOTIFY_SOCKET" not in e and "WATCHDOG_USEC" not in e
        assert e["__name__"] == "__main__" and e["argv"][1:] == [str(out)]
        assert e["argv"][0].endswith(os.path.join("tests", "scripts", "dump_env.py"))
        # ps, pgrep -f and /proc/PID/cmdline show what torchrun would have run, NUL for NUL; a
        # cold worker's title is one byte shorter than `python -Pm elasticd.worker.bootstrap
        # ARGS`: one string, as setproctitle(3) writes it (worker/proctitle.py)
        shown = [sys.executable, "-u", "-m", "tests.scripts.dump_env", str(out)]
        exact = "\0".join(shown) + "\0"
        assert e["facts"]["cmdline"] == (exact if not spawn else " ".join(shown) + "\0")
        facts = e["facts"]  # warm (forked) workers: children of the daemon in their own session
        assert facts["ppid"] == d.pid and facts["sid"] == facts["pid"] and facts["threads"] == 1, (
            facts
        )
    for key in ("random", "numpy_random")[
        : 1 if spawn else 2
    ]:  # never the stream of a process forked from
        values = [e["facts"].get(key) for e in envs]
        assert values[0] != values[1], key


def _thp_mode() -> str:
    with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
        return f.read().split("[")[1].split("]")[0]


@pytest.mark.skipif(
    not os.path.exists("/sys/kernel/mm/transparent_hugepage/enabled") or _thp_mode() != "madvise",
    reason="the kernel puts no memory, or all of it, on transparent huge pages unasked",
)
@pytest.mark.parametrize(
    "spawn, asked",
    [((), None), (("--no-warm-spawn",), None), ((), "0")],
    ids=["warm", "cold", "the user's 0"],
)
def test_workers_big_host_tensors_lie_on_huge_pages(daemons, tmp_path, spawn, asked):
    """torch's CPU allocator asks for huge pages (THP_MEM_ALLOC_ENABLE=1, worker_defaults) in
    every worker, the fork server's spares' included, unless the user set the variable."""
    out = tmp_path / "huge.txt"
    env = {"THP_MEM_ALLOC_ENABLE": asked} if asked else {}
    d = daemons(script("huge_pages.py"), "--nproc-per-node", "2", *spawn, args=[str(out)], env=env)
    assert d.wait(60) == 0, d.stderr()[-3000:]
    rows = sorted(line.split() for line in out.read_text().splitlines())
    assert [(rank, value) for rank, value, _ in rows] == [("0", asked or "1"), ("1", asked or "1")]
    for _rank, _value, kb in rows:
        assert (int(kb) >= 32 * 1024) == (asked is None), rows  # of the 64 MB tensor


def test_torchrun_command_line_works_as_is(daemons, tmp_path):
    # `torchrun --nproc-per-node cpu --rdzv-backend c10d -m pkg.mod ARGS`: ARGS are the script's,
    # even where they look like our flags
    out = tmp_path / "env.json"
    d = daemons(
        None,
        "--nproc-per-node",
        "cpu",
        "--rdzv-backend",
        "c10d",
        "-m",
        "tests.scripts.dump_env",
        str(out),
        "--max-restarts",
        "7",
        "--",
        "x",
    )
    assert d.wait(60) == 0, d.stderr()[-3000:]
    envs = [json.loads(line) for line in out.read_text().splitlines()]
    assert sorted(int(e["RANK"]) for e in envs) == list(range(os.cpu_count() or 1))
    for e in envs:
        assert e["argv"][1:] == [str(out), "--max-restarts", "7", "--", "x"]
        assert (
            e["TORCHELASTIC_MAX_RESTARTS"] == "3"
        )  # elasticd's own default: the flag was not taken as ours


def test_script_globals_live_until_shutdown_as_under_python(daemons, tmp_path):
    # `python script.py` frees the script's objects after atexit, at shutdown; freeing them
    # earlier on a live interpreter can deadlock gloo's destructor (DDP's reducer at exit)
    warm = daemons(
        script("exit_order.py"), "--nproc-per-node", "2", name="warm", args=[str(tmp_path / "warm")]
    )
    cold = daemons(
        "tests.scripts.exit_order",
        "--nproc-per-node",
        "1",
        "--no-warm-spawn",
        name="cold",
        args=[str(tmp_path / "cold")],
    )
    assert warm.wait(60) == 0, warm.stderr()[-3000:]
    assert cold.wait(60) == 0, cold.stderr()[-3000:]
    for name in ("warm.0", "warm.1", "cold.0"):
        assert (tmp_path / name).read_text().split() == ["atexit", "freed"], name


def test_process_group_teardown_never_deadlocks(daemons, tmp_path):
    # plain torch deadlocks in this loop within a few rounds (see the script); elasticd's
    # destroy_process_group lets gloo's threads finish first
    d = daemons(script("teardown_loop.py"), "--nproc-per-node", "2", args=[str(tmp_path), "30"])
    assert d.wait(90) == 0, d.stderr()[-3000:]
    assert "rounds done 30" in d.log_text(0) and "rounds done 30" in d.log_text(1)


def test_kill_9_of_a_worker_restarts_and_completes(daemons, tmp_path):
    d = daemons(
        script("ddp_tutorial.py"),
        *RESTART,
        "--nproc-per-node",
        "2",
        "--max-restarts",
        "3",
        *FAST,
        args=["--steps", "30", "--step-time", "0.05", "--snapshot", str(tmp_path / "snap.pt")],
    )
    d.wait_for_step(1, 5, timeout=60)
    os.kill(d.worker_pids()[1], signal.SIGKILL)
    assert d.wait(120) == 0, d.stderr()[-3000:]
    out = d.stdout()
    assert "[rank1]: done world_size=2 rank=1 restart=1" in out
    assert "resumed from snapshot at step" in out
    restarts = [e for e in d.events() if e.get("event") == "state" and e.get("new") == "RESTARTING"]
    assert len(restarts) == 1 and "rank 1 (node " in restarts[0]["cause"]
    assert "); killed by SIGKILL" in restarts[0]["cause"], restarts[0]["cause"]


@pytest.mark.slow
def test_twenty_kill_9_in_a_row_all_recover(daemons, tmp_path):
    """Every one of 20 kill -9s is followed by a restart in which every rank trains again."""
    kills = 20
    d = daemons(
        script("ddp_tutorial.py"),
        *RESTART,
        "--nproc-per-node",
        "2",
        "--max-restarts",
        str(kills),
        *FAST,
        "--restart-grace",
        "0.5",
        args=[
            "--steps",
            "100000",
            "--step-time",
            "0.02",
            "--snapshot",
            str(tmp_path / "snap.pt"),
            "--save-every",
            "2",
        ],
    )
    for i in range(kills):
        attempt = i + 1
        for rank in (0, 1):
            wait_until(
                lambda: re.search(r"^step \d+", d.log_text(rank, attempt), re.M),
                60,
                what=f"rank {rank} training in attempt {attempt}",
            )
        victim = i % 2
        pid = wait_until(lambda: d.worker_pids().get(victim), 30, what="worker pid")
        os.kill(pid, signal.SIGKILL)
        wait_until(lambda: len(d.attempt_dirs()) > attempt, 30, what=f"restart after kill {i + 1}")
    for rank in (0, 1):
        wait_until(
            lambda: re.search(r"^step \d+", d.log_text(rank, kills + 1), re.M),
            60,
            what=f"rank {rank} training after the last kill",
        )
    d.kill(signal.SIGTERM)
    assert d.wait(60) == 0
    restarts = [e for e in d.events() if e.get("event") == "state" and e.get("new") == "RESTARTING"]
    assert len(restarts) == kills


def test_exception_in_worker_restarts_and_reports_error_file(daemons):
    d = daemons(
        script("faulty.py"),
        "--nproc-per-node",
        "2",
        "--max-restarts",
        "2",
        *FAST,
        args=["--steps", "6", "--raise-at", "2", "--only-first-attempt"],
    )
    assert d.wait(120) == 0, d.stderr()[-3000:]
    restarting = [
        e for e in d.events() if e.get("event") == "state" and e.get("new") == "RESTARTING"
    ]
    assert len(restarting) == 1
    assert "ValueError: injected failure at step 2" in restarting[0]["cause"]
    err = json.loads((d.run_dir() / "attempt1" / "rank1.error.json").read_text())
    assert "injected failure" in err["message"]["message"]


# the same failure at the same step in every attempt: without this, the second attempt would end the
# job as deterministic (tests/e2e/test_triage_jobs.py); these tests are about the budget and backoff
SAME_FAILURE_RETRIED = ("--deterministic-retries", "0")


def test_budget_exhausted_names_rank_and_cause(daemons):
    d = daemons(
        script("faulty.py"),
        "--nproc-per-node",
        "2",
        "--max-restarts",
        "1",
        *FAST,
        *SAME_FAILURE_RETRIED,
        args=["--steps", "6", "--raise-at", "2"],
    )
    assert d.wait(120) == 1
    err = d.stderr()
    line = [ln for ln in err.splitlines() if ln.startswith("elasticd: job failed")]
    assert line, err[-3000:]
    assert "after 1 restart(s)" in line[0] and "rank 1" in line[0]
    assert "ValueError: injected failure at step 2" in line[0] and "rank1.stderr.log" in line[0]


def _backoffs(d) -> list[tuple[dict, float]]:
    """Each restart_backoff event with the seconds until the next rendezvous began."""
    events = d.events()
    out = []
    for i, e in enumerate(events):
        if e.get("event") == "restart_backoff":
            nxt = next(
                n
                for n in events[i + 1 :]
                if n.get("event") == "state" and n.get("new") == "RENDEZVOUS"
            )
            gap = (
                datetime.fromisoformat(nxt["timestamp"]) - datetime.fromisoformat(e["timestamp"])
            ).total_seconds()
            out.append((e, gap))
    return out


def test_crash_loop_backs_off_exponentially_and_waits_it_out(daemons):
    # every attempt fails before any rank reports a step: a crash loop
    d = daemons(
        script("faulty.py"),
        "--nproc-per-node",
        "2",
        "--max-restarts",
        "2",
        "--restart-backoff",
        "0.3",
        *FAST,
        *SAME_FAILURE_RETRIED,
        args=["--steps", "6", "--raise-at", "1", "--step-time", "0"],
    )
    assert d.wait(120) == 1, d.stderr()[-3000:]
    backoffs = _backoffs(d)
    assert [e["crash_streak"] for e, _ in backoffs] == [1, 2]
    for (e, gap), base in zip(backoffs, (0.3, 0.6), strict=True):
        assert base <= e["delay"] <= base + 0.3, e  # tenacity: 0.3 * 2**n plus up to 0.3 of jitter
        assert gap >= e["delay"] - 0.02, (gap, e)  # waited in full: SIGCHLD does not cut it short


def test_attempt_that_trained_restarts_after_the_first_backoff(daemons):
    # every attempt steps, then fails: each restart is a new streak, never a growing wait
    d = daemons(
        script("faulty.py"),
        "--nproc-per-node",
        "2",
        "--max-restarts",
        "2",
        "--restart-backoff",
        "0.3",
        *FAST,
        *SAME_FAILURE_RETRIED,
        args=["--steps", "6", "--raise-at", "3", "--step-time", "0.02", "--beat"],
    )
    assert d.wait(120) == 1, d.stderr()[-3000:]
    backoffs = _backoffs(d)
    assert [e["crash_streak"] for e, _ in backoffs] == [0, 0]
    for e, gap in backoffs:
        assert 0.3 <= e["delay"] <= 0.6 and gap >= e["delay"] - 0.02, (gap, e)


def test_fatal_exit_code_fails_without_restart(daemons):
    d = daemons(
        script("faulty.py"),
        "--nproc-per-node",
        "2",
        "--max-restarts",
        "3",
        "--fatal-exit-codes",
        "3,7",
        *FAST,
        args=["--steps", "6", "--exit-at", "2", "--exit-code", "7"],
    )
    assert d.wait(120) == 1
    assert not [
        e for e in d.events() if e.get("event") == "state" and e.get("new") == "RENDEZVOUS"
    ][1:]
    assert "exit code 7" in d.stderr()


def test_sigkill_of_daemon_takes_workers_and_grandchildren(daemons):
    d = daemons(
        script("faulty.py"),
        "--nproc-per-node",
        "2",
        *FAST,
        args=["--steps", "100000", "--spawn-child", "--step-time", "0.05"],
    )
    d.wait_for_step(1, 2, timeout=60)
    tree = [p for p in psutil.Process(d.pid).children(recursive=True)]
    grandchildren = [p for p in tree if p.ppid() != d.pid]
    assert len(grandchildren) >= 2  # one sleeping child per worker
    d.kill(signal.SIGKILL)
    d.proc.wait(10)
    wait_until(lambda: not leftover_processes(), 10, what="every worker and grandchild gone")
    # A process tearing down its memory has no readable environment yet is not a zombie: it is
    # no longer found as ours above, so wait for every process of the tree itself to finish.
    wait_until(
        lambda: gone(p.pid for p in tree), 10, what="every process of the daemon's tree dead"
    )


def test_worker_output_is_prefixed_and_logged_per_rank(daemons):
    d = daemons(
        script("faulty.py"), "--nproc-per-node", "2", args=["--steps", "2", "--step-time", "0"]
    )
    assert d.wait(60) == 0
    out = d.stdout()
    assert "[rank0]: step 2" in out and "[rank1]: step 2" in out
    assert "step 2" in d.log_text(0) and "[rank" not in d.log_text(0)
