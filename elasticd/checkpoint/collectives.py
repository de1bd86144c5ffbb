"""The checkpoint library's own small collectives: raw bytes and ints between ranks as uint8 and
int64 tensors over gloo (no pickle crosses the network), and this process's rank and world size
whether or not torch.distributed is up. Bytes are broadcast, gathered or sent to one rank over
a gloo group (`cpu_group`: the default group where it has gloo, else one made once, for NCCL
jobs)."""

from __future__ import annotations

import ctypes
import io
import os
from typing import Any

import torch
import torch.distributed as dist


def dist_on() -> bool:
    return dist.is_available() and dist.is_initialized()


def rank() -> int:
    """torch.distributed's rank when initialized, else torchrun's RANK, else 0."""
    return dist.get_rank() if dist_on() else int(os.environ.get("RANK", 0))


def world() -> int:
    return dist.get_world_size() if dist_on() else int(os.environ.get("WORLD_SIZE", 1))


# Pure memoisation: (default group object, gloo group) of a non-gloo job, made once per default
# group.
_cpu_groups: list[tuple[Any, Any]] = []


def cpu_group():
    """A group that takes CPU tensors: the default one when it has gloo, else a gloo group made
    once (a collective: every rank gets here at the same point, in load/capture/agreement).
    Keeping our small collectives on CPU avoids CUDA syncs and device placement in NCCL jobs."""
    backend = str(dist.get_backend())
    if backend == "gloo" or "cpu:gloo" in backend:
        return None
    default = dist.group.WORLD
    for owner, group in _cpu_groups:
        if owner is default:
            return group
    group = dist.new_group(backend="gloo")
    _cpu_groups[:] = [(default, group)]
    return group


def _tensor_bytes(t: torch.Tensor) -> bytes:
    """Bytes of a contiguous CPU uint8 tensor, without needing numpy."""
    return ctypes.string_at(t.data_ptr(), t.numel()) if t.numel() else b""


def broadcast_bytes(
    data: bytes | bytearray | torch.Tensor | None, src: int, group
) -> bytes | bytearray | torch.Tensor:
    """Raw bytes (or a uint8 tensor of them) from `src` to every rank, as uint8 tensors (no pickle
    involved). The sender gets its `data` back, the others bytes."""
    mine = dist.get_rank() == src
    n = torch.tensor([len(data) if mine and data is not None else 0], dtype=torch.int64)
    dist.broadcast(n, src, group=group)
    size = int(n.item())
    if size == 0:
        return b""
    if mine:
        assert data is not None
        if isinstance(data, torch.Tensor):
            buf = data
        else:
            buf = torch.frombuffer(
                data if isinstance(data, bytearray) else bytearray(data), dtype=torch.uint8
            )
        dist.broadcast(buf, src, group=group)
        return data
    buf = torch.empty(size, dtype=torch.uint8)
    dist.broadcast(buf, src, group=group)
    return _tensor_bytes(buf)


def send_bytes(data: bytes | bytearray, dst: int, group) -> None:
    """Raw bytes to one rank (its recv_bytes), as uint8 tensors: the length, then the bytes."""
    dist.send(torch.tensor([len(data)], dtype=torch.int64), dst, group=group)
    if data:
        dist.send(
            torch.frombuffer(
                data if isinstance(data, bytearray) else bytearray(data), dtype=torch.uint8
            ),
            dst,
            group=group,
        )


def recv_bytes(src: int, group) -> bytearray:
    """What send_bytes on rank `src` sent, received straight into a bytearray."""
    n = torch.zeros(1, dtype=torch.int64)
    dist.recv(n, src, group=group)
    buf = bytearray(int(n.item()))
    if buf:
        dist.recv(torch.frombuffer(buf, dtype=torch.uint8), src, group=group)
    return buf


def all_gather_bytes(data: bytes, group) -> list[bytes]:
    ranks = dist.get_world_size()
    n = torch.tensor([len(data)], dtype=torch.int64)
    sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(ranks)]
    dist.all_gather(sizes, n, group=group)
    longest = max(int(s.item()) for s in sizes)
    buf = torch.zeros(max(longest, 1), dtype=torch.uint8)
    if data:
        buf[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    out = [torch.empty_like(buf) for _ in range(ranks)]
    dist.all_gather(out, buf, group=group)
    return [_tensor_bytes(o[: int(s.item())]) for o, s in zip(out, sizes, strict=True)]


def all_ok(ok: bool, multi: bool = True) -> bool:
    """Whether every rank is ok: a MIN all_reduce over cpu_group() when `multi`."""
    if not multi:
        return ok
    t = torch.tensor([int(ok)], dtype=torch.int64)
    dist.all_reduce(t, op=dist.ReduceOp.MIN, group=cpu_group())
    return bool(t.item())


def all_gather_ints(value: int, group) -> list[int]:
    out = [torch.zeros(1, dtype=torch.int64) for _ in range(dist.get_world_size())]
    dist.all_gather(out, torch.tensor([value], dtype=torch.int64), group=group)
    return [int(t.item()) for t in out]


def to_bytes(obj: Any) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def from_bytes(data: bytes | bytearray) -> Any:
    """The only way bytes become objects here: weights_only, so no code can run."""
    return torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
