"""Checkpoint cost: the training stall of CheckpointManager.save (snapshot to host memory, persist
in the background) vs a plain synchronous torch.save of the same state, for about 100 MB and
1 GB; the per-step in-memory refresh; and load time (load_latest + restore vs torch.load +
load_state_dict of a hand-written snapshot). One process, CPU tensors.

    python bench/checkpoint.py --sizes 100,1000 --trials 3
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time

import torch

from elasticd.checkpoint import CheckpointManager, capture, restore


def model_of(mb: int) -> torch.nn.Module:
    """Linear layers of 4096 x 4096 fp32 (64 MiB) plus the rest, about `mb` MB of parameters."""
    n = mb * 1_000_000 // 4
    layers = []
    while n > 0:
        rows = min(4096, max(1, n // 4096))
        layers.append(torch.nn.Linear(4096, rows, bias=False))
        n -= rows * 4096
    return torch.nn.Sequential(*layers)


def timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", default="100,1000", help="state sizes in MB")
    p.add_argument("--trials", type=int, default=3)
    p.add_argument(
        "--dir", default=None, help="where to write (default: a temporary directory in the cwd)"
    )
    args = p.parse_args()
    root = tempfile.mkdtemp(prefix="bench-ckpt-", dir=args.dir or os.getcwd())
    mem = (
        tempfile.mkdtemp(prefix="bench-ckpt-mem-", dir="/dev/shm")
        if os.path.isdir("/dev/shm")
        else None
    )
    rows = []
    try:
        for mb in (int(x) for x in args.sizes.split(",")):
            model = model_of(mb)
            nbytes = sum(t.numel() * t.element_size() for t in model.state_dict().values())
            plain_path = os.path.join(root, f"plain-{mb}.pt")
            mgr = CheckpointManager(
                os.path.join(root, f"lib-{mb}"),
                keep=2,
                handle_sigterm=False,
                memory_dir=mem,
                memory_every=1,
            )
            plain, stall, write, refresh, load_plain, load_lib = [], [], [], [], [], []
            for step in range(1, args.trials + 1):
                with torch.no_grad():
                    for prm in model.parameters():
                        prm.add_(1.0)  # new values each time
                plain.append(
                    timed(
                        lambda: torch.save({"model": model.state_dict(), "step": step}, plain_path)
                    )
                )
                stall.append(mgr.save(step, capture(model=model, step=step)))
                t0 = time.perf_counter()
                mgr.wait()
                write.append(time.perf_counter() - t0 + stall[-1])
                if mem:
                    refresh.append(mgr.save_memory(step, capture(model=model, step=step)))
                fresh = model_of(mb)
                load_plain.append(
                    timed(
                        lambda: fresh.load_state_dict(
                            torch.load(plain_path, map_location="cpu", weights_only=True)["model"]
                        )
                    )
                )
                loader = CheckpointManager(os.path.join(root, f"lib-{mb}"), handle_sigterm=False)
                load_lib.append(timed(lambda: restore(loader.load_latest(), model=fresh)))
            mgr.close()
            med = statistics.median
            rows.append(
                (
                    mb,
                    nbytes,
                    med(plain),
                    med(stall),
                    med(write),
                    med(refresh) if refresh else None,
                    med(load_plain),
                    med(load_lib),
                )
            )
            print(
                f"  {mb} MB: plain save {med(plain):.3f}s, save() stall {med(stall):.3f}s "
                f"(background write {med(write):.3f}s), memory refresh "
                + (f"{med(refresh):.3f}s" if refresh else "n/a")
                + f", load plain {med(load_plain):.3f}s, load_latest+restore {med(load_lib):.3f}s",
                flush=True,
            )
            shutil.rmtree(os.path.join(root, f"lib-{mb}"), ignore_errors=True)
            os.unlink(plain_path)
    finally:
        shutil.rmtree(root, ignore_errors=True)
        if mem:
            shutil.rmtree(mem, ignore_errors=True)
    print()
    print(f"checkpoint stall, median of {args.trials}, {os.cpu_count()} cores, CPU tensors")
    print(
        f"{'state':>8} {'torch.save s':>13} {'save() stall s':>15} {'stall ratio':>12} "
        f"{'memory refresh s':>17} "
        f"{'load plain s':>13} {'load lib s':>11}"
    )
    for _mb, nbytes, plain, stall, _write, refresh, lp, ll in rows:
        print(
            f"{nbytes / 1e6:>6.0f}MB {plain:>13.3f} {stall:>15.3f} {stall / plain:>11.2f}x "
            f"{(f'{refresh:.3f}' if refresh is not None else 'n/a'):>17} {lp:>13.3f} {ll:>11.3f}"
        )


if __name__ == "__main__":
    main()
