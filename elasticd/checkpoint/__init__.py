"""The worker-side checkpoint library (`elasticd.checkpoint`, a public path), run inside the user's
training script: checkpoints that survive a crash at any instant, and an exact resume. Rank 0
writes a replicated (DDP) state, every rank its own shards of a sharded (FSDP2) one.

Adopting it in a DDP loop (the same code runs under elasticd, torchrun or as one process):

    mgr = CheckpointManager(every_steps=100)            # dir: arg, else $ELASTICD_CHECKPOINT_DIR
    state = mgr.load_latest()                           # rank 0 reads, every rank receives
    step = restore(state, model=model, optimizer=opt, sampler=sampler)["step"] if state else 0
    while step < total_steps:
        train_one_step(...); sampler.advance(batch_size); step += 1
        mgr.maybe_save(
            step, lambda: capture(model=model, optimizer=opt, sampler=sampler, step=step)
        )
        if mgr.should_stop():                           # SIGTERM (`elasticd stop`): saved above
            break
    mgr.close()                                         # waits for the save in flight

Every rank calls the same methods at the same steps: `capture()` gathers each rank's RNG state and
the save/stop decisions are agreed across ranks, so those calls are collectives.

The modules, one concern each, with the public API on top (this package's names): disk/ (the
directory's layout and manifest, torch-free: all the daemon reads; checkpoint files written,
verified, loaded and broadcast; their host copy; a sharded model's checkpoints in DCP's format)
and memory/ (the in-memory state: its slot files in /dev/shm, its cadence, refreshes and resume),
the two places a state is kept; collectives (bytes between ranks over gloo), walk (what a state
may hold), training_state and rng (capture/restore; RNG states), sharded (a sharded model's state
through torch.distributed.checkpoint's state_dict API), overlap (device copies overlapping the
next step), stop (SIGTERM and its watchdog), audit (the replicas' audit against silent data
corruption, before a state is kept) and manager (CheckpointManager, which drives them all).
The public names (`CheckpointManager`, `capture`, `restore`,
`load_latest`, ...) are each imported from their module at first use, so importing the package
or its format module loads no torch.

A worker-side library: it runs in the user's training processes and imports nothing of the daemon,
cluster, control or ops packages (tests/unit/project/test_layout.py checks it). The daemon reads the
torch-free parts: format (the latest checkpoint, for status), and memory/directory.py and
memory/slots.py (the in-memory directory it owns); tests/unit/project/test_layout.py checks they
load no torch.
"""

from __future__ import annotations

import importlib
from typing import Any

from elasticd.checkpoint.disk.format import (
    FORMAT,
    MANIFEST,
    Entry,
    candidates,
    latest_info,
    read_manifest,
)
from elasticd.checkpoint.disk.format import (
    MAX_MANIFEST as MAX_MANIFEST,
)  # public limits, outside __all__
from elasticd.checkpoint.disk.format import MAX_STEP as MAX_STEP

__all__ = [
    "FORMAT",
    "MANIFEST",
    "CheckpointError",
    "CheckpointManager",
    "Entry",
    "capture",
    "restore",
    "load_latest",
    "load_file",
    "candidates",
    "read_manifest",
    "latest_info",
    "install_sigterm_handler",
    "stop_requested",
    "request_stop",
    "unwrap_model",
]

_TORCH_NAMES = {  # name -> the module that defines it (imported at first use: they import torch)
    "CheckpointError": "manager",
    "CheckpointManager": "manager",
    "capture": "training_state",
    "restore": "training_state",
    "unwrap_model": "training_state",
    "load_latest": "disk.files",
    "load_file": "disk.files",
    "install_sigterm_handler": "stop",
    "stop_requested": "stop",
    "request_stop": "stop",
}


def __getattr__(name: str) -> Any:
    module = _TORCH_NAMES.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value  # once: later lookups find it directly
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_TORCH_NAMES))
