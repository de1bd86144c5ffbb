"""capture() and restore(): everything an exact resume needs (model, optimizer, scheduler, scaler,
sampler, every rank's RNG, the user's values) as one weights_only-loadable dict, and back.

`REFRESH` is the one context an in-memory refresh sets for the user's `lambda: capture(...)`, so
capture() knows it is one; `audit.SEEN`, set before a state is kept, is where capture() leaves
the live model and optimizer for the replicas' audit (checkpoint/audit.py)."""

from __future__ import annotations

import contextvars
import dataclasses
import random
from collections import OrderedDict
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist

from elasticd.checkpoint import audit, ddp_buckets, sharded
from elasticd.checkpoint import rng as rng_state
from elasticd.checkpoint.collectives import (
    all_gather_bytes,
    cpu_group,
    dist_on,
    from_bytes,
    to_bytes,
)
from elasticd.checkpoint.collectives import rank as this_rank
from elasticd.checkpoint.disk import shard_files
from elasticd.checkpoint.disk.format import FORMAT


@dataclasses.dataclass
class Refresh:
    """How capture() runs inside an in-memory refresh: CheckpointManager calls the user's
    `lambda: capture(...)`, which takes no argument of ours, with REFRESH set to one of these.
    Outside a refresh (a disk checkpoint, a direct call) REFRESH is None."""

    whole: (
        bool  # local rank 0 keeps the node's whole state; the other local ranks only their own RNG
    )
    # when overlapping: filled with the ids of the tensors only the optimizer writes, its
    # parameters and state (elasticd.checkpoint.overlap)
    owned: set[int] | None = None
    # set by capture() for a sharded model: every local rank keeps its own shards and the rest
    sharded: bool = False


class InMemory:
    """What a sharded resume from memory puts where the model's (and optimizer's) state goes:
    restore() hands the live model to it (elasticd.checkpoint.memory.shards.Pieces)."""

    def restore(
        self, state: Mapping[str, Any], model, optimizer, strict: bool
    ) -> Mapping[str, Any] | None:
        """None once loaded; else the state to restore instead (the newest disk checkpoint's,
        taken when the resume from memory failed on some rank)."""
        raise NotImplementedError


REFRESH: contextvars.ContextVar[Refresh | None] = contextvars.ContextVar(
    "elasticd_refresh", default=None
)


def unwrap_model(model: torch.nn.Module) -> torch.nn.Module:
    """The module whose state_dict has no DDP `module.` or torch.compile `_orig_mod.` prefix.
    (torch.compile's wrapper holds the model as its submodule `_orig_mod`; looked up in
    `_modules`, as a missing attribute costs nn.Module an exception with a formatted message.)"""
    while True:
        if isinstance(model, (torch.nn.parallel.DistributedDataParallel, torch.nn.DataParallel)):
            model = model.module
        elif isinstance(inner := model._modules.get("_orig_mod"), torch.nn.Module):
            model = inner
        else:
            return model


def capture(
    model: torch.nn.Module | None = None,
    optimizer=None,
    scheduler=None,
    scaler=None,
    sampler=None,
    *,
    rng: bool = True,
    **user_state: Any,
) -> dict[str, Any]:
    """Everything an exact resume needs, as one weights_only-loadable dict.

    A collective under torch.distributed (every rank's RNG state is gathered, so that each rank
    gets its own back). Tensors are live views: CheckpointManager.save copies them at the call;
    copy them yourself if you keep the dict while training goes on. `user_state` is anything
    else (step, best metric, ...) and comes back from restore()."""
    state: dict[str, Any] = {"format": FORMAT}
    refresh = REFRESH.get()
    shards = model is not None and sharded.is_sharded(model)
    seen = audit.SEEN.get()
    if seen is not None and model is not None:  # the replicas' audit digests the live state
        seen.model, seen.optimizer, seen.sharded = unwrap_model(model), optimizer, shards
    if shards and refresh is not None:
        refresh.sharded = True  # every local rank keeps its own shards
    rng_only = refresh is not None and not refresh.whole and not shards
    owned = refresh.owned if refresh is not None else None
    if model is not None and not rng_only:
        if shards:
            # each rank its own shards, the optimizer's state keyed by FQN (nothing gathered)
            state["model"], osd = sharded.state_dicts(unwrap_model(model), optimizer)
            if osd is not None and owned is not None:
                owned.update(sharded.optimizer_owned(state["model"], osd, optimizer))
            if osd is not None:
                state["optimizer"], optimizer = osd, None
        else:
            # an in-memory refresh copies the parameters at once: no detached alias is needed
            state["model"] = unwrap_model(model).state_dict(keep_vars=refresh is not None)
            ddp_buckets.check(model)
            if (buckets := ddp_buckets.layout(model)) is not None:
                state["ddp_buckets"] = buckets  # the first step after a resume reduces alike
    for key, obj in (
        ("optimizer", optimizer),
        ("scheduler", scheduler),
        ("scaler", scaler),
        ("sampler", sampler),
    ):
        if obj is None or rng_only:
            continue
        if not callable(getattr(obj, "state_dict", None)):
            hint = "; use elasticd.sampler.ResumableDistributedSampler" if key == "sampler" else ""
            raise TypeError(f"{key}: a {type(obj).__qualname__} has no state_dict(){hint}")
        state[key] = obj.state_dict()
        if key == "optimizer" and owned is not None and isinstance(obj, torch.optim.Optimizer):
            owned.update(id(p) for g in obj.param_groups for p in g["params"])
            owned.update(
                id(t) for s in obj.state.values() for t in s.values() if isinstance(t, torch.Tensor)
            )
    if rng:
        mine = rng_state.get_state()
        world = dist.get_world_size() if dist_on() else 1
        if world > 1 and refresh is not None:
            ranks = [None] * world  # an in-memory snapshot: each rank keeps its own
            ranks[dist.get_rank()] = mine
        elif world > 1:
            ranks = [from_bytes(b) for b in all_gather_bytes(to_bytes(mine), cpu_group())]
        else:
            ranks = [mine]
        state["rng"] = {"world_size": len(ranks), "ranks": ranks}
    state["user"] = dict(user_state)
    return state


def restore(
    state: Mapping[str, Any],
    model: torch.nn.Module | None = None,
    optimizer=None,
    scheduler=None,
    scaler=None,
    sampler=None,
    *,
    strict: bool = True,
    rng: bool = True,
) -> dict[str, Any]:
    """Apply a capture()d state to the given objects; return its user state (step, ...).

    Each rank takes its own RNG state; a rank beyond the saved world size is seeded from a value
    derived from the checkpoint and its rank. RNG comes last, after everything that is loaded."""
    from torch.nn.modules.utils import consume_prefix_in_state_dict_if_present

    held = state.get("model")
    if model is not None and isinstance(held, InMemory):
        # shards from the in-memory slots, placed in this world's mesh
        _missing(state, "model", *(("optimizer",) if optimizer is not None else ()))
        instead = held.restore(state, unwrap_model(model), optimizer, strict)
        if instead is not None:
            return restore(
                instead, model, optimizer, scheduler, scaler, sampler, strict=strict, rng=rng
            )
        model = optimizer = None
    elif model is not None and (sharded.is_sharded(model) or isinstance(held, shard_files.OnDisk)):
        # through set_state_dict (a sharded checkpoint on disk is read first, resharded by DCP)
        _missing(state, "model", *(("optimizer",) if optimizer is not None else ()))
        shard_files.restore(state, unwrap_model(model), optimizer, strict)
        model = optimizer = None
    for key, obj in (
        ("model", model),
        ("optimizer", optimizer),
        ("scheduler", scheduler),
        ("scaler", scaler),
        ("sampler", sampler),
    ):
        if obj is None:
            continue
        _missing(state, key)
        if key == "model":
            sd = OrderedDict(state["model"])
            consume_prefix_in_state_dict_if_present(sd, "module.")  # a checkpoint saved from DDP
            unwrap_model(model).load_state_dict(sd, strict=strict)
            ddp_buckets.impose(model, state.get("ddp_buckets"))
            ddp_buckets.unwrapped(model, state)
        else:
            obj.load_state_dict(state[key])
    if rng and "rng" in state:
        saved, rank = state["rng"], this_rank()
        if rank < len(saved["ranks"]) and saved["ranks"][rank] is not None:
            rng_state.set_state(saved["ranks"][rank])
        else:
            seed = rng_state.derived_seed(saved, rank)
            random.seed(seed)
            torch.manual_seed(seed)
            np = rng_state.numpy_or_none()
            if np is not None:
                np.random.seed(seed % 2**32)
    return dict(state.get("user", {}))


def _missing(state: Mapping[str, Any], *keys: str) -> None:
    for key in keys:
        if key not in state:
            raise KeyError(
                f"the checkpoint has no {key!r} state (it has: {', '.join(sorted(state))})"
            )
