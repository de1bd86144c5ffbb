"""torch's intra-op thread count in a warm spare, as a cold worker's import of torch would set it.

torch 2.13 (OpenMP + MKL build) fixes its thread count when it is imported: MKL reads
MKL_NUM_THREADS, else OMP_NUM_THREADS (the first of a comma list; 0 or a non-number counts as
unset), caps it at the machine's physical cores unless MKL_DYNAMIC is false, and without either
takes the physical cores this process may run on; torch then sizes its OpenMP pool from that.
Changing the environment after the import changes nothing, in this thread or in threads started
later. A spare imported torch before the script's first line, from the spares' environment, so a
script that sets OMP_NUM_THREADS before `import torch` (a common way to choose threads per rank)
would get the spare's count. So, until the script's first import of torch (or of another
preloaded package, whose import would have imported torch cold), the spare watches
`builtins.__import__`; at that import, if the thread variables differ from those torch was
imported with, it calls torch.set_num_threads with what the cold import would have chosen
(`cold_count`: MKL's rule above).
Inter-op threads do not depend on the environment. Measured: tests/e2e/test_torchrun_flags_run.py.
"""

from __future__ import annotations

import builtins
import contextlib
import os
import sys

VARIABLES = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "MKL_DYNAMIC")
_imported_with: dict[str, str | None] | None = None  # VARIABLES when the spare imported torch


def remember() -> None:
    """After the spare's imports: the thread variables torch was imported with, if it was."""
    global _imported_with
    if "torch" in sys.modules and _imported_with is None:
        _imported_with = {v: os.environ.get(v) for v in VARIABLES}


def _count(text: str | None) -> int | None:
    """A thread count as MKL reads one: the first item of a comma list, positive."""
    with contextlib.suppress(ValueError):
        n = int((text or "").split(",")[0])
        return n if n > 0 else None
    return None


def _physical_cores(cpus) -> int:
    """Distinct (package, core) pairs among `cpus`, by sysfs; the CPUs themselves without it."""
    cores = set()
    for cpu in cpus:
        try:
            top = f"/sys/devices/system/cpu/cpu{cpu}/topology/"
            with open(top + "physical_package_id") as p, open(top + "core_id") as c:
                cores.add((p.read().strip(), c.read().strip()))
        except OSError:
            return len(cpus)
    return len(cores) or len(cpus)


def cold_count(environ, mkl: bool) -> int:
    """The intra-op threads a fresh `import torch` chooses under `environ`."""
    asked = _count(environ.get("MKL_NUM_THREADS")) or _count(environ.get("OMP_NUM_THREADS"))
    if asked is None:
        return _physical_cores(os.sched_getaffinity(0))
    dynamic = (environ.get("MKL_DYNAMIC") or "true").strip().lower() not in ("false", "0", "no")
    if mkl and dynamic:
        online = [int(n[3:]) for n in os.listdir("/sys/devices/system/cpu") if n[3:].isdigit()]
        return min(asked, _physical_cores(online or os.sched_getaffinity(0)))
    return asked


def apply() -> None:
    """Set torch's threads as the cold import would have, where the environment changed."""
    torch = sys.modules.get("torch")
    if torch is None or _imported_with is None:
        return
    if all(os.environ.get(v) == _imported_with[v] for v in VARIABLES):
        return  # what torch was imported with: its count is already the cold one
    torch.set_num_threads(cold_count(os.environ, torch.backends.mkl.is_available()))


def follow(preloaded: list[str]) -> None:
    """Apply at the script's first import of torch or of a preloaded package; once."""
    if _imported_with is None:
        return
    tops = {"torch", *(name.partition(".")[0] for name in preloaded)}
    original = builtins.__import__
    done = False

    def watching_import(name, globals=None, locals=None, fromlist=(), level=0):
        nonlocal done
        if not done and level == 0 and name.partition(".")[0] in tops:
            done = True
            if builtins.__import__ is watching_import:
                builtins.__import__ = original
            apply()
        return original(name, globals, locals, fromlist, level)

    builtins.__import__ = watching_import


def _watcher_code():
    """The code of follow()'s import wrapper, whose frame bootstrap drops from tracebacks."""
    return next(
        c for c in follow.__code__.co_consts if getattr(c, "co_name", "") == "watching_import"
    )


WATCHER = _watcher_code()
