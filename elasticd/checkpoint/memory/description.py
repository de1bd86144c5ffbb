"""The description of a state in a slot: JSON where every container other than a list is
tagged, so that decoding builds only plain data (nothing a file could use to run code) and
round-trips exactly what torch.load(weights_only=True) would give back. Its tensors are stored
apart, in the slot's bytes (see writer and reader).

`Description` makes it through elasticd.checkpoint.walk and `rebuild` decodes it. A sharded
model's or optimizer's DTensor is described as its local shard and its offsets in the global
tensor (`Chunk`).
"""

from __future__ import annotations

import base64
import itertools
import json
from collections import OrderedDict
from typing import Any, NamedTuple

import torch

from elasticd.checkpoint import sharded
from elasticd.checkpoint import walk as _walk

_T = "\x00"
# (mesh, placements, global shape) -> this rank's chunk offsets: the same at every refresh, and
# working them out (DTensor.__create_chunk_list__) was two thirds of a tiny model's refresh
_OFFSETS: dict = {}


class Chunk(NamedTuple):
    """A DTensor's local shard as a slot holds it: the shard, and where it sits in the global
    tensor (torch.distributed.checkpoint's chunk: offsets), so it can be placed again in a
    mesh of another size (elasticd.checkpoint.memory.shards)."""

    tensor: torch.Tensor
    shape: tuple[int, ...]  # the global tensor's
    offsets: tuple[int, ...]


DICT = json.dumps(_T + "d").encode()  # the tag of a dict, as the JSON of a description spells it


class Description:
    """How elasticd.checkpoint.walk encodes a state for a slot: JSON, its tensors appended to
    `tensors` as (tensor, location). Runs every refresh. `last_flat` and `flat` (last refresh's,
    this refresh's): descriptions of dicts of named tensors (a model's state_dict, an
    optimizer's per-parameter state), made once and then the same object for as long as the
    names are, see named_tensors."""

    cannot = "kept in the in-memory state"

    def __init__(self, last_flat: dict) -> None:
        self.tensors: list = []
        self.last_flat, self.flat = last_flat, {}

    def tensor(self, t: Any, at: Any) -> dict:
        self.tensors.append((t, at))
        return {_T + "t": len(self.tensors) - 1}

    def dtensor(self, t: Any, at: Any) -> dict:
        """A sharded model's or optimizer's DTensor: its local shard (a tensor of the slot) and
        its offsets in the global tensor. Partial placements (a pending reduction) and DTensors
        elsewhere in the state are refused by their key."""
        spec = t._spec
        key = (spec.mesh, spec.placements, t.shape)
        offsets = _OFFSETS.get(key)
        if offsets is None:
            if _walk.root(at) not in sharded.PARTS or any(p.is_partial() for p in t.placements):
                raise _walk.wrapped(type(t), at, self.cannot)
            (chunk,) = t.__create_chunk_list__()
            offsets = _OFFSETS[key] = list(chunk.offsets)
        elif _walk.root(at) not in sharded.PARTS:
            raise _walk.wrapped(type(t), at, self.cannot)
        # the local shard itself (what to_local() returns, without its autograd function)
        local = getattr(t, "_local_tensor", None)
        self.tensors.append((t.to_local() if local is None else local, at))
        return {_T + "T": [len(self.tensors) - 1, list(t.shape), offsets]}

    def named_tensors(self, obj: dict, at: Any) -> dict:
        """The description of a dict of str -> tensor without a Python step per entry: it
        depends only on the names and where its tensors start in `tensors`, so the object made
        for them last refresh is handed out again, and Writer._json knows it by identity
        (nothing to compare or encode)."""
        cls, tensors = type(obj), self.tensors
        key = (cls, tuple(obj), len(tensors))
        desc = self.last_flat.get(key)
        if desc is None:
            tag = _T + ("d" if cls is dict else "o")
            desc = {tag: [[k, {_T + "t": i}] for i, k in enumerate(key[1], len(tensors))]}
        self.flat[key] = desc
        tensors.extend(zip(obj.values(), zip(itertools.repeat(at), key[1])))
        return desc

    def mapping(self, ordered: bool, pairs: list) -> dict:
        return {_T + ("o" if ordered else "d"): pairs}

    def collection(self, is_tuple: bool, items: list) -> dict:
        return {_T + ("u" if is_tuple else "s"): items}

    def value(self, obj: Any) -> dict:
        if isinstance(obj, torch.Size):
            return {_T + "S": list(obj)}
        if isinstance(obj, torch.dtype):
            return {_T + "D": str(obj).removeprefix("torch.")}
        if isinstance(obj, torch.device):
            return {_T + "v": str(obj)}
        if isinstance(obj, complex):
            return {_T + "c": [obj.real, obj.imag]}
        return {_T + "b": base64.b64encode(obj).decode()}

    def keeps(self, obj: Any) -> bool:
        return False


def rebuild(obj: Any, tensors: list) -> Any:
    if isinstance(obj, list):
        return [rebuild(v, tensors) for v in obj]
    if not isinstance(obj, dict):
        return obj
    ((tag, v),) = obj.items()
    tag = tag[1:]
    if tag == "t":
        return tensors[v]
    if tag == "T":
        return Chunk(tensors[v[0]], tuple(v[1]), tuple(v[2]))
    if tag in ("d", "o"):
        pairs = ((rebuild(k, tensors), rebuild(x, tensors)) for k, x in v)
        return OrderedDict(pairs) if tag == "o" else dict(pairs)
    if tag == "u":
        return tuple(rebuild(x, tensors) for x in v)
    if tag == "s":
        return {rebuild(x, tensors) for x in v}
    if tag == "S":
        return torch.Size(v)
    if tag == "D":
        return getattr(torch, v)
    if tag == "v":
        return torch.device(v)
    if tag == "b":
        return base64.b64decode(v)
    if tag == "c":
        return complex(*v)
    raise ValueError(f"unknown entry {tag!r} in an in-memory state")
