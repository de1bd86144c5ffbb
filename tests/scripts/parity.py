"""What a worker observes that its launcher decides, as one JSON line appended to argv[1]: its
environment at start, the command line the interpreter records, sys.flags, stdout's buffering
(python -u's), sys.path[0]; then torch's intra-op threads, here and in a new thread, after
setting OMP_NUM_THREADS and MKL_NUM_THREADS to argv[2] before `import torch` (rank 0) or after
it (other ranks): torch reads them when it is imported, so only rank 0's choice takes; and the
seeds of torch's unseeded generator and of str hashing, which differ between fresh processes."""

import fcntl
import json
import os
import sys
import threading

record = {
    "env": dict(os.environ),
    "orig_argv": sys.orig_argv,
    "argv": sys.argv,
    "flags": list(sys.flags),
    "stdout_write_through": sys.stdout.write_through,
    "path0": sys.path[0],
    "name": __name__,
}
before = os.environ["RANK"] == "0"
if before:
    os.environ["OMP_NUM_THREADS"] = os.environ["MKL_NUM_THREADS"] = sys.argv[2]
import torch  # noqa: E402 - the point: what the environment is when torch is imported

if not before:
    os.environ["OMP_NUM_THREADS"] = os.environ["MKL_NUM_THREADS"] = sys.argv[2]
seen = []
t = threading.Thread(target=lambda: seen.append(torch.get_num_threads()))
t.start()
t.join()
record["threads"] = [torch.get_num_threads(), seen[0], torch.get_num_interop_threads()]
record["seeds"] = [torch.initial_seed(), int(torch.randint(0, 2**62, (1,))), hash("a")]
with open(sys.argv[1], "a") as f:
    fcntl.flock(f, fcntl.LOCK_EX)
    f.write(json.dumps(record) + "\n")
