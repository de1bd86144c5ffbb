"""A 2-D mesh: FSDP2 over `dp` and tensor parallel over `tp` on a (2, 2) DeviceMesh, four forked
gloo ranks. capture/restore/CheckpointManager save and resume it bit-exact, and the checkpoint
loads into other mesh shapes (tensor parallel only over 4 ranks; FSDP2 only over 2): DCP
reshards each tensor by its global offsets."""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn as nn

import _ckpt_helpers as helpers
from elasticd.checkpoint import CheckpointManager, capture, restore
from unit.checkpoint.test_sharded_disk import _full, _model, _same, _step

pytest.importorskip("torch.distributed.fsdp")


def _model_2d(seed: int, shape: tuple[int, int]):
    """Column- then row-wise tensor parallel over `tp`, every layer fully_shard over `dp`."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import parallel as tp

    mesh = init_device_mesh("cpu", shape, mesh_dim_names=("dp", "tp"))
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 4))
    plan = {"0": tp.ColwiseParallel(), "2": tp.RowwiseParallel()}
    tp.parallelize_module(model, mesh["tp"], plan)
    for layer in (model[0], model[2], model):
        fully_shard(layer, mesh=mesh["dp"])
    return model, torch.optim.Adam(model.parameters(), lr=0.01)


def train_2d(rank: int, world: int, disk: str, out: str) -> None:
    model, opt = _model_2d(0, (2, 2))
    placements = {p.placements for p in model.parameters()}
    assert any(len(p) == 2 for p in placements), placements  # really 2-D
    with CheckpointManager(disk, handle_sigterm=False, every_steps=3) as mgr:
        for step in range(1, 4):
            _step(model, opt)
            mgr.maybe_save(step, lambda step=step: capture(model=model, optimizer=opt, step=step))
    at3 = _full(model, opt)
    for _ in range(2):
        _step(model, opt)
    final = _full(model, opt)
    if rank == 0:
        torch.save({"at3": at3, "final": final}, os.path.join(out, "ref.pt"))

    model, opt = _model_2d(1, (2, 2))  # other weights: restore overwrites them all
    torch.manual_seed(123)
    mgr = CheckpointManager(disk, handle_sigterm=False)
    assert restore(mgr.load_latest(), model=model, optimizer=opt) == {"step": 3}
    _same(_full(model, opt), at3)
    for _ in range(2):
        _step(model, opt)
    _same(_full(model, opt), final)  # RNG, parameters and Adam's state: bit-identical onwards


def load_other_shape(rank: int, world: int, disk: str, out: str, kind: str) -> None:
    model, opt = _model_2d(1, (1, 4)) if kind == "tp" else _model(1)
    if kind == "fsdp":  # _model's layers are (4 -> 8 -> 1): a (4 -> 8 -> 4) one, FSDP2 only
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        torch.manual_seed(1)
        model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 4))
        mesh = init_device_mesh("cpu", (world,))
        for layer in (model[0], model[2], model):
            fully_shard(layer, mesh=mesh)
        opt = torch.optim.Adam(model.parameters(), lr=0.01)
    mgr = CheckpointManager(disk, handle_sigterm=False)
    assert restore(mgr.load_latest(), model=model, optimizer=opt) == {"step": 3}
    ref = torch.load(os.path.join(out, "ref.pt"))
    _same(_full(model, opt), ref["at3"])
    for _ in range(2):
        _step(model, opt)
    got = _full(model, opt)  # the same arithmetic on other shards: equal to rounding
    for k, v in ref["final"].items():
        torch.testing.assert_close(got[k], v, rtol=1e-5, atol=1e-6)


@pytest.fixture(scope="module")
def saved_2d(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("mesh")
    disk, out = str(tmp / "disk"), str(tmp / "out")
    os.mkdir(out)
    helpers.run(train_2d, 4, tmp, disk, out, timeout=120)
    return tmp, disk, out


def test_fsdp2_with_tensor_parallel_on_a_2d_mesh_resumes_bit_exact(saved_2d):
    _, disk, _ = saved_2d
    names = [n for n in os.listdir(disk) if n.endswith(".dcp")]
    assert len(names) == 1, names
    files = sorted(os.listdir(os.path.join(disk, names[0])))
    assert files == [".metadata", *(f"__{r}_0.distcp" for r in range(4)), "state.pt"], files


@pytest.mark.parametrize("kind, world", [("tp", 4), ("fsdp", 2)])
def test_a_2d_checkpoint_loads_into_another_mesh_shape(saved_2d, kind, world):
    tmp, disk, out = saved_2d
    helpers.run(load_other_shape, world, tmp, disk, out, kind, timeout=120)
