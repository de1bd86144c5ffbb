"""DDP's buckets across a resume (elasticd.checkpoint.ddp_buckets): at 3 ranks a resumed model's
first step reduces its gradients exactly as the run it continues did, whenever it resumes (after
the first step, before DDP rebuilt its buckets, or after), with one bucket or several; and where
no resume can be exact, the job says so in one line at its first capture."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import _ckpt_helpers as helpers
from elasticd.checkpoint import capture, ddp_buckets, restore


def _model(**ddp) -> nn.Module:
    torch.manual_seed(0)
    net = nn.Sequential(
        nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 64), nn.LayerNorm(64), nn.Linear(64, 1)
    )
    return nn.parallel.DistributedDataParallel(net, **ddp)


def _step(model, opt, step: int, rank: int) -> torch.Tensor:
    x = torch.randn(16, 16, generator=torch.Generator().manual_seed(1000 * step + rank))
    opt.zero_grad()
    model(x).sum().backward()
    opt.step()
    return torch.cat([p.grad.flatten() for p in model.parameters()])


def _resume(rank: int, world: int, at: int, ddp: dict, use: bool, out: str) -> None:
    """Train `at` steps, capture; a new DDP model restores the state (its buckets imposed or
    not) and both take the same 3 steps: how many gradient elements differ in each."""
    model = _model(**ddp)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for s in range(at):
        _step(model, opt, s, rank)
    state = capture(model=model, rng=False)
    assert ("ddp_buckets" in state) == (at >= 1)
    if not use:
        state.pop("ddp_buckets", None)
    again = _model(**ddp)
    restore(state, model=again, rng=False)
    opt2 = torch.optim.SGD(again.parameters(), lr=0.1)
    diffs = [
        int((_step(model, opt, s, rank) != _step(again, opt2, s, rank)).sum())
        for s in range(at, at + 3)
    ]
    torch.save(diffs, f"{out}.{rank}")


@pytest.mark.parametrize("at", [1, 2, 3], ids=["before-rebuild", "just-rebuilt", "settled"])
@pytest.mark.parametrize(
    "ddp",
    [{}, {"bucket_cap_mb": 0.01}, {"gradient_as_bucket_view": True}],
    ids=["one-bucket", "two-buckets", "bucket-view"],
)
def test_a_resumed_model_reduces_as_the_run_it_continues(tmp_path, at, ddp):
    out = str(tmp_path / "diffs")
    helpers.run(_resume, 3, tmp_path, at, ddp, True, out, timeout=60)
    assert torch.load(f"{out}.0") == [0, 0, 0]


def test_without_the_buckets_the_first_step_differs(tmp_path):
    """What the module is for: the same resume without it is off in its first step."""
    out = str(tmp_path / "diffs")
    helpers.run(_resume, 3, tmp_path, 3, {}, False, out, timeout=60)
    assert torch.load(f"{out}.0")[0] > 0


def _said(capfd) -> str:
    """What the ranks logged (structlog's default logger prints to stdout)."""
    got = capfd.readouterr()
    return got.out + got.err


def _capture_twice(rank: int, world: int, ddp: dict) -> None:
    model = _model(**ddp)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for s in range(2):
        _step(model, opt, s, rank)
        capture(model=model, rng=False)


def test_static_graph_says_at_the_first_capture_that_resumes_are_not_exact(tmp_path, capfd):
    helpers.run(_capture_twice, 3, tmp_path, {"static_graph": True}, timeout=60)
    said = _said(capfd)  # three ranks print at once: their lines may interleave
    assert said.count("resume_not_bit_identical") == 3, said[-3000:]  # a rank each
    assert said.count("DDP(static_graph=True)") == 3, said[-3000:]


def test_two_ranks_say_nothing(tmp_path, capfd):
    """At 2 ranks a + b is b + a: the buckets cannot change a bit."""
    helpers.run(_capture_twice, 2, tmp_path, {"static_graph": True}, timeout=60)
    assert "resume_not_bit_identical" not in _said(capfd)


def _restore_unwrapped(rank: int, world: int) -> None:
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for s in range(2):
        _step(model, opt, s, rank)
    state = capture(model=model, rng=False)
    restore(state, model=model.module, rng=False)


def test_restore_given_the_model_without_its_ddp_wrapper_says_so(tmp_path, capfd):
    helpers.run(_restore_unwrapped, 3, tmp_path, timeout=60)
    err = _said(capfd)
    assert err.count("without its DistributedDataParallel wrapper") == 3, err[-2000:]


def test_layout_forms_from_ddp_logging():
    assert ddp_buckets._parse("3 2, 1 0", ",", " ") == [[3, 2], [1, 0]]
    assert ddp_buckets._parse("3, 2, 1, 0", ";", ",") == [[3, 2, 1, 0]]
    assert ddp_buckets._parse("", ",", " ") is None
    assert ddp_buckets._parse("a b", ",", " ") is None
