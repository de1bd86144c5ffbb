"""One rank of bench/detection.py --overhead: OPS gloo all_reduces of a SIZE-float tensor, timed,
with torch's Flight Recorder as the environment leaves it (on by default; TORCH_FR_BUFFER_SIZE=0
off; BENCH_HOOK=1 with it off: elasticd's own dispatcher hook instead, worker/collective_hook.py);
rank 0 prints the time per op and what answering the daemon's ask costs (worker/flight.py's dump
of the recorder's ring, or of the hook's).

    python bench/flight_cost.py RANK WORLD PORT OPS SIZE
"""

from __future__ import annotations

import json
import os
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from elasticd.worker import collective_hook, flight


def main() -> None:
    rank, world, port, ops, size = (int(a) for a in sys.argv[1:6])
    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, world, rank == 0, timeout=timedelta(seconds=60))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
    hook = os.environ.get("BENCH_HOOK") == "1" and collective_hook.install()
    t = torch.ones(size)
    for _ in range(200):  # warm-up
        dist.all_reduce(t)
    dist.barrier()
    t0 = time.perf_counter()
    for _ in range(ops):
        dist.all_reduce(t)
    took = time.perf_counter() - t0
    dist.barrier()
    if rank == 0:
        recorders = [collective_hook.dump] if hook else flight.recorders()
        d0 = time.perf_counter()
        text = flight.dump(recorders)
        dumped = time.perf_counter() - d0
        got = json.loads(text)  # a list of dumps where the build has two (CPU's and NCCL's)
        entries = sum(len(d.get("entries", [])) for d in (got if isinstance(got, list) else [got]))
        got = {"us_per_op": took / ops * 1e6, "dump_ms": dumped * 1e3, "entries": entries}
        print(json.dumps(got), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
