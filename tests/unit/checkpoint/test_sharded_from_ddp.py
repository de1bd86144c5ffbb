"""A user moves a job from DDP to FSDP2: the DDP job's full checkpoint (elasticd's `.pt`) loads
into the now-sharded model through the same load_latest + restore, each rank keeping only its own
shards of every tensor, the optimizer's index-keyed state matched to the parameters by name; an
optimizer built otherwise is refused with one line naming the fix."""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

import _ckpt_helpers as helpers
from elasticd.checkpoint import CheckpointManager, capture, restore
from unit.checkpoint.test_sharded_disk import _full, _model, _step

pytest.importorskip("torch.distributed.fsdp")


def ddp_job(rank: int, world: int, disk: str, out: str) -> None:
    """_model's layers under DDP: 3 steps, a save, 2 steps more (the reference)."""
    torch.manual_seed(0)
    model = DDP(nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1)))
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    with CheckpointManager(disk, handle_sigterm=False) as mgr:
        for _ in range(3):
            _step(model, opt)
        mgr.save(3, capture(model=model, optimizer=opt, step=3))
    for _ in range(2):
        _step(model, opt)
    if rank == 0:
        ref = {f"model.{k}": v for k, v in model.module.state_dict().items()}
        for i, s in opt.state_dict()["state"].items():
            ref |= {f"optim.{i}.{k}": v for k, v in s.items()}
        torch.save(ref, os.path.join(out, "final.pt"))


def fsdp_job(rank: int, world: int, disk: str, out: str, whole: bool) -> None:
    model, opt = _model(1)
    if not whole:  # an optimizer over part of the model: its state cannot be matched by name
        opt = torch.optim.Adam(model[0].parameters(), lr=0.01)
    mgr = CheckpointManager(disk, handle_sigterm=False)
    state = mgr.load_latest()
    assert mgr.loaded.file.endswith(".pt"), mgr.loaded  # the DDP job's full checkpoint
    if not whole:
        with pytest.raises(ValueError, match="4 parameters in 1 groups, the sharded model's 2"):
            restore(state, model=model, optimizer=opt)
        return
    assert restore(state, model=model, optimizer=opt) == {"step": 3}
    assert model[0].weight.to_local().shape == (4, 4)  # this rank's half of the (8, 4) weight
    for _ in range(2):
        _step(model, opt)
    got, ref = _full(model, opt), torch.load(os.path.join(out, "final.pt"))
    assert got.keys() == ref.keys()
    for k in ref:  # FSDP2's reduce-scatter against DDP's all-reduce: equal to rounding
        torch.testing.assert_close(got[k], ref[k], rtol=1e-5, atol=1e-6, msg=k)


@pytest.fixture(scope="module")
def ddp_checkpoint(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("from-ddp")
    disk, out = str(tmp / "disk"), str(tmp / "out")
    os.mkdir(out)
    helpers.run(ddp_job, 2, tmp, disk, out, timeout=120)
    return tmp, disk, out


def test_a_ddp_checkpoint_loads_into_the_sharded_model(ddp_checkpoint):
    tmp, disk, out = ddp_checkpoint
    helpers.run(fsdp_job, 2, tmp, disk, out, True, timeout=120)


def test_an_optimizer_that_cannot_be_matched_is_refused_in_one_line(ddp_checkpoint):
    tmp, disk, out = ddp_checkpoint
    helpers.run(fsdp_job, 2, tmp, disk, out, False, timeout=120)
