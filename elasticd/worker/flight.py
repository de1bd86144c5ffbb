"""This rank's collectives as torch's Flight Recorder keeps them, written for the daemon when it
asks: the evidence of a hang in a collective (who never arrived) or a desync (ranks in different
collectives at one sequence number), read before anything is killed (daemon/collective_seq.py).

The Flight Recorder is torch's own ring of each process group's latest collectives (sequence
number, op, input shapes and dtypes, the group), recorded in C++ by the backend itself (gloo and
NCCL alike, DDP's gradient all-reduce included), on by default (2000 entries, torch 2.13).
Where the user turned it off (TORCH_FR_BUFFER_SIZE=0), our own dispatcher hook on the c10d ops
keeps the same evidence instead (worker/collective_hook.py). elasticd changes nothing of the
recorder, so a job pays what it pays under torchrun (bench/detection.py --overhead measures the
recorder's cost and the hook's); nothing is written until the daemon asks.

The ask: a FIFO beside the dump (`ask_path`), made by the daemon. A daemon thread of the worker
blocks opening it for reading (no CPU, the GIL let go); the daemon opens it for writing without
blocking (nobody reading: no answer, no wait), which wakes the thread: it dumps the recorder's JSON
to the file (a rename, so a reader never sees half of one) and waits for the next ask. A main
thread blocked in a collective lets go of the GIL, so the answer comes while the rank hangs.
"""

from __future__ import annotations

import contextlib
import json
import os
import threading

from elasticd import names, safeio
from elasticd.worker import collective_hook

# torch's dumps, newest first: the CPU recorder (gloo) and, where built, NCCL's
_DUMPS = ("_dump_fr_trace_json", "_dump_nccl_trace_json")
_armed = False


def ask_path(path: str) -> str:
    """The FIFO through which the daemon asks for the dump at `path`."""
    return f"{path}.ask"


def arm() -> None:
    """Start answering the daemon's asks (once per process: after init_process_group returns),
    where it made a FIFO and this torch has a Flight Recorder."""
    global _armed
    path = os.environ.get(names.COLLECTIVES_FILE)
    if _armed or not path or not os.path.exists(ask_path(path)):
        return
    dumps = recorders()
    if collective_hook.recorder_off() or not dumps:  # torch's is off: ours (collective_hook.py)
        dumps = [collective_hook.dump] if collective_hook.install() else []
    if not dumps:
        return
    _armed = True
    threading.Thread(
        target=_serve, args=(path, dumps), name="elasticd-collectives", daemon=True
    ).start()


def recorders() -> list:
    """torch's Flight Recorder dumps this build has (an older torch: none)."""
    try:
        from torch._C import _distributed_c10d as c10d
    except ImportError:
        return []
    return [getattr(c10d, name) for name in _DUMPS if hasattr(c10d, name)]


def dump(recorders: list) -> str:
    """The recorders' JSON as torch writes it (written as it is: parsing and writing 2000
    entries again would double the answer's time), a JSON list of them where there are two."""
    found = []
    for record in recorders:
        try:
            raw = record(True, False)  # includeCollectives, onlyActive
        except Exception as e:  # noqa: BLE001 - a recorder off (NCCL's unused) says so
            raw = json.dumps({"errors": [f"{type(e).__name__}: {e}"[:200]]})
        found.append(raw.decode() if isinstance(raw, bytes) else raw)
    return found[0] if len(found) == 1 else "[" + ",".join(found) + "]"


def _serve(path: str, recorders: list) -> None:
    ask = ask_path(path)
    tmp = f"{path}.tmp"
    while True:
        try:
            with open(ask, "rb") as f:  # blocks until the daemon asks
                f.read()
        except OSError:
            return  # the attempt's directory is gone: nobody will ask again
        try:
            text = dump(recorders)
        except Exception as e:  # noqa: BLE001 - the daemon reads the reason instead
            text = json.dumps({"errors": [f"{type(e).__name__}: {e}"[:200]]})
        with contextlib.suppress(OSError):
            flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC
            with os.fdopen(os.open(tmp, flags, safeio.FILE_MODE), "w") as f:
                f.write(text)
            os.replace(tmp, path)
