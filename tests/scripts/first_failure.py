"""The first failure and its consequence: rank 1 raises a ValueError at `--raise-at`, closes its
process group on the way out (a `finally`, as many scripts do) and takes `--slow-exit` seconds to
exit (an atexit handler: a logger's flush); rank 0, waiting in the next all_reduce, dies at once of
gloo's "Connection closed by peer". The daemon reaps rank 0 first: the job's failure is still
rank 1's. Without DDP, plain torch.distributed."""

import argparse
import atexit
import time

import torch
import torch.distributed as dist

import elasticd


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--raise-at", type=int, default=3)
    p.add_argument("--slow-exit", type=float, default=2.0)
    p.add_argument("--step-time", type=float, default=0.02)
    args = p.parse_args()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    if rank == 1:
        atexit.register(time.sleep, args.slow_exit)
    t = torch.ones(1)
    try:
        for step in range(1, args.steps + 1):
            dist.all_reduce(t)
            elasticd.heartbeat(step)
            if rank == 1 and step == args.raise_at:
                raise ValueError(f"bad batch at step {step}: loss {-0.2718 * step:.4f}")
            time.sleep(args.step_time)
    finally:
        if rank == 1:
            dist.destroy_process_group()
    dist.destroy_process_group()
    print("done", flush=True)


if __name__ == "__main__":
    main()
