"""The README's checkpoint loop as a researcher writes it, every source of nondeterminism a resume
must get back in play: DDP (or FSDP2's fully_shard), AdamW with weight decay, dropout, a warm-up
LR schedule, a shuffled ResumableDistributedSampler, a DataLoader (0 or 2 worker processes,
drop_last on or off), a numpy and a Python draw per step, several epochs.

One job, three users: tests/unit/checkpoint/test_resume_property.py forks its ranks and calls `run`
(a crash: every rank stops dead after a step), tests/e2e/test_exact_resume.py runs it under
`elasticd run` (EXACT_* environment; a crash: one rank SIGKILLs itself once), and
tests/e2e/test_sdc.py (one rank flips a bit of its own weights: silent data corruption, once or
persistently). Rank 0 writes the final model and optimizer state's sha256 to OUT, and every rank
appends `step sha256-prefix` lines to OUT.RANK (the parameters after each step), so a failure names
the first step that differs.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import signal

import numpy as np
import psutil
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset

from elasticd.checkpoint import CheckpointManager, capture, restore
from elasticd.sampler import ResumableDistributedSampler

DEFAULTS = {
    "samples": 50,  # 50 at 3 ranks: a world that does not divide the dataset
    "batch": 4,
    "drop_last": True,
    "workers": 0,
    "sampler_batch": False,  # the sampler given batch_size (whole global batches)
    "steps": 30,
    "every": 4,  # disk checkpoint cadence
    "memory": True,  # resume from the in-memory state (refreshed every step) or from disk only
    "sharded": False,
    "ckpt_dir": None,  # None: $ELASTICD_CHECKPOINT_DIR (elasticd sets it)
    "memory_dir": None,  # None: elasticd's own; a directory when forked by the unit test
    "crash_after": None,  # every rank stops dead after this step (forked ranks)
    "kill_at": None,  # KILL_RANK SIGKILLs itself after this step, once (under elasticd)
    "kill_rank": 0,
    # FLIP_RANK (None: the node with EXACT_FLIP_HERE) flips one mantissa bit of one weight after
    # this step: once, or (flip_persistent) after every step from then on, as a bad part of its
    # node would (silent data corruption)
    "flip_at": None,
    "flip_rank": 1,
    "flip_persistent": False,
    # where the flip lands: "weights" right after the step's keep (the next forward reads it, so
    # its gradient reaches every rank through the all-reduce) or "update": in the next step after
    # its all-reduce, before the optimizer's step (only this rank's update is off)
    "flip_in": "weights",
    "out": None,
}


def exact_step(model, opt, sched, sampler, mgr, x, y, step: int) -> int:
    """One step of the loop, written once for this job and the forked checkpoint tests
    (tests/_ckpt_helpers.py): a loss scaled by a Python and a numpy draw (a resume must bring both
    RNGs back), the optimizer's and scheduler's step, the sampler's position, and the checkpoint
    boundary (maybe_save); the step reached."""
    scale = 1.0 + 0.1 * random.random() + 0.1 * float(np.random.rand())
    loss = F.mse_loss(model(x), y) * scale
    opt.zero_grad()
    loss.backward()
    opt.step()
    if sched is not None:
        sched.step()
    sampler.advance(len(x))
    step += 1
    mgr.maybe_save(
        step,
        lambda: capture(model=model, optimizer=opt, scheduler=sched, sampler=sampler, step=step),
    )
    return step


def _digest(tensors) -> str:
    h = hashlib.sha256()
    for t in tensors:
        t = t.to_local() if hasattr(t, "to_local") else t  # a sharded rank's own shard
        h.update(t.detach().cpu().reshape(-1).contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def _held(model, opt, sharded: bool) -> list[torch.Tensor]:
    """The model's and optimizer's tensors, whole (a collective when sharded)."""
    if sharded:
        from torch.distributed.checkpoint import state_dict as sd

        msd, osd = sd.get_state_dict(model, opt, options=sd.StateDictOptions(full_state_dict=True))
    else:
        msd, osd = model.module.state_dict(), opt.state_dict()
    tensors = [msd[k] for k in sorted(msd)]
    for k in sorted(osd["state"], key=str):
        s = osd["state"][k]
        tensors += [torch.as_tensor(s[n]) for n in sorted(s)]
    return tensors


def _faulty(rank: int, flip_rank: int | None) -> bool:
    """Whether this rank's bits flip: FLIP_RANK's, or (flip_rank None) any rank of the node
    whose daemon set EXACT_FLIP_HERE: a bad part stays with its node, whatever rank it runs."""
    return rank == flip_rank if flip_rank is not None else bool(os.environ.get("EXACT_FLIP_HERE"))


def _flip(model: nn.Module, marker: str, persistent: bool) -> None:
    """One mantissa bit of one weight, in place, from outside the library (the value stays
    finite, as almost all silent corruption does); `marker` counts the flips."""
    if os.path.exists(marker) and not persistent:
        return
    with open(marker, "a") as f:
        f.write("flip\n")
    weight = next(model.parameters()).detach()  # the same storage, outside autograd
    weight = weight.to_local() if hasattr(weight, "to_local") else weight  # a rank's own shard
    weight.view(-1).view(torch.int32)[5] ^= 1 << 12


def _flipper(cfg: dict, model: nn.Module, opt, rank: int):
    """What to do after each step: the flip cfg asks for, in the weights at once or (flip_in
    "update") inside the next optimizer step, before it updates."""
    marker, persistent, armed = f"{cfg['out']}.flipped", cfg["flip_persistent"], []
    if cfg["flip_in"] == "update":

        def flip_armed(*_) -> None:
            if armed:
                _flip(model, armed.pop(), persistent)

        opt.register_step_pre_hook(flip_armed)

    def after(step: int) -> None:
        flip_at = cfg["flip_at"]
        persists = persistent and flip_at is not None and step > flip_at
        if (step == flip_at or persists) and _faulty(rank, cfg["flip_rank"]):
            if cfg["flip_in"] == "update":
                armed[:] = [marker]
            else:
                _flip(model, marker, persistent)

    return after


def _model(world: int, sharded: bool) -> nn.Module:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(6, 32), nn.ReLU(), nn.Dropout(0.2), nn.Linear(32, 1))
    if not sharded:
        return DDP(net)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (world,))  # gloo on CPU, GPU or not
    for layer in (net[0], net[3], net):
        fully_shard(layer, mesh=mesh)
    return net


def run(cfg: dict, rank: int, world: int) -> int:
    """Train to cfg['steps'] (resuming from the newest checkpoint); the step reached."""
    cfg = {**DEFAULTS, **cfg}
    g = torch.Generator().manual_seed(1)
    n = cfg["samples"]
    data = TensorDataset(torch.randn(n, 6, generator=g), torch.randn(n, 1, generator=g))
    model = _model(world, cfg["sharded"])
    torch.manual_seed(100 + rank)  # every rank's RNG differs: each must get its own back
    random.seed(rank)
    np.random.seed(rank)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.05)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 10))
    sampler = ResumableDistributedSampler(
        data, shuffle=True, seed=3, batch_size=cfg["batch"] if cfg["sampler_batch"] else None
    )
    loader = DataLoader(
        data,
        batch_size=cfg["batch"],
        sampler=sampler,
        drop_last=cfg["drop_last"],
        num_workers=cfg["workers"],
        persistent_workers=cfg["workers"] > 0,
        generator=torch.Generator(),  # creating an iterator draws nothing from the global RNG
    )
    memory = {"memory_every": 1} if cfg["memory"] else {"memory_every": 0}
    if cfg["memory"] and cfg["memory_dir"]:
        memory["memory_dir"] = cfg["memory_dir"]
    mgr = CheckpointManager(
        cfg["ckpt_dir"], keep=2, every_steps=cfg["every"], handle_sigterm=False, **memory
    )
    state = mgr.load_latest()
    step = 0
    if state is not None:
        step = restore(state, model=model, optimizer=opt, scheduler=sched, sampler=sampler)["step"]
    log = open(f"{cfg['out']}.{rank}", "a")  # open for the whole run
    flip = _flipper(cfg, model, opt, rank)
    while step < cfg["steps"]:
        sampler.set_epoch(sampler.epoch)  # the epoch in progress keeps its position
        for x, y in loader:
            step = exact_step(model, opt, sched, sampler, mgr, x, y, step)
            log.write(f"{step} {_digest(p for p in model.parameters())[:16]}\n")
            log.flush()
            if step == cfg["crash_after"]:
                for child in psutil.Process().children():  # its DataLoader's workers die with it
                    child.kill()
                os._exit(0)  # dead: no final save, no teardown, a save maybe in flight
            if step == cfg["kill_at"] and rank == cfg["kill_rank"]:
                marker = f"{cfg['out']}.killed"
                if not os.path.exists(marker):
                    open(marker, "w").close()
                    os.kill(os.getpid(), signal.SIGKILL)
            flip(step)
            if step >= cfg["steps"]:
                break
        else:
            sampler.set_epoch(sampler.epoch + 1)
    held = _held(model, opt, cfg["sharded"])
    mgr.close()
    if rank == 0:
        with open(cfg["out"], "w") as f:
            f.write(_digest(held))
    return step


def first_difference(ref_out: str, run_out: str, world: int) -> str:
    """The first step whose parameters differ between two runs' logs (a step executed again
    after a resume replaces its earlier execution), for a failure message."""
    for r in range(world):
        logs = []
        for out in (ref_out, run_out):
            with open(f"{out}.{r}") as f:
                logs.append(dict(line.split() for line in f if line.strip()))
        for step in sorted(logs[0], key=int):
            if logs[0][step] != logs[1].get(step):
                return f"rank {r} first differs after step {step}"
    return "no step differs"


if __name__ == "__main__":
    dist.init_process_group("gloo")
    cfg = json.loads(os.environ["EXACT_JOB"])
    run(cfg, dist.get_rank(), dist.get_world_size())
    dist.destroy_process_group()
