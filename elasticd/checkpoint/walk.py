"""What a training state may hold, and the one walk over it that both copies of a state use: the
disk snapshot (elasticd.checkpoint.disk.snapshot) and the in-memory description
(elasticd.checkpoint.memory.description).

Allowed: tensors, but not subclasses that wrap others (the DTensor of a sharded model: FSDP2,
tensor parallel), except, for the in-memory description, a DTensor of capture()'s model and
optimizer (its local shard; the disk takes those through elasticd.checkpoint.sharded); None,
bool, int, float, complex, str, bytes, bytearray; torch.Size, dtype and device; dicts
(OrderedDict kept), lists, tuples, sets; numpy scalars and other numbers, which become Python's
int or float; for the disk only, classes registered with torch.serialization.add_safe_globals.
Anything else is refused in the caller's thread, naming its key, so that no state is kept that
could not be read back. The walk runs at every in-memory refresh: the common types come first.
"""

from __future__ import annotations

import numbers
from collections import OrderedDict
from collections.abc import Mapping
from typing import Any, Protocol

import torch

_PLAIN = frozenset((bool, int, float, str))
_STR = {str}
_TENSORS = frozenset((torch.Tensor, torch.nn.Parameter))
_VALUES = (torch.Size, torch.dtype, torch.device, bytes, bytearray, complex)


class Encoding(Protocol):
    """What a walk builds. `at` is a location as a (parent, key) chain, see where()."""

    cannot: str  # completes "a <type> cannot be ..." in the refusal

    def tensor(self, t: torch.Tensor, at: Any) -> Any: ...

    def named_tensors(self, obj: dict, at: Any) -> Any:
        """A dict or OrderedDict of str -> tensor (a state_dict), in one call."""

    def mapping(self, ordered: bool, pairs: list) -> Any: ...

    def collection(self, is_tuple: bool, items: list) -> Any:
        """A tuple (is_tuple) or a set of walked items; lists stay lists."""

    def value(self, obj: Any) -> Any:
        """A torch.Size, dtype or device, bytes, bytearray or complex."""

    def keeps(self, obj: Any) -> bool:
        """Whether a value of no allowed type is kept as it is."""


def walk(obj: Any, enc: Encoding, at: Any = None) -> Any:
    """`obj` as `enc` builds it. Keys are walked at their mapping's location."""
    cls = type(obj)
    if obj is None or cls in _PLAIN:
        return obj
    if cls is dict or cls is OrderedDict:
        if obj and _STR == set(map(type, obj)) and _TENSORS.issuperset(map(type, obj.values())):
            return enc.named_tensors(obj, at)
        return enc.mapping(
            cls is OrderedDict, [[walk(k, enc, at), walk(v, enc, (at, k))] for k, v in obj.items()]
        )
    if isinstance(obj, torch.Tensor):
        if cls not in _TENSORS and hasattr(cls, "__tensor_flatten__") and not obj.is_nested:
            return _subclass(obj, enc, at)
        return enc.tensor(obj, at)
    if cls is list:
        return [walk(v, enc, (at, i)) for i, v in enumerate(obj)]
    if isinstance(obj, Mapping):
        return enc.mapping(
            isinstance(obj, OrderedDict),
            [[walk(k, enc, at), walk(v, enc, (at, k))] for k, v in obj.items()],
        )
    if isinstance(obj, _VALUES):
        return enc.value(obj if cls in _VALUES else _base_value(obj))
    if isinstance(obj, (list, tuple, set, frozenset)):
        items = [walk(v, enc, (at, i)) for i, v in enumerate(obj)]
        return items if isinstance(obj, list) else enc.collection(isinstance(obj, tuple), items)
    if isinstance(obj, str):
        return str.__str__(obj)
    if cls.__module__ == "numpy" and getattr(obj, "ndim", None) == 0 and hasattr(obj, "item"):
        return walk(obj.item(), enc, at)  # a numpy scalar (a metric, a count)
    if isinstance(
        obj, numbers.Integral
    ):  # int subclasses (enums) too: plain values, as torch.load gives them
        return int(obj)
    if isinstance(obj, numbers.Real):
        return float(obj)
    if enc.keeps(obj):
        return obj
    raise refused(cls, at, enc.cannot)


def _subclass(obj: Any, enc: Encoding, at: Any) -> Any:
    """A DTensor where the encoding takes them (the in-memory slot: its local shard), else the
    refusal of a wrapper subclass."""
    shard = getattr(enc, "dtensor", None)
    if shard is not None and type(obj).__name__ == "DTensor":
        return shard(obj, at)
    raise wrapped(type(obj), at, enc.cannot)


def _base_value(obj: Any) -> Any:
    """A bytes, bytearray or complex subclass's value as its base type."""
    for base in (bytes, bytearray, complex):
        if isinstance(obj, base):
            return base(obj)
    return obj


def refused(cls: type, at: Any, cannot: str) -> TypeError:
    return TypeError(
        f"{where(at)}: a {cls.__module__}.{cls.__qualname__} cannot be {cannot}; "
        "store tensors, numbers, strings, lists and dicts"
    )


def wrapped(cls: type, at: Any, cannot: str) -> TypeError:
    """A tensor subclass that wraps other tensors (torch's traceable wrapper subclasses) has no
    storage of its own: a DTensor, as FSDP2's fully_shard and tensor parallel make, holds only
    this rank's shard. Neither a copy into a plain tensor nor the in-memory slot's memory copy
    (its data_ptr() is 0) can take it."""
    return TypeError(
        f"{where(at)}: a {cls.__module__}.{cls.__qualname__} (a tensor subclass that wraps "
        f"others, as the DTensors of FSDP2's fully_shard and tensor parallel do) cannot be "
        f"{cannot}; elasticd takes sharded state only as capture()'s model and optimizer"
    )


def root(at: Any) -> Any:
    """The top-level key of a location: "model" for state['model']['w']."""
    key = None
    while at is not None:
        at, key = at
    return key


def keys(at: Any) -> list:
    """A (parent, key) chain's keys, outermost first."""
    out = []
    while at is not None:
        at, key = at
        out.append(key)
    return out[::-1]


def where(at: Any) -> str:
    """A (parent, key) chain as the Python expression that reaches it: state['model']['w']."""
    return "state" + "".join(f"[{k!r}]" for k in keys(at))
