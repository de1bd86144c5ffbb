"""DDP's gradient buckets across a resume: the first step after it reduces as the run it continues.

DDP reduces a new model's first backward in one bucket holding the parameters in definition
order; from the second on, in buckets of the order the gradients became ready (rebuilt once).
Where an element sits in a bucket decides, through the all-reduce's ring segments, the order in
which its values from the ranks are summed: at 2 ranks a + b is b + a, at 3 or more (a + b) + c
is not a + (b + c). A resumed process's first step would reduce in the first-iteration layout
where the run it continues used the rebuilt one: a few gradient elements differ in their last
bit, and the run is no longer bit-identical to one that never failed.

So capture() records the rebuilt layout (`layout`), and restore(), given a DDP model that has not
rebuilt yet, runs one reduction of zeros with its gradient hooks fired in that order (`impose`): DDP
rebuilds from that order at the next forward, the buckets the run had. Every rank does it alike (it
is a collective), decided by what every rank holds alike: the state and the model's DDP settings.
Where it cannot be done (static_graph, DDP's mixed precision, restore() given the model without its
DDP wrapper), one warning line says so: at the job's first capture for a setting (`check`), at the
resume for the rest (`unwrapped`, for the missing wrapper); only from 3 ranks on, as below that the
order of the sum cannot show.
"""

from __future__ import annotations

import weakref
from collections.abc import Mapping
from typing import Any

import structlog
import torch
import torch.distributed as dist

log = structlog.get_logger()

# a model's rebuilt layout, read once (it never changes after the rebuild)
_KNOWN: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
# the ready order between a model's first backward and its rebuild (read again until rebuilt)
_PENDING: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
# models already checked for settings no resume can make exact (check, unwrapped)
_CHECKED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
# the layout a resume imposed on a model, checked against what DDP rebuilt at its first capture
_IMPOSED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def ddp_of(model: Any):
    """The DistributedDataParallel module a model is (through torch.compile's wrapper), or None."""
    ddp_type = torch.nn.parallel.DistributedDataParallel
    while isinstance(model, torch.nn.Module):
        if isinstance(model, ddp_type):
            return model
        model = model._modules.get("_orig_mod")
    return None


def layout(model: Any) -> dict[str, list] | None:
    """How DDP buckets this model's gradients from its second step on: {"buckets": lists of
    parameter indices} once rebuilt, {"order": the order the gradients became ready} between
    the first backward and the rebuild at the next forward; None before (or for another model)."""
    ddp = ddp_of(model)
    if ddp is None or ddp in _KNOWN:
        return _KNOWN.get(ddp) if ddp is not None else None
    rebuilt = getattr(ddp, "_has_rebuilt_buckets", False)
    if not rebuilt and ddp in _PENDING:
        return _PENDING[ddp]  # read once: reading it clears DDP's record
    logger = getattr(ddp, "logger", None)
    if logger is None:
        return None
    try:
        logger.set_runtime_stats_and_log()  # DDP's own log of them lags a step behind: now
        data = ddp._get_ddp_logging_data()
    except Exception:  # noqa: BLE001 - another torch: no layout, impose() never acts
        return None
    if rebuilt:
        buckets = _parse(data.get("rebuilt_per_bucket_param_indices"), ",", " ")
        if buckets is None:
            return None
        _KNOWN[ddp] = found = {"buckets": buckets}
        imposed = _IMPOSED.pop(ddp, None)
        if imposed is not None and "buckets" in imposed and imposed != found:
            log.warning(
                "ddp_buckets_differ",
                detail="DDP rebuilt other gradient buckets than the run this one resumed had: "
                "the steps since the resume may differ from it in their last bits",
            )
        return found
    order = _parse(data.get("prev_iteration_grad_ready_order_indices"), ";", ",")
    if order is None:
        return None  # no backward yet: a resume starts as this run did
    _PENDING[ddp] = {"order": order[0][: len(getattr(ddp, "_module_parameters", ()))]}
    return _PENDING[ddp]


def _parse(text: Any, outer: str, inner: str) -> list[list[int]] | None:
    """DDP's logging form of index lists as lists."""
    if not isinstance(text, str) or not text.strip():
        return None
    try:
        return [[int(i) for i in part.split(inner) if i.strip()] for part in text.split(outer)]
    except ValueError:
        return None


def check(model: Any) -> None:
    """Say once, at the first capture, when this DDP model's resumes cannot be bit-identical: at
    3 ranks or more, where the order of a sum over the ranks shows in its bits."""
    ddp = ddp_of(model)
    if ddp is None or ddp in _CHECKED:
        return
    _CHECKED[ddp] = True
    why = _unfit(ddp)
    if why and _world(ddp) >= 3:
        log.warning(
            "resume_not_bit_identical",
            reason=why,
            detail=f"{NOT_EXACT}; elasticd restores the buckets of DDP's other settings",
        )


def impose(model: Any, saved: Any) -> bool:
    """Make DDP rebuild the buckets `saved` (layout()'s form) at the model's next forward, when it
    has not rebuilt its own yet. A collective when it acts. True when it did."""
    ddp = ddp_of(model)
    if ddp is None or saved is None or getattr(ddp, "_has_rebuilt_buckets", True):
        return False  # not DDP, nothing recorded, or its buckets are settled already
    order, why = _order(ddp, saved)
    if why:
        if _world(ddp) >= 3:
            log.warning("resume_not_bit_identical", reason=why, detail=NOT_EXACT)
        return False
    params = ddp._module_parameters
    held = [p.grad for p in params]
    with torch.enable_grad():
        for p in params:
            p.grad = None
        ddp.reducer.prepare_for_backward([])
        for i in order:  # each hook fires alone, in the saved order; full buckets reduce zeros
            torch.autograd.backward(params[i], torch.zeros_like(params[i]))
    for p, grad in zip(params, held):
        p.grad = grad
    _IMPOSED[ddp] = saved
    return True


def unwrapped(model: Any, state: Any) -> None:
    """restore() given a model without the DDP wrapper its checkpoint was taken with: say so
    (once), as its first step after the resume reduces in the first-iteration buckets."""
    if model is None or ddp_of(model) is not None or not isinstance(state, Mapping):
        return
    if "ddp_buckets" in state and not _CHECKED.get(model) and _world(None) >= 3:
        _CHECKED[model] = True
        log.warning(
            "resume_not_bit_identical",
            reason="restore() was given the model without its DistributedDataParallel wrapper",
            detail=f"{NOT_EXACT}; wrap it first and give restore() the DDP model",
        )


NOT_EXACT = (
    "the first step after a resume may reduce gradients in another order than the run it "
    "continues, and so differ from it in the last bits"
)


def _world(ddp: Any) -> int:
    group = getattr(ddp, "process_group", None)
    try:
        return dist.get_world_size(group) if dist.is_initialized() else 1
    except Exception:  # noqa: BLE001 - a group this rank is not in
        return 1


def _unfit(ddp: Any) -> str:
    """Why no resume of this DDP model can restore its buckets, or ''."""
    if getattr(ddp, "static_graph", False):
        return "DDP(static_graph=True)"
    if getattr(ddp, "mixed_precision", None) is not None or getattr(
        ddp, "_use_python_reducer", False
    ):
        return "DDP's mixed_precision or its Python reducer"
    reducer = getattr(ddp, "reducer", None)
    if getattr(ddp, "_module_parameters", None) is None or not hasattr(
        reducer, "prepare_for_backward"
    ):
        return "this torch's DDP has no _module_parameters or reducer.prepare_for_backward"
    return ""


def _order(ddp: Any, saved: Any) -> tuple[list[int], str]:
    """The order to fire the gradient hooks in, or why the saved layout cannot be imposed."""
    why = _unfit(ddp)
    if why:
        return [], why
    if getattr(ddp, "find_unused_parameters", False):
        return [], "find_unused_parameters=True, where the run it continues had rebuilt buckets"
    if not ddp.require_backward_grad_sync:
        return [], "restore() was called inside no_sync()"
    lists = saved.get("buckets", [saved.get("order")]) if isinstance(saved, dict) else None
    ok = isinstance(lists, list) and all(
        isinstance(b, list) and all(type(i) is int for i in b) for b in lists
    )
    order = [i for b in lists for i in b] if ok else []
    if sorted(order) != list(range(len(ddp._module_parameters))):
        return [], "the checkpoint's buckets are for another model"
    return order, ""
