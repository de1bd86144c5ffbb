"""The worker processes' lives after spawn: reap exits, stop a whole tree (SIGTERM, grace,
SIGKILL, then a sweep by the daemon's token), dump stacks on request; and the daemon's own
process setup (subreaper, the guard).

The sweep (`find_tree`, psutil) spares the health check's session, which carries the token too. A
sweep that cannot read /proc (EMFILE) is retried until the kill timeout and then said in one line
(`teardown_sweep_failed`), never raised.
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import psutil

from elasticd import logs, names, safeio
from elasticd.daemon import systemd

if TYPE_CHECKING:
    from elasticd.daemon.spawn import Worker

log = logs.get("elasticd.workers")

_PR_SET_CHILD_SUBREAPER = 36


def make_subreaper() -> bool:
    """Orphaned grandchildren reparent to the daemon, so they stay findable and reapable."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def start_guard(token: str) -> subprocess.Popen:
    """See elasticd.daemon.guard: kills our workers' tree if the daemon dies without doing it.
    -P: nothing is imported from the working directory (see worker/proctitle.py)."""
    env = systemd.child_env(dict(os.environ))
    env.pop(names.AGENT, None)
    return subprocess.Popen(
        [sys.executable, "-P", "-m", "elasticd.daemon.guard", token],
        stdin=subprocess.PIPE,
        stdout=subprocess.DEVNULL,
        env=env,
        close_fds=True,
    )


def poll(workers: list[Worker]) -> list[Worker]:
    """Reap exits; return the workers that exited since the last call."""
    exited = []
    for w in workers:
        if w.exit_code is None:
            code = w.proc.poll()
            if code is not None:
                w.exit_code = code
                exited.append(w)
    return exited


def describe_exit(code: int) -> str:
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


def _signal_group(w: Worker, sig: int) -> None:
    try:
        os.killpg(w.pid, sig)  # the worker leads its own session and process group
    except (ProcessLookupError, PermissionError):
        pass


def find_tree(
    token: str, workers: list[Worker], spared: frozenset[int] = frozenset()
) -> list[psutil.Process]:
    """Every live process of this daemon's workers: descendants of the daemon (it is a
    subreaper, so orphans stay below it), members of the workers' sessions, and anything else
    carrying our ELASTICD_AGENT token in its environment (a descendant that left the session);
    never a member of a `spared` session (a health check's: it carries the token too, and no
    worker can join a session it did not start in). Raises OSError or psutil.Error when /proc
    cannot be read (no file descriptor left)."""
    me = os.getpid()
    sids = {w.pid for w in workers}
    found: dict[int, psutil.Process] = {}
    for p in psutil.Process(me).children(recursive=True):
        found[p.pid] = p
    for p in psutil.process_iter():
        if p.pid == me or p.pid in found:
            continue
        try:
            if os.getsid(p.pid) in sids or p.environ().get(names.AGENT) == token:
                found[p.pid] = p
        except (OSError, psutil.Error):
            continue
    return [p for p in found.values() if not _in_session(p.pid, spared) and _is_ours(p, token)]


def _in_session(pid: int, sessions: frozenset[int]) -> bool:
    if not sessions:
        return False
    try:
        return os.getsid(pid) in sessions
    except OSError:
        return False


def _is_ours(p: psutil.Process, token: str) -> bool:
    """The guard process and other helpers of the daemon do not carry the token; keep them."""
    try:
        return p.environ().get(names.AGENT) == token or p.status() == psutil.STATUS_ZOMBIE
    except psutil.ZombieProcess:
        return True
    except psutil.Error:
        return False


def stop(
    workers: list[Worker],
    token: str,
    grace: float,
    kill_timeout: float,
    keep: Callable[[], frozenset[int]] = frozenset,
    cut_short=lambda: False,
    spared: frozenset[int] = frozenset(),
) -> list[int]:
    """SIGTERM every worker's process group, wait up to `grace`, SIGKILL what is left, then sweep
    the whole tree, sparing the processes `keep()` names (asked at every round: a spare forked
    meanwhile is the daemon's child, as a worker's orphan is) and the sessions `spared`.
    `cut_short()` turning true ends the grace early (a second stop signal). Every wait is
    bounded: returns the pids that could not be reaped (a process in uninterruptible sleep
    cannot be), which the caller reports. A sweep that cannot read /proc (no file descriptor
    left) is tried again until `kill_timeout`, then said in one line: the job goes on (the guard
    sweeps if the daemon dies)."""
    live = [w for w in workers if w.proc.poll() is None]
    if live and grace > 0:
        for w in live:
            _signal_group(w, signal.SIGTERM)
            _signal_group(
                w, signal.SIGCONT
            )  # a stopped process acts on SIGTERM only when continued
        deadline = time.monotonic() + grace
        while (
            time.monotonic() < deadline
            and any(w.proc.poll() is None for w in live)
            and not cut_short()
        ):
            time.sleep(0.01)
    for w in workers:
        if w.proc.poll() is None:
            _signal_group(w, signal.SIGKILL)
    deadline = time.monotonic() + kill_timeout
    leftover: list[psutil.Process] = []
    failed: Exception | None = None
    while True:
        poll(workers)
        done = {w.pid for w in workers if w.exit_code is not None}
        try:
            found = find_tree(token, workers, spared)
            failed = None
        except (OSError, psutil.Error) as e:  # EMFILE: /proc cannot be read now
            found, failed = None, e
        # asked after the listing: a spare found reparented to the daemon was announced (its pid
        # in the daemon's socket) before it was, so keep() knows it (forkserver.fork_spare)
        kept = keep()
        if found is not None:
            leftover = [p for p in found if p.pid not in done and p.pid not in kept]
        for p in leftover:
            try:
                p.kill()
            except (OSError, psutil.Error):
                pass
        reap_orphans(workers, kept)
        if not (leftover or failed) and all(w.exit_code is not None for w in workers):
            return []
        if time.monotonic() >= deadline:
            if failed is not None:
                log.error(
                    "teardown_sweep_failed",
                    error=str(failed),
                    workers=[w.pid for w in workers],
                    hint="their sessions were killed; a descendant that left them may live on",
                )
            stuck = [p.pid for p in leftover] + [w.pid for w in workers if w.exit_code is None]
            if stuck:
                log.error(
                    "processes_unkillable",
                    pids=stuck,
                    hint="likely in uninterruptible sleep (state D)",
                )
            return stuck
        time.sleep(0.02)


def reap_orphans(workers: list[Worker], keep: frozenset[int] = frozenset()) -> None:
    """Reap zombies of reparented grandchildren (we are their subreaper); never our workers or
    spares, whose exit status Popen must read."""
    mine = {w.pid for w in workers} | keep
    try:
        children = psutil.Process().children()
    except (OSError, psutil.Error):  # EMFILE too: the next teardown reaps them
        return
    for p in children:
        if p.pid in mine:
            continue
        try:
            if p.status() == psutil.STATUS_ZOMBIE:
                os.waitpid(p.pid, os.WNOHANG)
        except (OSError, psutil.Error):
            pass


def dump_stacks(
    workers: list[Worker], sig_name: str, wait: float = 1.0, limit: int = 1 << 20
) -> list[tuple[Worker, str]]:
    """Ask every live worker for a stack dump of all its threads (the bootstrap registered
    faulthandler on `sig_name`), wait briefly for the files to fill, and return each worker with
    what its dump added to its stack file (at most `limit` bytes)."""
    sig = getattr(signal, sig_name)
    live = [w for w in workers if w.proc.poll() is None]
    sizes = {}
    for w in live:
        with os.fdopen(
            safeio.append(w.stack_path), "a"
        ) as f:  # the worker may not have made it yet
            sizes[w.pid] = os.fstat(f.fileno()).st_size
            stamp = time.strftime("%Y-%m-%dT%H:%M:%S%z")
            f.write(f"\n=== elasticd stack dump, rank {w.global_rank}, pid {w.pid}, {stamp} ===\n")
        try:
            os.kill(w.pid, sig)
            os.kill(w.pid, signal.SIGCONT)  # a stopped worker dumps only once continued
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + wait
    pending = set(sizes)
    while pending and time.monotonic() < deadline:
        time.sleep(0.02)
        for w in live:
            if w.pid in pending and w.stack_path.stat().st_size > sizes[w.pid] + 200:
                pending.discard(w.pid)
    if pending:
        time.sleep(0.05)
    dumps = []
    for w in live:
        with os.fdopen(safeio.open_existing(w.stack_path), "rb") as f:
            f.seek(sizes[w.pid])
            dumps.append((w, f.read(limit).decode(errors="replace")))
    return dumps
