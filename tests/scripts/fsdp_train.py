"""A small FSDP2 (fully_shard) job on gloo/CPU with elasticd's checkpoints, the README's calls.

usage: fsdp_train.py STEPS EVERY DELAY OUT [MESH]

MESH 2d: the model sharded over the "shard" dimension of a 2-D mesh (1 x world, "replicate" x
"shard"), whose "replicate" dimension init_device_mesh makes with new_group (a group per rank).

Each step's data comes from the global torch RNG, so a resume is bit-identical only when the
RNG, the parameters and Adam's state all come back exactly. At the end every rank writes the
gathered parameters and optimizer state to OUT/final<rank>.pt.
"""

import os
import sys
import time

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from elasticd.checkpoint import CheckpointManager, capture, restore


def main() -> None:
    steps, every, delay, out = int(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3]), sys.argv[4]
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 1))
    if sys.argv[5:] == ["2d"]:
        dims = ("replicate", "shard")
        mesh = init_device_mesh("cpu", (1, dist.get_world_size()), mesh_dim_names=dims)["shard"]
    else:
        mesh = init_device_mesh("cpu", (dist.get_world_size(),))  # gloo on CPU, GPU or not
    for layer in (model[0], model[2], model):
        fully_shard(layer, mesh=mesh)
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    mgr = CheckpointManager(every_steps=every)
    state = mgr.load_latest()
    step = restore(state, model=model, optimizer=opt)["step"] if state else 0
    print(f"start at {step}" + (f", resumed from step {step}" if state else ""), flush=True)
    while step < steps:
        model(torch.randn(8, 16)).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
        step += 1
        mgr.maybe_save(step, lambda: capture(model=model, optimizer=opt, step=step))
        print(f"step {step}/{steps}", flush=True)
        time.sleep(delay)
    mgr.close()
    final = {f"model.{k}": v.full_tensor() for k, v in model.state_dict().items()}
    for i, s in opt.state_dict()["state"].items():
        for k, v in s.items():
            final[f"optim.{i}.{k}"] = v.full_tensor() if hasattr(v, "full_tensor") else v
    torch.save(final, os.path.join(out, f"final{rank}.pt"))
    print(f"done: {steps} steps", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
