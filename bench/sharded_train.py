"""bench/sharded.py's training script: an FSDP2 (fully_shard) job on CPU/gloo (--device cuda: a
GPU per rank, NCCL) with about --mb MB of state (parameters + Adam's two moments), checkpointed
the way a user does it today or through elasticd, the same code under torchrun and `elasticd run`.

    --ckpt dcp        torch.distributed.checkpoint.save of {"model", "optimizer"} (get_state_dict)
                      into DIR/step-N, resumed by dcp.load + set_state_dict from the newest
                      directory with a `.metadata` (older ones removed, two kept)
    --ckpt dcp-async  the same with dcp.async_save on a gloo group of its own (torch's advice), the
                      previous save awaited before the next
    --ckpt elasticd   CheckpointManager(DIR, keep=2).maybe_save(step, capture(...)), resumed by
                      load_latest + restore (from memory where the launcher offers it and the
                      library holds sharded state in memory, else from disk)

--mode train: trains --steps steps, saving every --every, appending `pid rank restart step time`
to --out after each step; rank 0 appends `resumed from step N (source)` to OUT.resumed.
--mode costs: every method in turn, --saves saves each with a step between: the training stall
of each save (the slowest rank's), the save's whole time until durable (nothing else running),
the load time (the newest checkpoint into the live model), and elasticd's in-memory refresh
(n/a while the library keeps no sharded state in memory); rank 0 writes them as JSON to --out.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import statistics
import tempfile
import time

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from torch.distributed.checkpoint import state_dict as sd
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

DEPTH = 4


DEVICE = torch.device("cpu")  # --device cuda: this rank's GPU (LOCAL_RANK), NCCL


def build(mb: float, world: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    """DEPTH square layers, sharded by fully_shard, about `mb` MB with Adam's moments (3 x the
    parameters). Built on the meta device and each rank's shard initialised from a generator
    seeded by the parameter's index and the rank: start-up is fast, the same at every attempt."""
    # a multiple of 12 that does not depend on the world (1 to 4 ranks, even shards): a job
    # resumed at another world size (a node lost) must build the same model
    width = max(12, int(math.sqrt(mb * 1e6 / 4 / 3 / DEPTH)) // 12 * 12)
    with torch.device("meta"):
        model = nn.Sequential(*(nn.Linear(width, width, bias=False) for _ in range(DEPTH)))
    mesh = init_device_mesh(DEVICE.type, (world,))  # CPU: gloo, even where a GPU exists
    for layer in (*model, model):
        fully_shard(layer, mesh=mesh)
    model.to_empty(device=DEVICE)
    with torch.no_grad():
        for i, p in enumerate(model.parameters()):
            local = p.to_local()
            g = torch.Generator().manual_seed(1000 * i + dist.get_rank())
            local.copy_((torch.rand(local.shape, generator=g) - 0.5) * (2 / math.sqrt(width)))
    return model, torch.optim.Adam(model.parameters(), lr=1e-4)


def step(model: nn.Module, opt: torch.optim.Optimizer) -> None:
    width = model[0].in_features
    model(torch.randn(2, width, device=DEVICE)).pow(2).mean().backward()
    opt.step()
    opt.zero_grad()


class UserCheckpoints:
    """What a user writes today around torch.distributed.checkpoint (torchtitan's way)."""

    def __init__(self, directory: str, use_async: bool) -> None:
        self.dir, self.use_async = directory, use_async
        self.pending = None
        self.group = dist.new_group(backend="gloo") if use_async else None
        os.makedirs(directory, exist_ok=True)

    def save(self, step: int, model, opt) -> None:
        self.wait()
        msd, osd = sd.get_state_dict(model, opt)
        path = os.path.join(self.dir, f"step-{step}")
        state = {"model": msd, "optimizer": osd}
        if self.use_async:
            self.pending = dcp.async_save(state, checkpoint_id=path, process_group=self.group)
        else:
            dcp.save(state, checkpoint_id=path)
        self._prune(keep=3)  # the one being written, two complete

    def wait(self) -> None:
        if self.pending is not None:
            self.pending.result()
            self.pending = None

    def _prune(self, keep: int) -> None:
        if dist.get_rank() == 0:
            for old in self.steps()[:-keep]:
                shutil.rmtree(os.path.join(self.dir, f"step-{old}"), ignore_errors=True)

    def steps(self) -> list[int]:
        return sorted(int(n[5:]) for n in os.listdir(self.dir) if n.startswith("step-"))

    def load_latest(self, model, opt) -> int:
        done = [s for s in self.steps() if os.path.exists(self._meta(s))]
        if not done:
            return 0
        msd, osd = sd.get_state_dict(model, opt)
        state = {"model": msd, "optimizer": osd}
        dcp.load(state, checkpoint_id=os.path.join(self.dir, f"step-{done[-1]}"))
        sd.set_state_dict(
            model, opt, model_state_dict=state["model"], optim_state_dict=state["optimizer"]
        )
        return done[-1]

    def _meta(self, s: int) -> str:
        return os.path.join(self.dir, f"step-{s}", ".metadata")


class ElasticdCheckpoints:
    def __init__(self, directory: str, every: int, memory_dir: str | None = None) -> None:
        from elasticd.checkpoint import CheckpointManager

        kw = {"memory_dir": memory_dir, "memory_every": 1} if memory_dir else {}
        self.mgr = CheckpointManager(directory, keep=2, every_steps=every, **kw)

    def state(self, model, opt, step: int):
        from elasticd.checkpoint import capture

        return lambda: capture(model=model, optimizer=opt, step=step)

    def load_latest(self, model, opt) -> int:
        from elasticd.checkpoint import restore

        state = self.mgr.load_latest()
        return restore(state, model=model, optimizer=opt)["step"] if state else 0

    def note_replica(self, path: str) -> None:
        """The last replica exchange's bytes and background seconds (a job over nodes), written
        to `path` when they change."""
        got = self.mgr._memory.ring.figures()
        if got.get("replica_bytes") and got != getattr(self, "_noted", None):
            self._noted = got
            with open(path, "w") as f:
                json.dump(got, f)

    def source(self) -> str:
        loaded = self.mgr.loaded
        return "memory" if loaded and loaded.file.startswith("memory:") else "disk"


def train(args) -> None:
    began = time.time()
    model, opt = build(args.mb, dist.get_world_size())
    built = time.time()
    rank = dist.get_rank()
    ck = (
        ElasticdCheckpoints(args.dir, args.every)
        if args.ckpt == "elasticd"
        else UserCheckpoints(args.dir, args.ckpt == "dcp-async")
    )
    first = ck.load_latest(model, opt) + 1
    with open(f"{args.out}.loaded", "a") as f:  # every rank: its (re)build and load, for in place
        f.write(f"{os.getpid()} {rank} {began:.6f} {built:.6f} {time.time():.6f}\n")
    if first > 1 and rank == 0:
        source = ck.source() if isinstance(ck, ElasticdCheckpoints) else "disk"
        with open(f"{args.out}.resumed", "a") as f:  # the launchers keep stdout apart
            f.write(f"resumed from step {first - 1} ({source})\n")
    out = os.open(args.out, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    for s in range(first, args.steps + 1):
        step(model, opt)
        if isinstance(ck, ElasticdCheckpoints):
            ck.mgr.maybe_save(s, ck.state(model, opt, s))
            ck.note_replica(f"{args.out}.replica.{rank}")
        elif s % args.every == 0:
            ck.save(s, model, opt)
        os.write(out, f"{os.getpid()} {rank} {restart} {s} {time.time():.6f}\n".encode())
        time.sleep(args.step_delay)
    if isinstance(ck, ElasticdCheckpoints):
        ck.mgr.close()
    else:
        ck.wait()


def _slowest(xs: list[float]) -> float:
    """The median over saves of the slowest rank's figure (the job waits for that rank)."""
    t = torch.tensor(xs, dtype=torch.float64, device=DEVICE)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return statistics.median(t.tolist())


def _drained() -> None:
    """On a GPU, the step's kernels done: a save's stall is timed from an idle device."""
    if DEVICE.type == "cuda":
        torch.cuda.synchronize(DEVICE)


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def costs(args) -> None:
    model, opt = build(args.mb, dist.get_world_size())
    step(model, opt)  # Adam's moments exist
    nbytes = sum(
        t.to_local().numel() * t.element_size()
        for t in (*model.parameters(), *(v for s in opt.state.values() for v in s.values()))
        if t.dim()
    )
    out: dict = {"state_bytes": int(_slowest([nbytes]) * dist.get_world_size())}
    for method in args.methods.split(","):
        d = os.path.join(args.dir, method)
        stall, write, load, refresh = [], [], [], []
        if method == "elasticd":
            mem = _shared(
                tempfile.mkdtemp(prefix="bench-sharded-", dir="/dev/shm") if rank0() else ""
            )
            ck = ElasticdCheckpoints(d, 1, memory_dir=mem)
            for s in range(1, args.saves + 1):
                step(model, opt)
                _drained()
                t0 = time.perf_counter()
                stall.append(ck.mgr.save(s, ck.state(model, opt, s)))
                ck.mgr.wait()
                write.append(time.perf_counter() - t0)
                ck.mgr.save_memory(s, ck.state(model, opt, s))
                if ck.mgr.memory_every:  # 0: the library holds no sharded state in memory
                    refresh.append(ck.mgr.last_memory_stall)
                load.append(_timed(lambda: ck.load_latest(model, opt)))
            ck.mgr.close()
        else:
            ck = UserCheckpoints(d, method == "dcp-async")
            for s in range(1, args.saves + 1):
                step(model, opt)
                _drained()
                t0 = time.perf_counter()
                ck.save(s, model, opt)
                stall.append(time.perf_counter() - t0)
                ck.wait()
                write.append(time.perf_counter() - t0)
                load.append(_timed(lambda: ck.load_latest(model, opt)))
        held = torch.tensor(int(len(refresh) == args.saves), device=DEVICE)
        dist.all_reduce(held, op=dist.ReduceOp.MIN)  # every rank still refreshing
        out[method] = {
            "stall_s": _slowest(stall),
            "write_s": _slowest(write),
            "load_s": _slowest(load),
            # from the third refresh on: the first two map and first touch the two slots
            # (hundreds of MB of page faults at 1 GB), a cost paid once, not per refresh
            "refresh_s": _slowest(refresh[2:] or refresh) if held.item() else None,
        }
        if rank0():
            shutil.rmtree(d, ignore_errors=True)
            if method == "elasticd":
                shutil.rmtree(mem, ignore_errors=True)
    if rank0():
        with open(args.out, "w") as f:
            json.dump(out, f)


def rank0() -> bool:
    return dist.get_rank() == 0


def _shared(path: str) -> str:
    """Rank 0's temporary directory, told to every rank."""
    got = [path]
    dist.broadcast_object_list(got, 0)
    return got[0]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mode", choices=("train", "costs"), required=True)
    p.add_argument("--ckpt", choices=("dcp", "dcp-async", "elasticd"), default="elasticd")
    p.add_argument("--methods", default="dcp,dcp-async,elasticd")
    p.add_argument("--mb", type=float, default=100)
    p.add_argument("--dir", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--every", type=int, default=10)
    p.add_argument("--steps", type=int, default=10**6)
    p.add_argument("--saves", type=int, default=3)
    p.add_argument("--step-delay", type=float, default=0.02)
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    args = p.parse_args()
    if args.device == "cuda":
        global DEVICE
        DEVICE = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(DEVICE)
    dist.init_process_group("nccl" if args.device == "cuda" else "gloo")
    torch.manual_seed(dist.get_rank())
    (train if args.mode == "train" else costs)(args)
    # not in a finally: a rank unwinding from a fault elsewhere keeps its group to re-enter in
    # place (a destroyed one falls back to the restart: docs/in-place.md)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
