"""In-memory state: ranks resume from the step before a crash, agree on it, and fall back to disk
when it is missing, partial, damaged, older or from another world size."""

from __future__ import annotations

import os
import subprocess

import pytest
import torch

import _ckpt_helpers as helpers
from elasticd import checkpoint, memory
from elasticd.checkpoint import CheckpointManager


def final(path):
    got = torch.load(path, weights_only=True)
    tensors = {**{f"model.{k}": v for k, v in got["model"].items()},
               **{f"opt.{k}.{n}": t for k, s in got["optimizer"]["state"].items() for n, t in s.items()}}
    return tensors, got["loaded"]


def assert_same(ref, run):
    assert ref.keys() == run.keys() and ref
    for k in ref:
        assert torch.equal(ref[k], run[k]), k


@pytest.fixture
def reference(tmp_path):
    ref = tmp_path / "ref"
    helpers.run(helpers.train, 2, tmp_path, str(ref), 14, str(ref), None, timeout=90)
    return [final(f"{ref}.{r}.pt")[0] for r in range(2)]


def crashed_run(tmp_path, mem):
    """Two gloo ranks train with disk checkpoints every 4 steps and in-memory state every step,
    then die after step 10: disk holds step 8, memory steps 9 and 10."""
    run = tmp_path / "run"
    helpers.run(helpers.train, 2, tmp_path, str(run), 14, None, 10, 4, True, str(mem), timeout=90)
    assert checkpoint.latest_info(run)["step"] == 8
    for r in range(2):
        assert memory.steps(str(mem), world=2, rank=r) == [10, 9]
    return run


def resume(tmp_path, run, mem):
    helpers.run(helpers.train, 2, tmp_path, str(run), 14, str(run), None, 4, True, str(mem), timeout=90)
    return [final(f"{run}.{r}.pt") for r in range(2)]


def test_two_ranks_resume_from_memory_bit_exact(tmp_path, reference):
    mem = tmp_path / "mem"
    mem.mkdir()
    run = crashed_run(tmp_path, mem)
    for r, (tensors, loaded) in enumerate(resume(tmp_path, run, mem)):
        assert loaded["step"] == 10 and loaded["file"].startswith("memory:"), loaded
        assert_same(reference[r], tensors)


@pytest.mark.parametrize("damage", ["one rank missing", "full state truncated", "disk is newer"])
def test_falls_back_to_disk_and_stays_bit_exact(tmp_path, reference, damage):
    mem = tmp_path / "mem"
    mem.mkdir()
    run = crashed_run(tmp_path, mem)
    names = sorted(os.listdir(mem))
    if damage == "one rank missing":
        for n in names:
            if n.endswith("-r1.pt"):
                os.unlink(mem / n)
        expect = 8
    elif damage == "full state truncated":
        for n in names:  # both steps damaged: nothing in memory is usable
            if n.endswith("-full.pt"):
                os.truncate(mem / n, 100)
        expect = 8
    else:  # memory from an older timeline than the disk: disk wins
        for n in names:
            os.rename(mem / n, mem / n.replace("-s000000000010-", "-s000000000007-")
                      .replace("-s000000000009-", "-s000000000006-"))
        expect = 8
    for r, (tensors, loaded) in enumerate(resume(tmp_path, run, mem)):
        assert loaded["step"] == expect and not loaded["file"].startswith("memory:"), loaded
        assert_same(reference[r], tensors)


def test_other_world_size_is_ignored_and_stale_steps_are_dropped(tmp_path):
    mem = tmp_path / "mem"
    mem.mkdir()
    crashed_run(tmp_path, mem)
    # one process now: world size 1, so the world-2 states are not candidates
    mgr = CheckpointManager(tmp_path / "run", handle_sigterm=False, memory_dir=mem)
    state = mgr.load_latest()
    assert mgr.loaded.step == 8 and state["user"]["step"] == 8
    assert not [n for n in os.listdir(mem) if n.endswith("-r0.pt") or n.endswith("-full.pt")]


def test_single_process_refresh_every_n_steps_and_keep_two(tmp_path):
    mem = tmp_path / "mem"
    mem.mkdir()
    mgr = CheckpointManager(tmp_path / "disk", handle_sigterm=False, memory_dir=mem, memory_every=2)
    model = torch.nn.Linear(3, 1)
    for step in range(1, 8):
        mgr.maybe_save(step, lambda: checkpoint.capture(model=model, step=step))
    assert memory.steps(str(mem), world=1, rank=0) == [6, 4]
    assert memory.newest_step(str(mem)) == 6
    state = CheckpointManager(tmp_path / "disk", handle_sigterm=False, memory_dir=mem).load_latest()
    assert state["user"]["step"] == 6 and torch.equal(state["model"]["weight"], model.weight.detach())
    assert mgr.last_memory_stall > 0


def test_unusable_directory_turns_memory_off_and_disk_goes_on(tmp_path):
    not_a_dir = tmp_path / "file"
    not_a_dir.write_text("x")
    mgr = CheckpointManager(tmp_path / "disk", handle_sigterm=False, memory_dir=not_a_dir, every_steps=2)
    model = torch.nn.Linear(3, 1)
    for step in range(1, 5):
        mgr.maybe_save(step, lambda: checkpoint.capture(model=model, step=step))
    mgr.close()
    assert mgr.memory_every == 0
    assert checkpoint.latest_info(tmp_path / "disk")["step"] == 4


def test_daemon_side_create_remove_and_reap(tmp_path, monkeypatch):
    monkeypatch.setattr(memory, "ROOT", str(tmp_path))
    path = memory.create("job/../x")
    assert path and os.path.dirname(path) == str(tmp_path) and "/../" not in path[len(str(tmp_path)):]
    assert os.stat(path).st_mode & 0o777 == 0o700
    dead = subprocess.Popen(["true"])
    dead.wait()
    stale = memory.create("old")
    with open(os.path.join(stale, "owner"), "w") as f:
        f.write(str(dead.pid))
    assert memory.reap_stale() == [stale]
    assert os.path.isdir(path)  # ours: this process is alive
    memory.remove(path)
    assert not os.path.exists(path)
