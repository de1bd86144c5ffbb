"""An FSDP2 (fully_shard) job on CUDA/NCCL with the in-memory state, run under torchrun (a GPU
per rank, or ranks sharing one: one_gpu.py): the refresh of CUDA shards overlapped (page-locked
slots, the optimizer's shards copied on a side stream), and the resume from memory placed back on
the GPU.

usage: fsdp_cuda.py STEPS CRASH MEMORY_DIR DISK_DIR OUT [nodes]

Trains STEPS steps, refreshing every step and checking each refresh was queued with side-stream
copies; at step CRASH (0: never) every rank stops dead (os._exit), so that step's refresh never
lands and the step before is the newest whole one. `nodes`: every rank a node of its own
(MEMORY_DIR/node<rank>, LOCAL_WORLD_SIZE 1), so each also keeps a replica of the next rank's
slot, sent once its overlapped copies have landed. Writes the state gathered whole right after
loading (OUT.loaded.RANK, with the entry's file and step) and after every refresh
(OUT.sSTEP.RANK): model, optimizer and this rank's CPU and CUDA RNG.
"""

import os
import sys

import one_gpu
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.checkpoint import state_dict as sd
from torch.distributed.fsdp import fully_shard

from elasticd.checkpoint import CheckpointManager, capture, overlap, restore


def held(model, opt, **extra) -> dict:
    """The state gathered whole onto the CPU (a collective), and this rank's RNG."""
    full = sd.StateDictOptions(full_state_dict=True, cpu_offload=True)
    msd, osd = sd.get_state_dict(model, opt, options=full)
    rng = {"cpu": torch.get_rng_state(), "cuda": torch.cuda.get_rng_state()}
    return {"model": msd, "optimizer": osd, "rng": rng, **extra}


def main() -> None:
    steps, crash, mem, disk, out = int(sys.argv[1]), int(sys.argv[2]), *sys.argv[3:6]
    nodes = sys.argv[6:] == ["nodes"]
    device = one_gpu.device()
    dist.init_process_group("nccl")
    rank = dist.get_rank()
    if nodes:
        os.environ.update(LOCAL_RANK="0", LOCAL_WORLD_SIZE="1")
        mem = os.path.join(mem, f"node{rank}")
        os.makedirs(mem, exist_ok=True)
    torch.manual_seed(0)
    # 3 x 1024 x 1024 weights: 12 MB of parameters and 24 MB of Adam's moments, so each rank's
    # shards are above writer.OVERLAP_MIN_BYTES (8 MiB) at 2 ranks
    model = nn.Sequential(*(nn.Linear(1024, 1024) for _ in range(3))).to(device)
    for layer in (*model, model):
        fully_shard(layer)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    mgr = CheckpointManager(
        disk, every_steps=10_000, handle_sigterm=False, memory_dir=mem, memory_every=1
    )
    state = mgr.load_latest()
    step = restore(state, model=model, optimizer=opt)["step"] if state else 0
    on_gpu = all(p.to_local().is_cuda for p in model.parameters())
    file = mgr.loaded and mgr.loaded.file
    torch.save(held(model, opt, file=file, step=step, on_gpu=on_gpu), f"{out}.loaded.{rank}")
    while step < steps:
        model(torch.randn(16, 1024, device=device)).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
        step += 1
        mgr.maybe_save(step, lambda: capture(model=model, optimizer=opt, step=step))
        writer = mgr._memory.writer
        assert writer is not None and writer.queued and writer.overlap, "refresh not overlapped"
        assert overlap._waiting, "no shard copied on the side stream"
        torch.save(held(model, opt), f"{out}.s{step}.{rank}")
        if step == crash:
            sys.stdout.flush()
            os._exit(0)  # dead: no settle, no close; this step's copies never commit
    mgr.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
