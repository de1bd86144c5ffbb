"""The in-memory refresh of a sharded (FSDP2) job over two nodes: what each refresh stalls the step
and what its replica exchange (the slot sent to the next node, with its MAC) takes in the
background, on two forked gloo ranks on CPU, each a node of its own (its own memory directory in
/dev/shm). The job refreshes every step, about --mb MB of state per rank (4 square layers, Adam);
a step is --step seconds of sleep (the refresh's exchange runs beside it), or nothing (0: the next
refresh waits for the exchange, whose time then counts as stall). Also the MAC's throughput on one
core, HMAC-SHA256 and keyed BLAKE2b, on a 256 MiB buffer.

    PYTHONPATH=. python bench/replica.py --mb 200
    PYTHONPATH=<an older tree> python bench/replica.py --mb 200   # the same, with its code
"""

from __future__ import annotations

import argparse
import hashlib
import hmac
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

from exchange import run_ranks, sharded_job


def _rank(rank: int, store: str, mems: list[str], args: argparse.Namespace, out: str) -> None:
    from elasticd.checkpoint import capture

    os.environ.setdefault("ELASTICD_STATE_KEY", "5e" * 32)
    net, opt, mgr, n = sharded_job(rank, 2, store, mems, 2 * args.mb, out)
    net(torch.randn(4, n)).sum().backward()
    opt.step()
    ring = mgr._memory.ring
    stalls, exchanges = [], []
    for step in range(1, args.refreshes + 2):
        time.sleep(args.step)
        t0 = time.perf_counter()
        mgr.maybe_save(step, lambda: capture(model=net, optimizer=opt, step=step))
        if step > 1:  # the first maps the slots
            stalls.append(time.perf_counter() - t0)
            exchanges.append(ring.replicator.seconds)  # the one that ended in this refresh's wait
    ring.wait()
    got = {"stall": stalls[1:], "exchange": exchanges[1:], "bytes": ring.replicator.sent}
    Path(f"{out}.{rank}").write_text(json.dumps(got))
    dist.barrier()
    os._exit(0)


def _throughput() -> str:
    data = memoryview(bytearray(os.urandom(256 << 20)))
    key = os.urandom(32)
    out = []
    for name, f in (
        ("HMAC-SHA256", lambda: hmac.new(key, data, hashlib.sha256).digest()),
        ("keyed BLAKE2b", lambda: hashlib.blake2b(data, key=key).digest()),
    ):
        best = min(_timed(f) for _ in range(3))
        out.append(f"{name} {len(data) / best / 1e9:.2f} GB/s")
    return ", ".join(out)


def _timed(f) -> float:
    t0 = time.perf_counter()
    f()
    return time.perf_counter() - t0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mb", type=float, default=200.0, help="state per rank, MB")
    ap.add_argument("--step", type=float, default=0.5, help="seconds of a step (0: none)")
    ap.add_argument("--refreshes", type=int, default=8)
    args = ap.parse_args(argv)
    print(f"one core: {_throughput()}")
    shm = "/dev/shm" if os.path.isdir("/dev/shm") else None
    with tempfile.TemporaryDirectory(dir=shm) as tmp:
        work = Path(tmp)
        mems = [str(work / f"mem{i}") for i in range(2)]
        for m in mems:
            os.mkdir(m)
        store, out = str(work / "store"), str(work / "out")
        run_ranks(2, _rank, store, mems, args, out)
        got = [json.loads(Path(f"{out}.{r}").read_text()) for r in range(2)]
    stall = statistics.median(s for g in got for s in g["stall"])
    exchange = statistics.median(s for g in got for s in g["exchange"])
    mb = got[0]["bytes"] / 1e6
    print(
        f"{mb:.0f} MB slot, step {args.step:g} s: refresh stall {1e3 * stall:.1f} ms, "
        f"exchange {1e3 * exchange:.0f} ms in the background (median of {args.refreshes - 1} "
        f"refreshes x 2 ranks)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
