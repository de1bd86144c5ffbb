"""Sharded state with real gloo ranks on CPU: a model sharded by FSDP2's fully_shard holds
DTensors. The in-memory state keeps each rank's own shards
(tests/unit/checkpoint/test_sharded_memory.py has the resumes); a DTensor anywhere else in the
state, and the disk's plain Snapshot path, refuse them with one line naming the key, and the rank
goes on or raises: never a segfault (the in-memory writer once copied from a DTensor's data_ptr(),
which is 0). The disk save takes them
(tests/unit/checkpoint/test_sharded_disk.py)."""

from __future__ import annotations

import os

import pytest
import structlog
import torch
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh

import _ckpt_helpers as helpers
from elasticd.checkpoint import CheckpointManager, capture
from elasticd.checkpoint.disk.snapshot import Snapshot
from elasticd.checkpoint.memory import slots, writer

fsdp = pytest.importorskip("torch.distributed.fsdp")

USER = r"state\['user'\]\['extra'\]: a torch\.distributed\.tensor\.DTensor .*fully_shard"


def sharded_state_is_refused(rank: int, world: int, disk: str, mem: str) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
    mesh = init_device_mesh("cpu", (world,))  # gloo on CPU, GPU or not
    for layer in (model[0], model[2], model):
        fsdp.fully_shard(layer, mesh=mesh)
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    model(torch.randn(2, 4)).sum().backward()
    opt.step()

    def state():
        return capture(model=model, optimizer=opt, step=1)

    with structlog.testing.capture_logs() as logs:
        mgr = CheckpointManager(
            disk, handle_sigterm=False, memory_dir=mem, memory_every=1, every_steps=2
        )
        mgr.maybe_save(1, state)  # an in-memory refresh only: every rank keeps its own shards
        mgr.maybe_save(2, state)  # the disk save: every rank writes its own shards
        mgr.close()
    assert not [e for e in logs if e["event"] == "memory_state_off"], logs
    assert mgr.memory_every == 1
    assert [(h.step, h.sharded) for h in slots.held(mem, rank)] == [(2, True), (1, True)]
    assert mgr.last_saved is not None and mgr.last_saved.step == 2
    assert mgr.last_saved.file.endswith(".dcp")

    # A DTensor among the user's values, in the in-memory copy; the optimizer's sharded moments
    # in the disk's plain Snapshot (a sharded save takes them through sharded.HostCopy).
    own = os.path.join(mem, f"own{rank}")
    os.mkdir(own)
    w = writer.Writer(own, 0)
    with pytest.raises(TypeError, match=USER + ".*in-memory state"):
        w.write(
            1,
            capture(model=model, optimizer=opt, rng=False, extra=model[0].weight),
            world=world,
            rank=rank,
            sharded=True,
        )
    w.close()
    with pytest.raises(
        TypeError, match=r"state\['optimizer'\]\['state'\]\[0\]\['exp_avg'\]: a .*DTensor"
    ):
        Snapshot().take(capture(optimizer=opt, rng=False))


def test_fsdp2_state_is_refused_by_key_never_a_segfault(tmp_path):
    mem = tmp_path / "mem"
    mem.mkdir()
    helpers.run(sharded_state_is_refused, 2, tmp_path, str(tmp_path / "disk"), str(mem), timeout=90)
