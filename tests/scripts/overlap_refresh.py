"""Overlapped in-memory refreshes on a GPU (elasticd.checkpoint.overlap), in a process of its own.

usage: overlap_refresh.py check|forever MEMORY_DIR DISK_DIR

The state is built so that every tensor equals the step it was refreshed at: a 128 MiB parameter
that SGD (lr 1, gradient -1) raises by one at each optimizer step, and a buffer filled with the
step on the training stream, as a forward pass would. Little else runs between a refresh and the
next optimizer step, so the parameter's copy (milliseconds) is still running when that step
comes: a step that did not wait for it would leave step+1 values in the slot of step.

check: refreshes 12 steps back to back and reads the last one that can land whole; checks that
the copies were queued, that their cost reached the cadence, and that a refresh with no optimizer
step since the last one turns overlapping off (that last one is dropped: its slot is written
next, after its late copy has landed, and the step before stays) and stays exact.
forever: resumes from memory, as a restarted worker does, and refreshes every step until killed.
"""

import sys
import time

import structlog
import torch

from elasticd.checkpoint import CheckpointManager, capture
from elasticd.checkpoint.memory import reader, slots


class Model(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(32 * 2**20, device="cuda"))
        self.register_buffer("seen", torch.zeros(64, device="cuda"))


def setup(directory, disk):
    model = Model()
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    mgr = CheckpointManager(
        disk, handle_sigterm=False, memory_dir=directory, memory_every=1, memory_overlap=True
    )
    state = mgr.load_latest()
    if state is not None:
        model.load_state_dict(state["model"])
    return model, opt, mgr, state["user"]["step"] + 1 if state else 1


def step(model, opt, n):
    model.seen.fill_(float(n))
    model.w.grad = torch.full_like(model.w, -1.0)
    opt.step()  # w == n, once it has waited for the last refresh's copy


def refresh(model, opt, mgr, n):
    mgr.save_memory(n, lambda: capture(model=model, optimizer=opt, rng=False, step=n))


def held(directory):
    return slots.steps(directory, world=1, rank=0, local_rank=0)


def whole(directory, n):
    got = reader.read(directory, n, world=1, rank=0, local_rank=0)
    w, seen = got["model"]["w"], got["model"]["seen"]
    assert got["user"] == {"step": n}, got["user"]
    assert torch.equal(w, torch.full_like(w, float(n))), (
        f"step {n}: the parameter holds {w.unique()[:4].tolist()}"
    )
    assert torch.equal(seen, torch.full_like(seen, float(n))), (
        f"step {n}: the buffer holds {seen.unique().tolist()}"
    )


def check(directory, disk):
    model, opt, mgr, first = setup(directory, disk)
    assert first == 1
    with structlog.testing.capture_logs() as logs:
        for n in range(1, 13):  # back to back: each optimizer step comes while the last copy runs
            step(model, opt, n)
            refresh(model, opt, mgr, n)
            writer = mgr._memory.writer
            assert writer.queued and writer.overlap, "the refresh was not overlapped"
        deadline = time.monotonic() + 10
        while held(directory) != [11] and time.monotonic() < deadline:
            time.sleep(
                0.01
            )  # 11 lands once copied; 12 waits for an optimizer step that never comes
        assert held(directory) == [11], held(directory)
        whole(directory, 11)
        assert mgr._memory.cadence.costs, "no overlapped refresh's cost reached the cadence"
        with torch.no_grad():  # a parameter updated by hand, racing 12's copy: that refresh must go
            model.w.add_(1.0)
            model.seen.fill_(13.0)
        refresh(model, opt, mgr, 13)  # no optimizer step since 12: dropped, 13 copied synchronously
        assert not writer.overlap and not writer.queued  # into 12's slot, once 12's copy has landed
        assert held(directory) == [13, 11], held(directory)
        whole(directory, 13)
        whole(directory, 11)
    off = [e for e in logs if e["event"] == "memory_overlap_off"]
    assert len(off) == 1 and "no optimizer step" in off[0]["reason"], logs
    mgr.close()
    print("overlap check ok")


def forever(directory, disk):
    model, opt, mgr, first = setup(directory, disk)
    for n in range(first, 10**9):
        step(model, opt, n)
        refresh(model, opt, mgr, n)


if __name__ == "__main__":
    {"check": check, "forever": forever}[sys.argv[1]](sys.argv[2], sys.argv[3])
