"""Warm spares as the daemon sees them: the daemon side of the fork server
(elasticd.worker.forkserver), which forks spares with torch already imported, and the fallback of
a fresh interpreter per spare. A spare waits on its job pipe for a rank (see spawn.spawn).

`ForkServer` asks for spares, collects them without blocking the loop and, with `teach`, asks the
server to import learned modules; `start_spare` starts a fresh-interpreter spare where the server
is unfit; `discard_spares` lets spares go. `Spare.bind` binds a spare to a rank's environment
(worker/bound.py), and `Spare.fits` says whether a rank's environment has the values a bound
spare's imports read.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from elasticd import names, safeio
from elasticd.daemon import systemd
from elasticd.worker import preload, proctitle


class Child:
    """A process the daemon did not start itself but is the parent of (a fork server's spare,
    reparented to the daemon as subreaper): Popen's pid, poll(), returncode, kill() and wait()."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            try:
                pid, status = os.waitpid(self.pid, os.WNOHANG)
            except ChildProcessError:
                # not ours (yet): the fork server announces a spare before its middle process
                # exits and hands it to us (forkserver.fork_spare); where the daemon is no
                # subreaper, never. Gone only once it no longer exists.
                try:
                    os.kill(self.pid, 0)
                except ProcessLookupError:
                    self.returncode = -signal.SIGKILL
                return self.returncode
            if pid:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def kill(self) -> None:
        if self.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signal.SIGKILL)

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(f"pid {self.pid}", timeout or 0.0)
            time.sleep(0.005)
        assert self.returncode is not None
        return self.returncode


@dataclass
class Spare:
    """A warm process waiting for a rank: one JSON line on `job` hands it one (see bootstrap).
    `bound`: for a spare bound to a rank ahead (`bind`), the values its imports read, which the
    rank it is handed must have."""

    proc: subprocess.Popen | Child
    job: BinaryIO
    bound: dict[str, str | None] | None = None

    @property
    def pid(self) -> int:
        return self.proc.pid

    def bind(self, env: dict[str, str], modules: dict[str, str], reads: list[str]) -> None:
        """Have the spare import `modules` now with `env`, its expected rank's environment
        (worker/bound.py), each only from the file the workers loaded it from."""
        message = {"env": env, "modules": list(modules), "origins": modules}
        try:
            self.job.write(json.dumps({"bind": message}).encode() + b"\n")
            self.job.flush()
        except OSError:
            self.proc.kill()  # replaced at the next collect, as a spare that died
            return
        self.bound = {key: env.get(key) for key in reads}

    def fits(self, env: dict[str, str]) -> bool:
        """Whether this spare may take the rank whose environment is `env`."""
        return self.bound is None or all(env.get(k) == v for k, v in self.bound.items())


def worker_defaults(nproc: int) -> dict[str, str]:
    """What every worker's environment holds unless the daemon's own sets it (the user's value,
    0 included, wins). Both are read once, at torch's import or its first allocation, so a warm
    spare has them from its start. OMP_NUM_THREADS=1 with several workers, as torchrun sets it.
    THP_MEM_ALLOC_ENABLE=1 (torch's own switch, not torchrun's): its CPU allocator aligns each
    block of 2 MB or more to 2 MB and asks for transparent huge pages on it (madvise), so a big
    host model is faulted in, and given back, in 512 times fewer pages. Measured: an FSDP2 step
    of 1 GB on CPU twice as fast, a survivor's rebuild in place 0.44 -> 0.22 s, the same
    resident memory (docs/performance.md#host-memory-in-huge-pages)."""
    wanted = {"THP_MEM_ALLOC_ENABLE": "1"}
    if nproc > 1:
        wanted["OMP_NUM_THREADS"] = "1"
    return {key: value for key, value in wanted.items() if key not in os.environ}


def _spare_env(token: str, nproc: int, preload: tuple[str, ...]) -> dict[str, str]:
    """The environment every worker shares, so what is read at import, library load or a first
    allocation (worker_defaults) is already right in a warm process. Unbuffered output comes
    from -u on the command line (proctitle.command), as under torchrun, not from the
    environment."""
    env = systemd.child_env(dict(os.environ))
    env.update(
        {
            names.AGENT: token,
            names.DAEMON_PID: str(os.getpid()),
            names.WARM_PRELOAD: ",".join(preload),
        }
    )
    env.update(worker_defaults(nproc))
    return env


def start_spare(
    token: str, nproc: int, preload: tuple[str, ...], log_path: Path, shown: list[str]
) -> Spare:
    """A warm spare that is a fresh interpreter (never a fork): it imports torch and `preload`,
    then waits on stdin for its rank's environment and arguments. Handing it a rank skips
    interpreter start-up and imports on a restart. The fallback where the fork server is unfit.
    `shown`: the workers' command line (proctitle.title), which the spare makes room for."""
    with os.fdopen(safeio.append(log_path), "ab") as out:
        proc = subprocess.Popen(
            proctitle.command("elasticd.worker.bootstrap", shown),
            env=_spare_env(token, nproc, preload),
            stdin=subprocess.PIPE,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            close_fds=True,
        )
    assert proc.stdin is not None
    return Spare(proc, proc.stdin)


class ForkServer:
    """Daemon side of elasticd.worker.forkserver: asks for spares and collects them (pid and the
    write end of the spare's job pipe) without blocking the agent loop. `shown`: the workers'
    command line (proctitle.title); the server's own has room for it, and its forks inherit
    that."""

    def __init__(
        self, token: str, nproc: int, preload: tuple[str, ...], log_path: Path, shown: list[str]
    ) -> None:
        self._sock, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            with os.fdopen(safeio.append(log_path), "ab") as out:
                self.proc = subprocess.Popen(
                    proctitle.command("elasticd.worker.forkserver", shown),
                    env=_spare_env(token, nproc, preload),
                    stdin=theirs,
                    stdout=out,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                    close_fds=True,
                )
        finally:
            theirs.close()
        self._sock.setblocking(False)
        self.pending = 0  # spares asked for and not yet received
        self.unfit: str | None = None  # the server's reason not to fork; it has quit
        self.learning = False  # importing what the workers imported (teach); no forks meanwhile
        self.learned = False  # its report is ready: the spares received before it lack them

    @property
    def usable(self) -> bool:
        return self.unfit is None and self.proc.poll() is None

    def fileno(self) -> int:
        """The connection to the server: readable when a spare (or its refusal) arrives."""
        return self._sock.fileno()

    def request(self, n: int) -> None:
        for _ in range(n):
            try:
                self._sock.send(b"s")
            except OSError:
                return
            self.pending += 1

    def teach(self, names_path: Path) -> None:
        """Ask the server to import the modules listed there (worker/preload.py); its report
        comes back beside them, `learned` says when."""
        try:
            self._sock.send(preload.REQUEST + os.fsencode(names_path))
        except OSError:
            return
        self.learning = True

    def collect(self, timeout: float = 0.0) -> list[Spare]:
        """The spares forked since the last call; with `timeout`, wait that long for all pending.
        Stops at a learning report (`learned`): what came before it lacks what it taught."""
        got: list[Spare] = []
        deadline = time.monotonic() + timeout
        while (self.pending or self.learning) and self.usable:
            try:
                msg, fds, _flags, _addr = socket.recv_fds(self._sock, 512, 1)
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    break
                time.sleep(0.005)
                continue
            except OSError:
                break
            if not msg:
                break
            if msg.startswith(b"unfit "):
                self.unfit = msg[6:].decode(errors="replace")
                break
            if msg == preload.ANSWER:
                self.learning, self.learned = False, True
                break
            self.pending = max(0, self.pending - 1)  # a middle killed after sending: two words
            if fds and msg != b"lost":
                got.append(Spare(Child(int(msg)), os.fdopen(fds[0], "wb")))
        return got

    def close(self) -> None:
        """The server exits when the connection closes; spares it forked belong to the daemon."""
        self._sock.close()
        try:
            self.proc.wait(timeout=2)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def discard_spares(spares: list[Spare]) -> None:
    """Spares exit on EOF; kill any that do not, and bound ones at once (they read their pipe only
    once their imports are done)."""
    for p in spares:
        with contextlib.suppress(OSError):
            p.job.close()
        if p.bound is not None:
            p.proc.kill()
    for p in spares:
        try:
            p.proc.wait(timeout=2)
        except subprocess.TimeoutExpired:
            p.proc.kill()
            p.proc.wait()
    spares.clear()
