"""The referee of two disagreeing replicas (daemon/referee.py): the claim it stands on, checked
against real gloo ranks (DDP's all-reduced gradient at a world of two is g0/2 + g1/2 made in one
process, bit for bit, every step of exact_job's model, dropout and AdamW included), its verdict,
and what it refuses to judge."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

import _ckpt_helpers as ck
from elasticd import repro
from elasticd.daemon import referee

STEPS = 4


def _net() -> nn.Module:  # tests/scripts/exact_job.py's model, unwrapped
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 32), nn.ReLU(), nn.Dropout(0.2), nn.Linear(32, 1))


def _batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(4, 6, generator=g), torch.randn(4, 1, generator=g)


def _ddp_rank(rank: int, world: int, out: str) -> None:
    from torch.nn.parallel import DistributedDataParallel as DDP

    model = DDP(_net())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.05)
    torch.manual_seed(100 + rank)
    steps = []
    for s in range(STEPS):
        x, y = _batch(rank, s)
        rng = torch.get_rng_state()
        opt.zero_grad()
        F.mse_loss(model(x), y).backward()
        steps.append({"rng": rng, "grads": [p.grad.clone() for p in model.parameters()]})
        opt.step()
    params = [p.detach().clone() for p in model.parameters()]
    torch.save({"steps": steps, "params": params}, f"{out}.{rank}")


def test_ddp_at_two_ranks_is_half_of_each_local_gradient_summed_in_one_process(tmp_path):
    out = str(tmp_path / "ddp")
    ck.run(_ddp_rank, 2, tmp_path, out, timeout=60)
    ranks = [torch.load(f"{out}.{r}", weights_only=True) for r in (0, 1)]
    model = _net()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.05)
    for s in range(STEPS):
        local = []
        for r in (0, 1):
            torch.set_rng_state(ranks[r]["steps"][s]["rng"])  # the rank's dropout draws
            x, y = _batch(r, s)
            model.zero_grad()
            F.mse_loss(model(x), y).backward()
            local.append([p.grad.clone() for p in model.parameters()])
        for p, g0, g1 in zip(model.parameters(), *local, strict=True):
            p.grad = g0.div(2) + g1.div(2)  # as bundle._referee_step mixes them
        for r in (0, 1):
            ddp = ranks[r]["steps"][s]["grads"]
            assert all(torch.equal(p.grad, g) for p, g in zip(model.parameters(), ddp)), (s, r)
        opt.step()
    for r in (0, 1):
        assert all(torch.equal(a, b) for a, b in zip(model.parameters(), ranks[r]["params"]))


def test_the_rank_whose_digest_the_replay_reproduces_is_right():
    assert referee.judge(7, [7, 9], 5, 1.0).odd == 1
    call = referee.judge(9, [7, 9], 5, 1.0)
    assert call.odd == 0 and "reproduced rank 1's digest" in call.said
    neither = referee.judge(8, [7, 9], 5, 1.0)
    assert neither.odd is None and "reproduced neither" in neither.said


def test_without_both_bundles_or_a_pre_step_state_it_decides_nothing(tmp_path):
    def idle(until, done):
        return None

    call = referee.referee(tmp_path, 5, 1.0, idle)
    assert call.odd is None and "no bundle of rank 0" in call.said and "--ledger" in call.said
    for r in (0, 1):  # certified at step 3: not step 5's pre-step state
        head = {"kind": "sdc", "failed_step": 5, "certified_step": 3, "digests": [1, 2]}
        repro.write(tmp_path / f"rank{r}{repro.SDC_SUFFIX}", head, b"")
    call = referee.referee(tmp_path, 5, 1.0, idle)
    assert call.odd is None and "not the pre-step state of step 5" in call.said, call
    assert referee.referee(None, 5, 1.0, idle).odd is None
