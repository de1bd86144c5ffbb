"""elasticd: a per-node daemon that keeps PyTorch distributed training alive.

Worker-side API (costs nothing when not running under elasticd):
    elasticd.heartbeat(step=None)   report progress from a loop without an optimizer step
    elasticd.checkpoint             atomic rank-0 checkpoints and exact resume
    elasticd.sampler                resumable distributed sampler (whole global batches)
    elasticd.ledger                 per-sample ledger: record(epoch, step, indices), resumed(step)
"""

from __future__ import annotations

import os

__version__ = "0.1.0"
__all__ = ["heartbeat", "__version__"]

_writer = None
_armed = False


def heartbeat(step: int | None = None) -> None:
    """Tell the daemon this rank made progress. A no-op outside elasticd; a few microseconds inside.

    Calls from optimizer.step() happen automatically under elasticd; call this from loops that
    have no optimizer step, or to report the step number yourself."""
    writer = _writer if _armed else _beat_writer()
    if writer is not None:
        writer.beat(step)


def _beat_writer():
    """This process's heartbeat file writer (elasticd.worker.health.Writer), opened at the first
    call; None outside elasticd. The bootstrap's hooks and the checkpoint library write through
    it."""
    global _writer, _armed
    if not _armed:
        _armed = True
        from elasticd import names

        path = os.environ.get(names.HEARTBEAT_FILE)
        if path:
            from elasticd.worker.health import Writer

            try:
                _writer = Writer(path)
            except OSError:
                _writer = None
    return _writer
