"""A DDP loop whose rank `--rank` runs out of memory at step `--hog-at` of the first attempt: it
moves itself into the memory-limited cgroup `--cgroup` (cgroup v1) and allocates until the
kernel's OOM killer ends it. Later attempts train `--steps` steps."""

import argparse
import os
import time

import torch
import torch.distributed as dist

import elasticd


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--cgroup", required=True)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--rank", type=int, default=1)
    p.add_argument("--hog-at", type=int, default=2)
    p.add_argument("--step-time", type=float, default=0.05)
    args = p.parse_args()
    dist.init_process_group("gloo")
    first = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
    t = torch.ones(1)
    for step in range(1, args.steps + 1):
        dist.all_reduce(t)
        print(f"step {step}", flush=True)
        elasticd.heartbeat(step)
        if first and dist.get_rank() == args.rank and step == args.hog_at:
            with open(os.path.join(args.cgroup, "cgroup.procs"), "w") as f:
                f.write(str(os.getpid()))
            hog = []
            while True:  # touched pages, charged to the cgroup, until the OOM killer comes
                hog.append(b"x" * (16 << 20))
        time.sleep(args.step_time)
    dist.barrier()
    print("done", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
