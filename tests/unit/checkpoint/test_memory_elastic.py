"""Resuming from the in-memory state across a world-size change: a node lost (whichever holds
global rank 0) and the survivors resume from their own memory; nodes added, whose ranks receive
the state from a rank that holds it. At most one refresh interval of work is lost, the state is
the very one held, each sample of the epoch is trained on exactly once over the whole run, and
the RNG rules hold (memory/state.py: choose, derived_base).

Nodes are simulated: each has its own memory directory (the daemon's) and disk directory, and
its ranks are local ranks 0, 1 of it; the daemons' rendezvous plays no part."""

from __future__ import annotations

import ast
import os
import random
from collections import Counter

import numpy as np
import pytest
import torch

import _ckpt_helpers as helpers
from elasticd import checkpoint
from elasticd.checkpoint import rng as rng_state
from elasticd.checkpoint.memory import slots
from elasticd.checkpoint.memory.state import choose, derived_base
from elasticd.checkpoint.memory.writer import Writer

SAMPLES, EVERY, CRASH = 96, 3, 8  # refreshed at 3 and 6, disk at 5, dead after 8: resume at 6


@pytest.fixture(autouse=True, scope="module")
def warm():
    """One optimizer step here first: its lazy imports (about 2 s of torch._dynamo) then happen
    once, before the ranks fork, instead of in each of them on two cores."""
    model = torch.nn.Linear(1, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.ones(1, 1)).sum().backward()
    opt.step()


def make_nodes(tmp_path, layout: dict[str, list[int]]) -> list[dict]:
    nodes = []
    for name, ranks in layout.items():
        for d in ("mem", "disk"):
            (tmp_path / f"{name}-{d}").mkdir(exist_ok=True)
        nodes.append(
            {
                "mem": str(tmp_path / f"{name}-mem"),
                "disk": str(tmp_path / f"{name}-disk"),
                "ranks": ranks,
            }
        )
    return nodes


def job(
    tmp_path, name: str, layout: dict[str, list[int]], total: int, crash_after: int | None = None
) -> str:
    world = sum(len(r) for r in layout.values())
    out = str(tmp_path / name)
    helpers.run(
        helpers.train_on_nodes,
        world,
        tmp_path,
        make_nodes(tmp_path, layout),
        total,
        crash_after,
        out,
        EVERY,
        SAMPLES,
        timeout=90,
    )
    return out


def load(path: str) -> dict:
    return torch.load(path, weights_only=True)


def assert_same_tensors(a, b, where=""):
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b), where
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), where
        for k in a:
            assert_same_tensors(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same_tensors(x, y, f"{where}[{i}]")
    else:
        assert a == b, where


def seen(out: str, world: int) -> list:
    return [ast.literal_eval(open(f"{out}.idx.{r}").read()) for r in range(world)]


def assert_exactly_once(
    before: str, old_world: int, after: str, new_world: int, resumed: int, total: int
):
    """Samples trained on up to the resumed step before the crash, and after it by the new world:
    the epoch's every sample once (the steps in between were lost with the crash)."""
    count: Counter = Counter()
    for rank_steps in seen(before, old_world):
        assert [s for s, _, _ in rank_steps] == list(range(1, CRASH + 1))
        count.update(i for s, epoch, idx in rank_steps if s <= resumed for i in idx)
    for rank_steps in seen(after, new_world):
        assert [s for s, _, _ in rank_steps] == list(range(resumed + 1, total + 1))
        assert {epoch for _, epoch, _ in rank_steps} == {0}
        count.update(i for _, _, idx in rank_steps for i in idx)
    assert count == Counter(range(SAMPLES)), sorted(i for i, n in count.items() if n != 1)


def assert_rng(got: dict, want: dict):
    for kind in ("python", "torch", "numpy"):
        assert_same_tensors(got[kind], want[kind], kind)


def derived_rng(rank: int, step: int, world: int) -> dict:
    """What restore() sets for a rank that resumes from memory without its own RNG state."""
    seed = rng_state.derived_seed({"seed": derived_base(step, world)}, rank)
    version, internal, gauss = random.Random(seed).getstate()
    _, keys, pos, has_gauss, cached = np.random.RandomState(seed % 2**32).get_state(legacy=True)
    return {
        "python": {
            "version": version,
            "state": torch.tensor(internal, dtype=torch.int64),
            "gauss_next": gauss,
        },
        "torch": torch.Generator().manual_seed(seed).get_state(),
        "numpy": {
            "bit_generator": "MT19937",
            "keys": torch.from_numpy(keys.astype(np.int64)),
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "cached_gaussian": float(cached),
        },
    }


@pytest.mark.parametrize(
    "lost_holds_rank0", [True, False], ids=["lost-node-held-rank-0", "lost-node-did-not"]
)
def test_node_lost_survivors_resume_from_their_own_memory(tmp_path, lost_holds_rank0):
    # 4 ranks on nodes A and B; B is lost; A's two ranks go on as a world of 2
    layout = {"B": [0, 1], "A": [2, 3]} if lost_holds_rank0 else {"A": [0, 1], "B": [2, 3]}
    before = job(tmp_path, "before", layout, total=100, crash_after=CRASH)
    survivors = layout["A"]  # their global ranks before
    # refreshed every 3 steps and at the disk save's step 5 (on every rank, wherever rank 0 is)
    assert [h.step for h in slots.held(str(tmp_path / "A-mem"), 0)] == [6, 5]
    # the survivors' own disk: nothing (rank 0 saved on B), or step 5, older than memory
    disk = checkpoint.latest_info(tmp_path / "A-disk")
    assert disk is None if lost_holds_rank0 else disk["step"] == 5
    # 96 samples, 8 a step for 6 steps before, 4 a step after: the epoch ends at step 18
    after = job(tmp_path, "after", {"A": [0, 1]}, total=18)
    for new_rank, old_rank in enumerate(survivors):
        got = load(f"{after}.loaded.{new_rank}")
        assert got["step"] == 6 and got["file"].startswith(f"memory:{tmp_path / 'A-mem'}/w4-"), got[
            "file"
        ]
        held = load(f"{before}.s6.{old_rank}")
        assert_same_tensors(got["model"], held["model"], "model")
        assert_same_tensors(got["optimizer"], held["optimizer"], "optimizer")
        assert_rng(got["rng"], held["rng"])  # a survivor keeps its own RNG, whatever its new rank
    assert_exactly_once(before, 4, after, 2, resumed=6, total=18)


def test_nodes_added_receive_the_state_from_a_rank_that_holds_it(tmp_path):
    # 2 ranks on node A; then 4, with node C (empty memory and disk directories) joining
    before = job(tmp_path, "before", {"A": [0, 1]}, total=100, crash_after=CRASH)
    old_lineage = slots.held(str(tmp_path / "A-mem"), 0)[0].lineage
    after = job(tmp_path, "after", {"A": [0, 1], "C": [2, 3]}, total=6 + (SAMPLES - 6 * 4) // 8)
    held = load(f"{before}.s6.0")
    for r in range(4):
        got = load(f"{after}.loaded.{r}")
        assert got["step"] == 6, got
        # A's ranks read their node's slot, C's receive it: rank 2 from rank 0, rank 3 from rank 1
        assert got["file"].startswith(
            f"memory:{tmp_path / 'A-mem'}/w2-" if r < 2 else f"memory:rank{r - 2}/w2-"
        )
        assert_same_tensors(got["model"], held["model"], "model")
        assert_same_tensors(got["optimizer"], held["optimizer"], "optimizer")
        # A's ranks keep their own RNG; C's are derived from the step, the new world and the rank
        assert_rng(got["rng"], load(f"{before}.s6.{r}")["rng"] if r < 2 else derived_rng(r, 6, 4))
    assert not torch.equal(
        load(f"{after}.loaded.2")["rng"]["torch"], load(f"{after}.loaded.3")["rng"]["torch"]
    )
    assert_exactly_once(before, 2, after, 4, resumed=6, total=15)
    # every node now refreshes one new lineage: a later resume can take C's memory too
    a, c = slots.held(str(tmp_path / "A-mem"), 0), slots.held(str(tmp_path / "C-mem"), 0)
    assert [h.step for h in a] == [h.step for h in c] == [15, 12]
    assert {h.lineage for h in a + c} == {a[0].lineage} and a[0].lineage != old_lineage


@pytest.mark.parametrize("damaged", [False, True])
def test_a_state_that_cannot_be_sent_sends_every_rank_to_the_disk(tmp_path, damaged):
    """Node 0 holds step 4, node 1 nothing: node 1's rank receives it, checked on arrival. When the
    holder cannot read it (a damaged description), it sends nothing, and every rank goes to the
    disk checkpoint together (here: none), with the holder's slots dropped."""
    mems = [str(tmp_path / "m0"), str(tmp_path / "m1")]
    for m in mems:
        os.mkdir(m)
    w = Writer(mems[0], 0, lineage=5, local_world=1)
    w.write(
        4,
        {
            "model": {"w": torch.arange(6.0)},
            "user": {"step": 4},
            "rng": {"world_size": 1, "ranks": [{"torch": torch.ones(3)}]},
        },
        world=1,
        rank=0,
    )
    w.close()
    if damaged:
        h = slots.header(slots.slot_path(mems[0], 0, 0))
        with open(slots.slot_path(mems[0], 0, 0), "r+b") as f:
            f.seek(slots.HEADER + h["data_len"] + 3)
            f.write(b"#")
    helpers.run(
        helpers.load_on_own_nodes, 2, tmp_path, mems, str(tmp_path / "disk"), str(tmp_path / "got")
    )
    got = [load(str(tmp_path / f"got.{r}")) for r in range(2)]
    if damaged:
        assert [g["state"] for g in got] == [None, None] and slots.held(mems[0], 0) == []
        return
    assert [g["file"] for g in got] == [
        f"memory:{mems[0]}/w1-s000000000004",
        "memory:rank0/w1-s000000000004",
    ]
    for g in got:
        assert torch.equal(g["state"]["model"]["w"], torch.arange(6.0)) and g["state"]["user"] == {
            "step": 4
        }
    assert torch.equal(
        got[0]["state"]["rng"]["ranks"][0]["torch"], torch.ones(3)
    )  # the holder keeps its own
    assert got[1]["state"]["rng"]["ranks"] == [None, None]  # the receiver's is derived by restore()
    assert got[1]["state"]["rng"]["seed"] == derived_base(4, 2)


# -- the rules, on what ranks report --------------------------------------------------------------


def view(whole=(), own=None, local=0, disk=-1):
    """A rank's report: `whole` its node's (step, lineage) of local rank 0, written by 2 local
    ranks of a 4-rank world; `own` its own slots (local rank 0: the same)."""
    whole = [[s, x, 2, 4] for s, x in whole]
    own = (
        [[s, x] for s, x in own]
        if own is not None
        else [w[:2] for w in whole]
        if local == 0
        else []
    )
    return {"whole": whole, "own": own, "local": local, "disk": disk, "next": 1}


def test_choose_takes_the_newest_step_any_node_holds_that_every_rank_can_resume():
    a = [(6, 7), (3, 7)]
    # survivors of a lost node, and a new node's ranks that hold nothing: step 6, sent to the new
    c, why = choose([view(a), view(a, own=a, local=1), view(), view(local=1)])
    assert (c.step, c.lineage, c.world, c.holders, c.keepers) == (6, 7, 4, (0, 1), (0, 1)), why
    # a rank that held the lineage lacks its RNG at 6 (its refresh torn): the step before
    c, _ = choose([view(a), view(a, own=[(3, 7)], local=1)])
    assert c.step == 3
    # ... and at no step at all: nothing (the disk's); a local rank its node never had (it ran
    # 2) has none to keep and takes a derived one
    assert choose([view(a), view(a, own=[], local=1)]) == (
        None,
        "rank 1 lacks its own RNG state at step 6",
    )
    assert choose([view(a), view(a, own=[], local=2)])[0].keepers == (0,)
    # a newer disk checkpoint wins; an equal one does not
    assert choose([view(a, disk=7), view()]) == (None, "disk checkpoint at step 7 is newer")
    assert choose([view(a, disk=6), view()])[0].step == 6
    assert choose([view(), view()]) == (None, "no step held in memory")


def test_choose_never_mixes_a_timeline_a_node_missed():
    # node B was cut off while A resumed at 6 of lineage 7 and went on as lineage 9; B comes back
    # holding 6 and 8 of lineage 7: 8 is of an abandoned timeline, but whole and consistent on its
    # own
    a, b = [(9, 9), (6, 7)], [(8, 7), (6, 7)]
    c, _ = choose([view(a), view(b)])
    assert (c.step, c.lineage, c.holders, c.keepers) == (
        9,
        9,
        (0,),
        (0,),
    )  # B's ranks took no part in 9
    # the same step number in two lineages: the one more ranks hold, whatever the order
    for views in (
        [view([(9, 9)]), view([(9, 7)]), view([(9, 7)])],
        [view([(9, 7)]), view([(9, 9)]), view([(9, 7)])],
    ):
        c, _ = choose(views)
        assert (c.step, c.lineage) == (9, 7) and len(c.holders) == 2
