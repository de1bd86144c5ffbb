"""Appends this worker's environment, __name__, argv and process facts as one JSON line to argv[1],
and prints "dumped rank R".

The facts are what a warm worker must share with a cold one: its parent (the daemon), its own
session, one thread at start, random streams of its own (a fork would copy its parent's), and
the command line ps shows."""

import fcntl
import json
import os
import random
import sys

facts = {
    "ppid": os.getppid(),
    "sid": os.getsid(0),
    "pid": os.getpid(),
    "threads": len(os.listdir("/proc/self/task")),
    "random": random.random(),
    "cmdline": open("/proc/self/cmdline", "rb").read().decode(errors="surrogateescape"),
}
if "numpy" in sys.modules:  # imported ahead by the warm interpreter; a cold one imports it here
    facts["numpy_random"] = float(sys.modules["numpy"].random.random())
record = dict(os.environ, __name__=__name__, argv=sys.argv, facts=facts)
with open(sys.argv[1], "a") as f:
    fcntl.flock(f, fcntl.LOCK_EX)
    f.write(json.dumps(record) + "\n")
print(f"dumped rank {os.environ.get('RANK')}", flush=True)
