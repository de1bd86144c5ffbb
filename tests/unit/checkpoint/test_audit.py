"""The replicas' audit (checkpoint/audit.py): the digest reads bits, the verdict names the odd one
out, and a CheckpointManager keeps no state the replicas disagree on (real gloo ranks, forked)."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

import _ckpt_helpers as helpers
from elasticd import names
from elasticd.checkpoint import CheckpointManager, audit, capture
from elasticd.checkpoint.memory import slots


def flip(t: torch.Tensor, index: int = 0, bit: int = 3) -> None:
    """One mantissa bit of one float32 value, in place: the value stays finite."""
    ints = t.data.view(-1).view(torch.int32)
    ints[index] ^= 1 << bit


def test_digest_is_the_bits_not_the_values():
    a = [torch.randn(5, 7), torch.arange(6, dtype=torch.float16), torch.tensor([True, False])]
    same = [t.clone() for t in a]
    assert audit.digest(a) == audit.digest(same)
    flipped = [t.clone() for t in a]
    flip(flipped[0], 11, 0)
    assert torch.allclose(flipped[0], a[0]) and audit.digest(flipped) != audit.digest(a)
    # -0.0 and 0.0 are equal values, different bits
    assert audit.digest([torch.tensor([0.0])]) != audit.digest([torch.tensor([-0.0])])
    # a non-contiguous view digests its own elements
    m = torch.randn(4, 4)
    assert audit.digest([m.t()]) == audit.digest([m.t().contiguous()])


@pytest.mark.parametrize(
    "digests, odd, suspects",
    [
        ([7, 7, 7], None, ()),
        ([7, 8, 7], (1,), (1,)),
        ([7, 8], (), (0, 1)),  # two replicas: undecided
        ([1, 1, 2, 2], (), (0, 1, 2, 3)),  # no majority
        ([1, 1, 1, 2, 3], (3, 4), (3, 4)),
    ],
)
def test_verdict(digests, odd, suspects):
    v = audit.verdict(digests)
    assert v.agreed == (odd is None)
    if odd is not None:
        assert v.odd == odd and v.suspects == suspects and v.undecided == (not odd)


def _train(rank, model, opt, tmp, flip_after, flipped, skip=False):
    """Six steps of `model`, kept in memory at every step; after `flip_after`'s boundary
    `flipped()` flips a bit (None: not on this rank); `skip`: that step's optimizer.step() is not
    called. (the step reached, the manager, the audit's SilentDataCorruption or None)"""
    mgr = CheckpointManager(tmp + "/ckpt", memory_every=1, memory_dir=f"{tmp}/mem")
    torch.manual_seed(rank)
    step = 0
    try:
        while step < 6:
            loss = model(torch.randn(2, 4)).square().sum()
            opt.zero_grad()
            loss.backward()
            if not (skip and step == flip_after):
                opt.step()
            step += 1
            mgr.maybe_save(step, lambda: capture(model=model, optimizer=opt, step=step))
            if step == flip_after and flipped is not None:
                flipped()
    except audit.SilentDataCorruption as e:
        with open(f"{tmp}/sdc{rank}", "w") as f:  # the forked rank's exit code is the helper's
            f.write(str(e))
        return step, mgr, e
    return step, mgr, None


def _job(rank: int, world: int, tmp: str, flip_rank: int | None, flip_after: int) -> None:
    torch.manual_seed(0)
    model = DDP(nn.Linear(4, 3))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    flipped = (lambda: flip(model.module.weight, 5)) if rank == flip_rank else None
    step, mgr, e = _train(rank, model, opt, tmp, flip_after, flipped)
    if e is not None:
        held = [h.step for h in slots.held(f"{tmp}/mem", 0)]  # the node's state
        # nothing of the step the replicas disagreed on was kept; the newest kept is certified
        assert step == flip_after + 1 and max(held) == flip_after, (step, held)
        assert e.code == names.SDC_EXIT and f"step {step}" in str(e)
        return
    assert mgr.audits == 6, mgr.audits
    mgr.close()


@pytest.mark.parametrize("world", [2, 3])
def test_a_flipped_bit_on_one_rank_ends_every_rank_before_the_state_is_kept(tmp_path, world):
    (tmp_path / "mem").mkdir()
    helpers.run(_job, world, tmp_path, str(tmp_path), 1, 3)
    said = [(tmp_path / f"sdc{r}").read_text() for r in range(world)]
    assert len(set(said)) == 1, said  # every rank reached the same verdict
    if world == 3:
        assert "rank(s) 1 disagreed with the other 2 replicas" in said[0], said[0]
    else:
        assert "undecided between ranks 0, 1" in said[0], said[0]


def test_clean_replicas_pass_every_audit(tmp_path):
    (tmp_path / "mem").mkdir()
    helpers.run(_job, 3, tmp_path, str(tmp_path), None, 3)


def _sharded_job(rank: int, world: int, tmp: str, flip_after: int | None, skip: bool) -> None:
    """FSDP2 over `world` ranks; rank 1 flips a bit of its own shard after `flip_after`'s
    boundary. `skip`: that step's optimizer.step() is not called (as a GradScaler skips it), so
    the boundary itself verifies the window."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 3))
    fully_shard(model, mesh=init_device_mesh("cpu", (world,)))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    flipped = (lambda: flip(next(model.parameters()).to_local(), 1)) if rank == 1 else None
    step, mgr, e = _train(rank, model, opt, tmp, flip_after, flipped, skip)
    if e is not None:
        held = [h.step for h in slots.held(f"{tmp}/mem", rank)]  # this rank's own shards
        assert step == flip_after + 1 and max(held) == flip_after, (step, held)
        assert e.code == names.SDC_EXIT and mgr.audits == flip_after, mgr.audits  # 2..4
        return
    assert flip_after is None and mgr.audits == 5, mgr.audits  # every window after the first keep
    mgr.close()


@pytest.mark.parametrize(
    ("world", "skip"), [(2, False), (2, True), (3, False)], ids=["2", "2-skipped-step", "3"]
)
def test_a_flipped_bit_in_one_ranks_shard_names_it_before_the_state_is_kept(tmp_path, world, skip):
    """At 3 ranks the shards are uneven (8 rows: 3, 3, 2) and two ranks' audits pass: the
    verdict still reaches every rank and names rank 1 alone."""
    pytest.importorskip("torch.distributed.fsdp")
    (tmp_path / "mem").mkdir()
    helpers.run(_sharded_job, world, tmp_path, str(tmp_path), 3, skip)
    said = [(tmp_path / f"sdc{r}").read_text() for r in range(world)]
    assert len(set(said)) == 1, said
    assert "rank(s) 1's shards" in said[0] and "before step 4's update" in said[0], said[0]


@pytest.mark.parametrize("world", [2, 3])
def test_clean_shards_pass_every_audit_in_time(tmp_path, world):
    pytest.importorskip("torch.distributed.fsdp")
    (tmp_path / "mem").mkdir()
    helpers.run(_sharded_job, world, tmp_path, str(tmp_path), None, False)
    assert not list(tmp_path.glob("sdc*"))


def test_the_windows_cadence_holds_their_budget_of_step_time():
    a = audit.Auditor()
    assert a._proposal(0.1) == 1  # nothing measured yet: every step
    a._window_costs.extend([0.0005] * 5)  # two digests, 0.5 ms
    assert a._proposal(0.1) == 2  # 0.25% of a 100 ms step is 0.25 ms
    assert a._proposal(1.0) == 1 and a._proposal(0.01) == 20
    assert audit.WINDOW_BUDGET + 0.0075 <= 0.01  # with the refresh's budget: the 1%
