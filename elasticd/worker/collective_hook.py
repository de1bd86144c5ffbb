"""This rank's collectives where torch's Flight Recorder is off (TORCH_FR_BUFFER_SIZE=0, or
TORCH_NCCL_TRACE_BUFFER_SIZE=0 where the first is unset): a dispatcher hook of our own on the
c10d ops, dumped in the recorder's JSON form, so the daemon's verdict (daemon/collective_seq.py:
who never arrived, a desync) works the same.

The hook is a Python kernel at the AutogradCPU and AutogradCUDA keys of torch's c10d ops (the
ones every collective goes through, DDP's C++ reducer and FSDP included, whatever the backend),
which notes the op (its own sequence number per process group, the op, input shapes and dtypes)
and calls the op below autograd. A rank's latest KEPT collectives per group are kept with their
`Work`, asked whether it completed only when the daemon asks (nothing per op but the note). What
it does not see: point-to-point ops (send, recv: not collectives; the recorder skips them in the
verdict too), and collectives a backend issues without the dispatcher (none in torch 2.13's gloo
and NCCL paths). It costs a Python call per collective (bench/detection.py --overhead).
"""

from __future__ import annotations

import json
import os
import threading
from collections import deque

KEPT = 8  # a group's latest collectives kept
# c10d op -> (the name torch's recorder gives it, the index of its input tensor(s) in the op's
# arguments, the index of its process group)
OPS = {
    "allreduce_": ("all_reduce", 0, 1),
    "allreduce_coalesced_": ("all_reduce_coalesced", 0, 1),
    "allgather_": ("all_gather", 1, 2),
    "_allgather_base_": ("all_gather_into_tensor", 1, 2),
    "allgather_coalesced_": ("all_gather_coalesced", 1, 2),
    "allgather_into_tensor_coalesced_": ("all_gather_into_tensor_coalesced", 1, 2),
    "reduce_scatter_": ("reduce_scatter", 1, 2),
    "_reduce_scatter_base_": ("reduce_scatter_tensor", 1, 2),
    "reduce_scatter_tensor_coalesced_": ("reduce_scatter_tensor_coalesced", 1, 2),
    "broadcast_": ("broadcast", 0, 1),
    "reduce_": ("reduce", 0, 1),
    "gather_": ("gather", 1, 2),
    "scatter_": ("scatter", 1, 2),
    "alltoall_": ("all_to_all", 1, 2),
    "alltoall_base_": ("all_to_all_single", 1, 2),
    "barrier": ("barrier", 0, 1),
}
KEYS = ("AutogradCPU", "AutogradCUDA")

_lock = threading.Lock()
_groups: dict[str, dict] = {}  # group name -> {"desc", "seq", "ops": deque of entries}
_lib = None  # the torch.library.Library holding the kernels (kept: dropping it unregisters)


def reset() -> None:
    """Forget every group's collectives: the group re-formed in place (worker/reconfigure.py),
    and its replacement counts from 1, as torch's recorder does for the new generation; a
    survivor counting on would be judged "never arrived at seq 9" where the fault was at 3."""
    with _lock:
        _groups.clear()


def recorder_off(env: dict | None = None) -> bool:
    """Whether torch's Flight Recorder is off for this process, as torch reads its setting."""
    env = os.environ if env is None else env
    raw = env.get("TORCH_FR_BUFFER_SIZE", env.get("TORCH_NCCL_TRACE_BUFFER_SIZE"))
    if raw is None:
        return False
    try:
        return int(raw) <= 0
    except ValueError:
        return False


def install() -> bool:
    """The hook on every c10d op this torch has (once per process); False where it could not
    be put (an older torch: the stacks alone then judge a hang)."""
    global _lib
    if _lib is not None:
        return True
    try:
        import torch
        import torch.distributed  # registers the c10d ops

        lib = torch.library.Library("c10d", "IMPL")
        for name, where in OPS.items():
            if not hasattr(torch.ops.c10d, name):
                continue
            kernel = _kernel(torch, name, getattr(torch.ops.c10d, name).default, *where)
            for key in KEYS:
                lib.impl(name, kernel, key)
    except Exception:  # noqa: BLE001 - no hook: the dump says there are no collectives
        return False
    _lib = lib
    return True


def _kernel(torch, name: str, op, said: str, inputs: int, group: int):
    below = torch._C._AutoDispatchBelowAutograd

    def kernel(*args, **kwargs):
        entry = _note(said, args[inputs], args[group])
        with below():
            result = op(*args, **kwargs)
        work = result[-1] if isinstance(result, tuple) else result
        entry["work"] = work
        return result

    return kernel


def _note(op: str, tensors, pg) -> dict:
    """The op entered as its group's next collective."""
    flat = tensors if isinstance(tensors, (list, tuple)) else (tensors,)
    if flat and isinstance(flat[0], (list, tuple)):
        flat = [t for x in flat for t in x]
    try:
        name, desc = pg.group_name, pg.group_desc
    except Exception:  # noqa: BLE001 - a ScriptObject that does not say: one group for all
        name, desc = "0", ""
    entry = {
        "op": op,
        "sizes": [t.shape for t in flat],  # made lists only when dumped
        "dtypes": [t.dtype for t in flat],
        "work": None,
    }
    with _lock:
        g = _groups.get(name)
        if g is None:
            g = _groups[name] = {"desc": desc, "seq": 0, "ops": deque(maxlen=KEPT)}
        g["seq"] += 1
        entry["seq"] = g["seq"]
        g["ops"].append(entry)
    return entry


def _dtype(dtype) -> str:
    """A dtype as the recorder names it ("Float", "BFloat16")."""
    import torch

    return torch.empty(0, dtype=dtype).type().rsplit(".", 1)[-1].removesuffix("Tensor")


def dump(include_collectives: bool = True, only_active: bool = False) -> str:
    """The collectives kept, in the Flight Recorder's JSON form (what collective_seq.progress
    reads): entries, and each group's last enqueued and completed sequence numbers."""
    del include_collectives, only_active  # the recorder's arguments, for flight.dump
    entries, status = [], {}
    with _lock:
        groups = {n: (g["desc"], g["seq"], list(g["ops"])) for n, g in _groups.items()}
    for name, (desc, seq, ops) in groups.items():
        # ops before the oldest kept are taken as completed (their rank went on past them)
        completed = ops[0]["seq"] - 1 if ops else seq
        for e in ops:
            done = _completed(e["work"])
            # a Work that cannot say: done if the rank went on past it, else in progress
            if done or (done is None and e is not ops[-1]):
                completed = max(completed, e["seq"])
        status[name] = {"last_enqueued_collective": seq, "last_completed_collective": completed}
        for e in ops:
            entries.append(
                {
                    "pg_id": name,
                    "process_group": [name, desc],
                    "collective_seq_id": e["seq"],
                    "profiling_name": f"elasticd:{e['op']}",
                    "input_sizes": [list(s) for s in e["sizes"]],
                    "input_dtypes": [_dtype(d) for d in e["dtypes"]],
                    "is_p2p": False,
                }
            )
    return json.dumps({"version": "elasticd-hook", "entries": entries, "pg_status": status})


def _completed(work) -> bool | None:
    """Whether an op's Work completed (none yet: the kernel still runs, the op in progress); None
    where the Work cannot say (NCCL's on torch 2.11 unboxes to None: seen on an H200). Taking
    such an op as done made a rank waiting in it idle, and the hang's verdict lost its culprit."""
    if work is None:
        return False
    try:
        import torch

        return bool(torch._C._distributed_c10d.Work.unbox(work).is_completed())
    except Exception:  # noqa: BLE001 - a Work that does not say
        return None
