"""Sets up and tears down a DDP process group many times: init, one step, an all_reduce,
destroy_process_group, then the model is freed (as when main() returns).

Plain torch deadlocks here within a few rounds: freeing the DDP Reducer destroys the gloo group,
whose destructor joins its worker threads with the GIL held while a worker waits for the GIL to
drop its last finished work. argv: a scratch directory for the FileStores, the number of rounds."""

import os
import sys

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP


def one_round(directory: str, i: int) -> None:
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    store = dist.FileStore(os.path.join(directory, f"store{i}"), world)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
    model = DDP(nn.Linear(8, 8))
    model(torch.randn(4, 8)).sum().backward()
    dist.all_reduce(torch.ones(1))
    dist.destroy_process_group()


def main() -> None:
    directory, rounds = sys.argv[1], int(sys.argv[2])
    for i in range(rounds):
        one_round(directory, i)
    print(f"rounds done {rounds}", flush=True)


if __name__ == "__main__":
    main()
