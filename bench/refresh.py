"""In-memory refresh: what it really costs the training, synchronous vs overlapped, against what
the cadence is charged for it.

memory.cadence.Cadence spaces refreshes out so that their cost stays under `memory_budget` of the
step time, from what each refresh is charged (the host's stall; with memory_overlap, that plus the
training stream's copies and the optimizer step's wait, from CUDA events). This benchmark checks
the charge against the truth: one process trains an MLP (on CUDA where there is a GPU: by
default the steady benchmark's `gpu` workload, 4096 wide, 4 deep, batch 2048, SGD), and blocks
of --block steps alternate between no refresh, a synchronous refresh every N steps and an
overlapped one (CheckpointManager(memory_overlap=True)) every N steps, through maybe_save as a
training loop calls it. Each step ends with the device synchronised, as bench/step_logger.py
does. A refresh's true cost is (its blocks' mean step time - the no-refresh blocks') x N; the
table also gives the median charge and the host stall, and the share of the step the default
cadence would spend at that charge.

    python bench/refresh.py                         # CUDA if there is a GPU, else the CPU
    python bench/refresh.py --every 1,5 --rounds 8 --optimizer adamw
"""

from __future__ import annotations

import argparse
import inspect
import math
import os
import shutil
import statistics
import tempfile
import time

import torch

from elasticd.checkpoint import CheckpointManager, capture

MODES = ("none", "synchronous", "overlapped")


def build(device: torch.device, width: int, depth: int, batch: int, optimizer: str):
    torch.manual_seed(0)
    dims = [64] + [width] * depth
    layers = [m for a, b in zip(dims, dims[1:]) for m in (torch.nn.Linear(a, b), torch.nn.ReLU())]
    model = torch.nn.Sequential(*layers, torch.nn.Linear(width, 1)).to(device)
    opt = (
        torch.optim.AdamW(model.parameters(), lr=1e-4)
        if optimizer == "adamw"
        else torch.optim.SGD(model.parameters(), lr=0.01)
    )
    x, y = torch.randn(batch, 64, device=device), torch.randn(batch, 1, device=device)
    return model, opt, x, y


def block(model, opt, x, y, mgr, steps: int, first: int, sync, stalls: list | None = None) -> float:
    """Train `steps` steps from `first` (a multiple of N, plus 1), refreshing through `mgr` when
    given; mean seconds per step from the end of the first refresh to the end of the last, whole
    periods of N steps: each holds one refresh's host stall and the effect of one refresh's
    copies on the steps after it (the last one's falls outside, the first one's inside). The
    host's stall of each refresh goes to `stalls`."""
    every = mgr.memory_every if mgr is not None else 1
    ends = []
    for step in range(first, first + steps):
        opt.zero_grad(set_to_none=True)
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        sync()
        if mgr is not None:
            mgr.maybe_save(step, lambda: capture(model=model, optimizer=opt, step=step))
            if stalls is not None and step % every == 0:
                stalls.append(mgr.last_memory_stall)
        ends.append(time.perf_counter())
    sync()  # the last refresh's copies land before the next block (outside its window)
    return (ends[-1] - ends[every - 1]) / (steps - every)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    p.add_argument("--width", type=int, default=4096)
    p.add_argument("--depth", type=int, default=4)
    p.add_argument("--batch", type=int, default=2048)
    p.add_argument("--optimizer", choices=("sgd", "adamw"), default="sgd")
    p.add_argument("--every", default="1,10", help="comma-separated refresh intervals N to measure")
    p.add_argument("--block", type=int, default=60, help="steps per block (a multiple of every N)")
    p.add_argument("--rounds", type=int, default=5, help="blocks of each kind, interleaved")
    p.add_argument(
        "--budget",
        type=float,
        default=inspect.signature(CheckpointManager).parameters["memory_budget"].default,
        help="the cadence's budget, for the last columns (default: the library's)",
    )
    args = p.parse_args()
    cuda = args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    everies = [int(n) for n in args.every.split(",")]
    if any(args.block % n or args.block < 2 * n for n in everies):
        raise SystemExit(
            f"--block {args.block} must be a multiple of every N in --every {args.every}, "
            "at least twice as large"
        )
    model, opt, x, y = build(device, args.width, args.depth, args.batch, args.optimizer)
    shm = "/dev/shm" if os.path.isdir("/dev/shm") else None
    root = tempfile.mkdtemp(prefix="bench-refresh-")
    mems = {}
    try:
        mgrs = {}
        for n in everies:
            for mode in MODES[1:]:
                mems[n, mode] = tempfile.mkdtemp(prefix="bench-refresh-mem-", dir=shm)
                mgrs[n, mode] = CheckpointManager(
                    os.path.join(root, f"{n}-{mode}"),
                    handle_sigterm=False,
                    memory_dir=mems[n, mode],
                    memory_every=n,
                    memory_overlap=mode == "overlapped",
                )
        # warm-up: kernels, allocator, optimizer state
        block(model, opt, x, y, None, args.block, 1, sync)
        nbytes = sum(t.nbytes for t in model.state_dict().values())
        nbytes += sum(
            t.nbytes for s in opt.state.values() for t in s.values() if isinstance(t, torch.Tensor)
        )
        for mgr in mgrs.values():  # map and (overlapped) pin each slot: one-off costs
            block(model, opt, x, y, mgr, 2 * max(everies), 1, sync)
        times: dict = {
            key: [] for key in [("none", 0)] + [(m, n) for n in everies for m in MODES[1:]]
        }
        charged: dict = {key: [] for key in times}
        stalls: dict = {key: [] for key in times}
        step = 1
        for r in range(args.rounds):
            order = list(times)  # rotated: no kind always follows another
            order = order[r % len(order) :] + order[: r % len(order)]
            for mode, n in order:
                mgr = mgrs.get((n, mode))
                if mgr is not None:
                    mgr._memory.cadence.costs.clear()
                times[mode, n].append(
                    block(model, opt, x, y, mgr, args.block, step, sync, stalls[mode, n])
                )
                step += args.block
                if mgr is not None:
                    # an overlapped refresh's charge comes once its events passed: the block's
                    # last one in its next block
                    charged[mode, n] += mgr._memory.cadence.costs
        off = [k for k, m in mgrs.items() if k[1] == "overlapped" and not m._memory.writer.overlap]
        for mgr in mgrs.values():
            mgr.close()
            if mgr._memory.writer is not None:
                mgr._memory.writer.close()
    finally:
        shutil.rmtree(root, ignore_errors=True)
        for d in mems.values():
            shutil.rmtree(d, ignore_errors=True)
    what = torch.cuda.get_device_name(device) if cuda else f"CPU, {os.cpu_count()} cores"
    report(args, what, nbytes, times, charged, stalls, off)


def report(args, what: str, nbytes: int, times: dict, charged: dict, stalls: dict, off: list):
    """The table: each kind's step time, its true cost per refresh and what the cadence charged."""
    med = statistics.median
    base = med(times["none", 0])
    print(
        f"in-memory refresh of a {nbytes / 1e6:.0f} MB state ({args.width}x{args.depth} MLP, "
        f"batch {args.batch}, {args.optimizer}) on {what}, torch {torch.__version__}; median of "
        f"{args.rounds} blocks of {args.block} steps each; step without refreshes "
        f"{1e3 * base:.3f} ms"
    )
    if off:
        print(
            f"  overlapping turned itself off for N in {sorted(n for n, _ in off)}: those rows "
            "are synchronous"
        )
    print(
        f"{'refresh':<12} {'N':>4} {'step ms':>9} {'true cost ms':>13} {'charged ms':>11} "
        f"{'host ms':>8} {'N at budget':>12} {'cost there':>11}"
    )
    for (mode, n), ts in times.items():
        if mode == "none":
            continue
        true = (med(ts) - base) * n
        charge = med(charged[mode, n]) if charged[mode, n] else float("nan")
        at = max(1, math.ceil(charge / (args.budget * base))) if charge == charge else 0
        share = true / (at * base) if at else float("nan")
        print(
            f"{mode:<12} {n:>4} {1e3 * med(ts):>9.3f} {1e3 * true:>13.3f} {1e3 * charge:>11.3f} "
            f"{1e3 * med(stalls[mode, n]):>8.3f} {at:>12} {100 * share:>10.2f}%"
        )


if __name__ == "__main__":
    main()
