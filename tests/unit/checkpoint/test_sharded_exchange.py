"""The shard exchange of a sharded (FSDP2) resume from memory at another world size, with real
gloo ranks on CPU over simulated nodes (each its own memory directory, one shared disk): each
rank receives only the parts of the old shards that overlap its new ones (bytes bounded by its
new shard), and a failure on one rank after the ranks agreed on the step (a chunk damaged in
transit, set_state_dict raising) makes every rank load the newest disk checkpoint, bit-exact,
with one line; without a disk checkpoint the attempt ends and its restart starts from scratch.
Tensor parallel and a 2-D mesh (FSDP2 across tensor-parallel pairs) are held and resharded the
same way."""

from __future__ import annotations

import os
import re
import shutil
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

import _ckpt_helpers as helpers
from elasticd.checkpoint import CheckpointManager, capture, restore, sharded
from elasticd.checkpoint.memory import exchange, slots

pytest.importorskip("torch.distributed.fsdp")

WIDTH = 96  # 2 Linear(96, 96) with Adam: 223 KB of state
SLICES = 12  # DTensors in the state (4 parameters, 2 moments each): slices per sender at most


def _net(layout: str, world: int) -> nn.Module:
    """Two layers, the same weights on every rank before sharding: "fsdp" FSDP2 over every rank,
    "tp" tensor parallel (column- then row-wise) over every rank, "2d" both on a (world/2, 2)
    mesh: tensor parallel within pairs, FSDP2 across them."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import parallel as tp

    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh(), nn.Linear(WIDTH, WIDTH))
    if layout == "tp":
        mesh = init_device_mesh("cpu", (world,))
        tp.parallelize_module(net, mesh, {"0": tp.ColwiseParallel(), "2": tp.RowwiseParallel()})
        return net
    dp = init_device_mesh("cpu", (world,))  # gloo on CPU, GPU or not
    if layout == "2d":
        mesh = init_device_mesh("cpu", (world // 2, 2), mesh_dim_names=("dp", "tp"))
        plan = {"0": tp.ColwiseParallel(), "2": tp.RowwiseParallel()}
        tp.parallelize_module(net, mesh["tp"], plan)
        dp = mesh["dp"]
    for layer in (net[0], net[2], net):
        fully_shard(layer, mesh=dp)
    if layout == "2d":
        assert all(len(p.placements) == 2 for p in net.parameters())  # really 2-D
    return net


def _job(
    rank: int,
    world: int,
    nodes: list[dict],
    steps: int,
    out: str,
    fault: str = "",
    layout: str = "fsdp",
) -> None:
    """Train `steps` steps from whatever load_latest gives (`_net(layout)`, Adam, a disk
    checkpoint every 4 steps, the in-memory state every step), then stop dead (no final save: a
    crash). Writes the gathered state after loading (`out`.loaded.RANK, with where from, the step
    and this rank's new shard bytes) and at every step (`out`.sSTEP). `fault`: "transit" damages
    the bytes sent to rank 1, "apply" makes rank 1's first set_state_dict raise, "die" kills the
    rank sending to rank 1 in the middle of the exchange."""
    from torch.distributed.checkpoint import state_dict as sd

    node = next(n for n in nodes if rank in n["ranks"])
    os.environ.update(
        LOCAL_RANK=str(node["ranks"].index(rank)), LOCAL_WORLD_SIZE=str(len(node["ranks"]))
    )
    net = _net(layout, world)
    opt = torch.optim.Adam(net.parameters(), lr=1e-2)
    if fault == "transit":
        exchange.TAMPER = lambda dst, msg: dst == 1 and msg.__setitem__(0, msg[0] ^ 0xFF)
    if fault == "die":  # the serving rank killed while it packs the shards it sends
        exchange.TAMPER = lambda dst, msg: dst == 1 and os._exit(9)
    if fault == "apply" and rank == 1:
        raised = []

        def once(*_):
            if not raised:
                raised.append(1)
                raise RuntimeError("rank 1's load_state_dict fails once")

        net.register_load_state_dict_pre_hook(once)
    memory = {"memory_dir": node["mem"], "memory_every": 1}  # every step: no cost budget here
    mgr = CheckpointManager(node["disk"], every_steps=4, handle_sigterm=False, **memory)

    def whole() -> dict:
        full = sd.StateDictOptions(full_state_dict=True)
        msd, osd = sd.get_state_dict(net, opt, options=full)
        return {"model": msd, "optimizer": osd}

    step, state = 0, mgr.load_latest()
    if state is not None:
        step = restore(state, model=net, optimizer=opt)["step"]
    msd, osd = sharded.state_dicts(net, opt)
    mine = sum(
        t.to_local().nbytes
        for part in (msd, *osd["state"].values())
        for t in part.values()
        if isinstance(t, sharded.dtensor_class())
    )
    loaded = {"file": mgr.loaded and mgr.loaded.file, "step": step, "shard_bytes": mine}
    torch.save(whole() | loaded, f"{out}.loaded.{rank}")
    g = torch.Generator().manual_seed(1)
    for _ in range(steps):
        x = torch.randn(8, WIDTH, generator=g)
        net(x + step).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
        step += 1
        mgr.maybe_save(step, lambda: capture(model=net, optimizer=opt, step=step))
        held = whole()
        if rank == 0:
            torch.save(held, f"{out}.s{step}")
    mgr.wait()
    dist.barrier()
    os._exit(0)


def _nodes(tmp: Path, ranks: list[list[int]]) -> list[dict]:
    for n in range(len(ranks)):
        (tmp / f"mem{n}").mkdir(exist_ok=True)
    return [
        {"mem": str(tmp / f"mem{n}"), "disk": str(tmp / "disk"), "ranks": rs}
        for n, rs in enumerate(ranks)
    ]


def _run(
    tmp: Path, nodes: list[dict], steps: int, out: Path, fault: str = "", layout: str = "fsdp"
) -> None:
    world = sum(len(n["ranks"]) for n in nodes)
    helpers.run(_job, world, tmp, nodes, steps, str(out), fault, layout, timeout=120)


def _loaded(out: Path, rank: int) -> dict:
    return torch.load(f"{out}.loaded.{rank}", weights_only=True)


def _same(a: dict, b: dict) -> None:
    for part in ("model", "optimizer"):
        fa, fb = _flat(a[part]), _flat(b[part])
        assert fa.keys() == fb.keys(), part
        for k in fa:
            assert (
                torch.equal(fa[k], fb[k]) if isinstance(fa[k], torch.Tensor) else fa[k] == fb[k]
            ), k


def _flat(obj, at: str = "") -> dict:
    if isinstance(obj, dict):
        return {k2: v2 for k, v in obj.items() for k2, v2 in _flat(v, f"{at}/{k}").items()}
    if isinstance(obj, list):
        return {k2: v2 for i, v in enumerate(obj) for k2, v2 in _flat(v, f"{at}/{i}").items()}
    return {at: obj}


def _said(capfd) -> str:
    got = capfd.readouterr()
    return got.out + got.err


def _received(text: str) -> list[int]:
    got = re.findall(r"memory_state_exchanged.*?received_bytes=\[([\d, ]*)\]", text)
    assert len(got) == 1, text[-3000:]
    return [int(n) for n in got[0].split(",")]


def test_each_rank_receives_only_the_parts_of_old_shards_its_new_shards_need(tmp_path, capfd):
    """1 -> 2 (a node joins) and 3 -> 2 (the third node lost, its shards from a replica): each
    rank receives at most its new shards' bytes plus 8 per sender and 8 per slice (alignment),
    not every old rank's whole slot as before; the state is the one the memory held."""
    whole = 2 * (WIDTH * WIDTH + WIDTH) * 4 * 3  # parameters, exp_avg, exp_avg_sq (float32)
    _run(tmp_path, _nodes(tmp_path, [[0]]), 3, tmp_path / "a")
    capfd.readouterr()
    _run(tmp_path, _nodes(tmp_path, [[0], [1]]), 0, tmp_path / "b")
    got = _received(_said(capfd))
    assert got[0] == 0 and 0 < got[1], got  # rank 0 holds old rank 0's slot: all it needs
    for r in range(2):
        loaded = _loaded(tmp_path / "b", r)
        assert loaded["step"] == 3 and "/sharded-exchanged/" in loaded["file"], loaded["file"]
        _same(loaded, torch.load(f"{tmp_path / 'a'}.s3", weights_only=True))
    mine = _loaded(tmp_path / "b", 1)["shard_bytes"]
    assert mine <= got[1] <= mine + 8 * (1 + SLICES), (got, mine, whole)
    print(f"1 -> 2: received {got} bytes; new shard {mine}; before: {whole} (rank 0's slot)")

    (tmp_path / "three").mkdir()
    three = _nodes(tmp_path / "three", [[0], [1], [2]])
    _run(tmp_path, three, 3, tmp_path / "c")
    assert {h.rank for h in slots.held(three[0]["mem"], 0, slots.REPLICA)} == {2}
    capfd.readouterr()
    _run(tmp_path, three[:2], 0, tmp_path / "d")
    got = _received(_said(capfd))
    step = _loaded(tmp_path / "d", 0)["step"]
    assert step in (2, 3), step  # the last replica may not have landed: one refresh lost
    for r in range(2):
        loaded = _loaded(tmp_path / "d", r)
        assert "/sharded-replicas/" in loaded["file"], loaded["file"]
        _same(loaded, torch.load(f"{tmp_path / 'c'}.s{step}", weights_only=True))
        mine = loaded["shard_bytes"]
        assert got[r] <= mine + 8 * (2 + SLICES * 3), (r, got, mine)
    print(f"3 -> 2: received {got} bytes; before: 2/3 and 1/3 of {whole} (whole slots)")


@pytest.mark.parametrize("fault", ["transit", "apply"])
def test_failure_on_one_rank_after_agreeing_loads_the_disk_on_every_rank(tmp_path, capfd, fault):
    """1 -> 2 ranks, memory at step 5, disk at step 4: rank 1 alone fails (the chunk it receives
    damaged on the way, or its set_state_dict raising); both ranks load the disk's step 4,
    bit-exact, after one line naming what failed; the slots are dropped."""
    one = _nodes(tmp_path, [[0]])
    _run(tmp_path, one, 5, tmp_path / "a")
    capfd.readouterr()
    _run(tmp_path, _nodes(tmp_path, [[0], [1]]), 0, tmp_path / "b", fault)
    said = [ln for ln in _said(capfd).splitlines() if "memory_state_skipped" in ln]
    what = "MAC does not verify" if fault == "transit" else "set_state_dict"
    assert len(said) == 1 and "rank 1" in said[0] and what in said[0], said
    assert "loading the newest disk checkpoint" in said[0], said
    for r in range(2):
        loaded = _loaded(tmp_path / "b", r)
        assert loaded["step"] == 4 and not loaded["file"].startswith("memory:"), loaded["file"]
        _same(loaded, torch.load(f"{tmp_path / 'a'}.s4", weights_only=True))
    assert not slots.held(one[0]["mem"], 0), "the slots of the abandoned resume are dropped"


def test_failure_without_a_disk_checkpoint_ends_the_attempt_and_the_next_starts_afresh(
    tmp_path, capfd
):
    """No disk checkpoint (3 steps, the disk every 4): the damaged transfer ends the attempt on
    every rank with one line, the slots dropped, and the restart starts from scratch."""
    _run(tmp_path, _nodes(tmp_path, [[0]]), 3, tmp_path / "a")
    two = _nodes(tmp_path, [[0], [1]])
    capfd.readouterr()
    codes = helpers.join(
        helpers.start(_job, 2, tmp_path, two, 0, str(tmp_path / "b"), "transit"), 120
    )
    assert codes == [1, 1], codes
    err = _said(capfd)
    assert err.count("memory_state_skipped") == 1 and "starts from scratch" in err, err[-3000:]
    assert "RuntimeError: resuming from memory failed on rank 1" in err, err[-3000:]
    assert not any(slots.held(n["mem"], 0) for n in two)
    shutil.rmtree(tmp_path / "b", ignore_errors=True)
    _run(tmp_path, two, 0, tmp_path / "c")
    assert all(_loaded(tmp_path / "c", r)["step"] == 0 for r in range(2))


def test_a_peer_killed_in_the_middle_of_the_exchange_ends_the_attempt_at_once(tmp_path, capfd):
    """1 -> 2 ranks, rank 0 (which serves rank 1's new shards) killed while packing them: rank 1,
    waiting in the exchange, ends the attempt within seconds (gloo sees the peer's connection
    close; the exchange's own bound is 60 s) with one error naming the exchange, and the slots
    stay: the next attempt resumes from them, bit-exact."""
    _run(tmp_path, _nodes(tmp_path, [[0]]), 3, tmp_path / "a")
    two = _nodes(tmp_path, [[0], [1]])
    capfd.readouterr()
    t0 = time.monotonic()
    codes = helpers.join(helpers.start(_job, 2, tmp_path, two, 0, str(tmp_path / "b"), "die"), 90)
    took = time.monotonic() - t0
    assert codes == [9, 1], codes
    err = _said(capfd)
    said = "TimeoutError: the in-memory shard exchange (shards): no answer from a peer"
    assert said in err, err[-3000:]
    assert took < exchange.WAIT / 2, f"rank 1 waited {took:.1f}s for a dead peer"
    assert slots.held(two[0]["mem"], 0), "the slots outlive an attempt that failed"
    _run(tmp_path, two, 0, tmp_path / "c")
    for r in range(2):
        loaded = _loaded(tmp_path / "c", r)
        assert loaded["step"] == 3 and "/sharded-exchanged/" in loaded["file"], loaded["file"]
        _same(loaded, torch.load(f"{tmp_path / 'a'}.s3", weights_only=True))


def test_a_servers_unreadable_slot_makes_every_rank_load_the_disk_with_one_line(tmp_path, capfd):
    """3 -> 2 ranks (node 2 lost), memory at step 5, disk at step 4; node 0's replica of rank 2,
    which rank 0 is to serve, is damaged (its MAC fails first): both ranks load the disk's step
    4, one line naming it."""
    three = _nodes(tmp_path, [[0], [1], [2]])
    _run(tmp_path, three, 5, tmp_path / "a")
    for h in slots.held(three[0]["mem"], 0, slots.REPLICA):
        with open(slots.slot_path(three[0]["mem"], 0, h.k, slots.REPLICA), "r+b") as f:
            header = slots.parse(f.read(slots.FIELDS.size), os.fstat(f.fileno()).st_size)
            f.seek(slots.HEADER + header["data_len"])  # the description: its checksum fails
            f.write(b"\xff" * 8)
    capfd.readouterr()
    _run(tmp_path, three[:2], 0, tmp_path / "b")
    said = [ln for ln in _said(capfd).splitlines() if "memory_state_skipped" in ln]
    assert len(said) == 1 and "rank 0: rank 2's replica refused" in said[0], said
    for r in range(2):
        loaded = _loaded(tmp_path / "b", r)
        assert loaded["step"] == 4 and not loaded["file"].startswith("memory:"), loaded["file"]
        _same(loaded, torch.load(f"{tmp_path / 'a'}.s4", weights_only=True))


@pytest.mark.parametrize("layout, ranks", [("tp", [[0], [1]]), ("2d", [[0, 1], [2, 3]])])
def test_tensor_parallel_and_2d_crash_resumes_from_each_ranks_own_slot_bit_exact(
    tmp_path, layout, ranks
):
    """Tensor parallel over two nodes, and FSDP2 across tensor-parallel pairs on a (2, 2) mesh
    over two nodes of two ranks: a crash after step 3, the same world again: every rank resumes
    step 3 from its own slot, the state bit-identical to the one the job had."""
    nodes = _nodes(tmp_path, ranks)
    _run(tmp_path, nodes, 3, tmp_path / "a", layout=layout)
    _run(tmp_path, nodes, 0, tmp_path / "b", layout=layout)
    for r in range(sum(map(len, ranks))):
        loaded = _loaded(tmp_path / "b", r)
        assert loaded["step"] == 3 and "/sharded-own/" in loaded["file"], loaded["file"]
        _same(loaded, torch.load(f"{tmp_path / 'a'}.s3", weights_only=True))


@pytest.mark.parametrize("layout", ["tp", "2d"])
def test_tensor_parallel_and_2d_node_lost_reshard_from_own_slots_and_replicas(tmp_path, layout):
    """4 ranks on two nodes, node 1 lost: its two ranks' shards come from node 0's replicas, and
    the two survivors reshard everything to tensor parallel over 2 ("tp") or a (1, 2) mesh
    ("2d"), the state bit-identical to the 4-rank job's at the step resumed."""
    nodes = _nodes(tmp_path, [[0, 1], [2, 3]])
    _run(tmp_path, nodes, 3, tmp_path / "a", layout=layout)
    assert {h.rank for h in slots.held(nodes[0]["mem"], 0, slots.REPLICA)} <= {2, 3}
    _run(tmp_path, nodes[:1], 0, tmp_path / "b", layout=layout)
    step = _loaded(tmp_path / "b", 0)["step"]
    assert step in (2, 3), step  # the last replica may not have landed: one refresh lost
    for r in range(2):
        loaded = _loaded(tmp_path / "b", r)
        assert loaded["step"] == step and "/sharded-replicas/" in loaded["file"], loaded["file"]
        _same(loaded, torch.load(f"{tmp_path / 'a'}.s{step}", weights_only=True))
