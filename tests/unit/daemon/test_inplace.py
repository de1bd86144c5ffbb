"""Which recovery path a job is on (daemon/inplace.py) and what this torch can re-form in place
(worker/reconfigure.py), against the real torch.distributed of the interpreter that runs the
tests: torch 2.13 (the first CI run) lacks reconfigure, torch 2.14.1 (the second) has it."""

import dataclasses
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch.distributed as dist

from elasticd.config import Config
from elasticd.daemon import inplace
from elasticd.daemon.deadlines import Deadline
from elasticd.lifecycle.states import Failure, RestartCause
from elasticd.worker import reconfigure

HAS = hasattr(dist, "_reconfigure")


def test_support_follows_what_torch_has():
    found = reconfigure.support()
    assert found.ok is HAS
    assert torch_version() in found.why
    if not HAS:
        assert "_reconfigure" in found.why and "torch>=2.14" in found.why


@pytest.mark.parametrize(
    "backend, ok",
    [("gloo", True), ("cpu:gloo,cuda:nccl", True), ("nccl", True), ("mpi", False)],
)
def test_backends(backend, ok):
    found = reconfigure.backend_support(backend)
    if not HAS:
        assert not found.ok and "torch>=2.14" in found.why
        return
    nccl = hasattr(getattr(dist, "ProcessGroupNCCL", None), "reconfigure")
    assert found.ok is (ok and (nccl or "nccl" not in backend)), found.why


@pytest.mark.parametrize(
    "changes, path, words",
    [
        ({}, "restart", "--in-place off"),
        ({"in_place": "auto", "no_python": True}, "restart", "--no-python"),
        ({"in_place": "auto", "nnodes": "2"}, "restart", "one node only"),
        ({"in_place": "auto", "nnodes": "1:2"}, "restart", "one node only"),
    ],
)
def test_the_path_where_the_job_rules_it_out(changes, path, words):
    chosen = inplace.choose(dataclasses.replace(Config(), **changes))
    assert (chosen.name, chosen.in_place) == (path, False)
    assert words in chosen.why


def test_the_path_where_torch_decides():
    chosen = inplace.choose(dataclasses.replace(Config(), in_place="auto"))
    assert chosen.in_place is HAS
    assert chosen.name == ("in_place" if HAS else "restart")
    assert ("has dist._reconfigure" if HAS else "lacks") in chosen.why


def torch_version():
    import torch

    return torch.__version__


@pytest.mark.parametrize(
    "deadline, seconds",
    [
        (None, inplace.STUCK_UNLEARNED),
        (Deadline(300.0, False), inplace.STUCK_UNLEARNED),  # not learned yet
        (Deadline(1.0, True, p99=0.02), inplace.STUCK_FLOOR),  # fast steps: the floor
        (Deadline(4.0, True, p99=0.5), 1.0),  # about a step: 2 x p99
        (Deadline(1.0, True, p99=0.4), 0.5),  # under half the hang deadline
    ],
)
def test_a_survivor_is_stuck_after_about_one_step(deadline, seconds):
    assert inplace.stuck_after(deadline) == pytest.approx(seconds)


@pytest.mark.parametrize(
    "code, words",
    [(143, "stopped on SIGTERM"), (7, "a fatal exit code"), (1, None)],
)
def test_a_rank_that_stopped_on_sigterm_restarts_the_group(code, words):
    """Exit 143 is the checkpoint library's stop (checkpoint/stop.py): every rank agreed to stop
    and exits too, so a spare started for the first would be wasted on a group that restarts
    (bench/chaos.py's sigterm: 9 s to a cold restart after it)."""
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        worker = SimpleNamespace(exit_code=None, proc=live)
        agent = SimpleNamespace(
            group=SimpleNamespace(workers=[worker], beats=lambda: [SimpleNamespace(beats=3)]),
            forming=None,
            cfg=SimpleNamespace(fatal_exit_codes={7}, max_restarts=3),
            round=SimpleNamespace(worker_store=object()),
            in_place_used=0,
        )
        why = Failure(RestartCause.CRASH, "r", rank=1, exit_code=code)
        refused = inplace._refused(agent, why)
        assert refused is None if words is None else words in refused
        live.kill()
        live.wait(10)  # every rank gone: the restart's
        assert inplace._refused(agent, why) is not None
    finally:
        live.kill()
        live.wait(10)


def test_an_attempt_that_replaced_a_rank_in_place_had_trained():
    """A second fault before the replacement's first step restarts the group (`_refused`), but
    the attempt trained (every rank had stepped, or nothing was replaced in place): no crash
    streak grows from it, no backoff doubles (bench/chaos.py --in-place auto waited 25.6 s)."""
    from elasticd.daemon.recovery import Recovery

    r = Recovery(Config())
    r.started()
    assert not r.trained([None, None])
    r.replaced_in_place()
    assert r.trained([None, None])
    r.crash_streak = 5
    r.backoff(r.trained([None]))
    assert r.crash_streak == 0
    r.started()  # the next attempt judged on its own
    assert not r.trained([None, None])
