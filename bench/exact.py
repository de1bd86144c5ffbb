"""What exact mode costs: step time and memory of elasticd.global_batch's exact mode against its
normal mode, the same global batch and micro-batches, at one and two ranks (gloo, CPU).

Each run is `torchrun --nproc-per-node W bench/exact.py --worker ...` (the launcher is not what is
measured: this is the training library's cost). Both modes compute the same micro-batches per rank
(G = 4 micro-batches of m: two per rank at W=2, four at W=1); normal mode syncs the last through
DDP's all-reduce, exact mode seeds every micro-batch, keeps the other ranks' micro-batch gradients
apart and sums them in index order (rank 0 -> 1, then a broadcast).

Step time is measured paired, in one process group: two copies of the model, one per mode, trained
in alternating chunks of CHUNK steps (torch's deterministic mode switched on for exact chunks
only), so that a shared machine's drift, which moves a run's step time by 2x from one minute to
the next here, hits both alike; reported: each mode's median chunk (rank 0's mean step time) and
the median of the per-pair ratios. Memory is measured in a process per mode: the peak RSS growth
of the training loop over the process before it, the largest over ranks.

    python bench/exact.py --rounds 3
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
WORKLOADS = {  # name: (width, depth, micro-batch, steps)
    "tiny": (256, 1, 64, 400),  # the bundled example's MLP
    "compute": (1024, 2, 64, 120),  # 1.1 M parameters, 4.3 MB of gradient
}
CHUNK = 10  # steps per timed chunk; the first chunk of each mode is warm-up


def _setup(workload: str, exact: bool):
    """One mode's model, optimizer, GlobalBatch and batch iterator, the same start for both."""
    import torch
    import torch.nn as nn
    from torch.nn.parallel import DistributedDataParallel as DDP
    from torch.utils.data import DataLoader, TensorDataset

    from elasticd.global_batch import GlobalBatch

    width, depth, micro, _ = WORKLOADS[workload]
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(4096, 32, generator=g), torch.randn(4096, 1, generator=g))
    torch.manual_seed(0)
    layers, dim = [], 32
    for _ in range(depth):
        layers += [nn.Linear(dim, width), nn.ReLU(), nn.Dropout(0.1)]
        dim = width
    model = DDP(nn.Sequential(*layers, nn.Linear(dim, 1)))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    gb = GlobalBatch(data, 4 * micro, micro, exact=exact)
    return model, opt, gb, iter(DataLoader(data, batch_sampler=gb))


def _steps(run, count: int) -> float:
    """Mean seconds per step over `count` steps of one mode."""
    import torch
    import torch.nn.functional as F

    model, opt, gb, batches = run
    torch.use_deterministic_algorithms(gb.exact)
    t0 = time.perf_counter()
    for _ in range(count):
        opt.zero_grad(set_to_none=True)
        for mb, (x, y) in gb.micro_batches(model, batches):
            (F.mse_loss(model(x), y) * mb.scale).backward()
        opt.step()
    return (time.perf_counter() - t0) / count


def worker(workload: str, mode: str) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)  # the same in both modes and worlds (exact mode's condition)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    steps = WORKLOADS[workload][3]
    if mode == "paired":
        runs = {False: _setup(workload, False), True: _setup(workload, True)}
        chunks: dict[bool, list[float]] = {False: [], True: []}
        for c in range(steps // CHUNK):
            for exact in (c % 2 == 1, c % 2 == 0):
                chunks[exact].append(_steps(runs[exact], CHUNK))
        if rank == 0:
            n, e = chunks[False][1:], chunks[True][1:]
            ratios = [b / a for a, b in zip(n, e, strict=True)]
            print(json.dumps({"normal_ms": 1e3 * statistics.median(n),
                              "exact_ms": 1e3 * statistics.median(e),
                              "ratio": statistics.median(ratios)}))  # fmt: skip
    else:
        run = _setup(workload, mode == "exact")
        before = _rss_mb()
        _steps(run, steps // 4)
        grown = [0.0] * world
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB -> MiB
        dist.all_gather_object(grown, peak - before)
        if rank == 0:
            print(json.dumps({"grown_mb": max(grown)}))
    dist.destroy_process_group()
    # gloo's worker threads drop their last work (taking the GIL) before the DDP model is freed:
    # without this pause torch aborts now and then at exit (elasticd's bootstrap does the same)
    time.sleep(0.05)


def _rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def measure(workload: str, world: int, mode: str) -> dict:
    return torchrun_json(HERE / "exact.py", world, ["--worker", workload, "--mode", mode])


def torchrun_json(script: Path, world: int, args: list[str], timeout: float = 600) -> dict:
    """`torchrun --nproc-per-node W --standalone script args` (this checkout's elasticd on the
    path, one intra-op thread), killed whole at `timeout`: the last JSON line rank 0 printed."""
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node",
        str(world),
        "--standalone",
        str(script),
        *args,
    ]
    env = dict(os.environ, PYTHONPATH=str(HERE.parent), OMP_NUM_THREADS="1")
    proc = subprocess.Popen(
        cmd,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        start_new_session=True,
    )
    try:
        out, err = proc.communicate(timeout=timeout)
    finally:
        if proc.poll() is None:  # torchrun and its workers, all in its session
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{err[-3000:]}")
    lines = [ln for ln in out.splitlines() if ln.startswith("{")]
    return json.loads(lines[-1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--workloads", default="tiny,compute")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    p.add_argument("--mode", default="paired", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        worker(args.worker, args.mode)
        return
    print("| workload | ranks | step time normal / exact | ratio | memory growth normal / exact |")
    print("| --- | --- | --- | --- | --- |")
    for workload in args.workloads.split(","):
        for world in (1, 2):
            timed = [measure(workload, world, "paired") for _ in range(args.rounds)]
            mem = {m: measure(workload, world, m)["grown_mb"] for m in ("normal", "exact")}
            n, e, r = (
                statistics.median(t[k] for t in timed) for k in ("normal_ms", "exact_ms", "ratio")
            )
            lo, hi = min(t["ratio"] for t in timed), max(t["ratio"] for t in timed)
            print(
                f"| {workload} | {world} | {n:.2f} / {e:.2f} ms | {r:.2f}x ({lo:.2f}-{hi:.2f}) | "
                f"{mem['normal']:.1f} / {mem['exact']:.1f} MB |",
                flush=True,
            )


if __name__ == "__main__":
    main()
