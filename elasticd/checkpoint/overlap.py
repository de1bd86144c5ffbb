"""Device-to-host copies of the in-memory state that overlap the next training step (CUDA).

A synchronous refresh of GPU tensors waits for the GPU to drain, then copies into pageable shared
memory at a fraction of the link's speed: the whole copy is training time lost, so the cadence
(cadence.Cadence) refreshes a big state rarely. Here the slot's mapping is pinned and the copy is
queued instead, and the training loop goes on at once:

- Tensors the optimizer owns (its parameters and its state) are copied on a side stream that
  starts where the step ended. Nothing writes them until the next optimizer step, and a global
  optimizer-step pre-hook makes that step wait on the GPU (not the host) for the copy. Forward
  and backward only read them, so the copy runs alongside.
- Every other device tensor (buffers, which forward may update; user tensors) is copied on the
  training stream itself, so it is ordered before whatever comes next.
- A thread marks the slot whole once the copies have landed and the next optimizer step has
  waited for them. A process killed before that leaves the slot invalid, and the other slot (the
  previous refresh) stands.

If the next refresh comes and no optimizer step went through the hook since (an optimizer step
replayed from a CUDA graph, or parameters updated by hand), the copy may have raced a write: it
is dropped (its copies still land before its slot is written again) and the Writer goes back to
synchronous refreshes for good.

It is on by default (CheckpointManager(memory_overlap=True)) for states with at least
writer.OVERLAP_MIN_BYTES on the GPU; smaller ones are cheaper to copy at once. memory.writer's
Writer imports this module at its first overlapped refresh only.

The cost charged to the cadence is what the refresh cost the step: the host's time, the training
stream's copies, and however long the optimizer step waited for the side stream, measured with
CUDA events once they have passed.
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import queue
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook


@dataclasses.dataclass(eq=False)
class Pending:
    """One refresh whose copies are queued on the GPU."""

    device: torch.device
    commit: Callable[[], None]  # writes the description and marks the slot whole
    tensors: list | None  # held until the copies land: their memory must not be reused before
    began: Any  # events: on the training stream where the refresh was queued,
    ordered: Any  # after its copies on the training stream,
    copied: Any  # and on the side stream after the optimizer-owned copies
    host: float  # seconds the refresh took on the host
    counted: bool  # its cost goes to the cadence (not when the refresh had to map its slot first)
    stepped: Any = None  # event on the training stream where the optimizer step began to wait
    fired: threading.Event = dataclasses.field(default_factory=threading.Event)
    done: threading.Event = dataclasses.field(default_factory=threading.Event)
    dropped: bool = False
    committed: bool = False


_waiting: list[Pending] = []  # refreshes the next optimizer step must wait for
_hook: list = []  # the registered hook's handle, once per process


@torch.compiler.disable
def _before_optimizer_step(optimizer, args, kwargs) -> None:
    """Every optimizer's step waits, on the GPU, for the side-stream copies queued before it."""
    if not _waiting or torch.cuda.is_current_stream_capturing():
        # in a CUDA graph capture an outside event cannot be waited on: those copies are dropped
        return
    while _waiting:
        p = _waiting.pop()
        stream = torch.cuda.current_stream(p.device)
        p.stepped = torch.cuda.Event(enable_timing=True)
        p.stepped.record(stream)
        stream.wait_event(p.copied)
        p.fired.set()


class Copier:
    """Queues a slot's device-to-host copies and commits the slot once they have landed."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.stream = torch.cuda.Stream(device)
        self.pending: dict[int, Pending] = {}  # slot index -> its refresh in flight
        self.finished: deque[Pending] = deque()  # committed, cost not yet measured
        self.error: BaseException | None = None
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(
            target=self._run, name="elasticd-memory-commit", daemon=True
        )
        self._thread.start()
        atexit.register(self.close)
        if not _hook:
            _hook.append(register_optimizer_step_pre_hook(_before_optimizer_step))

    def pin(self, address: int, size: int) -> bool:
        """Page-lock a slot's mapping so copies into it are asynchronous. Registered from this
        Copier's thread: a refused registration leaves its error code in that thread, which
        launches no kernel that could report it as its own."""
        try:
            return self._call(
                lambda: int(torch.cuda.cudart().cudaHostRegister(address, size, 0)) == 0
            )
        except Exception:  # noqa: BLE001 - no runtime bindings: synchronous copies do
            return False

    def unpin(self, address: int) -> None:
        with contextlib.suppress(Exception):
            self._call(lambda: torch.cuda.cudart().cudaHostUnregister(address))

    def copy(
        self,
        key: int,
        side: list,
        ordered: list,
        commit: Callable[[], None],
        started: float,
        counted: bool = True,
    ) -> None:
        """Queue (view, tensor) copies: `side` on the side stream (tensors only the optimizer
        writes), `ordered` on the training stream; the thread then calls `commit`."""
        main = torch.cuda.current_stream(self.device)
        began = torch.cuda.Event(enable_timing=True)
        began.record(main)
        if side:
            self.stream.wait_event(began)
            with torch.cuda.stream(self.stream):
                for view, t in side:
                    view.copy_(t.detach(), non_blocking=True)
        copied = torch.cuda.Event(enable_timing=True)
        copied.record(self.stream)
        for view, t in ordered:
            view.copy_(t.detach(), non_blocking=True)
        done = torch.cuda.Event(enable_timing=True)
        done.record(main)
        p = Pending(
            self.device,
            commit,
            [t for _, t in side + ordered],
            began,
            done,
            copied,
            time.perf_counter() - started,
            counted,
        )
        if side:
            _waiting.append(p)
        else:
            p.fired.set()
        self.pending[key] = p
        self._jobs.put(p)

    def settle(self, timeout: float | None = None) -> list[int]:
        """Drop the refreshes no optimizer step has waited for and wait for the others to be
        committed. Returns the slots of the dropped ones (left invalid)."""
        dropped = []
        for key, p in list(self.pending.items()):
            if not p.fired.is_set():
                with contextlib.suppress(ValueError):
                    _waiting.remove(p)
                p.dropped = True
                dropped.append(key)
                p.fired.set()
            p.done.wait(timeout)
        self.pending.clear()
        if self.error is not None:
            err, self.error = self.error, None
            raise OSError(
                f"an overlapped in-memory refresh failed: {type(err).__name__}: {err}"
            ) from err
        return dropped

    def unfired(self) -> bool:
        """A refresh in flight that no optimizer step has waited for yet."""
        return any(not p.fired.is_set() for p in self.pending.values())

    def costs(self) -> list[float]:
        """Seconds each committed refresh cost the step, for those whose events have passed."""
        out = []
        for _ in range(len(self.finished)):
            p = self.finished.popleft()
            if p.stepped is not None and not p.stepped.query():
                self.finished.append(p)  # the optimizer step that waited has not run yet
                continue
            ordered = p.began.elapsed_time(p.ordered)
            waited = max(0.0, p.stepped.elapsed_time(p.copied)) if p.stepped is not None else 0.0
            if p.counted:
                out.append(p.host + (ordered + waited) / 1e3)
        return out

    def close(self) -> None:
        """Drop what no step waited for, let the rest land, stop the thread (idempotent)."""
        if self._thread.is_alive():
            with contextlib.suppress(OSError):
                self.settle(timeout=10)  # bounded: a GPU that hangs must not hold the exit
            self._jobs.put(None)
            self._thread.join(timeout=10)
        atexit.unregister(self.close)

    def _call(self, fn: Callable[[], Any]) -> Any:
        if not self._thread.is_alive():  # closed (at exit): nothing runs kernels any more
            return fn()
        box: list = []
        ready = threading.Event()
        self._jobs.put((fn, box, ready))
        ready.wait()
        if isinstance(box[0], BaseException):
            raise box[0]
        return box[0]

    def _run(self) -> None:
        torch.cuda.set_device(
            self.device
        )  # this thread's runtime calls must not touch GPU 0's context
        while (job := self._jobs.get()) is not None:
            if isinstance(job, tuple):
                fn, box, ready = job
                try:
                    box.append(fn())
                except BaseException as e:  # noqa: BLE001 - handed to the caller
                    box.append(e)
                ready.set()
                continue
            p = job
            p.fired.wait()
            try:
                # a dropped refresh's copies still land: its slot is written next
                p.copied.synchronize()
                p.ordered.synchronize()
                if not p.dropped:
                    p.commit()
                    p.committed = True
                    self.finished.append(p)
            except BaseException as e:  # noqa: BLE001 - raised on the training thread at the next refresh
                self.error = e
            finally:
                p.tensors = None
                p.done.set()
