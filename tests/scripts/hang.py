"""Hang injection for tests: `--mode loop|deadlock|spin|stuck|desync|stop` at `--at` step on rank
`--rank` (stuck: the rank sleeps in `read_batch` while the others wait in all_reduce; spin: it
computes for `--spin` seconds, a straggler, then goes on; desync: it calls all_gather where the
others call all_reduce; stop: it stops itself, SIGSTOP, as Ctrl-Z would); `--jitter
MEDIAN,SIGMA` adds a log-normal sleep to every step of every rank; `--backend nccl` runs on the
GPU (one_gpu.py: ranks may share one), reading the loss after each step as a script that logs it
does, so a rank waits where NCCL's collective does: in that read, not in the call that queued it.

Trains a tiny model with a real optimizer (so elasticd's automatic heartbeat sees every step) and
an all_reduce per step. Faults fire only in the first attempt, so the restarted run completes."""

import argparse
import atexit
import os
import random
import signal
import time

import one_gpu
import torch
import torch.distributed as dist


def read_batch():
    """A data read that never returns (--mode stuck)."""
    time.sleep(3600)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=10)
    p.add_argument(
        "--mode",
        choices=["none", "loop", "deadlock", "spin", "stuck", "desync", "stop"],
        default="none",
    )
    p.add_argument("--at", type=int, default=3)
    p.add_argument("--rank", type=int, default=1)
    p.add_argument("--step-time", type=float, default=0.05)
    p.add_argument("--spin", type=float, default=0.0, help="--mode spin: seconds it computes")
    p.add_argument(
        "--jitter", default="", help="MEDIAN,SIGMA: each step also sleeps a log-normal extra"
    )
    p.add_argument(
        "--exit-delay", type=float, default=0.0, help="an atexit handler that takes this long"
    )
    p.add_argument("--backend", choices=["gloo", "nccl"], default="gloo")
    args = p.parse_args()
    if args.exit_delay:
        atexit.register(time.sleep, args.exit_delay)
    on = one_gpu.device() if args.backend == "nccl" else torch.device("cpu")
    dist.init_process_group(args.backend)
    rank = dist.get_rank()
    armed = rank == args.rank and os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
    model = torch.nn.Linear(4, 1).to(on)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    t = torch.ones(1, device=on)
    jitter = [float(x) for x in args.jitter.split(",") if x]
    rng = random.Random(rank)
    for step in range(1, args.steps + 1):
        if jitter:  # a heavy-tailed pause: a data read's, on every rank independently
            time.sleep(jitter[0] * rng.lognormvariate(0.0, jitter[1]))
        opt.zero_grad()
        model(torch.randn(2, 4, device=on)).sum().backward()
        opt.step()
        if armed and step == args.at and args.mode == "loop":
            print(f"rank {rank} entering an endless loop", flush=True)
            while True:
                pass
        if armed and step == args.at and args.mode == "stop":
            print(f"rank {rank} stops itself", flush=True)
            os.kill(os.getpid(), signal.SIGSTOP)
        if armed and step == args.at and args.mode == "spin":
            print(f"rank {rank} computes for {args.spin:g}s", flush=True)
            end = time.monotonic() + args.spin
            while time.monotonic() < end:
                pass
        if armed and step == args.at and args.mode == "stuck":
            print(f"rank {rank} stuck reading a batch at {time.time():.3f}", flush=True)
            read_batch()
        if armed and step == args.at and args.mode == "deadlock":
            print(f"rank {rank} skips the all_reduce and waits for a message", flush=True)
            dist.recv(t, src=0)
        elif armed and step == args.at and args.mode == "desync":
            print(f"rank {rank} calls all_gather where the others call all_reduce", flush=True)
            dist.all_gather([torch.zeros(1, device=on) for _ in range(dist.get_world_size())], t)
        else:
            dist.all_reduce(t)
        print(f"step {step} {t.item():g}" if on.type == "cuda" else f"step {step}", flush=True)
        time.sleep(args.step_time)
    dist.barrier()
    print("done", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
