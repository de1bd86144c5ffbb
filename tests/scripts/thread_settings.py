"""Appends the thread settings this worker's libraries chose as one JSON line to argv[1]: torch's
intra-op threads, numpy's OpenBLAS pool size, and the threads running once both have worked.
A warm worker must choose what a cold one chooses from the same environment."""

import fcntl
import json
import os
import sys

import numpy
import torch

from elasticd.worker import forkserver


def openblas_threads() -> list[int]:
    """Each loaded OpenBLAS's own answer (its getter is named after its build)."""
    counts = []
    for lib in forkserver.openblas_libraries():
        for name in (
            "openblas_get_num_threads",
            "openblas_get_num_threads64_",
            "scipy_openblas_get_num_threads64_",
        ):
            if hasattr(lib, name):
                counts.append(getattr(lib, name)())
                break
    return counts


a = numpy.ones((256, 256))
(a @ a).sum()
torch.ones(512, 512).matmul(torch.ones(512, 512)).sum()
record = {
    "rank": os.environ["RANK"],
    "omp": os.environ.get("OMP_NUM_THREADS"),
    "torch": torch.get_num_threads(),
    "interop": torch.get_num_interop_threads(),
    "openblas": openblas_threads(),
    "threads": len(os.listdir("/proc/self/task")),
}
with open(sys.argv[1], "a") as f:
    fcntl.flock(f, fcntl.LOCK_EX)
    f.write(json.dumps(record) + "\n")
