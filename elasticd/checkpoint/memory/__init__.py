"""In-memory training state: the latest step's state in shared memory, so that a crashed worker's
replacement resumes from the step before the crash instead of the last disk checkpoint.

The daemon owns the directory (a private tmpfs directory under /dev/shm, one per daemon run,
passed to workers as ELASTICD_MEMORY_DIR, flocked while the daemon lives, removed when it exits);
workers of every attempt of that run write into it through CheckpointManager. It survives worker
crashes and a change of world size (the node's slots are named by local rank, not global rank),
not the node itself nor its daemon: a lost node's ranks are served by the nodes that still hold
the state (elasticd.checkpoint.memory.state), and disk checkpoints stay the fallback.

Each local rank L owns two preallocated slot files, `l<L>.0` and `l<L>.1`, memory-mapped and
written in turn, so a refresh is a memory copy of the tensors into the mapping plus a small
JSON description of everything else: no serializer, no allocation, no file created per step.
Local rank 0's slot holds the whole state (DDP state is the same on every rank, as for rank-0
disk checkpoints) with its RNG; the other local ranks' slots hold their own RNG state only. In a
sharded job (FSDP2, tensor parallel) every local rank's slot holds its own shards and the rest,
and over several nodes two replica slots `r<L>.0`/`r<L>.1` hold the next node's rank's (shards,
replica).

Every slot records the step, the world size, global rank and local world size that wrote it, and
its lineage: a number the ranks agree on at each load (CheckpointManager.load_latest), written
with every later step. Steps of one lineage come from one uninterrupted run, so (step, lineage)
names one state wherever it is held, and a node that missed a resume (cut off, then back) can
never offer a same-numbered step of an abandoned timeline as if it were the current one.

Slot layout: a 4 KiB header, the tensors' bytes (64-byte aligned), then the description.
A write first marks the slot invalid, copies, writes the description and its CRC, and marks
the slot valid last, so a worker killed mid-write leaves that slot invalid and the other one (the
previous step) intact. A step S therefore stays readable until S+2 is written, which needs a
collective step that every rank joins only after loading. Space is reserved with
posix_fallocate before the mapping is touched: a full tmpfs is an OSError, never a SIGBUS.

The modules, one concern each: directory (the daemon's /dev/shm directory: create, remove, reap
what a dead daemon left; torch-free, the only one the daemon imports, with slots), slots (the
slot files' format and headers, torch-free), cadence (how often to refresh, torch-free),
description (how a state's non-tensor part is written and read back), writer (the refresh) and
reader (a slot's state, in place or as bytes to send), choice (which step a resume takes: one
rule, each layout saying who holds a step); for sharded jobs, shards (the resume:
which step, from where, placed in the new mesh) and replica (the ring that keeps each rank's
slot on the next node).
"""
