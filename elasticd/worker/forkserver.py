"""Warm spares forked from one interpreter that has already imported torch.

A fresh interpreter importing torch costs a core a second or two; refilling the spares that way
after every (re)start takes that CPU from the training workers for their first seconds (on a
busy node, idle scheduling priority does not hide it: caches and memory bandwidth are shared).
So the daemon starts one fork server per run, `python -m elasticd.worker.forkserver`, which imports
torch and the preload list once, while the nodes meet. For each spare the daemon asks for it
forks twice: the grandchild is reparented to the daemon (a child subreaper), which then waits on
it, signals it and reads its exit status as for any worker it started itself. The spare waits on
a pipe whose write end travels to the daemon with its pid (SCM_RIGHTS), and takes its rank from
there exactly as a fresh-interpreter spare does (bootstrap.take_rank). A refill costs a fork,
tens of milliseconds.

Forking is safe only from a process with one thread and no CUDA context: the server checks
both before every fork and otherwise answers "unfit" with the reason and quits (a preloaded module
that started a thread); the daemon then falls back to fresh-interpreter spares. numpy's OpenBLAS
starts a pool of one thread per core at import unless OMP_NUM_THREADS or OPENBLAS_NUM_THREADS is
1 (so always with one worker per node, as torchrun sets neither then): OpenBLAS ends that pool
itself before every fork and starts it again at its next call, so the server ends it once, idle,
after the imports, and its spares start theirs as a fresh interpreter would. What a fork shares
and a fresh process would not is reset in the spare: Python's `random` is reseeded by the
interpreter at fork, numpy's global generator and torch's default CPU generator here (without
it every spare, so every rank of every attempt, would draw the same "random" numbers). What
cannot be reset is the interpreter's str hash seed: the spares of one fork server share it.

While it learns the job's imports (worker/preload.py), the server waits on a probe that runs at
idle priority, for seconds on a loaded machine; it forks the spares asked for meanwhile
(`_serve_while`), so that a restart in a job's first minute takes spares holding torch rather
than starting cold. Such a spare leaves the learning call's stack by an exception
(`BecomeSpare`), which puts back what learning changed in the process.
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import os
import select
import socket
import sys
import time

from elasticd import names
from elasticd.worker import preload

_REQUEST = b"s"


def thread_count(wait: float = 0.5) -> int:
    """This process's threads. A thread whose join just returned (OpenBLAS's pool, ended by
    end_idle_blas_pools) can stay listed a moment longer on a loaded machine, so a count above
    one is read again for up to `wait` seconds before it stands."""
    deadline = time.monotonic() + wait
    while True:
        threads = len(os.listdir("/proc/self/task"))
        if threads == 1 or time.monotonic() >= deadline:
            return threads
        time.sleep(0.01)


def unfit_reason() -> str | None:
    """Why this process must not fork a worker, or None."""
    threads = thread_count()
    if threads != 1:
        return (
            f"the preloaded modules started {threads - 1} thread(s); forking would copy their "
            "locks mid-use"
        )
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        return "a preloaded module initialised CUDA; a forked child cannot use it"
    return None


def openblas_libraries() -> list[ctypes.CDLL]:
    """Every OpenBLAS this process has loaded (numpy's, scipy's), by the files mapped in it."""
    with open("/proc/self/maps") as maps:
        paths = {p[5].strip() for line in maps if len(p := line.split(maxsplit=5)) == 6}
    libs = []
    for path in sorted(p for p in paths if "openblas" in os.path.basename(p)):
        with contextlib.suppress(OSError):
            libs.append(ctypes.CDLL(path))
    return libs


def end_idle_blas_pools() -> None:
    """End the thread pool of every OpenBLAS loaded here (numpy's, started at import), as
    OpenBLAS's own fork handler does before each fork; its next call starts the pool again with
    the size it chose at load from this process's environment, the spares' environment."""
    for lib in openblas_libraries():
        with contextlib.suppress(AttributeError):  # another BLAS build: the thread check decides
            lib.blas_thread_shutdown_()


def freeze_imports() -> None:
    """Move every object the imports made to the collector's permanent generation, as Python's
    docs advise before forking workers: the spares' full collections then skip them instead of
    writing to each and so copying every page from the server (the transformers Trainer's
    gc.collect() at resume: 1.8 s on the loaded 2-core VM, 0.4 s with the freeze). What the
    script can notice: gc.get_freeze_count() is not 0 and gc.get_objects() leaves them out."""
    gc.freeze()


class BecomeSpare(BaseException):
    """Raised in a spare forked while the server waits on a learning probe (`_serve_while`), so
    that it unwinds the learning call (which puts its environment back) up to `serve`."""

    def __init__(self, read_end: int) -> None:
        super().__init__(read_end)
        self.read_end = read_end


def serve(conn: socket.socket) -> int | None:
    """Fork a spare per request. Returns, in a spare only, the read end of its job pipe; in the
    server, None once the daemon closes the connection or the server is unfit."""
    while True:
        try:
            request = conn.recv(4096)
        except ConnectionError:
            return None
        if not request:
            return None
        if request.startswith(preload.REQUEST):
            preload.wait_for = lambda fd: _serve_while(conn, fd)
            try:
                conn.send(preload.answer(request))
            except BecomeSpare as spare:
                return spare.read_end
            finally:
                preload.wait_for = None
            continue
        why = unfit_reason()
        if why:
            conn.send(f"unfit {why}".encode())
            return None
        read_end = fork_spare(conn)
        if read_end is not None:
            return read_end


def _serve_while(conn: socket.socket, fd: int) -> None:
    """Until `fd` (a learning probe's pipe) is readable, fork the spares the daemon asks for:
    a probe runs at idle priority and on a loaded machine takes its time, and a restart in the
    meantime must find spares that hold torch, not start cold (the daemon replaces them with
    spares holding what was learned once its report comes). In such a spare, BecomeSpare."""
    watched: list = [fd, conn]
    while True:
        ready, _, _ = select.select(watched, [], [])
        if fd in ready:
            return
        try:
            request = conn.recv(4096)
        except ConnectionError:
            request = b""
        if not request:  # the daemon is gone: the server quits once the probe is done
            watched = [fd]
            continue
        why = unfit_reason()
        if why:
            conn.send(f"unfit {why}".encode())
            watched = [fd]
            continue
        read_end = fork_spare(conn)
        if read_end is not None:
            raise BecomeSpare(read_end)


def fork_spare(conn: socket.socket) -> int | None:
    """Fork one spare (twice: the middle process exits, so the spare is reparented to the
    daemon). The middle process sends the daemon the spare's pid and the write end of its job
    pipe before it exits: so the pid is in the daemon's socket before the spare becomes the
    daemon's child, and a teardown sweep that finds it there finds its pid too (sent after the
    reparenting, the sweep could kill a spare the daemon did not know yet). Returns, in the
    spare, the read end of that pipe; in the server, None."""
    read_end, write_end = os.pipe()
    report_r, report_w = os.pipe()
    middle = os.fork()
    if middle == 0:
        os.close(report_r)
        spare = _fork_or_exit()
        if spare == 0:
            os.close(report_w)
            os.close(write_end)
            conn.close()
            return read_end
        try:
            socket.send_fds(conn, [str(spare).encode()], [write_end])
            os.write(report_w, b"sent")
        finally:
            os._exit(0)
    os.close(report_w)
    os.close(read_end)
    os.close(write_end)
    os.waitpid(middle, 0)  # once it is reaped, its child has been reparented to the daemon
    sent = os.read(report_r, 8)
    os.close(report_r)
    if sent != b"sent":
        with contextlib.suppress(OSError):
            conn.send(b"lost")  # the fork failed or the middle was killed: the daemon stops waiting
    return None


def _fork_or_exit() -> int:
    try:
        return os.fork()
    except OSError:
        os._exit(1)  # the server sees no pid and sends nothing: the daemon asks again later


def become_spare(read_end: int) -> None:
    """In the grandchild: wait until reparented to the daemon, then look like a fresh process."""
    daemon = int(os.environ[names.DAEMON_PID])
    deadline = time.monotonic() + 10.0
    while os.getppid() != daemon and time.monotonic() < deadline:
        time.sleep(0.001)  # the middle process is exiting
    np = sys.modules.get("numpy")
    if np is not None:
        np.random.seed()  # fresh entropy, as numpy's import gives a fresh interpreter
    torch = sys.modules.get("torch")
    if torch is not None:
        torch.default_generator.seed()  # the same (CUDA's is untouched: not started here)
    os.setsid()  # its own session and process group, as for a cold worker
    os.dup2(read_end, 0)
    os.close(read_end)


def main() -> None:
    from elasticd.worker import bootstrap

    bootstrap.die_with_daemon()
    conn = socket.socket(fileno=0)  # a socketpair end; a spare's stdin becomes its job pipe
    bootstrap.preload()
    end_idle_blas_pools()
    freeze_imports()
    read_end = serve(conn)
    if read_end is None:
        bootstrap.quit_unused()
    become_spare(read_end)
    bootstrap.main()  # dies with the daemon from here on, takes its rank from stdin


if __name__ == "__main__":
    main()
