"""Checkpoints on disk: the directory's layout and manifest (format, torch-free: all the daemon
reads), one file per checkpoint written while hashing it and loaded only once it verifies (files),
its host copy written in the background (snapshot), and a sharded model's checkpoints in
torch.distributed.checkpoint's format (shard_files). CheckpointManager (checkpoint/manager.py)
drives them; the in-memory state (checkpoint/memory/) is the other place a state is kept.
"""
