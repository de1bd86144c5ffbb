"""The host copy of a state that a disk checkpoint writes in the background (`Snapshot`): buffers
reused from the previous save where shapes match, pinned for GPU tensors."""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

import torch

from elasticd.checkpoint.walk import walk


class Snapshot:
    """Copies a state into host memory the training loop cannot change under the background
    writer. Host buffers are reused from the previous save when shapes match (it has finished by
    then: one save in flight), which makes the copy several times faster than fresh allocations
    (no page faults) and lets device tensors go through pinned memory without a sync each.

    Containers are rebuilt as plain dict/list/tuple/set; anything torch.load(weights_only=True)
    could not read back is refused (elasticd.checkpoint.walk), so no checkpoint is written that
    cannot be loaded."""

    cannot = "read back with torch.load(weights_only=True)"

    def __init__(self) -> None:
        self.buffers: list[torch.Tensor] = []  # in the order the walk meets the tensors
        self._old: list[torch.Tensor] = []
        self._device = False

    def take(self, state: Any) -> Any:
        self._old, self.buffers, self._device = self.buffers, [], False
        try:
            out = self.visit(state)
            if self._device and torch.cuda.is_available():
                torch.cuda.synchronize()  # the non_blocking copies have landed
            return out
        finally:
            self._old = []

    def visit(self, state: Any) -> Any:
        return walk(state, self)

    def tensor(self, t: torch.Tensor, at: Any) -> torch.Tensor:
        t = t.detach()
        if t.layout != torch.strided or t.is_quantized or t.is_nested:
            return t.to("cpu", copy=True)
        i = len(self.buffers)
        buf = self._old[i] if i < len(self._old) else None
        if buf is None or buf.shape != t.shape or buf.dtype != t.dtype:
            buf = torch.empty(t.shape, dtype=t.dtype, pin_memory=t.device.type == "cuda")
        self._device = self._device or t.device.type != "cpu"
        buf.copy_(t, non_blocking=t.device.type == "cuda")
        self.buffers.append(buf)
        return buf

    def named_tensors(self, obj: dict, at: Any) -> dict:
        return type(obj)((k, self.tensor(v, (at, k))) for k, v in obj.items())

    def mapping(self, ordered: bool, pairs: list) -> dict:
        return OrderedDict(pairs) if ordered else dict(pairs)

    def collection(self, is_tuple: bool, items: list) -> tuple | set:
        return tuple(items) if is_tuple else set(items)

    def value(self, obj: Any) -> Any:
        return obj

    def keeps(self, obj: Any) -> bool:
        """A class the user registered with torch.serialization.add_safe_globals."""
        try:
            safe = tuple(g for g in torch.serialization.get_safe_globals() if isinstance(g, type))
        except AttributeError:  # older torch
            safe = ()
        return isinstance(obj, safe)
