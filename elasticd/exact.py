"""Exact mode's two parts: each micro-batch's randomness keyed by (step, micro-batch index), and
the gradient summed over the micro-batches in index order whatever the world. With both, a step's
result depends on the weights, the optimizer state and the step alone, so a run whose world
changes (2 -> 1 -> 2 ranks) ends bit for bit where an uninterrupted one does.
`seed_micro_batch` seeds, `OrderedSum` sums, `deterministic` turns on deterministic kernels and
`check_model` refuses what exact mode cannot cover.

Why a chain and not an all-reduce: floating-point addition is not associative, and an all-reduce
adds the ranks' partial sums in an order that depends on the world (and on the algorithm). Here
the sum is always the left fold ((g0 + g1) + g2) + ... over the micro-batch indices, which is what
autograd computes when one rank accumulates every micro-batch into `.grad`. The ranks own
contiguous runs of indices (elasticd.batch_split.split_exact): rank 0 lets autograd fold its own
into `.grad`; every other rank keeps each micro-batch's gradients apart (`.grad` taken away after
each backward), receives the running sum from the rank before it, adds its own in order and
passes it on; the last rank with work sends the result to every rank (NCCL: broadcasts it).
Cost: the other ranks hold one gradient per micro-batch they computed, and the W-1 sends follow
one another (measured in bench/exact.py, docs/performance.md). On gloo every wait of the sum
is a receive (`OrderedSum._share`), which a dead or unwound peer ends at once.

Elementwise additions are exact in IEEE arithmetic (one rounding, the same on every machine), so
moving the running sum between ranks changes no bit. What is not covered, and why:
- gradients computed with a different intra-op thread count: full reductions (a loss's `mean`
  over more than ~32k elements) split their work by thread, so keep `torch.set_num_threads` the
  same in every world (GlobalBatch says so in one line when a resume finds it changed);
- buffers updated in forward (BatchNorm's running statistics) depend on which micro-batches a
  rank saw; DDP's broadcast of them at every forward would also hang ranks that run different
  numbers of forwards, so exact mode refuses DDP(broadcast_buffers=True) with buffers;
- sparse gradients (an Embedding with sparse=True): refused;
- CUDA kernels without a deterministic implementation: exact mode turns on
  `torch.use_deterministic_algorithms(True)`, under which torch raises naming the operation;
- randomness drawn in DataLoader worker processes (augmentation in a Dataset's __getitem__):
  it follows the workers' own streams; derive it from the sample's index instead.
"""

from __future__ import annotations

import hashlib
import os
import random

import torch
import torch.distributed as dist

from elasticd.checkpoint.rng import numpy_or_none

__all__ = ["OrderedSum", "deterministic", "micro_seed", "seed_micro_batch"]

ANSWER_TAG = 1  # a receiver's answer travels apart from the gradients (tag 0)


def micro_seed(seed: int, step: int, index: int) -> int:
    """The seed of micro-batch `index` of optimizer step `step`: a hash, so neighbouring steps
    and indices get unrelated streams (63 bits: what torch.manual_seed takes)."""
    digest = hashlib.blake2b(f"{seed}/{step}/{index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


def seed_micro_batch(seed: int, step: int, index: int) -> None:
    """Seed torch's (CPU and, where this process has started CUDA, every device's), numpy's
    global and Python's generators for one micro-batch, whichever rank computes it. (Not
    torch.manual_seed: before CUDA starts it queues a lazy seeding with a formatted stack trace,
    0.5 ms per call.)"""
    s = micro_seed(seed, step, index)
    random.seed(s)
    torch.default_generator.manual_seed(s)
    if torch.cuda.is_initialized():
        torch.cuda.manual_seed_all(s)
    np = numpy_or_none()
    if np is not None:
        np.random.seed(s % 2**32)


def deterministic() -> None:
    """Kernels that give the same bits on every run: torch's deterministic algorithms (an
    operation without one raises, naming it) and cuBLAS's fixed workspace, which must be set
    before cuBLAS starts (a later setting of the variable is ignored)."""
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True)


def check_model(model: torch.nn.Module) -> None:
    """Refuse what exact mode cannot make exact (module docstring)."""
    if isinstance(model, torch.nn.parallel.DistributedDataParallel) and (
        model.will_sync_module_buffers()
    ):
        raise ValueError(
            "exact mode: this DDP model broadcasts its buffers at every forward, and in exact "
            "mode the ranks run different numbers of forwards (that would hang); build it with "
            "DistributedDataParallel(..., broadcast_buffers=False) (buffers updated in forward, "
            "such as BatchNorm's running statistics, are not exact across world changes anyway)"
        )


class OrderedSum:
    """One rank's side of the in-order gradient sum over a step's micro-batches (module
    docstring). `working`: how many ranks (0..working-1) own micro-batches."""

    def __init__(self, params: list[torch.nn.Parameter], working: int) -> None:
        self.params = [p for p in params if p.requires_grad]
        self.working = working
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        self.world = dist.get_world_size() if dist.is_initialized() else 1
        self.kept: list[list[torch.Tensor | None]] = []
        # the tensors that travel: on the GPU with NCCL, else on the CPU (gloo)
        nccl = self.world > 1 and dist.get_backend() == "nccl"
        self.device = self.params[0].device if nccl and self.params else torch.device("cpu")
        # how the sum travels (_share): gloo's TCP pairs need the receivers' answers
        self._gloo = not nccl
        self.groups = _dtype_groups(self.params)

    def begin(self) -> None:
        """Before a step's first micro-batch: no gradient, so the first backward sets `.grad`
        (no addition), as it does in a world of one."""
        for p in self.params:
            p.grad = None
        self.kept.clear()

    def after_backward(self) -> None:
        """After each micro-batch's backward: rank 0 keeps folding into `.grad` (autograd adds in
        index order); the others take each micro-batch's gradients apart, to add after the
        running sum of the ranks before them."""
        if self.rank == 0:
            return
        grads = [p.grad for p in self.params]
        for g in grads:
            if g is not None and g.is_sparse:
                raise ValueError("exact mode cannot sum sparse gradients in order")
        self.kept.append(grads)
        for p in self.params:
            p.grad = None

    def finish(self) -> None:
        """After the step's last micro-batch: the chain, then every rank holds the sum."""
        if self.world == 1:
            return
        if self.rank == 0:
            total = [p.grad for p in self.params]
        elif self.rank < self.working:
            total = self._recv(self.rank - 1)
            for grads in self.kept:
                for k, g in enumerate(grads):
                    if g is None:
                        continue
                    total[k] = g if total[k] is None else total[k].add_(g)
        else:
            total = []
        self.kept.clear()
        sent = self._post(total, [self.rank + 1]) if self.rank < self.working - 1 else []
        if not self._gloo:  # NCCL: as a plain send
            _wait(sent)
        total = self._share(total, self.working - 1)
        if self._gloo:  # done by now: the shared sum was built on what they carried
            _wait(sent)
        for p, g in zip(self.params, total, strict=True):
            p.grad = None if g is None else g.to(p.device)

    # -- moving a list of gradients (some None) as a mask and one flat tensor per dtype ---------
    def _mask(self, grads) -> torch.Tensor:
        return torch.tensor([g is not None for g in grads], dtype=torch.uint8, device=self.device)

    def _flat(self, grads, mask: torch.Tensor) -> list[torch.Tensor]:
        present = mask.tolist()
        return [
            torch.cat([grads[k].reshape(-1).to(self.device) for k in ks if present[k]])
            for ks in self.groups.values()
            if any(present[k] for k in ks)
        ]

    def _empty(self, mask: torch.Tensor) -> list[torch.Tensor]:
        present = mask.tolist()
        return [
            torch.empty(
                sum(self.params[k].numel() for k in ks if present[k]),
                dtype=dtype,
                device=self.device,
            )
            for dtype, ks in self.groups.items()
            if any(present[k] for k in ks)
        ]

    def _unflat(self, flats: list[torch.Tensor], mask: torch.Tensor) -> list[torch.Tensor | None]:
        present = mask.tolist()
        out: list[torch.Tensor | None] = [None] * len(self.params)
        it = iter(flats)
        for ks in self.groups.values():
            if not any(present[k] for k in ks):
                continue
            flat, at = next(it), 0
            for k in ks:
                if present[k]:
                    n = self.params[k].numel()
                    out[k] = flat[at : at + n].view(self.params[k].shape)
                    at += n
        return out

    def _post(self, grads, dsts: list[int]) -> list:
        mask = self._mask(grads)
        tensors = [mask, *self._flat(grads, mask)]
        return [dist.isend(t, dst) for dst in dsts for t in tensors]

    def _recv(self, src: int, answer: bool = False) -> list[torch.Tensor | None]:
        mask = self._mask(self.params)  # shape only
        dist.recv(mask, src)
        flats = self._empty(mask)
        for flat in flats:
            dist.recv(flat, src)
        if answer:
            dist.send(torch.ones(1, dtype=torch.uint8), src, tag=ANSWER_TAG)
        return self._unflat(flats, mask)

    def _share(self, grads, src: int) -> list[torch.Tensor | None]:
        """The sum from the last working rank to every rank. On gloo it is sent to each, and
        each answers with a byte once it has everything; the last rank waits for the answers
        before its sends. A send whose data sits in the socket when its receiver stops reading
        (it unwound from another fault, or died) is not ended by the connection's end (gloo
        fails a failed pair's receives and the sends still waiting for the receiver, not one
        being written; torch 2.14.1; a broadcast's root is stuck the same way) and waited out
        the group's timeout, the survivor killed as stuck; a pending receive fails at once.
        (The chain's senders need no answer: their next wait is this receive.) NCCL:
        broadcast, as before."""
        if not self._gloo:
            return self._broadcast(grads, src)
        if self.rank != src:
            return self._recv(src, answer=True)
        others = [r for r in range(self.world) if r != src]
        sent = self._post(grads, others)
        _wait([dist.irecv(torch.zeros(1, dtype=torch.uint8), r, tag=ANSWER_TAG) for r in others])
        _wait(sent)
        return grads

    def _broadcast(self, grads, src: int) -> list[torch.Tensor | None]:
        mine = self.rank == src
        mask = self._mask(grads) if mine else self._mask(self.params)
        dist.broadcast(mask, src)
        flats = self._flat(grads, mask) if mine else self._empty(mask)
        for flat in flats:
            dist.broadcast(flat, src)
        return grads if mine else self._unflat(flats, mask)


def _wait(works: list) -> None:
    for work in works:
        work.wait()


def _dtype_groups(params) -> dict[torch.dtype, list[int]]:
    """The parameters' positions by dtype, in order of first appearance (the same on every
    rank): one flat tensor per dtype travels."""
    groups: dict[torch.dtype, list[int]] = {}
    for k, p in enumerate(params):
        groups.setdefault(p.dtype, []).append(k)
    return groups
