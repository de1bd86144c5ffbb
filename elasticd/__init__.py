"""elasticd: a per-node daemon that keeps PyTorch distributed training alive. The top-level
modules are the shared contracts, imported by the daemon and by the workers alike, and the public
paths user scripts import (`elasticd.heartbeat`, `elasticd.sampler`, `elasticd.global_batch`); so
they import nothing of the packages below, but for the few reaches this docstring names.

This module is the public worker-side call `elasticd.heartbeat(step=None)`, which writes through
this process's heartbeat writer (worker/heartbeat.py's `writer()`): it reaches worker/heartbeat.py
only once a worker first beats under elasticd, and imports nothing at load, so `import elasticd`
costs nothing outside elasticd. The other reaches: global_batch.py and exact.py, worker
side, use the checkpoint library's collectives and RNG; `__main__` runs ops/cli.py's command.

Worker-side API (costs nothing when not running under elasticd; user scripts import these paths):
    elasticd.heartbeat(step=None)   report progress from a loop without an optimizer step
    elasticd.checkpoint             crash-safe checkpoints (DDP or sharded) and exact resume
    elasticd.sampler                resumable distributed sampler (whole global batches)
    elasticd.global_batch           a constant global batch whatever the world
    elasticd.ledger                 per-sample ledger: record(epoch, step, indices), resumed(step)
    elasticd.integrations.lightning / .transformers   a framework's whole state kept in memory
"""

from __future__ import annotations

import os

__version__ = "0.1.0"
__all__ = ["heartbeat", "__version__"]

_writer = None  # worker/heartbeat.py's writer, once this process first beats under elasticd
_armed = False


def heartbeat(step: int | None = None) -> None:
    """Tell the daemon this rank made progress. A no-op outside elasticd; a few microseconds inside.
    Calls from optimizer.step() happen automatically under elasticd; call this from loops that
    have no optimizer step, or to report the step number yourself."""
    global _writer, _armed
    if not _armed:
        _armed = True
        from elasticd import names

        if os.environ.get(names.HEARTBEAT_FILE):  # else worker/heartbeat.py is never imported
            from elasticd.worker import heartbeat as beats

            _writer = beats.writer()
    if _writer is not None:
        _writer.beat(step)
