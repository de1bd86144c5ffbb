"""The frameworks people train with, unchanged under elasticd (tests/scripts/*_train.py: Lightning,
the transformers Trainer, Accelerate; 2 CPU workers, gloo): a kill -9 of a worker recovers and the
job ends with exit 0; spares that preloaded what the workers imported (daemon/learning.py) do not
change what the script sees; a crash's survivors are not waited on, a stop's save completes."""

from __future__ import annotations

import json
import os
import re
import signal

import pytest

from harness import FAST, RESTART, run_cli, script, wait_until

ENV = {"HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
FLAGS = ("--nproc-per-node", "2", "--max-restarts", "2", *FAST, *RESTART)  # the restart's


def _need(module: str) -> None:
    why = f"{module} is not installed (pip install -e '.[integrations]')"
    pytest.importorskip(module, reason=why)


def _start(daemons, tmp_path, name: str, *args: str):
    out = ["--out", str(tmp_path / "out"), "--steps", "100000", "--step-time", "0.05"]
    return daemons(script(f"{name}_train.py"), *FLAGS, args=[*out, *args], env=ENV)


def _event(d, name: str, timeout: float, **match) -> dict:
    def found():
        for e in d.events():
            if e.get("event") == name and all(e.get(k) == v for k, v in match.items()):
                return e
        return None

    return wait_until(found, timeout, what=f"event {name} {match or ''}")


def _running(d) -> list[dict]:
    return [e for e in d.events() if e.get("event") == "state" and e.get("new") == "RUNNING"]


def bound_ranks(d, pid: int | None = None) -> set[str]:
    """The ranks spares were bound to (spares_bound events), or the one spare `pid` was."""
    out = set()
    for e in d.events():
        if e.get("event") == "spares_bound":
            out.update(r for p, r in e["spares"].items() if pid is None or int(p) == pid)
    return out


def _kill_rank1_and_recover(d) -> dict:
    pids = d.worker_pids()
    os.kill(pids[1], signal.SIGKILL)
    recovered = _event(d, "recovered", 120)
    assert recovered["first_step"] < 20  # loose: a loaded 2-core machine
    return recovered


def _stepped_again(d) -> None:
    """Rank 1 of the restart trained (its step numbers go on from the framework's checkpoint)."""
    step = re.compile(r"^step \d+", re.M)
    wait_until(lambda: step.search(d.log_text(1, attempt=2)), 60, what="rank 1 stepping again")


def _stop(d) -> None:
    assert run_cli("stop", "--socket", str(d.socket), "--timeout", "20").returncode == 0
    assert d.wait(60) == 0


def test_lightning_learned_spares_keep_rank_zero_only(daemons, tmp_path):
    _need("pytorch_lightning")
    observe = tmp_path / "observe.jsonl"
    d = _start(daemons, tmp_path, "lightning", "--observe", str(observe))
    learned = _event(d, "preload_learned", 300)  # two probes and an import, on a loaded machine
    assert learned["preloaded"] > 0 and not learned["error"] and not learned["tainted"]
    skipped = {e["module"]: e["why"] for e in d.events() if e.get("event") == "preload_skipped"}
    assert skipped["lightning_fabric.utilities.rank_zero"] == "reads RANK at import"
    # the spares now hold Lightning's dependencies, and one per rank has Lightning itself,
    # imported with that rank's environment (worker/bound.py); the restart starts in those
    wait_until(lambda: bound_ranks(d) == {"0", "1"}, 60, what="a spare bound to each rank")
    _kill_rank1_and_recover(d)
    _stepped_again(d)
    restarted = _running(d)[1]["pids"]
    assert all(bound_ranks(d, pid) == {rank} for rank, pid in restarted.items()), restarted
    _stop(d)
    seen = [json.loads(line) for line in observe.read_text().splitlines()]
    starts = [s for s in seen if "first_line_rank" in s]
    assert len(starts) == 4, seen  # two ranks, two attempts
    # Lightning came with the bound spare (no cold start after all), and saw the right rank
    assert [s["ahead"] for s in starts] == [False, False, True, True], starts
    assert all(s["first_line_rank"] == s["rank"] for s in starts), starts
    ran = [s["rank_zero_only_ran_on"] for s in seen if "rank_zero_only_ran_on" in s]
    assert ran == [0, 0], seen


def test_transformers_trainer_recovers_from_kill9(daemons, tmp_path):
    _need("transformers")
    d = _start(daemons, tmp_path, "transformers")
    d.wait_for_step(1, 3, timeout=120)
    _kill_rank1_and_recover(d)
    _stepped_again(d)
    _stop(d)


def test_accelerate_crash_is_not_waited_on_and_stop_saves(daemons, tmp_path):
    _need("accelerate")
    d = _start(daemons, tmp_path, "accelerate", "--save-on-sigterm")
    d.wait_for_step(1, 3, timeout=120)
    _kill_rank1_and_recover(d)
    crash = next(
        e for e in d.events() if e.get("event") == "workers_stopped" and e["state"] == "RESTARTING"
    )
    # rank 0's SIGTERM handler would ask for a collective save with a dead rank: not waited on
    assert crash["exits"]["0"] == -signal.SIGKILL and crash["seconds"] < 1.0, crash
    _stepped_again(d)
    _stop(d)
    stopped = [e for e in d.events() if e.get("event") == "workers_stopped"][-1]
    assert stopped["exits"] == {"0": 0, "1": 0}, stopped  # the save ran, then the script ended
    for rank in (0, 1):
        assert "saved at stop" in d.log_text(rank), d.log_text(rank)[-2000:]
    saved = int((tmp_path / "out" / "step.txt").read_text())
    assert f"saved at stop, step {saved}" in d.log_text(0)
