"""Every generator's state of this process (Python's, numpy's, torch's, CUDA's) as tensors and
numbers that torch.load(weights_only=True) reads back, and setting it again. Captured at every
in-memory refresh, so Python's and numpy's generators are compared in place through ctypes and
read again only when they have changed. `derived_seed` seeds a rank whose state holds no RNG
of its own."""

from __future__ import annotations

import array
import ctypes
import dataclasses
import functools
import hashlib
import random
import sys
from collections.abc import Mapping
from typing import Any, ClassVar

import torch


@functools.cache
def numpy_or_none():
    """numpy, or None where it is not installed (looked up once: a failed import searches the
    whole path again each time)."""
    try:
        import numpy
    except ImportError:
        return None
    return numpy


def get_state() -> dict[str, Any]:
    """This process's RNG states as tensors, ints and floats (weights_only-loadable). CUDA's only
    where this process has initialised CUDA: reading it would otherwise create a CUDA context on
    every GPU (and fail in a process forked from one that has), and a process that never used
    CUDA has drawn nothing from it that a resume would need."""
    state: dict[str, Any] = {"python": _python_rng.state(), "torch": torch.get_rng_state()}
    np = numpy_or_none()
    if np is not None:
        state["numpy"] = _numpy_rng.state(np)
    if torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


@dataclasses.dataclass
class _PythonRng:
    """Python's global RNG state, read again only when it may have changed.

    random.getstate() builds 625 ints, and turning them into a tensor takes as long again:
    together a good part of a small training step's in-memory refresh. In CPython the
    generator's index and 624-word key sit in the object right after its header; those bytes are
    compared instead, and the last state stands while they and gauss_next are unchanged
    (anything that draws, seeds or sets the state rewrites them). The layout is checked against
    getstate() once per generator; where it differs (another interpreter or build), every call
    reads getstate()."""

    inst: Any = None
    raw: bytes | None = None
    value: dict[str, Any] | None = None
    usable: bool = False
    key: Any = (
        None  # the generator's index and key in place (ctypes array); read while `inst` lives
    )
    _AT: ClassVar[int] = 16  # after ob_refcnt and ob_type: int index; uint32_t state[624]
    _SIZE: ClassVar[int] = 4 + 624 * 4

    def _raw(self) -> bytes:
        return self.key.raw

    def state(self) -> dict[str, Any]:
        inst = getattr(
            random.getstate, "__self__", random
        )  # the generator behind random's functions
        if (
            inst is self.inst
            and self.usable
            and self.value is not None
            and getattr(inst, "gauss_next", None) == self.value["gauss_next"]
            and self._raw() == self.raw
        ):
            return self.value
        version, internal, gauss = inst.getstate()
        self.value = {
            "version": version,
            "state": torch.frombuffer(array.array("q", internal), dtype=torch.int64),
            "gauss_next": gauss,
        }
        if inst is not self.inst:
            self.inst = inst
            base = type(inst).__mro__[-2]  # the C type that holds the key
            self.usable = (
                sys.implementation.name == "cpython" and base.__basicsize__ >= self._AT + self._SIZE
            )
            if self.usable:
                self.key = (ctypes.c_char * self._SIZE).from_address(id(inst) + self._AT)
                self.usable = self._raw() == (
                    array.array("i", internal[-1:]).tobytes()
                    + array.array("I", internal[:-1]).tobytes()
                )
        self.raw = self._raw() if self.usable else None
        return self.value


_python_rng = (
    _PythonRng()
)  # pure memoisation: the last state read, while the generator is unchanged


@dataclasses.dataclass
class _NumpyRng:
    """numpy's global RNG state, read again only when it may have changed.

    np.random.get_state() copies the 624-word key element by element (about 0.1 ms, more than a
    small training step's whole in-memory refresh). The generator's state struct, reachable
    through numpy's public ctypes interface, is compared instead: if its bytes are unchanged and
    no Gaussian was cached (drawing the cached one leaves the struct alone), the last state
    stands. The struct's layout is checked against get_state() once per generator; where it
    differs this shortcut is off."""

    gen: Any = None
    raw: bytes | None = None
    value: dict[str, Any] | None = None
    usable: bool = False
    key: Any = None  # the state struct in place (ctypes array); read while `gen` lives

    def _raw(self) -> bytes:
        return self.key.raw

    def state(self, np) -> dict[str, Any]:
        get_gen = getattr(np.random, "get_bit_generator", None)
        gen = get_gen() if get_gen else None
        if (
            gen is not None
            and gen is self.gen
            and self.usable
            and self.value is not None
            and not self.value["has_gauss"]
            and self._raw() == self.raw
        ):
            return self.value
        name, keys, pos, has_gauss, cached = np.random.get_state(legacy=True)
        self.value = {
            "bit_generator": str(name),
            "keys": torch.from_numpy(keys.astype(np.int64)),
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "cached_gaussian": float(cached),
        }
        if gen is not self.gen:
            self.gen = gen
            self.usable = False
            try:
                if type(gen).__name__ == "MT19937":
                    self.key = (ctypes.c_char * (624 * 4 + 4)).from_address(
                        gen.ctypes.state_address
                    )
                    expected = keys.astype("<u4").tobytes() + int(pos).to_bytes(
                        4, "little", signed=True
                    )
                    self.usable = self._raw() == expected
            except (AttributeError, TypeError, ValueError):
                pass
        self.raw = self._raw() if self.usable else None
        return self.value


_numpy_rng = _NumpyRng()  # pure memoisation, as _python_rng


def set_state(state: Mapping[str, Any]) -> None:
    py = state["python"]
    key = py["state"]  # an int64 tensor; a list of ints in older checkpoints
    random.setstate(
        (
            py["version"],
            tuple(key.tolist() if isinstance(key, torch.Tensor) else key),
            py["gauss_next"],
        )
    )
    torch.set_rng_state(state["torch"])
    np = numpy_or_none()
    if np is not None and "numpy" in state:
        s = state["numpy"]
        np.random.set_state(
            (
                s["bit_generator"],
                s["keys"].numpy().astype(np.uint32),
                s["pos"],
                s["has_gauss"],
                s["cached_gaussian"],
            )
        )
    if "cuda" in state and torch.cuda.is_available():
        for i, s in enumerate(state["cuda"][: torch.cuda.device_count()]):
            torch.cuda.set_rng_state(s, i)


def derived_seed(rng: Mapping[str, Any], rank: int) -> int:
    """For a rank the state has no RNG state for (the world grew, or the rank's node was lost):
    reproducible, distinct per rank. The base is the state's own `seed` where it has one (an
    in-memory resume sets it from the step and the world size: memory/state.py: derived_base), else
    the first rank's torch state that a disk checkpoint holds."""
    seed = rng.get("seed")
    if isinstance(seed, int):
        base = seed.to_bytes(8, "little")
    else:
        known = [r for r in rng.get("ranks") or [] if r is not None]
        base = bytes(known[0]["torch"].tolist()) if known else b""
    return (
        int.from_bytes(hashlib.sha256(base + rank.to_bytes(8, "little")).digest()[:8], "little")
        >> 1
    )
