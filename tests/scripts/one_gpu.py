"""The GPU of this rank for the test scripts and benches that run NCCL with every rank on this one
machine: a GPU of its own where the machine has one per rank, else the ranks share the GPUs there
are and each is given a host id of its own (NCCL_HOSTID), so that NCCL takes it for a node apart
and carries its traffic over its socket transport. NCCL refuses two ranks of one host on one GPU
("Duplicate GPU detected"), so this is how a machine with one GPU runs a job of several NCCL
ranks: slower than NVLink, the same collectives, kernels and Flight Recorder. Call it before
init_process_group."""

from __future__ import annotations

import os
import socket

import torch


def device() -> torch.device:
    rank, gpus = int(os.environ.get("RANK", "0")), torch.cuda.device_count()
    if gpus < int(os.environ.get("WORLD_SIZE", "1")):
        os.environ.setdefault("NCCL_HOSTID", f"{socket.gethostname()}-rank{rank}")
        os.environ.setdefault("NCCL_SOCKET_IFNAME", "lo")
    found = torch.device("cuda", rank % gpus)
    torch.cuda.set_device(found)
    return found
