"""A worker's command line as ps, pgrep -f, py-spy and /proc/PID/cmdline show it: the one torchrun
would have started, `python -u train.py ARGS` (or `python -u -m module ARGS`).

Workers start as `python -P -m elasticd.worker.bootstrap` (cold, or a fresh warm spare) or are
forked from `python -P -m elasticd.worker.forkserver`, yet operators find and signal training
processes by their script (`pgrep -f train.py`, `pkill -f`, `ps`). The kernel reads
/proc/PID/cmdline from the process's argument area (arg_start..arg_end in /proc/PID/stat), so each
worker rewrites that area once it knows its job; the interpreter's own view (sys.argv,
sys.orig_argv) is untouched.

An area cannot grow, so the daemon starts those processes with a command exactly as long as the
title: `-Pm` becomes `-Puu..um`. -P keeps the working directory off sys.path: these processes
import elasticd and torch (as root, for a service) before the user's code, and a directory
someone else may write to must not supply them (the bootstrap puts the entrypoint's directory on
sys.path itself, where `python script.py` or `python -m` would). The flag, not PYTHONSAFEPATH,
which the script's own `python` subprocesses would inherit. -u is what torchrun runs its workers
with (their stdout and stderr unbuffered, with nothing in the environment that their own
subprocesses would inherit), and repeating it changes nothing more; where there is no room for
one, the bootstrap makes the streams as -u would (bootstrap.unbuffered_output). The title is then
written NUL-separated, byte for byte what the torchrun command shows. Where the title is the
shorter one (a very short script name), it is written as setproctitle(3) does: one string ended
by NUL, with the area's last byte non-zero, which tells the kernel to show it up to that NUL.
"""

from __future__ import annotations

import ctypes
import os
import sys
from collections.abc import Sequence


def title(entrypoint: str, args: Sequence[str]) -> list[str]:
    """The command line torchrun would run for `entrypoint` (a script path or a module)."""
    if entrypoint.endswith(".py") or os.sep in entrypoint:
        return [sys.executable, "-u", entrypoint, *args]
    return [sys.executable, "-u", "-m", entrypoint, *args]


def _size(argv: Sequence[str]) -> int:
    return sum(len(os.fsencode(a)) + 1 for a in argv)


def command(module: str, shown: Sequence[str], tail: Sequence[str] = ()) -> list[str]:
    """`python -P -m module *tail`, padded (-Pm as -Puu..um) so that its argument area is as long
    as `shown`'s."""
    need = _size(shown) - _size([sys.executable, "-Pm", module, *tail])
    return [sys.executable, "-P" + "u" * max(need, 0) + "m", module, *tail]


def show(shown: Sequence[str]) -> bool:
    """Make this process's /proc/PID/cmdline read `shown`. False, changing nothing, where the
    argument area cannot be found or does not hold this interpreter's original command line."""
    try:
        with open("/proc/self/stat", "rb") as f:
            fields = f.read().rpartition(b")")[2].split()  # fields from the 3rd (state) on
        start, end = int(fields[45]), int(fields[46])  # arg_start, arg_end: fields 48 and 49
    except (OSError, ValueError, IndexError):
        return False
    size = end - start
    original = b"".join(os.fsencode(a) + b"\0" for a in sys.orig_argv)
    if start <= 0 or size != len(original) or size < 2 or ctypes.string_at(start, size) != original:
        return False
    exact = b"".join(os.fsencode(a) + b"\0" for a in shown)
    if len(exact) == size:
        data = exact
    else:  # setproctitle's way: up to the first NUL, since the area's last byte is not one
        text = b" ".join(os.fsencode(a) for a in shown)[: size - 2] + b"\0"
        data = text + b" " * (size - len(text))
    ctypes.memmove(start, data, size)
    return True
