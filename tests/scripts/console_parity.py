"""What a torchrun script writes where, for the console's parity with torchrun: a line on stdout
and a warning on stderr from every rank, then rank 1 raises after init_process_group, so torch's
excepthook prefixes each line of its traceback with `[rank1]: ` itself."""

import os
import sys
import warnings

import torch.distributed as dist

dist.init_process_group(backend="gloo")
rank = dist.get_rank()
print(f"out of rank {rank}", flush=True)
warnings.warn(f"careful, rank {rank}", stacklevel=1)
sys.stderr.flush()
dist.barrier()
if rank == 1:
    raise RuntimeError(f"injected on rank {rank} of {os.environ['WORLD_SIZE']}")
dist.barrier()
