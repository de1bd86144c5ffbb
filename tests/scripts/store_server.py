"""A bare c10d TCPStore server on ADDR:PORT until killed: a rendezvous store hosted by no node of
the job, so that a test can lose any node (the one holding group rank 0 included)."""

import datetime
import signal
import sys

import torch.distributed as dist

store = dist.TCPStore(
    sys.argv[1],
    int(sys.argv[2]),
    None,
    True,
    datetime.timedelta(seconds=3600),
    wait_for_workers=False,
)
print("serving", flush=True)
signal.sigwait({signal.SIGTERM, signal.SIGINT})
