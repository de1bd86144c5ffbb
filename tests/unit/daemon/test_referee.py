"""The referee of two disagreeing replicas (daemon/referee.py): the claim it stands on, checked
against real gloo ranks (DDP's all-reduced gradient at a world of two is g0/2 + g1/2 made in one
process, bit for bit, every step of exact_job's model, dropout and AdamW included; on NCCL and the
GPU too where there is one), its verdict, and what it refuses to judge."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

import _ckpt_helpers as ck
from elasticd import repro
from elasticd.daemon import referee
from harness import ROOT, script
from scripts import referee_job

GPU = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU (NCCL)")


def _replayed(ranks: list[dict], device: str) -> None:
    """The disputed steps made again in one process as bundle._referee_step does (each rank's
    local gradient from its own draws, then g0/2 + g1/2), checked bit for bit against the
    gradients DDP all-reduced at every step and the parameters both ranks ended with."""
    model = referee_job.net(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.05)
    for s in range(referee_job.STEPS):
        local = []
        for r in (0, 1):
            referee_job.set_rng(ranks[r]["steps"][s]["rng"])  # the rank's dropout draws
            x, y = referee_job.batch(r, s, device)
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


def test_ddp_at_two_ranks_is_half_of_each_local_gradient_summed_in_one_process(tmp_path):
    out = str(tmp_path / "ddp")
    ck.run(referee_job.train, 2, tmp_path, out, timeout=60)
    _replayed([torch.load(f"{out}.{r}", weights_only=True) for r in (0, 1)], "cpu")


@GPU
def test_on_nccl_and_the_gpu_the_mix_in_one_process_is_what_ddp_all_reduced(tmp_path):
    """The same claim with NCCL's all-reduce and the GPU's kernels (dropout's draws from the
    CUDA generator): two ranks under torchrun (sharing the GPU where there is one), the replay
    in this process on the GPU."""
    out = str(tmp_path / "ddp")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    done = subprocess.run(
        [*cmd, script("referee_job.py"), out],
        capture_output=True,
        text=True,
        timeout=180,
        env=dict(os.environ, PYTHONPATH=path),
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    ranks = [torch.load(f"{out}.{r}", weights_only=True) for r in (0, 1)]  # RNG on the CPU
    _replayed(ranks, "cuda")


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
