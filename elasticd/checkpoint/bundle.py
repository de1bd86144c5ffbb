"""Repro bundles, on the worker's side: written when the script dies of an exception, and read
back by the one process `elasticd replay` starts (elasticd/worker/replay.py).

Why here: only the checkpoint library knows a certified pre-step state (every state
CheckpointManager keeps passed the replicas' audit), the step a failure happened in (the last
`maybe_save` boundary, plus one) and how to put a state back (`restore`). A script that does not
use CheckpointManager gets no bundle: elasticd cannot know where its step begins or what its
state is, so a replay of it would be a rerun from the start, not of the failed step.

Writing (`arm`, `_on_failure`): the newest kept state this rank can read alone (its node's
in-memory slot, else the disk checkpoint on this node), this rank's RNG in it as a world of one's,
the ledger's samples of each step since, what ran and where. Not written, with one
`repro_bundle_skipped` line saying why: the ledger off (the step's samples would be unverified),
no state kept yet, a sharded (FSDP2) state (one rank's shards cannot re-run a step alone).

Replaying (`replaying`, `replay_state`, `boundary`): `load_latest()` returns the bundle's state
(loaded with weights_only=True), nothing is saved or refreshed, and the boundary after the failed
step ends the replay with the digest of the live parameters and optimizer state
(checkpoint/audit.py's `digest`). The sampler deals the failed rank's samples (names.REPLAY_AS).

The referee (daemon/referee.py): where two replicas disagree, each rank writes a bundle of the
disputed step (`on_sdc`, both digests in it), and the referee's two replays meet at the step's
optimizer step (`_referee_step`): one hands over its rank's gradients, the other mixes them in.
"""

from __future__ import annotations

import io
import json
import os
import platform
import sys
import time
import traceback
import weakref
from typing import Any

import structlog
import torch
import torch.optim.optimizer as optimizer_hooks

from elasticd import __version__, ledger, names, repro
from elasticd.checkpoint import audit
from elasticd.checkpoint.collectives import dist_on, rank, world
from elasticd.checkpoint.disk import files
from elasticd.checkpoint.disk.format import candidates
from elasticd.checkpoint.memory import reader, slots
from elasticd.worker import bootstrap

log = structlog.get_logger()

_manager: weakref.ref | None = None


class ReplayDone(SystemExit):
    """The failed step completed in the replay: its result is written; the script ends here."""


def replaying() -> bool:
    return bool(os.environ.get(names.REPLAY))


def arm(manager: Any) -> None:
    """The manager whose kept states a bundle takes (the newest made; a script has one)."""
    global _manager
    _manager = weakref.ref(manager)
    if _on_failure not in bootstrap.FAILURE_HOOKS and not replaying():
        bootstrap.FAILURE_HOOKS.append(_on_failure)


def _on_failure(exc: BaseException) -> None:
    mgr = _manager() if _manager is not None else None
    error_file = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if mgr is None or not error_file or not isinstance(exc, Exception):
        return
    path = os.path.join(os.path.dirname(error_file), f"rank{rank()}{repro.SUFFIX}")
    try:
        why = write(mgr, exc, path)
    except Exception as e:  # noqa: BLE001 - the failure is the script's; the bundle is extra
        why = f"writing it failed: {type(e).__name__}: {e}"
    if why:
        log.warning("repro_bundle_skipped", rank=rank(), reason=why, action="no replay")
    else:
        log.error("repro_bundle_written", rank=rank(), path=path, replay=f"elasticd replay {path}")


def on_sdc(exc: BaseException, step: int, digests: list[int]) -> None:
    """Two replicas disagreed at `step` (checkpoint/audit.py): this rank's bundle of that step,
    with every rank's digest, for the referee (daemon/referee.py) to replay the global step
    from; `rankR.sdc.repro` beside the error file. One `sdc_referee_bundle_skipped` line
    where none can be written."""
    mgr = _manager() if _manager is not None else None
    error_file = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if mgr is None or not error_file or replaying():
        return
    path = os.path.join(os.path.dirname(error_file), f"rank{rank()}{repro.SDC_SUFFIX}")
    try:
        why = write(mgr, exc, path, failed=step, extra={"kind": "sdc", "digests": digests})
    except Exception as e:  # noqa: BLE001 - the detection stands; the bundle is extra
        why = f"writing it failed: {type(e).__name__}: {e}"
    if why:
        log.warning("sdc_referee_bundle_skipped", rank=rank(), reason=why, action="undecided")


def write(
    mgr: Any,
    exc: BaseException,
    path: str,
    failed: int | None = None,
    extra: dict[str, Any] | None = None,
) -> str:
    """Write the bundle of `exc` at `path` (the failed step: the one after the last boundary,
    unless given); "" when written, else why not."""
    if not ledger.enabled():
        return "the ledger is off (elasticd run --ledger): the step's samples would be unverified"
    if failed is None:
        failed = (mgr._boundary if mgr._boundary is not None else (mgr._last_step or 0)) + 1
    got = certified(mgr, failed - 1)
    if isinstance(got, str):
        return got
    state, step, source = got
    own = ledger.own_file()  # None: nothing recorded yet (a script that deals its own batches)
    samples = {
        str(s): [i for indices, _ in rec for i in indices]
        for s, rec in (ledger.read(own).steps.items() if own is not None else ())
        if step < s < failed
    }
    buf = io.BytesIO()
    torch.save({"state": state}, buf)
    tb = "".join(traceback.format_exception(exc))
    header = {
        "kind": "exception",
        "torch": torch.__version__,
        "python": platform.python_version(),
        "entrypoint": bootstrap.RUNNING.get("entrypoint", sys.argv[0]),
        "args": bootstrap.RUNNING.get("args", sys.argv[1:]),
        "cwd": bootstrap.RUNNING.get("cwd", os.getcwd()),
        "env": repro.kept_env(os.environ),
        "rank": rank(),
        "world": world(),
        "certified_step": step,
        "certified_from": source,
        "audited": bool(mgr._audit.on and world() > 1 and mgr._audit.last_step is not None),
        "failed_step": failed,
        "samples": samples,
        "error": {"exception": f"{type(exc).__name__}: {exc}", "callstack": tb},
        **(extra or {}),
    }
    repro.write(path, header, buf.getbuffer())  # no copy of the state
    return ""


def certified(mgr: Any, upto: int) -> tuple[dict[str, Any], int, str] | str:
    """The newest state kept at or before step `upto` that this rank reads alone, as a world of
    one's (this rank's RNG its only), with its step and source; else why none."""
    best: tuple[dict[str, Any], int, str] | None = None
    mem = mgr._memory
    if mem.on and mem.directory:
        for h in slots.held(mem.directory, mem.local_rank):
            if h.sharded:
                return "a sharded (FSDP2) state: one rank's shards cannot re-run a step alone"
            if h.rank != rank() or h.world != world() or h.step > upto:
                continue
            try:
                got = reader.read(
                    mem.directory, h.step, world=world(), rank=rank(), local_rank=mem.local_rank
                )
            except ValueError:
                continue
            best = (got, h.step, "memory")
            break
    disk = [e for e in candidates(mgr.directory) if e.step <= upto] if mgr.directory else []
    if disk and (best is None or disk[0].step > best[1]):
        if disk[0].files is not None:
            return "a sharded (FSDP2) state: one rank's shards cannot re-run a step alone"
        found = files._first_good(mgr.directory, disk[:1])
        if found is not None:
            best = (found[1]["state"], found[2].step, "disk")
    if best is None:
        return "no state kept yet (the failure came before the first refresh or checkpoint)"
    state, step, source = best
    state = dict(state)
    rng = state.get("rng")
    if isinstance(rng, dict):
        mine = rng["ranks"][rank()] if rank() < len(rng["ranks"]) else None
        state["rng"] = {"world_size": 1, "ranks": [mine]}
    return state, step, source


# -- the replay's side ----------------------------------------------------------------------------


def _bundle() -> tuple[dict[str, Any], int]:
    return repro.read_header(os.environ[names.REPLAY])


def replay_state() -> tuple[dict[str, Any], Any]:
    """(state, Entry) of the bundle's certified state, for load_latest()."""
    from elasticd.checkpoint.disk.format import Entry

    path = os.environ[names.REPLAY]
    head, offset = _bundle()
    got = torch.load(io.BytesIO(repro.payload(path, offset)), weights_only=True)
    step = int(head["certified_step"])
    if os.environ.get(names.REFEREE_GRADS_OUT) or os.environ.get(names.REFEREE_GRADS_IN):
        optimizer_hooks.register_optimizer_step_pre_hook(_referee_step)
    return got["state"], Entry(file=f"replay:{path}", step=step, world_size=1)


def _referee_step(optimizer: Any, args: Any, kwargs: Any) -> None:
    """The referee's replays (daemon/referee.py) of a disputed step, before its optimizer step:
    the first leaves its rank's local gradients (at a world of one, DDP's all-reduce is the
    identity) and ends; the second sets each gradient to what DDP's default hook gives at a world
    of two, its own and the other's each divided by 2, then summed (two addends: the same bits
    in either order), so that the step's update and digest are the job's."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    out, into = os.environ.get(names.REFEREE_GRADS_OUT), os.environ.get(names.REFEREE_GRADS_IN)
    if out:
        torch.save([p.grad for p in params], f"{out}.tmp")
        os.replace(f"{out}.tmp", out)  # whole, for the other replay that waits for it
        result({"outcome": "gradients", "step": int(_bundle()[0]["failed_step"])})
        raise ReplayDone(0)
    if into:
        while not os.path.exists(into):  # the first replay, side by side (the referee's bound)
            time.sleep(0.01)
        other = torch.load(into, weights_only=True)
        if len(other) != len(params):
            raise RuntimeError("the referee's two replays hold different parameters")
        for p, g in zip(params, other, strict=True):
            if p.grad is not None and g is not None:
                p.grad = p.grad.div(2) + g.div(2)
            elif p.grad is not None or g is not None:
                raise RuntimeError("the referee's two replays' gradients differ in which exist")


def boundary(step: int, state: Any) -> None:
    """At maybe_save(step) in a replay: past the failed step, leave the result and end."""
    head, _ = _bundle()
    if step < int(head["failed_step"]):
        return
    value = None
    if callable(state):
        seen = audit.Seen()
        token = audit.SEEN.set(seen)
        try:
            state()
        finally:
            audit.SEEN.reset(token)
        if seen.model is not None and not seen.sharded:
            value = audit.digest(audit.tensors(seen.model, seen.optimizer))
    result({"outcome": "completed", "step": step, "digest": value})
    raise ReplayDone(0)


def result(data: dict[str, Any]) -> None:
    """The replay's result, for the CLI (names.REPLAY_RESULT)."""
    path = os.environ.get(names.REPLAY_RESULT)
    if path:
        with open(path, "w") as f:
            json.dump({**data, "elasticd": __version__, "distributed": dist_on()}, f)
