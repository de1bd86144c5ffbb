"""Sharded state: a model whose parameters are DTensors (FSDP2's fully_shard, tensor parallel).

capture() and restore() take its state through torch.distributed.checkpoint.state_dict
(get_state_dict / set_state_dict) with the sharded options: each rank holds its own shards, nothing
is gathered, and the optimizer's state is keyed by parameter name (FQN), which is what resharding at
another world size needs. HostCopy is the copy a disk save writes in the background
(elasticd.checkpoint.disk.shard_files): each rank's local shards in host buffers, still DTensors of
the same spec, so torch.distributed.checkpoint writes each rank's own shards.

`is_sharded` tells a sharded model. `apply_full` loads a full (DDP-era) state into a sharded
model: set_state_dict with full_state_dict=True, the optimizer's index keys matched by name.

A job that never imports torch.distributed.tensor (DDP) pays nothing here: the DTensor class is
looked up in sys.modules, not imported.
"""

from __future__ import annotations

import sys
import weakref
from collections.abc import Mapping
from typing import Any

import torch

from elasticd.checkpoint.disk.snapshot import Snapshot

# the parts of a captured state that hold a sharded model's DTensors (get_state_dict's model and
# optimizer); the rest of a state is the same on every rank. Disk (DCP) and memory alike split here
PARTS = ("model", "optimizer")

# model -> whether any of its parameters is a DTensor (fully_shard is applied before training)
_SHARDED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def dtensor_class() -> type | None:
    """torch's DTensor class once something imported it (FSDP2, tensor parallel), else None."""
    return getattr(sys.modules.get("torch.distributed.tensor"), "DTensor", None)


def is_sharded(model: torch.nn.Module | None) -> bool:
    cls = dtensor_class()
    if cls is None or model is None:
        return False
    known = _SHARDED.get(model)
    if known is None:
        known = _SHARDED[model] = any(isinstance(p, cls) for p in model.parameters())
    return known


def holds_shards(state: Any) -> bool:
    """Whether a captured state's model (or optimizer) part holds DTensors: a sharded save."""
    cls = dtensor_class()
    if cls is None or not isinstance(state, Mapping):
        return False
    model = state.get("model")
    if isinstance(model, Mapping) and any(isinstance(v, cls) for v in model.values()):
        return True
    optim = state.get("optimizer")
    moments = optim.get("state") if isinstance(optim, Mapping) else None
    return isinstance(moments, Mapping) and any(
        isinstance(t, cls) for s in moments.values() if isinstance(s, Mapping) for t in s.values()
    )


def optimizer_owned(msd: Mapping, osd: Mapping, optimizer) -> set[int]:
    """The ids of the local shards in a state_dicts() pair that only `optimizer`'s step writes,
    for the in-memory refresh to copy beside the next step (elasticd.checkpoint.overlap): its
    state's, and the model's that are its parameters (matched by storage: the model state holds
    detached aliases of the parameters, not the Parameters)."""

    def local(t: Any) -> Any:
        return getattr(t, "_local_tensor", t)

    params = {local(p).data_ptr() for g in optimizer.param_groups for p in g["params"] if p.numel()}
    owned = {
        id(local(v))
        for v in msd.values()
        if isinstance(v, torch.Tensor) and v.numel() and local(v).data_ptr() in params
    }
    moments = osd.get("state", {})
    owned.update(
        id(local(t))
        for s in moments.values()
        if isinstance(s, Mapping)
        for t in s.values()
        if isinstance(t, torch.Tensor)
    )
    return owned


def fresh_by_name(model: torch.nn.Module, optimizer, saved_state: Any) -> dict[str, Any] | None:
    """The parameters a fresh optimizer (no state yet) steps, by name, where those names are
    exactly a saved optimizer state's (`saved_state`: get_state_dict's "state", keyed by name) and
    every one is a DTensor; else None. A sharded resume from memory then gives such an optimizer
    its state itself (memory.shards.seed): torch's get_state_dict would make one by a step of
    zero gradients (a whole step's compute and memory) for set_state_dict to replace. Names that
    differ (a wrapper torch's names see through) leave the optimizer to torch."""
    cls = dtensor_class()
    if optimizer is None or optimizer.state or cls is None:
        return None
    if not isinstance(saved_state, Mapping) or not saved_state:
        return None
    stepped = {id(p) for g in optimizer.param_groups for p in g["params"] if p.requires_grad}
    named = {n: p for n, p in model.named_parameters() if id(p) in stepped}
    if len(named) != len(stepped) or set(saved_state) != set(named):
        return None
    return named if all(isinstance(p, cls) for p in named.values()) else None


def _options(strict: bool = True, full: bool = False):
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    # the defaults, spelled out: sharded (nothing gathered), left on the device (copied by the save)
    return StateDictOptions(full_state_dict=full, cpu_offload=False, strict=strict)


def state_dicts(model: torch.nn.Module, optimizer) -> tuple[dict, dict | None]:
    """(model state, optimizer state keyed by FQN or None): DTensors aliasing the live shards."""
    from torch.distributed.checkpoint import state_dict as sd

    if optimizer is None:
        return sd.get_model_state_dict(model, options=_options()), None
    return sd.get_state_dict(model, optimizer, options=_options())


def apply(
    model: torch.nn.Module, optimizer, msd: Mapping, osd: Mapping | None, strict: bool
) -> None:
    """Load a model (and optimizer) state of state_dicts()'s form back: set_state_dict."""
    from torch.distributed.checkpoint import state_dict as sd

    if optimizer is None:
        sd.set_model_state_dict(model, dict(msd), options=_options(strict))
        return
    sd.set_state_dict(
        model,
        optimizer,
        model_state_dict=dict(msd),
        optim_state_dict=dict(osd or {}),
        options=_options(strict),
    )


def apply_full(
    model: torch.nn.Module, optimizer, msd: Mapping, osd: Mapping | None, strict: bool
) -> None:
    """A full (unsharded) state, as a DDP job saved it, into a sharded model: set_state_dict with
    full_state_dict=True cuts each full tensor down to this rank's shards by its placements (every
    rank holds the whole state already: it read the file). torch.optim keys its state by the
    parameter's index; it is re-keyed by name in the live optimizer's parameter order, the order
    the DDP job's optimizer had when both were built from model.parameters()."""
    from torch.distributed.checkpoint import state_dict as sd
    from torch.nn.modules.utils import consume_prefix_in_state_dict_if_present

    msd = dict(msd)  # set_state_dict replaces the values of the dicts it is given
    consume_prefix_in_state_dict_if_present(msd, "module.")
    if optimizer is None:
        sd.set_model_state_dict(model, msd, options=_options(strict, full=True))
        return
    sd.set_state_dict(
        model,
        optimizer,
        model_state_dict=msd,
        optim_state_dict=_by_name(model, optimizer, osd or {}),
        options=_options(strict, full=True),
    )


def _by_name(model: torch.nn.Module, optimizer, osd: Mapping) -> dict:
    groups = osd.get("param_groups", [])
    if not all(isinstance(i, int) for g in groups for i in g.get("params", ())):
        return {"state": dict(osd.get("state", {})), "param_groups": list(groups)}  # by name
    names = {id(p): n for n, p in model.named_parameters()}
    order = [names.get(id(p), "") for g in optimizer.param_groups for p in g["params"]]
    saved = sum(len(g["params"]) for g in groups)
    if saved != len(order) or len(groups) != len(optimizer.param_groups) or "" in order:
        raise ValueError(
            f"the checkpoint's optimizer has {saved} parameters in {len(groups)} groups, the "
            f"sharded model's {len(order)} in {len(optimizer.param_groups)}: build the optimizer "
            "from model.parameters() as the unsharded job did, or restore without optimizer="
        )
    return {
        "state": {order[i]: v for i, v in osd.get("state", {}).items()},
        "param_groups": [dict(g, params=[order[i] for i in g["params"]]) for g in groups],
    }


class HostCopy(Snapshot):
    """Each rank's shards copied into host memory the training loop cannot change while the
    background writer runs (Snapshot's reused buffers, in the order met). A DTensor comes back
    as a DTensor of the same spec (mesh, placements, global shape) around the host copy of its
    local shard, built without from_local, which would move it back to the mesh's device; a plain
    tensor (the optimizer's step) as a plain host tensor; containers are rebuilt, other values
    kept (torch.distributed.checkpoint writes them; Snapshot's walk would refuse the DTensors)."""

    def visit(self, state: Any) -> Any:
        return self._copy(state, dtensor_class())

    def _copy(self, obj: Any, cls: type | None) -> Any:
        if cls is not None and isinstance(obj, cls):
            return cls(self.tensor(obj.to_local(), None), obj._spec, requires_grad=False)
        if isinstance(obj, torch.Tensor):
            return self.tensor(obj, None)
        if isinstance(obj, Mapping):
            return {k: self._copy(v, cls) for k, v in obj.items()}
        if isinstance(obj, (list, tuple)):
            return type(obj)(self._copy(v, cls) for v in obj)
        return obj
