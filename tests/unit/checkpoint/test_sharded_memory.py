"""The in-memory state of a sharded (FSDP2, fully_shard) job, with real gloo ranks on CPU over
simulated nodes (each its own memory directory): every rank keeps its own shards, and on more
than one node a replica of the next node's rank, so a crash at the same world resumes from its own
slot, a lost node from the survivors' slots and replicas at the smaller world, a grown world from
the ranks that hold the shards, and two lost neighbours from the disk, with one line saying why.
A replica changed in the survivor's /dev/shm is refused (its MAC does not verify), never loaded.
Each sample of the epoch is trained on exactly once across the change."""

from __future__ import annotations

import ast
import json
import shutil
from pathlib import Path

import pytest
import torch

import _ckpt_helpers as helpers
from elasticd import names
from elasticd.checkpoint.memory import slots

pytest.importorskip("torch.distributed.fsdp")

SAMPLES = 48  # an epoch: 24 batches of 2


def _train(tmp: Path, world: int, nodes: list[dict], total: int, crash: int | None, out: Path):
    """helpers.train_on_nodes with FSDP2, the in-memory state refreshed every step."""
    args = (nodes, total, crash, str(out), 1, SAMPLES, True)
    helpers.run(helpers.train_on_nodes, world, tmp, *args, timeout=150)


def _nodes(tmp: Path, ranks: list[list[int]]) -> list[dict]:
    """Nodes with a memory directory each and one shared disk directory (a sharded checkpoint
    needs a filesystem every rank sees)."""
    out = []
    for n, rs in enumerate(ranks):
        mem = tmp / f"mem{n}"
        mem.mkdir(exist_ok=True)
        out.append({"mem": str(mem), "disk": str(tmp / "disk"), "ranks": rs})
    return out


def _same(a, b, at: str = "state") -> None:
    """Equal, tensors bit for bit."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and torch.equal(a, b), at
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), at
        for k in a:
            _same(a[k], b[k], f"{at}[{k!r}]")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), at
        for i, (x, y) in enumerate(zip(a, b)):
            _same(x, y, f"{at}[{i}]")
    else:
        assert a == b, at


def _state(path: str, rng: bool = False) -> dict:
    got = torch.load(path, weights_only=True)
    return {k: got[k] for k in ("model", "optimizer", *(("rng",) if rng else ()))}


def _seen(out: Path, world: int) -> list[tuple[int, int, list[int]]]:
    return [
        tuple(s) for r in range(world) for s in ast.literal_eval(Path(f"{out}.idx.{r}").read_text())
    ]


def test_fsdp2_worker_crash_resumes_from_its_own_slot_bit_exact(tmp_path):
    nodes = _nodes(tmp_path, [[0, 1]])
    first, second = tmp_path / "a", tmp_path / "b"
    _train(tmp_path, 2, nodes, 20, 7, first)
    held = [slots.held(nodes[0]["mem"], r) for r in range(2)]
    assert all(h[0].sharded and h[0].step == 7 for h in held), held  # every rank its own shards
    assert not slots.held(nodes[0]["mem"], 0, slots.REPLICA)  # one node: no replica
    _train(tmp_path, 2, nodes, 9, None, second)
    for r in range(2):
        got = torch.load(f"{second}.loaded.{r}", weights_only=True)
        assert got["step"] == 7 and "/sharded-own/" in got["file"], got["file"]  # no exchange
        # the optimizer's state came from the slot as it is, not made first by a step of zero
        # gradients (torch's get_state_dict on a fresh optimizer)
        assert got["loading_steps"] == 0
        _same(_state(f"{second}.loaded.{r}", rng=True), _state(f"{first}.s7.{r}", rng=True))


def test_fsdp2_node_lost_survivor_resumes_from_own_shards_and_replica(tmp_path):
    """Two nodes of one rank each; either is lost (its memory with it), rank 0's included. The
    survivor rebuilds the whole state at world 1 from its own slot and its replica of the lost
    rank, no disk read; the epoch's samples are each trained on once."""
    nodes = _nodes(tmp_path, [[0], [1]])
    first = tmp_path / "a"
    _train(tmp_path, 2, nodes, 40, 7, first)
    for lost in (1, 0):  # each survivor on a copy of its memory and of the disk
        alone = tmp_path / f"alone{lost}"
        shutil.copytree(nodes[1 - lost]["mem"], alone / "mem")
        shutil.copytree(tmp_path / "disk", alone / "disk")
        survivor = {"mem": str(alone / "mem"), "disk": str(alone / "disk"), "ranks": [0]}
        replicas = slots.held(survivor["mem"], 0, slots.REPLICA)
        assert replicas and {h.rank for h in replicas} == {lost}, replicas
        total = 7 + (SAMPLES - 2 * 2 * 7) // 2  # the rest of the epoch at world 1
        second = alone / "b"
        _train(alone, 1, [survivor], total, None, second)
        got = torch.load(f"{second}.loaded.0", weights_only=True)
        assert "/sharded-replicas/" in got["file"], got["file"]
        assert got["step"] in (6, 7), got["step"]  # at most one refresh lost (every step here)
        assert got["loading_steps"] == 0  # the optimizer's state placed as received, no dry step
        for r in range(2):
            _same(_state(f"{second}.loaded.0"), _state(f"{first}.s{got['step']}.{r}"))
        seen = [i for s, e, idx in _seen(first, 2) if e == 0 and s <= got["step"] for i in idx]
        seen += [i for s, e, idx in _seen(second, 1) if e == 0 for i in idx]
        assert sorted(seen) == list(range(SAMPLES)), (len(seen), len(set(seen)))


def test_fsdp2_world_grows_new_rank_receives_its_shards_from_memory(tmp_path):
    nodes = _nodes(tmp_path, [[0], [1]])
    first, second = tmp_path / "a", tmp_path / "b"
    _train(tmp_path, 1, nodes[:1], 40, 7, first)
    _train(tmp_path, 2, nodes, 8, None, second)
    for r in range(2):
        got = torch.load(f"{second}.loaded.{r}", weights_only=True)
        assert got["step"] == 7 and "/sharded-exchanged/" in got["file"], got["file"]
        assert got["loading_steps"] == 0  # the optimizer's state placed as received, no dry step
        _same(_state(f"{second}.loaded.{r}"), _state(f"{first}.s7.0"))


def test_fsdp2_two_neighbouring_nodes_lost_falls_back_to_disk_saying_why(tmp_path, capfd):
    nodes = _nodes(tmp_path, [[0], [1], [2]])
    first, second = tmp_path / "a", tmp_path / "b"
    _train(tmp_path, 3, nodes, 40, 7, first)
    capfd.readouterr()
    # nodes 1 and 2 lost: node 0 holds rank 0's shards and its replica of rank 2's, not rank 1's
    _train(tmp_path, 1, nodes[:1], 8, None, second)
    got = torch.load(f"{second}.loaded.0", weights_only=True)
    assert got["step"] == 5 and not got["file"].startswith("memory:"), got["file"]
    err = capfd.readouterr()
    said = [line for line in (err.out + err.err).splitlines() if "memory_state_skipped" in line]
    assert len(said) == 1 and "rank 1's shards" in said[0], said
    _same(_state(f"{second}.loaded.0"), _state(f"{first}.s5.0"))


def _flip_tensors(file: str) -> None:
    """What someone who can write a node's /dev/shm, or who changes the bytes on their way from
    the other node, could do: one bit of every tensor of a slot flipped, its header and
    description left whole (their CRC still holds)."""
    h = slots.header(file)
    with open(file, "r+b") as f:
        f.seek(slots.HEADER + h["data_len"])
        desc = json.loads(f.read(h["meta_len"]))
        for offset, _dtype, shape in desc["tensors"]:
            if all(shape):
                f.seek(slots.HEADER + offset)
                byte = f.read(1)[0]
                f.seek(slots.HEADER + offset)
                f.write(bytes([byte ^ 0x40]))


def test_fsdp2_a_tampered_replica_is_refused_and_the_resume_takes_the_step_before(
    tmp_path, capfd, monkeypatch
):
    """Two nodes of one rank each, node 1 lost. In the survivor's memory the replica of rank 1's
    newest step (7) has one bit of every tensor flipped: the resume refuses it in one line,
    invalidates it, and resumes at world 1 from the step before (6), own slot and replica, bit
    for bit; each sample of the epoch is trained on once."""
    monkeypatch.setenv(names.STATE_KEY, "5e" * 32)  # as the daemon gives its workers
    nodes = _nodes(tmp_path, [[0], [1]])
    first = tmp_path / "a"
    _train(tmp_path, 2, nodes, 40, 7, first)
    survivor = {"mem": nodes[0]["mem"], "disk": nodes[0]["disk"], "ranks": [0]}
    (newest,) = [h for h in slots.held(survivor["mem"], 0, slots.REPLICA) if h.step == 7]
    _flip_tensors(slots.slot_path(survivor["mem"], 0, newest.k, slots.REPLICA))
    capfd.readouterr()
    second = tmp_path / "b"
    _train(tmp_path, 1, [survivor], 6 + (SAMPLES - 2 * 2 * 6) // 2, None, second)
    got = torch.load(f"{second}.loaded.0", weights_only=True)
    err = capfd.readouterr()
    said = [line for line in (err.out + err.err).splitlines() if "memory_replica_refused" in line]
    assert len(said) == 1 and "MAC does not verify" in said[0], said
    assert got["step"] == 6 and "/sharded-replicas/" in got["file"], got["file"]
    for r in range(2):
        _same(_state(f"{second}.loaded.0"), _state(f"{first}.s6.{r}"))
    assert all(h.step != 7 for h in slots.held(survivor["mem"], 0, slots.REPLICA))
    seen = [i for s, e, idx in _seen(first, 2) if e == 0 and s <= 6 for i in idx]
    seen += [i for s, e, idx in _seen(second, 1) if e == 0 for i in idx]
    assert sorted(seen) == list(range(SAMPLES)), (len(seen), len(set(seen)))
