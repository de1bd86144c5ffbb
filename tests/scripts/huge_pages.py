"""Appends `rank THP_MEM_ALLOC_ENABLE kB` to argv[1]: how much of a 64 MB tensor this worker made
and filled lies on transparent huge pages (AnonHugePages of the mapping that holds it)."""

import fcntl
import os
import sys

import torch

block = torch.empty(16 * 2**20).fill_(1.0)  # 64 MB of float32
start = block.data_ptr()
huge = None
with open("/proc/self/smaps") as smaps:
    for line in smaps:
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):
            low, high = (int(x, 16) for x in head.split("-"))
            inside = low <= start < high
        elif inside and head == "AnonHugePages:":
            huge = int(line.split()[1])
            break
with open(sys.argv[1], "a") as f:
    fcntl.flock(f, fcntl.LOCK_EX)
    f.write(f"{os.environ['RANK']} {os.environ.get('THP_MEM_ALLOC_ENABLE')} {huge}\n")
