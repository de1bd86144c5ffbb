"""DDP at a world of two with each step's RNG and all-reduced gradients kept, for the referee's
claim (tests/unit/daemon/test_referee.py): forked gloo ranks on the CPU call `train`; run as a
script under torchrun it trains on NCCL and the GPU (the ranks may share one: one_gpu.py).

usage: referee_job.py OUT (writes OUT.RANK: every step's RNG and gradients, the parameters after)
"""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

STEPS = 4


def net(device: torch.device | str = "cpu") -> nn.Module:  # exact_job.py's model, unwrapped
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 32), nn.ReLU(), nn.Dropout(0.2), nn.Linear(32, 1)).to(device)


def batch(rank: int, step: int, device: torch.device | str = "cpu") -> tuple:
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(4, 6, generator=g).to(device), torch.randn(4, 1, generator=g).to(device)


def rng(device: torch.device | str = "cpu") -> dict:
    """The draws a step's dropout takes: the CPU's, and the GPU's where the model is there."""
    cuda = torch.device(device).type == "cuda"
    return {"cpu": torch.get_rng_state(), **({"cuda": torch.cuda.get_rng_state()} if cuda else {})}


def set_rng(state: dict) -> None:
    torch.set_rng_state(state["cpu"])
    if "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"])


def train(rank: int, world: int, out: str, device: torch.device | str = "cpu") -> None:
    on = torch.device(device)
    model = DDP(net(on), device_ids=[on.index] if on.type == "cuda" else None)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.05)
    torch.manual_seed(100 + rank)
    steps = []
    for s in range(STEPS):
        x, y = batch(rank, s, on)
        drawn = rng(on)
        opt.zero_grad()
        F.mse_loss(model(x), y).backward()
        steps.append({"rng": drawn, "grads": [p.grad.clone() for p in model.parameters()]})
        opt.step()
    params = [p.detach().clone() for p in model.parameters()]
    torch.save({"steps": steps, "params": params}, f"{out}.{rank}")


if __name__ == "__main__":
    import one_gpu

    gpu = one_gpu.device()
    dist.init_process_group("nccl")
    train(dist.get_rank(), dist.get_world_size(), sys.argv[1], gpu)
    dist.destroy_process_group()
