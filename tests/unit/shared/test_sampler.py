"""ResumableDistributedSampler: DistributedSampler parity, exact mid-epoch resume, and
exactly-once coverage of an interrupted epoch across a world-size change."""

from __future__ import annotations

import io
from collections import Counter

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler

from elasticd.sampler import ResumableDistributedSampler


class Range:
    """A map-style dataset of n items whose item i is i."""

    def __init__(self, n: int):
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> int:
        return i


def samplers(cls, n, world, **kw):
    return [cls(Range(n), num_replicas=world, rank=r, **kw) for r in range(world)]


@pytest.mark.parametrize("shuffle", [True, False])
@pytest.mark.parametrize("drop_last", [False, True])
def test_same_indices_as_distributed_sampler(shuffle, drop_last):
    for n in (1, 2, 7, 10, 13, 64):
        for world in (1, 2, 3, 4):
            for seed, epoch in ((0, 0), (5, 3)):
                ours = samplers(
                    ResumableDistributedSampler,
                    n,
                    world,
                    shuffle=shuffle,
                    seed=seed,
                    drop_last=drop_last,
                )
                ref = samplers(
                    DistributedSampler, n, world, shuffle=shuffle, seed=seed, drop_last=drop_last
                )
                for a, b in zip(ours, ref):
                    a.set_epoch(epoch)
                    b.set_epoch(epoch)
                    assert list(a) == list(b), (n, world, a.rank, seed, epoch)
                    assert len(a) == len(b) == a.num_samples == b.num_samples
                    assert isinstance(a, DistributedSampler)


def consume(samplers_, steps: int, batch: int) -> list[int]:
    """Every rank trains on `steps` batches in lockstep; returns the indices used, all ranks."""
    used = []
    for s in samplers_:
        it = iter(s)
        for _ in range(steps):
            got = [i for _, i in zip(range(batch), it)]
            used += got
            s.advance(len(got))
    return used


def resume(state, n, world, **kw):
    new = samplers(ResumableDistributedSampler, n, world, **kw)
    for s in new:
        s.load_state_dict(state)
        s.set_epoch(state["epoch"])  # what the usual loop does first: keeps the position
    return new


@pytest.mark.parametrize("drop_last", [False, True])
def test_exact_mid_epoch_resume_same_world(drop_last):
    n, world, batch, steps = 50, 2, 4, 3
    first = samplers(ResumableDistributedSampler, n, world, seed=3, drop_last=drop_last)
    full = []
    for s in first:
        s.set_epoch(2)
        full.append(list(s))
    consume(first, steps, batch)
    state = first[0].state_dict()
    assert (
        state["epoch"] == 2
        and state["consumed"] == steps * batch * world
        and state["world_size"] == world
    )
    assert state == first[1].state_dict()
    again = resume(state, n, world, drop_last=drop_last)
    for r, s in enumerate(again):
        assert list(s) == full[r][steps * batch :]  # the exact next sample, nothing repeated
        assert len(s) == len(full[r]) - steps * batch
    # The next epoch is a fresh DistributedSampler epoch again.
    ref = samplers(DistributedSampler, n, world, seed=3, drop_last=drop_last)
    for s, b in zip(again, ref):
        s.set_epoch(3)
        b.set_epoch(3)
        assert list(s) == list(b) and len(s) == len(b)


def test_dataloader_resume_counts_trained_batches_not_prefetched():
    """The loader draws ahead of training; advance() counts what training used."""
    ds = TensorDataset(torch.arange(30))
    s = ResumableDistributedSampler(ds, num_replicas=1, rank=0, seed=1)
    loader = DataLoader(ds, batch_size=4, sampler=s)
    seen = []
    for step, (x,) in enumerate(loader):
        if step == 3:
            break  # batch 3 was loaded but never trained on
        seen += x.tolist()
        s.advance(len(x))
    s2 = ResumableDistributedSampler(ds, num_replicas=1, rank=0, seed=99)
    s2.load_state_dict(s.state_dict())
    rest = [i for (x,) in DataLoader(ds, batch_size=4, sampler=s2) for i in x.tolist()]
    assert seen + rest == list(ResumableDistributedSampler(ds, num_replicas=1, rank=0, seed=1))
    assert sorted(seen + rest) == list(range(30))


def check_exactly_once(before, after, n, new_world, drop_last):
    counts = Counter(before + after)
    assert len(before) == len(set(before))
    if drop_last:  # nothing twice; at most new_world - 1 skipped at the end of the order
        assert max(counts.values()) == 1
        assert n - new_world < len(counts) <= n
    else:  # everything at least once; padding repeats fewer than new_world samples
        assert set(counts) == set(range(n))
        assert sum(counts.values()) - n < new_world
        assert len(after) % new_world == 0


@pytest.mark.parametrize("old_world,new_world", [(3, 2), (2, 3)])
@pytest.mark.parametrize("drop_last", [False, True])
def test_world_size_change_sees_every_sample_once(old_world, new_world, drop_last):
    for n, steps, batch in ((61, 4, 3), (60, 2, 5), (37, 1, 4)):
        old = samplers(ResumableDistributedSampler, n, old_world, seed=11, drop_last=drop_last)
        for s in old:
            s.set_epoch(4)
        before = consume(old, steps, batch)
        state = old[0].state_dict()
        new = resume(state, n, new_world, drop_last=drop_last)
        per_rank = [list(s) for s in new]
        assert len({len(p) for p in per_rank}) == 1, "ranks must stay in lockstep"
        assert [len(s) for s in new] == [len(p) for p in per_rank]
        after = [i for p in per_rank for i in p]
        check_exactly_once(before, after, n, new_world, drop_last)
        # What was consumed is a prefix of the epoch's global order, whatever the world size.
        order = ResumableDistributedSampler(Range(n), num_replicas=1, rank=0, seed=11)
        order.set_epoch(4)
        assert set(before) == set(list(order)[: state["consumed"]])
        # Resume again mid-way at the new size, then back: still exactly once.
        for s in new:
            s.advance(batch)
        it_before = before + [i for p in per_rank for i in p[:batch]]
        third = resume(new[0].state_dict(), n, old_world, drop_last=drop_last)
        rest = [i for s in third for i in s]
        if not drop_last:
            real = [i for i in it_before + rest]
            assert set(real) == set(range(n))
        else:
            assert max(Counter(it_before + rest).values()) == 1
        # The following epoch follows the new world size like DistributedSampler.
        ref = samplers(DistributedSampler, n, new_world, seed=11, drop_last=drop_last)
        for s, b in zip(new, ref):
            s.set_epoch(5)
            b.set_epoch(5)
            assert list(s) == list(b)


def test_set_epoch_keeps_position_only_for_the_current_epoch():
    s = ResumableDistributedSampler(Range(20), num_replicas=2, rank=0, seed=0)
    s.set_epoch(1)
    s.advance(3)
    s.set_epoch(1)
    assert len(s) == 10 - 3
    s.set_epoch(2)
    assert len(s) == 10 and s.consumed == 0


def test_finished_epoch_yields_nothing_until_the_next():
    s = ResumableDistributedSampler(Range(9), num_replicas=2, rank=1, seed=0)
    s.advance(len(list(s)))  # 5 each, one padded
    assert s.epoch_done and len(s) == 0 and list(s) == []
    assert s.state_dict()["consumed"] == 9
    s.set_epoch(1)
    assert len(s) == 5


def test_state_is_weights_only_loadable_and_checked():
    s = ResumableDistributedSampler(Range(20), num_replicas=2, rank=0, seed=4, shuffle=False)
    s.advance(2)
    buf = io.BytesIO()
    torch.save(s.state_dict(), buf)
    state = torch.load(io.BytesIO(buf.getvalue()), weights_only=True)
    t = ResumableDistributedSampler(Range(20), num_replicas=2, rank=1, seed=0)
    t.load_state_dict(state)
    assert (t.seed, t.shuffle, t.consumed) == (4, False, 4)
    assert list(t) == list(range(5, 20, 2))
    with pytest.raises(ValueError, match="dataset of 20"):
        ResumableDistributedSampler(Range(21), num_replicas=2, rank=0).load_state_dict(state)
    with pytest.raises(ValueError, match="newer"):
        t.load_state_dict({**state, "format": 99})
    with pytest.raises(ValueError):
        t.advance(-1)


def test_world_and_rank_from_torchrun_env_without_process_group(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "3")
    monkeypatch.setenv("RANK", "2")
    s = ResumableDistributedSampler(Range(9))
    assert (s.num_replicas, s.rank) == (3, 2)
    assert list(s) == list(DistributedSampler(Range(9), num_replicas=3, rank=2))
    monkeypatch.delenv("WORLD_SIZE")
    monkeypatch.delenv("RANK")
    s = ResumableDistributedSampler(Range(9))
    assert (s.num_replicas, s.rank) == (1, 0)
