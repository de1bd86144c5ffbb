"""ResumableDistributedSampler(batch_size=B): the rest of an epoch the world changed in is dealt in
whole global batches, so a DataLoader with drop_last=True drops nothing and every sample is
trained exactly once; the ledger's checker (ops/ledger_check.py) proves it from the records.

`simulate` runs the usual loop for every rank in lockstep, with DataLoader(drop_last=True)'s rule
(a batch shorter than B is dropped and ends the epoch), through a plan of world sizes, each
resumed from the state of a step at most `rollback` steps back (what a crash loses)."""

from __future__ import annotations

import math
from collections import Counter
from itertools import islice

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch.utils.data.distributed import DistributedSampler

from elasticd import ledger
from elasticd.ledger import LedgerFile
from elasticd.ops import ledger_check
from elasticd.sampler import ResumableDistributedSampler
from unit.shared.test_sampler import Range


class Recorder:
    """The ledger's calls, as the rank files of each attempt (no files written)."""

    def __init__(self):
        self.files: list[LedgerFile] = []
        self.current: dict[int, LedgerFile] = {}
        self.rank = 0

    def new_attempt(self, world: int) -> None:
        t = len(self.files) + 1.0
        self.current = {
            r: LedgerFile(None, r, world, f"attempt{len(self.files)}", t) for r in range(world)
        }
        self.files += self.current.values()

    def resumed(self, step: int) -> None:
        self.current[self.rank].resumed = step

    def record(self, epochs, step: int, indices) -> None:
        f = self.current[self.rank]
        if f.resumed is None:
            f.resumed = step - 1
        f.steps.setdefault(step, []).append((list(indices), list(epochs)))


@pytest.fixture
def recorder(monkeypatch):
    rec = Recorder()
    monkeypatch.setattr(ledger, "enabled", lambda: True)
    monkeypatch.setattr(ledger, "record", rec.record)
    monkeypatch.setattr(ledger, "resumed", rec.resumed)
    monkeypatch.setattr(ledger, "dataset_size", lambda n: None)
    return rec


def simulate(rec, n, b, plan, rollbacks=None, seed=3, drop_last=False):
    """Train through `plan` [(world, steps), ...]; returns (the surviving steps, each the global
    batch in dealing order as (epoch, index); the epochs a rank's partial batch was dropped in;
    how each epoch's samples were dealt: {epoch: {world, or 0 for whole global batches}})."""
    survived, dropped, modes, states = [], [], [], []
    samplers = None
    for k, (world, steps) in enumerate(plan):
        rec.new_attempt(world)
        new = [
            ResumableDistributedSampler(
                Range(n), world, r, seed=seed, drop_last=drop_last, batch_size=b
            )
            for r in range(world)
        ]
        if samplers is not None:
            back = min((rollbacks or [0] * len(plan))[k], len(states) - 1)
            state = states[-1 - back]
            del survived[state["step"] :], modes[state["step"] :], states[len(states) - back :]
            for r, s in enumerate(new):
                rec.rank = r
                s.load_state_dict(state)
        samplers = new
        for s in samplers:
            s.set_epoch(s.epoch)
        if not states:
            states.append(samplers[0].state_dict())  # step 0: a fresh start
        its, done, idle = [iter(s) for s in samplers], 0, 0
        while done < steps and idle < 3:
            s0 = samplers[0]
            if s0.whole_batches:
                assert len(s0) % b == 0, "a partial batch to drop"
            got = [list(islice(it, b)) for it in its]
            assert len({len(g) for g in got}) == 1, "ranks out of lockstep"
            if len(got[0]) < b:  # DataLoader(drop_last=True): dropped, the epoch ends
                if got[0]:
                    assert not s0.whole_batches, "a partial global batch"
                    dropped.append(s0.epoch)
                idle += 1
                for s in samplers:
                    s.set_epoch(s.epoch + 1)
                its = [iter(s) for s in samplers]
                continue
            idle = 0
            _, _, epochs = samplers[0]._deal(fresh=False)
            for r, s in enumerate(samplers):
                rec.rank = r
                s.advance(b)
            f = rec.current
            step = samplers[0].step
            batch = [(f[r].steps[step][0][1][j], got[r][j]) for j in range(b) for r in range(world)]
            survived.append(batch)
            modes.append(0 if s0.whole_batches else world)
            states.append(samplers[0].state_dict())
            done += 1
    fresh: dict[int, set[int]] = {}  # how each epoch's samples were dealt
    for batch, mode in zip(survived, modes):
        for e, _ in batch:
            fresh.setdefault(e, set()).add(mode)
    return survived, dropped, fresh


def order(n, epoch, seed=3):
    s = ResumableDistributedSampler(Range(n), 1, 0, seed=seed)
    s.set_epoch(epoch)
    return list(s)


plans = st.lists(st.tuples(st.integers(1, 4), st.integers(0, 14)), min_size=1, max_size=5).map(
    lambda p: [(w, s) for w, s in p]
)


@settings(
    max_examples=300, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck)
)
@given(b=st.integers(1, 4), k=st.integers(1, 3), plan=plans, back=st.lists(st.integers(0, 2)))
def test_divisible_dataset_is_one_stream_of_whole_batches(recorder, b, k, plan, back):
    """N a multiple of every global batch: whatever the world changes (incl. right at an epoch's
    end, several in one epoch, growing and shrinking) and the steps rolled back, the trained
    samples are the epochs' orders one after the other, nothing dropped, nothing twice."""
    worlds = [w for w, _ in plan]
    n = b * math.lcm(*worlds) * k
    rollbacks = [0, *back, *[0] * len(plan)][: len(plan)]
    survived, dropped, _ = simulate(recorder, n, b, plan, rollbacks)
    assert not dropped
    stream = [i for batch in survived for _, i in batch]
    epochs = math.ceil(len(stream) / n) + 1
    expected = [i for e in range(epochs) for i in order(n, e)]
    assert stream == expected[: len(stream)]
    labels = [e for batch in survived for e, _ in batch]
    assert labels == [p // n for p in range(len(stream))]
    proof = ledger_check.history(recorder.files)
    assert not proof.problems
    assert [sorted((e, i) for _, e, i in proof.steps[s]) for s in sorted(proof.steps)] == [
        sorted(batch) for batch in survived
    ]
    proof.dataset_size = n
    lines, ok = ledger_check.epochs(proof)
    assert ok, lines


@settings(
    max_examples=300, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck)
)
@given(
    n=st.integers(1, 40),
    b=st.integers(1, 5),
    plan=plans,
    drop_last=st.booleans(),
    back=st.lists(st.integers(0, 2)),
)
def test_any_dataset_re_dealt_epochs_exactly_once_fresh_ones_as_torch(
    recorder, n, b, plan, drop_last, back
):
    rollbacks = [0, *back, *[0] * len(plan)][: len(plan)]
    survived, dropped, fresh = simulate(recorder, n, b, plan, rollbacks, drop_last=drop_last)
    per_epoch: dict[int, Counter] = {}
    for batch in survived:
        for e, i in batch:
            per_epoch.setdefault(e, Counter())[i] += 1
    last = max(per_epoch, default=0)
    for e, seen in per_epoch.items():
        if 0 not in fresh[e]:  # DistributedSampler's epoch, cut to whole batches by the loader
            (w,) = fresh[e]
            ref = [
                DistributedSampler(Range(n), w, r, seed=3, drop_last=drop_last) for r in range(w)
            ]
            for s in ref:
                s.set_epoch(e)
            whole = len(ref[0]) // b * b
            want = Counter(i for s in ref for i in list(s)[:whole])
            assert seen == want or e == last, (e, w)
        else:  # re-dealt: every sample once (all of them once the epoch is over)
            assert max(seen.values()) == 1, e
            if e < last:
                assert set(seen) == set(range(n)), e


def test_world_change_with_drop_last_skips_nothing_issue_example(recorder):
    """The issue's case: 4,000 samples, batch 16, world 1 -> 2 after an odd number of steps:
    without batch_size each rank's last 8 are dropped; with it, none."""
    survived, dropped, _ = simulate(recorder, 4000, 16, [(1, 7), (2, 130)])
    seen = Counter(i for batch in survived for e, i in batch if e == 0)
    assert not dropped and len(seen) == 4000 and max(seen.values()) == 1
    # 7 steps of 16 leave 3,888 = 121.5 global batches of 32: the last is completed with the
    # next epoch's first 16, which that epoch starts with
    assert sum(1 for batch in survived for e, _ in batch if e == 1) >= 16
    old = [ResumableDistributedSampler(Range(4000), 1, 0, seed=3)]
    old[0].advance(7 * 16)
    legacy = [ResumableDistributedSampler(Range(4000), 2, r, seed=3) for r in range(2)]
    for s in legacy:
        s.load_state_dict(old[0].state_dict())
    assert [len(s) % 16 for s in legacy] == [8, 8]  # what DataLoader(drop_last=True) drops


def test_fresh_epochs_identical_to_distributed_sampler_with_batch_size():
    for n in (1, 7, 10, 13, 64):
        for world in (1, 2, 3):
            for drop_last in (False, True):
                for b in (1, 3, 4):
                    ours = ResumableDistributedSampler(
                        Range(n), world, world - 1, seed=5, drop_last=drop_last, batch_size=b
                    )
                    ref = DistributedSampler(
                        Range(n), world, world - 1, seed=5, drop_last=drop_last
                    )
                    ours.set_epoch(2)
                    ref.set_epoch(2)
                    assert list(ours) == list(ref) and len(ours) == len(ref)
                    ours.advance(b)  # a same-world resume continues DistributedSampler's epoch
                    again = ResumableDistributedSampler(
                        Range(n), world, world - 1, drop_last=drop_last, batch_size=b
                    )
                    again.load_state_dict(ours.state_dict())
                    assert list(again) == list(ref)[b:]


def test_carry_is_kept_by_set_epoch_and_state():
    s = ResumableDistributedSampler(Range(10), 2, 0, seed=1, batch_size=2)
    s.load_state_dict({**s.state_dict(), "fresh_world": 1, "consumed": 4})  # begun at world 1
    assert s.whole_batches and len(s) == 4  # 6 left: one global batch of 4, one of 2 + 2 borrowed
    s.advance(4)
    state = s.state_dict()
    assert (state["consumed"], state["carry"], state["fresh_world"], state["step"]) == (10, 2, 0, 1)
    t = ResumableDistributedSampler(Range(10), 3, 1, seed=1, batch_size=2)
    t.load_state_dict(state)
    t.set_epoch(state["epoch"])
    assert len(t) == 0
    t.set_epoch(state["epoch"] + 1)
    assert t.consumed == 2 and t.whole_batches  # 8 left at world 3: 2 global batches of 6
    assert len(t) == 4
    t.set_epoch(7)  # not the next epoch: fresh
    assert t.consumed == 0 and not t.whole_batches
    with pytest.raises(ValueError, match="batch_size"):
        ResumableDistributedSampler(Range(10), 2, 0, batch_size=0)
