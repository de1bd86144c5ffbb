"""How a DataLoader worker ended, where torch's error does not say.

torch's DataLoader reports a worker that died in one of two ways. Its SIGCHLD handler names the
cause ("DataLoader worker (pid 812) is killed by signal: Killed."); but where the rank's own
check reaped the worker first (its queue's timeout, or a loader made off the main thread, which
has no handler), it raises "DataLoader worker (pid(s) 812) exited unexpectedly", nothing more:
the famous message people search for, and one the daemon's triage cannot tell apart from the
script's own bug (an outside kill -9 or the OOM killer in 2 of 10 chaos loader kills, restarted
as the rank's own failure). The exit status is still there: torch's frame holds the worker's
process object, reaped, with its `exitcode`. `note` adds it to the error as a note, in the
words of torch's other message, so that the traceback says what happened and the error file's
message (bootstrap.write_error_file) classifies as it would have (lifecycle/triage.py).
"""

from __future__ import annotations

import contextlib
import re
import signal
import types
from collections.abc import Callable
from multiprocessing.process import BaseProcess

GONE = re.compile(r"DataLoader worker \(pid\(s\) (?P<pids>[\d, ]+)\) exited unexpectedly$")


def note(exc: BaseException, sigchld: Callable | None = None) -> None:
    """Each "exited unexpectedly" in `exc`'s chain gains a note per worker it names whose exit
    status its traceback's frames still hold; and where the script's SIGCHLD handler (torch's
    DataLoader's, held by the bootstrap while it handles the failure) says a loader worker died,
    `exc` gains what it says. Never raises: it runs before the error file is written, and the
    frames hold the script's objects, whatever their attributes do."""
    with contextlib.suppress(Exception):
        _note(exc)
    if sigchld is not None:
        _ask(exc, sigchld)


def _ask(exc: BaseException, sigchld: Callable) -> None:
    """torch's handler checks its loaders' workers (waitid, without reaping them) and raises
    where one died: its words become a note (the error the script unwound with may be another,
    such as the resource sharer's ConnectionResetError, raised first)."""
    try:
        sigchld(signal.SIGCHLD, None)
    except Exception as e:  # noqa: BLE001 - what it raises is what it has to say
        words = str(e).strip()
        if "DataLoader worker" in words and words not in str(exc):
            with contextlib.suppress(Exception):
                exc.add_note(f"{words} (elasticd: torch's check of its loader's workers)")


def _note(exc: BaseException) -> None:
    seen: set[int] = set()
    e: BaseException | None = exc
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        found = GONE.search(str(e)) if isinstance(e, RuntimeError) else None
        if found:
            pids = {int(p) for p in found["pids"].replace(",", " ").split()}
            ended = {p.pid: p.exitcode for p in _processes(e.__traceback__) if p.pid in pids}
            for pid in sorted(ended):
                if ended[pid] is not None:
                    e.add_note(said(pid, ended[pid]))
        e = e.__cause__ or e.__context__


def said(pid: int, exitcode: int) -> str:
    """A worker's end as torch's SIGCHLD handler words it (a signal: its strsignal name)."""
    if exitcode < 0:
        try:
            name = signal.strsignal(-exitcode) or f"signal {-exitcode}"
        except ValueError:
            name = f"signal {-exitcode}"
        how = f"is killed by signal: {name}."
    else:
        how = f"exited with code {exitcode}."
    return f"DataLoader worker (pid {pid}) {how} (elasticd: its exit status)"


def _processes(tb: types.TracebackType | None):
    """The process objects the traceback's frames hold: in a local, a list or tuple in one, or a
    list or tuple attribute of a local's (torch's `failed_workers`, its iterator's `_workers`)."""
    while tb is not None:
        for value in list(tb.tb_frame.f_locals.values()):
            yield from _in(value)
            if isinstance(value, (types.ModuleType, type)):
                continue  # a module's frame holds its globals: the instances are what matter
            for attr in getattr(value, "__dict__", {}).values():
                if isinstance(attr, (list, tuple)):
                    yield from _in(attr)
        tb = tb.tb_next


def _in(value):
    if isinstance(value, BaseProcess):
        yield value
    elif isinstance(value, (list, tuple)):
        yield from (v for v in value if isinstance(v, BaseProcess))
