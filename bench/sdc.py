"""What the replicas' audit against silent data corruption costs, and how soon it finds a flip:
bench/steady.py's `compute` workload (a 1024-wide MLP, depth 2, batch 128, SGD; or AdamW with
--adamw, whose state the audit digests too) at W ranks (gloo, CPU; --device cuda: NCCL, one GPU
per rank), its in-memory state refreshed at the library's default cadence.

Each run is `torchrun --nproc-per-node W bench/sdc.py --worker ...` (the library is measured, not
the launcher; the in-memory directories are given, as elasticd would give one). Paired, in one
process group: two CheckpointManagers on the same model, one auditing (the default) and one with
audit_replicas=False, take turns keeping the state in alternating chunks of CHUNK steps, so that a
shared machine's drift hits both alike (--aa: both unaudited, which shows the pairing's own
noise). Reported: each side's median chunk (rank 0's mean step
time, refreshes included) and the median of the per-pair ratios; and, measured directly, the
audits' own seconds over the auditing side's training time (the overhead in % of step time), the
cost of one audit, and each side's refresh cadence (the audit's cost is the refresh's, under the
same budget, so the auditing side may refresh less often).

--sharded: the model is FSDP2's (fully_shard over the W ranks), whose shards the audit checks in
time (each rank's own, digested at the boundary before a keep and again as the next optimizer
step begins) instead of across replicas.

Then detection: TRIALS times, rank 1 flips one mantissa bit of one weight after a keep at a
random step, training goes on until the audit ends it (audit.SilentDataCorruption, caught here),
and the steps in between are the detection latency, against the audit interval; every rank then
takes rank 0's parameters and optimizer state again (a broadcast) and goes on. Every audit of the
clean steps must pass: any failure is a false alarm, counted.

And `--referee N`: the verdict's latency under `elasticd run` (tests/scripts/exact_job.py, the
e2e test's job, --ledger): N times side by side, a 2-rank job whose rank 1 flips one bit in its
update (the referee's replay names it, daemon/referee.py) and a 3-rank job whose rank 1 flips
the same bit (a majority names it, no replay); each time from the disagreement (rank 0's
error file, written there) to the daemon's `sdc_suspected`, and the referee's own seconds.

    python bench/sdc.py                    # compute, 2 ranks, CPU
    python bench/sdc.py --world 3 --steps 600 --adamw
    python bench/sdc.py --sharded --adamw
    python bench/sdc.py --referee 3
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import statistics
import tempfile
import time
from pathlib import Path

from exact import torchrun_json

HERE = Path(__file__).resolve().parent
CHUNK = 20  # steps per timed chunk; the first pair is warm-up


def _setup(width: int, depth: int, batch: int, adamw: bool, device: str, sharded: bool):
    import torch
    import torch.distributed as dist
    import torch.nn as nn
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.manual_seed(0)
    dims = [64] + [width] * depth
    layers = [m for a, b in zip(dims, dims[1:]) for m in (nn.Linear(a, b), nn.ReLU())]
    model = nn.Sequential(*layers, nn.Linear(width, 1)).to(device)
    if sharded:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh(torch.device(device).type, (dist.get_world_size(),))
        for layer in [m for m in model if isinstance(m, nn.Linear)] + [model]:
            fully_shard(layer, mesh=mesh)
    else:
        model = DDP(model, device_ids=[torch.device(device).index] if device != "cpu" else None)
    opt = (
        torch.optim.AdamW(model.parameters(), lr=1e-3)
        if adamw
        else torch.optim.SGD(model.parameters(), lr=0.01)
    )
    torch.manual_seed(1)
    x, y = torch.randn(batch, 64, device=device), torch.randn(batch, 1, device=device)
    return model, opt, x, y


def _detections(trials: int, auditor, model, opt, train, now) -> list[int | None]:
    """Steps from each flip (rank 1, one bit of one weight, after the keep of a random step) to
    the audit that ends it, None where none did; every rank then takes rank 0's state again."""
    import torch
    import torch.distributed as dist

    from elasticd.checkpoint import audit

    latencies: list[int | None] = []
    interval, rng = max(1, auditor.memory_every), random.Random(7)
    for _ in range(trials):
        flip_at = now() + rng.randrange(1, 2 * interval + 1)  # drawn alike on every rank
        where = rng.randrange(next(model.parameters()).numel())  # a DTensor's: global
        try:
            while now() < flip_at + 10 * interval + 10:  # else: never found (None)
                train(auditor, 1)
                if now() == flip_at and dist.get_rank() == 1:
                    weight = next(model.parameters()).detach()
                    weight = weight.to_local() if hasattr(weight, "to_local") else weight
                    weight.view(-1).view(torch.int32)[where % weight.numel()] ^= 1 << 12
            latencies.append(None)
        except audit.SilentDataCorruption:
            latencies.append(now() - flip_at)
        if hasattr(model, "module"):  # DDP: the replicas agree again (a shard is its own)
            with torch.no_grad():
                for t in audit.tensors(model.module, opt):
                    dist.broadcast(t, 0)
    return latencies


def worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    from elasticd.checkpoint import CheckpointManager, capture

    cuda = args.device == "cuda"
    device = f"cuda:{os.environ.get('LOCAL_RANK', '0')}" if cuda else "cpu"
    if cuda:
        torch.cuda.set_device(device)
    torch.set_num_threads(1)
    dist.init_process_group("nccl" if cuda else "gloo")
    rank = dist.get_rank()
    model, opt, x, y = _setup(args.width, args.depth, args.batch, args.adamw, device, args.sharded)
    sides = {
        on: CheckpointManager(
            f"{args.dir}/ckpt-{on}",
            handle_sigterm=False,
            memory_dir=f"{args.dir}/mem-{on}",
            audit_replicas=on and not args.aa,
        )
        for on in (True, False)
    }
    step = 0

    def train(mgr, count: int) -> int:
        nonlocal step
        for _ in range(count):
            opt.zero_grad(set_to_none=True)
            F.mse_loss(model(x), y).backward()
            opt.step()
            step += 1
            mgr.maybe_save(step, lambda: capture(model=model, optimizer=opt, step=step))
        if cuda:
            torch.cuda.synchronize()
        return count

    chunks: dict[bool, list[float]] = {True: [], False: []}
    trained = 0.0  # the auditing side's seconds
    shares: list[float] = []  # per chunk of the auditing side: its audits' share of its time
    for c in range(args.steps // CHUNK):
        for on in (c % 2 == 0, c % 2 == 1):
            before = sides[on].audit_seconds
            t0 = time.perf_counter()
            train(sides[on], CHUNK)
            took = time.perf_counter() - t0
            chunks[on].append(took / CHUNK)
            if on:
                trained += took
                shares.append((sides[on].audit_seconds - before) / took)
    auditor = sides[True]
    clean_audits = auditor.audits
    latencies = _detections(args.trials, auditor, model, opt, train, lambda: step)
    if rank == 0:
        on, off = chunks[True][1:], chunks[False][1:]
        print(
            json.dumps(
                {
                    "audit_ms": 1e3 * statistics.median(on),
                    "off_ms": 1e3 * statistics.median(off),
                    "ratio": statistics.median(b / a for a, b in zip(off, on)),
                    "audits": clean_audits,
                    "audit_seconds": auditor.audit_seconds,
                    "trained_seconds": trained,
                    # once the cadence settled: the chunks of the second half
                    "steady_share": statistics.median(shares[len(shares) // 2 :]),
                    "every_on": auditor.memory_every,
                    "every_off": sides[False].memory_every,
                    "window_every": auditor._audit.window_every,  # sharded: the audit in time's
                    "latencies": latencies,
                    "false_alarms": 0,  # an alarm on a clean step would have ended the run
                }
            )
        )
    for mgr in sides.values():
        mgr.close()
    dist.destroy_process_group()


def measure(args: argparse.Namespace) -> dict:
    root = tempfile.mkdtemp(prefix="elasticd-bench-sdc-", dir="/dev/shm")
    try:
        for on in (True, False):
            os.mkdir(f"{root}/mem-{on}", 0o700)
        worker_args = [
            "--worker",
            *("--dir", root, "--steps", str(args.steps), "--trials", str(args.trials)),
            *("--width", str(args.width), "--depth", str(args.depth)),
            *("--batch", str(args.batch), "--device", args.device),
            *(("--adamw",) if args.adamw else ()),
            *(("--sharded",) if args.sharded else ()),
            *(("--aa",) if args.aa else ()),
        ]
        return torchrun_json(HERE / "sdc.py", args.world, worker_args, args.timeout)
    finally:
        shutil.rmtree(root, ignore_errors=True)


def table(args: argparse.Namespace, r: dict) -> list[str]:
    share = r["audit_seconds"] / r["trained_seconds"] if r["trained_seconds"] else 0.0
    lat = [n for n in r["latencies"] if n is not None]
    missed = len(r["latencies"]) - len(lat)
    return [
        f"workload: {args.width}-wide MLP, depth {args.depth}, batch {args.batch}, "
        f"{'AdamW' if args.adamw else 'SGD'}, {args.world} ranks, {args.device}"
        f"{', FSDP2' if args.sharded else ', DDP'}",
        "| | step time (median chunk) | refresh every |",
        "| --- | --- | --- |",
        f"| audit on (default) | {r['audit_ms']:.2f} ms | {r['every_on']} steps |",
        f"| audit off | {r['off_ms']:.2f} ms | {r['every_off']} steps |",
        f"| on / off (median of pairs) | {r['ratio']:.4f} | |",
        "",
        f"audits: {r['audits']} on clean steps, {r['false_alarms']} false alarms; "
        f"one audit {1e3 * r['audit_seconds'] / max(1, r['audits']):.3f} ms (mean)",
        f"the audits' own time, share of step time: {100 * share:.3f}% over the whole run, "
        f"{100 * r['steady_share']:.3f}% once the cadence settled (median chunk, second half)",
        f"detection: {len(lat)} flips found ({missed} missed), after "
        f"{min(lat, default=0)}-{max(lat, default=0)} steps (mean "
        f"{statistics.mean(lat) if lat else 0:.1f}); audit interval {r['every_on']} steps"
        + (f" (sharded: a window every {r['window_every']})" if args.sharded else ""),
    ]


def _verdict_after(nproc: int, tmp: Path, timeout: float, *flags: str) -> dict:
    """One job under `elasticd run`: seconds from rank 0's sdc_detected to sdc_suspected."""
    import datetime

    from recovery import events, kill_tree, spawn

    cfg = {"flip_at": 4, "flip_in": "update", "steps": 6, "out": str(tmp / "job.out")}
    env = {**os.environ, "EXACT_JOB": json.dumps(cfg)}
    env["PYTHONPATH"] = os.pathsep.join([str(HERE.parent), str(HERE.parent / "tests")])
    cmd = [
        *("python3", "-m", "elasticd", "run", "--nproc-per-node", str(nproc), "--ledger"),
        *("--log-dir", str(tmp / "logs"), "--state-dir", str(tmp / "state"), "--no-tee"),
        *("--checkpoint-dir", str(tmp / "ckpt"), "--log-format", "json", "--max-restarts", "2"),
        *flags,
        str(HERE.parent / "tests" / "scripts" / "exact_job.py"),
    ]
    proc = spawn(cmd, env, tmp / "daemon.log")
    try:
        proc.wait(timeout)
    finally:
        if proc.poll() is None:
            kill_tree(proc)

    def at(e: dict) -> float:
        return datetime.datetime.fromisoformat(e["timestamp"]).timestamp()

    (found,) = [e for e in events(tmp / "daemon.log") if e.get("event") == "sdc_suspected"]
    # rank 0's error file, written at the disagreement (checkpoint/audit.py), and never after
    detected = next((tmp / "logs").rglob("attempt1/rank0.error.json")).stat().st_mtime
    return {
        "seconds": at(found) - detected,
        "rank": found["rank"],
        "referee_seconds": found.get("referee_seconds"),
        "referee_warm": found.get("referee_warm", 0),
    }


def referee_trials(trials: int, timeout: float) -> list[str]:
    """Per trial, in turn: 2 ranks with the referee's replays in warm spares (the default), the
    same in fresh interpreters (--no-warm-spawn), 3 ranks where a majority decides."""
    kinds = {"warm": (2, ()), "cold": (2, ("--no-warm-spawn",)), "majority": (3, ())}
    rows: dict[str, list[dict]] = {kind: [] for kind in kinds}
    for _ in range(trials):
        for kind, (nproc, flags) in kinds.items():
            with tempfile.TemporaryDirectory(prefix="elasticd-bench-referee-") as tmp:
                rows[kind].append(_verdict_after(nproc, Path(tmp), timeout, *flags))
    fmt = lambda xs: ", ".join(f"{x:.2f}" for x in xs)  # noqa: E731
    lines = ["from the disagreement (rank 0's error file) to sdc_suspected, seconds:"]
    for kind in ("warm", "cold"):
        got = rows[kind]
        lines.append(
            f"  2 ranks, the referee, {kind}: {fmt(r['seconds'] for r in got)} (named rank "
            f"{sorted({r['rank'] for r in got})}; the referee itself "
            f"{fmt(r['referee_seconds'] or 0 for r in got)}; replays in warm spares: "
            f"{', '.join(str(r['referee_warm']) for r in got)} of 2)"
        )
    three = rows["majority"]
    lines.append(
        f"  3 ranks, a majority:           {fmt(r['seconds'] for r in three)} "
        f"(named rank {sorted({r['rank'] for r in three})})"
    )
    for kind in ("warm", "cold"):
        ratio = [a["seconds"] / b["seconds"] for a, b in zip(rows[kind], three)]
        lines.append(
            f"  referee {kind} / majority, per trial: {fmt(ratio)} "
            f"(median {statistics.median(ratio):.2f})"
        )
    return lines


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--dir", help=argparse.SUPPRESS)
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--steps", type=int, default=400, help="timed steps, both sides")
    p.add_argument("--trials", type=int, default=5, help="bit flips timed to their detection")
    p.add_argument("--width", type=int, default=1024)
    p.add_argument("--depth", type=int, default=2)
    p.add_argument("--batch", type=int, default=128)
    p.add_argument("--adamw", action="store_true", help="AdamW, whose state is audited too")
    p.add_argument("--sharded", action="store_true", help="FSDP2: the audit in time")
    p.add_argument(
        "--aa", action="store_true", help="both sides unaudited: the paired ratio's own noise"
    )
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--timeout", type=float, default=900)
    p.add_argument("--json", action="store_true", help="the raw figures as a last line")
    p.add_argument(
        "--referee", type=int, default=0, metavar="N", help="time the verdict under elasticd run"
    )
    args = p.parse_args()
    if args.referee:
        print("\n".join(referee_trials(args.referee, args.timeout)))
        return
    if args.worker:
        worker(args)
        return
    r = measure(args)
    print("\n".join(table(args, r)))
    if args.json:
        print(json.dumps(r))


if __name__ == "__main__":
    main()
