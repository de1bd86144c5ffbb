"""The rendezvous benchmark's entrypoint: join the process group, record the time, leave.

Appends `rank wall_time` to $BENCH_OUT once init_process_group has returned."""

import os
import time

import torch.distributed as dist


def main():
    dist.init_process_group("gloo")
    fd = os.open(os.environ["BENCH_OUT"], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    os.write(fd, f"{dist.get_rank()} {time.time():.6f}\n".encode())
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
