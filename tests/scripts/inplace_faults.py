"""A torchrun script that does what a survivor cannot re-enter in place after (tests/e2e/
test_inplace.py), by its flags: `--thread` starts a thread of its own (not a daemon thread) that
runs until the training loop ends, so it still runs when a collective fails and the script
unwinds; `--swallow` has rank 0 catch a collective's error and go on, so it never unwinds;
`--hang-at N` has rank 1, in its first process, sleep for ever before step N's collective (outside
it: the others wait in it); `--raise-at N` has rank 1, in its first process, raise an error of
its own (a ValueError, as bad data would) at step N, or with `--loader-died-of NAME` the error
torch's DataLoader raises when its worker died of a signal (Killed, Segmentation fault) as it
handed over a batch (raised while handling the ConnectionResetError of multiprocessing's
resource sharer), or with `--loader-killed-unseen` a real DataLoader whose worker is SIGKILLed
where torch's SIGCHLD handler does not see it (its own check reaps the worker: "exited
unexpectedly", no cause named); `--die-at-end` has rank 1, in the job's first
process, SIGKILL itself past the last step while rank 0 returns once the daemon announced the
generation rank 1's replacement starts for (no collective after the loop, not even
destroy_process_group's). Prints
`step N` per step."""

import argparse
import os
import signal
import threading
import time

import torch
import torch.distributed as dist

p = argparse.ArgumentParser()
p.add_argument("--steps", type=int, default=100)
p.add_argument("--thread", action="store_true")
p.add_argument("--swallow", action="store_true")
p.add_argument("--hang-at", type=int, default=0)
p.add_argument("--raise-at", type=int, default=0)
p.add_argument("--loader-died-of", default="")
p.add_argument("--loader-killed-unseen", action="store_true")
p.add_argument("--die-at-end", action="store_true")
args = p.parse_args()

dist.init_process_group("gloo")
done = threading.Event()
if args.thread:
    threading.Thread(target=done.wait, name="ticker").start()
w = torch.nn.Parameter(torch.zeros(4))
opt = torch.optim.SGD([w], lr=0.1)
for step in range(1, args.steps + 1):
    w.grad = torch.ones(4)
    first = dist.get_rank() == 1 and os.environ["ELASTICD_IN_PLACE_GEN"] == "0"
    if step == args.hang_at and first:
        while True:
            time.sleep(1)
    if step == args.raise_at and first and args.loader_died_of:
        try:  # a Python socket's error, not a collective's: the batch's fd from the dead worker
            raise ConnectionResetError(104, "Connection reset by peer")
        except ConnectionResetError:  # as torch raises it: the reset is its context
            raise RuntimeError(  # noqa: B904
                f"DataLoader worker (pid 4242) is killed by signal: {args.loader_died_of}. "
            )
    if step == args.raise_at and first and args.loader_killed_unseen:
        import multiprocessing

        from torch.utils.data import DataLoader, Dataset

        class Slow(Dataset):
            def __len__(self):
                return 4

            def __getitem__(self, i):
                time.sleep(60)
                return i

        batches = iter(DataLoader(Slow(), num_workers=1, timeout=2))
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)  # torch's handler, which names the cause
        for worker in multiprocessing.active_children():
            os.kill(worker.pid, signal.SIGKILL)
        next(batches)  # "DataLoader worker (pid(s) N) exited unexpectedly"
    if step == args.raise_at and first:
        raise ValueError(f"bad sample at step {step}")
    try:
        dist.all_reduce(w.grad)
    except RuntimeError as e:
        if not (args.swallow and dist.get_rank() == 0):
            raise
        print(f"ignored: {e}", flush=True)
    opt.step()  # the heartbeat beats at every optimizer step
    print(f"step {step}", flush=True)
    time.sleep(0.05)
done.set()  # only where the loop ended: an error leaves the thread running
if args.die_at_end and os.environ["TORCHELASTIC_RESTART_COUNT"] == "0":
    if dist.get_rank() == 1 and os.environ["ELASTICD_IN_PLACE_GEN"] == "0":
        os.kill(os.getpid(), signal.SIGKILL)
    # rank 0, past its last collective, sees no failure: it returns once the daemon announced
    # the generation its replacement starts for (the store the daemon announces it in)
    from datetime import timedelta

    from elasticd import names

    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]))
    store.wait([names.in_place_key(1)], timedelta(seconds=30))
else:
    dist.destroy_process_group()
