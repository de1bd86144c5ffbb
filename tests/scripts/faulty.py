"""Fault injection for tests: `--raise-at N` (`--error TEXT`: a RuntimeError of that text, where
`{loss}` is a number that differs each attempt: sign, decimals, exponent; `--later-each-attempt`: N
+ the restart count, a failure that is not the same twice), `--exit-at N CODE`, `--abort-at N`
(SIGABRT), `--abort-at-exit` (SIGABRT from an atexit handler, once the work is done, as a C++
thread's std::terminate at interpreter exit), `--spawn-child` (a grandchild), `--beat` (report each
step through elasticd.heartbeat, as a training loop would), `--first-attempt-steps N` (the first
attempt's length: a node that starts alone keeps going until a joining node re-forms the group).

Plain torch.distributed like any torchrun script; the fault hits only `--rank R` (default 1)."""

import argparse
import atexit
import os
import subprocess
import sys
import time

import torch
import torch.distributed as dist

LOSSES = ("0.3123", "-0.2718", "3.2e-05", "0.00041")  # a float as a message prints it


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--first-attempt-steps", type=int, default=-1)
    p.add_argument("--rank", type=int, default=1)
    p.add_argument("--raise-at", type=int, default=-1)
    p.add_argument("--error", default="", help="--raise-at raises RuntimeError(this text)")
    p.add_argument("--exit-at", type=int, default=-1)
    p.add_argument("--exit-code", type=int, default=3)
    p.add_argument("--abort-at", type=int, default=-1)
    p.add_argument("--abort-at-exit", action="store_true")
    p.add_argument("--only-first-attempt", action="store_true")
    p.add_argument("--later-each-attempt", action="store_true")
    p.add_argument("--spawn-child", action="store_true", help="start a long sleep grandchild")
    p.add_argument("--step-time", type=float, default=0.05)
    p.add_argument("--beat", action="store_true")
    args = p.parse_args()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    restarts = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    first = restarts == 0
    if first and args.first_attempt_steps >= 0:
        args.steps = args.first_attempt_steps
    if args.later_each_attempt:
        args.raise_at += restarts
    armed = rank == args.rank and (first or not args.only_first_attempt)
    if args.spawn_child:
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
        print(f"child pid {child.pid}", flush=True)
    t = torch.ones(1)
    for step in range(1, args.steps + 1):
        dist.all_reduce(t)
        print(f"step {step}", flush=True)
        if args.beat:
            import elasticd

            elasticd.heartbeat(step)
        if armed and step == args.raise_at and args.error:
            raise RuntimeError(args.error.replace("{loss}", LOSSES[restarts % len(LOSSES)]))
        if armed and step == args.raise_at:
            raise ValueError(f"injected failure at step {step}")
        if armed and step == args.exit_at:
            sys.exit(args.exit_code)
        if armed and step == args.abort_at:
            os.abort()
        time.sleep(args.step_time)
    dist.barrier()
    print("done", flush=True)
    dist.destroy_process_group()
    if armed and args.abort_at_exit:
        atexit.register(os.abort)


if __name__ == "__main__":
    main()
