"""A worker's command line as ps, pgrep -f, py-spy and /proc/PID/cmdline show it: the one torchrun
would have started, `python -u train.py ARGS` (or `python -u -m module ARGS`).

Workers start as `python -P -m elasticd.worker.bootstrap` (cold, or a fresh warm spare) or are
forked from `python -P -m elasticd.worker.forkserver` (the guard too starts with -P), yet operators
find and signal training processes by their script (`pgrep -f train.py`, `pkill -f`, `ps`). The
kernel reads /proc/PID/cmdline from the process's argument area (arg_start..arg_end in
/proc/PID/stat), so each worker rewrites that area once it knows its job; the interpreter's own view
(sys.argv, sys.orig_argv) is untouched.

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

The environment area the same way (`show_environ`): /proc/PID/environ is read from
env_start..env_end, which a spare handed its rank moves to its rank's environment (prctl's
PR_SET_MM), so that monitors mapping pids to ranks find what a cold worker shows.
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


_PR_SET_MM, _PR_SET_MM_ENV_START, _PR_SET_MM_ENV_END, _PR_SET_MM_MAP = 35, 10, 11, 14
_environ_block = None  # the area /proc/PID/environ is read from, kept for the process's life


class _MmMap(ctypes.Structure):
    """The kernel's struct prctl_mm_map (linux/prctl.h)."""

    _fields_ = [
        (name, ctypes.c_uint64)
        for name in (
            "start_code", "end_code", "start_data", "end_data", "start_brk", "brk",
            "start_stack", "arg_start", "arg_end", "env_start", "env_end", "auxv",
        )
    ] + [("auxv_size", ctypes.c_uint32), ("exe_fd", ctypes.c_uint32)]  # fmt: skip


def _prctl():
    prctl = ctypes.CDLL(None, use_errno=True).prctl
    prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong]
    return prctl


def _move_map(start: int, end: int) -> bool:
    """PR_SET_MM_MAP: every bound given again (from /proc/self/stat; brk as it is now), the
    environment's new, the auxiliary vector and executable kept. Needs no capability where the
    kernel has checkpoint/restore (CRIU's way), unlike the single-field calls."""
    try:
        with open("/proc/self/stat", "rb") as f:
            fields = [int(x) for x in f.read().rpartition(b")")[2].split()[1:]]
    except (OSError, ValueError):
        return False
    at = dict(start_code=22, end_code=23, start_stack=24, start_data=41, end_data=42)
    if len(fields) < 48:
        return False
    mm = _MmMap(**{k: fields[i] for k, i in at.items()}, start_brk=fields[43])
    mm.arg_start, mm.arg_end, mm.env_start, mm.env_end = fields[44], fields[45], start, end
    mm.exe_fd = 0xFFFFFFFF  # kept
    libc = ctypes.CDLL(None, use_errno=True)
    libc.sbrk.restype = ctypes.c_void_p
    prctl = _prctl()
    for _ in range(3):  # brk as it is when the call is made: again if it moved meanwhile
        mm.brk = libc.sbrk(0) or 0
        if prctl(_PR_SET_MM, _PR_SET_MM_MAP, ctypes.addressof(mm), ctypes.sizeof(mm), 0):
            return False
        if (libc.sbrk(0) or 0) == mm.brk:
            return True
    return True


def _move_fields(start: int, end: int) -> bool:
    """PR_SET_MM_ENV_START and _END (CAP_SYS_RESOURCE): the kernel keeps env_start <= env_end at
    each call, so which end moves first depends on where the block lies."""
    prctl = _prctl()
    for first, first_at, then, then_at in (
        (_PR_SET_MM_ENV_START, start, _PR_SET_MM_ENV_END, end),
        (_PR_SET_MM_ENV_END, end, _PR_SET_MM_ENV_START, start),
    ):
        if prctl(_PR_SET_MM, first, first_at, 0, 0) == 0:
            return prctl(_PR_SET_MM, then, then_at, 0, 0) == 0
    return False


CHECK = (
    "import sys; from elasticd.worker import proctitle; sys.exit(not proctitle.show_environ({}))"
)


def show_environ(env: dict[str, str]) -> bool:
    """Make this process's /proc/PID/environ read `env` (NUL-separated `K=V`, in its order), as
    the kernel shows a process started with it: a spare forked from the fork server has the
    server's area whatever os.environ holds, and monitors map pids to ranks by it. The kernel
    reads /proc/PID/environ from env_start..env_end, which prctl(PR_SET_MM) moves to a block
    kept here for the process's life. False, changing nothing, where the kernel refuses (no
    checkpoint/restore support and no CAP_SYS_RESOURCE: the daemon says so once)."""
    global _environ_block
    data = b"".join(os.fsencode(k) + b"=" + os.fsencode(v) + b"\0" for k, v in env.items())
    block = ctypes.create_string_buffer(data, max(len(data), 1))
    start = ctypes.addressof(block)
    kept, _environ_block = _environ_block, block  # kept before the kernel may point at it
    if _move_map(start, start + len(data)) or _move_fields(start, start + len(data)):
        return True
    _environ_block = kept
    return False
