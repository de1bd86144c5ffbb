"""Appends this worker's environment, __name__ and argv as one JSON line to argv[1]."""

import fcntl
import json
import os
import sys

record = dict(os.environ, __name__=__name__, argv=sys.argv)
with open(sys.argv[1], "a") as f:
    fcntl.flock(f, fcntl.LOCK_EX)
    f.write(json.dumps(record) + "\n")
