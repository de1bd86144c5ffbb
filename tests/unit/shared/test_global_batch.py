"""elasticd.global_batch, elasticd.batch_split and elasticd.exact: the split rules as properties
over many (G, m, W), the stream each step deals from, its state, and with real gloo ranks (forked,
tests/_ckpt_helpers.py) the gradient each mode yields: the mean over the global batch in normal
mode, the same bits in every world in exact mode."""

from __future__ import annotations

import io
import math
import os
import signal
import time
from collections import Counter
from fractions import Fraction

import psutil
import pytest
import structlog
import structlog.testing
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset

import _ckpt_helpers as helpers
from elasticd import exact as exact_mode
from elasticd.batch_split import split, split_exact
from elasticd.global_batch import GlobalBatch

SIZES = st.tuples(
    st.integers(1, 300), st.integers(1, 64), st.integers(1, 40)
)  # (global batch, micro-batch, world)


def _real(plan):
    return [m for rank in plan.ranks for m in rank if not m.filler]


@settings(max_examples=400, deadline=None)
@given(SIZES)
def test_either_split_covers_the_global_batch_once_in_micro_batches_no_larger_than_m(sizes):
    g, m, w = sizes
    for plan in (split(g, m, w), split_exact(g, m, w)):
        real = sorted(_real(plan), key=lambda x: x.index)
        assert [x.index for x in real] == list(range(len(real)))  # numbered in position order
        covered = [p for x in real for p in range(x.offset, x.offset + x.size)]
        assert covered == list(range(g))  # each position once, in order
        assert all(1 <= x.size <= m for x in real)
        assert len(plan.ranks) == w
        # contiguous runs, rank 0 first
        flat = [x.index for rank in plan.ranks for x in rank if not x.filler]
        assert flat == sorted(flat)
        # the loss weights sum to one mean: DDP divides the ranks' sum by W in normal mode
        total = sum(Fraction(x.size, g) * (1 if plan.exact else w) for x in real)
        assert total / (1 if plan.exact else w) == 1
        assert math.isclose(
            sum(plan.scale(x) for rank in plan.ranks for x in rank) / (1 if plan.exact else w), 1
        )


@settings(max_examples=400, deadline=None)
@given(SIZES)
def test_normal_split_is_even_and_keeps_every_rank_in_step(sizes):
    g, m, w = sizes
    plan = split(g, m, w)
    shares = [plan.samples(r) for r in range(w)]
    assert max(shares) - min(shares) <= 1 and sum(shares) == g
    passes = {len(rank) for rank in plan.ranks}
    assert passes == {math.ceil(max(shares) / m)}  # the same number of forwards everywhere
    assert all(plan.scale(x) == 0 for rank in plan.ranks for x in rank if x.filler)
    fillers = any(x.filler for rank in plan.ranks for x in rank)
    assert fillers == (w > g or (m == 1 and g % w != 0))
    assert (plan.note() is None) == (g % w == 0 and not fillers)


@settings(max_examples=400, deadline=None)
@given(SIZES, st.integers(1, 40))
def test_exact_split_has_the_same_micro_batches_in_every_world(sizes, other):
    g, m, w = sizes
    a, b = split_exact(g, m, w), split_exact(g, m, other)
    assert sorted(_real(a), key=lambda x: x.index) == sorted(_real(b), key=lambda x: x.index)
    k = math.ceil(g / m)
    counts = [len(rank) for rank in a.ranks]
    assert sum(counts) == k and max(counts) - min(counts) <= 1
    assert counts == sorted(counts, reverse=True)  # a world larger than K: the last ranks idle
    assert (a.note() is None) == (k % w == 0)


@pytest.mark.parametrize(
    "plan, words",
    [
        (split(64, 16, 2), None),
        (split(64, 16, 3), "global batch 64 over 3 ranks does not divide evenly: 22 samples "
         "(rank 0), 21 (ranks 1-2) per rank; each step still trains on exactly 64 samples"),
        (split(2, 4, 3), "1 filler pass(es) of one sample at loss weight 0"),
        (split_exact(10, 4, 2), "3 micro-batches of at most 4: 2 micro-batches (rank 0), 1 "
         "(rank 1) per rank"),
        (split_exact(10, 4, 4), "1 rank(s) compute none and only join the gradient sum"),
        (split_exact(12, 4, 3), None),
    ],
)  # fmt: skip
def test_the_one_line_says_what_each_rank_takes(plan, words):
    note = plan.note()
    assert note == words if words is None else words in note


@pytest.mark.parametrize("bad", [(0, 4, 2), (8, 0, 2), (8, 4, 0), (8.0, 4, 2), (True, 4, 2)])
def test_bad_sizes_are_refused_naming_them(bad):
    with pytest.raises(ValueError, match="must be"):
        split(*bad)


# -- the stream -------------------------------------------------------------------------------


def _gb(n=23, g=10, m=4, world=1, rank=0, **kw) -> GlobalBatch:
    return GlobalBatch(range(n), g, m, num_replicas=world, rank=rank, seed=5, **kw)


def _steps(gb: GlobalBatch, count: int) -> list[list[int]]:
    out = []
    for _ in range(count):
        out.append(gb.global_indices())
        gb._finish_step()
    return out


@pytest.mark.parametrize("n, g", [(23, 10), (7, 10), (30, 10), (1, 3)])
def test_each_epoch_is_dealt_exactly_once_in_whole_global_batches(n, g):
    steps = _steps(_gb(n, g), 30)
    assert all(len(s) == g for s in steps)
    stream = [i for s in steps for i in s]
    for e in range(len(stream) // n):
        epoch = stream[e * n : (e + 1) * n]
        assert sorted(epoch) == list(range(n))
        g_ = torch.Generator().manual_seed(5 + e)  # elasticd.sampler's order for that epoch
        assert epoch == torch.randperm(n, generator=g_).tolist()


@pytest.mark.parametrize("exact", [False, True])
@pytest.mark.parametrize("world", [1, 2, 3, 5, 12])
def test_the_ranks_lists_make_up_the_same_global_batch_in_every_world(world, exact):
    reference = _steps(_gb(), 8)
    ranks = [_gb(world=world, rank=r, exact=exact) for r in range(world)]
    streams = [iter(r) for r in ranks]
    for s in range(8):
        dealt = Counter()
        for r, gb in enumerate(ranks):
            for micro in gb.mine:
                got = next(streams[r])
                if not micro.filler:
                    assert len(got) == micro.size
                    dealt.update(got)
        assert dealt == Counter(reference[s]), s


def test_the_position_travels_in_a_weights_only_checkpoint_and_resumes_at_another_world():
    run = _gb(world=2)
    _steps(run, 5)
    buf = io.BytesIO()
    torch.save(run.state_dict(), buf)
    buf.seek(0)
    state = torch.load(buf, weights_only=True)
    assert (state["epoch"], state["consumed"], state["step"]) == (2, 4, 5)
    resumed = _gb(world=3, rank=1)
    resumed.load_state_dict(state)
    assert _steps(resumed, 4) == _steps(_gb(), 9)[5:]
    with pytest.raises(ValueError, match="dataset of 23 samples, this one has 24"):
        _gb(n=24).load_state_dict(state)
    with pytest.raises(ValueError, match="not a GlobalBatch's"):
        _gb().load_state_dict({"format": 1, "epoch": 0, "consumed": 0})


def test_an_iterator_made_before_restore_is_refused():
    data = TensorDataset(torch.arange(23.0))
    gb = GlobalBatch(data, 10, 4, num_replicas=1, rank=0)
    with pytest.raises(RuntimeError, match="batch_sampler=this GlobalBatch"):
        next(gb.micro_batches(nn.Linear(1, 1), iter([])))
    early = iter(DataLoader(data, batch_sampler=gb))
    later = _gb()
    _steps(later, 3)
    gb.load_state_dict(later.state_dict())
    with pytest.raises(RuntimeError, match="make it after restore"):
        next(gb.micro_batches(nn.Linear(1, 1), early))


# -- gradients, with real gloo ranks ----------------------------------------------------------

N, G, M, STEPS = 37, 11, 3, 6


def _data():
    g = torch.Generator().manual_seed(1)
    return TensorDataset(torch.randn(N, 5, generator=g), torch.randn(N, 1, generator=g))


def _net():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 16), nn.ReLU(), nn.Dropout(0.3), nn.Linear(16, 1))


def _train(rank: int, world: int, out: str, exact: bool) -> None:
    """STEPS optimizer steps; rank 0 saves the parameters and the last step's gradient."""
    import numpy as np

    data, net = _data(), _net()
    model = DDP(net) if world > 1 else net
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    gb = GlobalBatch(data, G, M, seed=3, exact=exact)
    batches = iter(DataLoader(data, batch_sampler=gb))
    for _ in range(STEPS):
        opt.zero_grad()
        for mb, (x, y) in gb.micro_batches(model, batches):
            x = x + 0.1 * torch.from_numpy(np.random.standard_normal(x.shape).astype("float32"))
            (F.mse_loss(model(x), y) * mb.scale).backward()
        grads = [p.grad.clone() for p in net.parameters()]
        opt.step()
    if rank == 0:
        torch.save({"params": list(net.parameters()), "grads": grads}, out)


def _run(tmp_path, world: int, exact: bool) -> dict:
    out = str(tmp_path / f"w{world}-{exact}.pt")
    helpers.run(_train, world, tmp_path, out, exact, timeout=90, distributed=world > 1)
    return torch.load(out, weights_only=True)


def test_exact_mode_gives_the_same_bits_in_every_world(tmp_path):
    ref = _run(tmp_path, 1, True)
    for world in (3, 5):  # 4 micro-batches: 2+1+1 over 3 ranks; at 5, one rank idle
        got = _run(tmp_path, world, True)
        for a, b in zip(ref["params"], got["params"], strict=True):
            assert torch.equal(a, b), world
    # normal mode is not bit-exact across worlds (dropout keyed by rank, an all-reduce's order):
    # the comparison above can tell
    normal = [_run(tmp_path, w, False)["params"] for w in (1, 2)]
    assert not all(torch.equal(a, b) for a, b in zip(*normal, strict=True))


def _mean_gradient(rank: int, world: int, out: str, g: int, m: int) -> None:
    """One step without dropout or noise in normal mode: the gradient must be the mean over the
    global batch, whatever the split."""
    data, net = _data(), _net().eval()
    model = DDP(net) if world > 1 else net
    gb = GlobalBatch(data, g, m, seed=3)
    batches = iter(DataLoader(data, batch_sampler=gb))
    for mb, (x, y) in gb.micro_batches(model, batches):
        (F.mse_loss(model(x), y) * mb.scale).backward()
    if rank == 0:
        torch.save([p.grad for p in net.parameters()], out)
    if dist.is_initialized():
        dist.barrier()


@pytest.mark.parametrize(
    "world, g, m",
    [(1, G, M), (2, G, M), (3, G, M), (2, 3, 1), (3, 2, 4)],
    ids=["1", "2-uneven", "3", "filler-for-m-1", "world-over-G"],
)
def test_normal_mode_gradient_is_the_mean_over_the_global_batch(tmp_path, world, g, m):
    out = str(tmp_path / "grad.pt")
    helpers.run(_mean_gradient, world, tmp_path, out, g, m, timeout=90, distributed=world > 1)
    got = torch.load(out, weights_only=True)
    data, net = _data(), _net().eval()
    idx = GlobalBatch(data, g, m, num_replicas=1, rank=0, seed=3).global_indices()
    x, y = data[idx]
    F.mse_loss(net(x), y).backward()
    for a, b in zip(got, [p.grad for p in net.parameters()], strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_normal_mode_over_several_ranks_needs_ddp_and_a_thread_count_change_is_said():
    data = TensorDataset(torch.arange(23.0))
    gb = GlobalBatch(data, 10, 4, num_replicas=2, rank=0)
    with pytest.raises(TypeError, match="needs a DistributedDataParallel model"):
        next(gb.micro_batches(nn.Linear(1, 1), iter(DataLoader(data, batch_sampler=gb))))
    exact = GlobalBatch(data, 10, 4, num_replicas=2, rank=0, exact=True)
    state = {**exact.state_dict(), "threads": torch.get_num_threads() + 1}
    with structlog.testing.capture_logs() as said:
        exact.load_state_dict(state)
    assert [e["event"] for e in said] == ["exact_threads_changed"]


def _refuses_buffer_broadcast(rank: int, world: int) -> None:
    with pytest.raises(ValueError, match="broadcast_buffers=False"):
        exact_mode.check_model(DDP(nn.BatchNorm1d(3)))
    exact_mode.check_model(DDP(nn.BatchNorm1d(3), broadcast_buffers=False))


def test_exact_mode_refuses_a_ddp_model_that_broadcasts_buffers(tmp_path):
    helpers.run(_refuses_buffer_broadcast, 1, tmp_path, timeout=60)


def _sender_and_stalled_receiver(rank: int, world: int, n: int, stage: str) -> None:
    """One rank runs the ordered sum of a step; the other asks for data as the sum's next step
    would (the running sum in the chain, or the result the last rank shares), then stops
    reading (it stops itself; the test kills it): the first rank's data is left mid-send."""
    big = nn.Parameter(torch.zeros(n))
    chain = exact_mode.OrderedSum([big], working=2)
    chain.begin()
    big.grad = torch.ones(n)
    if rank == (1 if stage == "chain" else 0):
        _stall(chain, big, n, share=stage == "share", sender=1 - rank)
    if stage == "share":
        chain.after_backward()  # rank 1 keeps its micro-batch's gradient apart
    _fails_at_once(chain, "the send")


def _stall(chain, big, n: int, share: bool, sender: int) -> None:
    """Ask for the data the ordered sum sends next (for the shared sum, after rank 0's part of
    the chain, all of it taken by rank 1), then stop reading: the sender is left mid-send."""
    if share:
        for work in chain._post([big.grad], [1]):
            work.wait()
    dist.irecv(torch.empty(1, dtype=torch.uint8), sender)  # the mask
    dist.irecv(torch.empty(n), sender)  # the flat gradient
    os.kill(os.getpid(), signal.SIGSTOP)
    os._exit(0)  # not reached: the test kills the stopped rank


def _fails_at_once(chain, who: str) -> None:
    began = time.monotonic()
    with pytest.raises(RuntimeError):
        chain.finish()
    waited = time.monotonic() - began
    assert waited < 10, f"{who} waited {waited:.1f}s for a dead peer"
    os._exit(0)  # the group is broken: no destroy


def _kill_when_stopped(procs, stalled: int) -> list:
    """Kill the stalled rank once it has stopped itself and its senders have filled the
    sockets' buffers; the ranks' exit codes."""
    try:
        stopped = psutil.Process(procs[stalled].pid)
        deadline = time.monotonic() + 30
        while stopped.status() != psutil.STATUS_STOPPED:
            assert time.monotonic() < deadline, "the stalled rank never stopped"
            time.sleep(0.02)
        time.sleep(0.3)
        stopped.kill()
    finally:
        codes = helpers.join(procs, timeout=20)  # kills what is left at the deadline
    return codes


@pytest.mark.parametrize("stage", ["chain", "share"])
def test_a_rank_mid_send_in_the_ordered_sum_fails_at_once_when_its_receiver_dies(tmp_path, stage):
    """A survivor blocked in the ordered sum's send (the running sum to the next rank, or the
    result from the last rank to the others) when its receiver stopped reading and closed was
    killed as stuck (gloo woke it only at the group's timeout, 30 s here): the send now ends
    with the receiver's connection."""
    n = 16 << 20  # 64 MB: more than the sockets' buffers hold
    procs = helpers.start(_sender_and_stalled_receiver, 2, tmp_path, n, stage)
    codes = _kill_when_stopped(procs, 1 if stage == "chain" else 0)
    assert codes[1 if stage == "share" else 0] == 0, codes


def _three_ranks_one_stalled(rank: int, world: int, n: int, stage: str) -> None:
    """The ordered sum of a step at three ranks, one of which asks for its data as the sum would,
    then stops reading (it stops itself; the test kills it): "middle", the last rank (2), whose
    running sum comes from the middle rank, which has just received its own from rank 0; "share",
    rank 0, one of the two ranks the last rank sends the sum to, the other one reading on."""
    big = nn.Parameter(torch.zeros(n))
    chain = exact_mode.OrderedSum([big], working=3)
    chain.begin()
    big.grad = torch.ones(n)
    stalled, sender = (2, 1) if stage == "middle" else (0, 2)
    if rank == stalled:
        _stall(chain, big, n, share=stage == "share", sender=sender)
    if rank > 0:
        chain.after_backward()  # each micro-batch's gradient kept apart, added in the chain
    if stage == "share" and rank == 1:  # it reads on: the sum of all three reaches it
        chain.finish()
        assert torch.equal(big.grad, torch.full((n,), 3.0))
        os._exit(0)
    _fails_at_once(chain, f"rank {rank}")


@pytest.mark.parametrize("stage", ["middle", "share"])
def test_at_three_ranks_the_ordered_sum_ends_at_once_for_every_rank_whose_peer_dies(
    tmp_path, stage
):
    """Three ranks, one of which stops reading mid-transfer and is killed: in the chain's middle
    (rank 1 receives its running sum, then sends on to the stalled last rank; rank 0 waits for
    the shared sum) each waiting rank ends with the dead one's connection, not at the group's
    timeout (30 s here); with the shared sum (the last rank sends it to ranks 0 and 1, rank 0
    stalled) the last rank ends at once and rank 1, which read on, has the whole sum."""
    n = 16 << 20  # 64 MB: more than the sockets' buffers hold
    stalled = 2 if stage == "middle" else 0
    procs = helpers.start(_three_ranks_one_stalled, 3, tmp_path, n, stage)
    codes = _kill_when_stopped(procs, stalled)
    assert [c for r, c in enumerate(codes) if r != stalled] == [0, 0], codes
