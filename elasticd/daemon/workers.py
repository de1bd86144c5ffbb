"""Spawn a node's workers with torchrun's environment, and stop a whole worker tree.

Each worker gets its own session (so its process group can be signalled as one), its output goes
straight to a per-rank file (a slow daemon can never block a worker on a full pipe), and carries
ELASTICD_AGENT=<token> so a sweep finds every descendant, even one that left the session.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import signal
import socket
import stat
import string
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO

import psutil

from elasticd import logs, names, safeio
from elasticd.daemon import supervise, systemd
from elasticd.worker import health, proctitle

log = logs.get("elasticd.workers")

_PR_SET_CHILD_SUBREAPER = 36


@dataclass(frozen=True)
class GroupSpec:
    """Everything a node needs to start one attempt's local workers."""

    entrypoint: str  # "module", "module:function" or "path/to/script.py"
    args: tuple[str, ...]
    nproc: int
    rank_base: int  # global rank of local rank 0
    world_size: int
    group_rank: int
    group_world_size: int
    master_addr: str
    master_port: int
    restart_count: int
    max_restarts: int
    run_id: str
    attempt_dir: Path
    token: str  # identifies this daemon's processes for sweeps
    stack_signal: str = "SIGUSR1"
    checkpoint_dir: str = ""
    role: str = "default"
    virtual_local_rank: bool = False  # LOCAL_RANK=0 and CUDA_VISIBLE_DEVICES = the rank's GPU
    no_python: bool = False  # the entrypoint is an executable the bootstrap becomes
    extra_env: dict[str, str] = field(default_factory=dict)

    def worker_args(self, local_rank: int) -> tuple[str, ...]:
        """The script's arguments with torchrun's ${local_rank} macro filled in (string.Template's
        safe_substitute, as torch.distributed.elastic.utils.macros does)."""
        return tuple(
            string.Template(a).safe_substitute(local_rank=str(local_rank)) for a in self.args
        )


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
            except ChildProcessError:  # not ours after all (the daemon is no subreaper): gone
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
    """A warm process waiting for a rank: one JSON line on `job` hands it one (see bootstrap)."""

    proc: subprocess.Popen | Child
    job: BinaryIO

    @property
    def pid(self) -> int:
        return self.proc.pid


@dataclass
class Worker:
    local_rank: int
    global_rank: int
    proc: subprocess.Popen | Child
    log_path: Path
    error_path: Path
    stack_path: Path
    heartbeat_path: Path
    started: float  # monotonic
    exit_code: int | None = None

    @property
    def pid(self) -> int:
        return self.proc.pid


def make_subreaper() -> bool:
    """Orphaned grandchildren reparent to the daemon, so they stay findable and reapable."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def worker_env(spec: GroupSpec, local_rank: int, paths: dict[str, Path]) -> dict[str, str]:
    """torchrun's contract (LocalElasticAgent._start_workers, torch 2.13) plus ours (names)."""
    env = systemd.child_env(
        dict(os.environ)
    )  # systemd's notify socket and watchdog are the daemon's
    rank = spec.rank_base + local_rank
    env.update(
        RANK=str(rank),
        LOCAL_RANK=str(local_rank),
        GROUP_RANK=str(spec.group_rank),
        ROLE_RANK=str(rank),
        ROLE_NAME=spec.role,
        LOCAL_WORLD_SIZE=str(spec.nproc),
        WORLD_SIZE=str(spec.world_size),
        GROUP_WORLD_SIZE=str(spec.group_world_size),
        ROLE_WORLD_SIZE=str(spec.world_size),
        MASTER_ADDR=spec.master_addr,
        MASTER_PORT=str(spec.master_port),
        TORCHELASTIC_RESTART_COUNT=str(spec.restart_count),
        TORCHELASTIC_MAX_RESTARTS=str(spec.max_restarts),
        TORCHELASTIC_RUN_ID=spec.run_id,
        TORCHELASTIC_USE_AGENT_STORE="True",
        TORCH_NCCL_ASYNC_ERROR_HANDLING=os.environ.get("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1"),
        TORCHELASTIC_ERROR_FILE=str(paths["error"]),
    )
    env.update(
        {
            names.AGENT: spec.token,
            names.DAEMON_PID: str(os.getpid()),
            names.ENTRYPOINT: spec.entrypoint,
            names.HEARTBEAT_FILE: str(paths["heartbeat"]),
            names.STACK_FILE: str(paths["stack"]),
            names.STACK_SIGNAL: spec.stack_signal,
            names.ATTEMPT_DIR: str(spec.attempt_dir),
            names.LOCAL_RANK: str(local_rank),
        }
    )
    if spec.virtual_local_rank:  # each worker sees its own GPU as device 0, as under torchrun
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        env["CUDA_VISIBLE_DEVICES"] = (
            visible.split(",")[local_rank].strip() if visible is not None else str(local_rank)
        )
        env["LOCAL_RANK"] = "0"
    if spec.no_python:
        env[names.NO_PYTHON] = "1"
    if spec.checkpoint_dir:
        env.setdefault(names.CHECKPOINT_DIR, spec.checkpoint_dir)
    if spec.nproc > 1 and "OMP_NUM_THREADS" not in os.environ:
        env["OMP_NUM_THREADS"] = "1"
    # Output goes to a file: without this, Python holds prints back in a block buffer.
    env.setdefault("PYTHONUNBUFFERED", "1")
    env.update(spec.extra_env)
    return env


def console_prefix(role: str, rank: int, local_rank: int) -> str:
    """What a worker's echoed lines start with: `[rankR]: `, or torchrun's
    TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE (${role_name}, ${rank}, ${local_rank}) where it is set."""
    template = os.environ.get("TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE")
    if template is None:
        return f"[rank{rank}]: "
    return string.Template(template).safe_substitute(
        role_name=role, rank=rank, local_rank=local_rank
    )


def _paths(spec: GroupSpec, rank: int) -> dict[str, Path]:
    return {
        "log": spec.attempt_dir / f"rank{rank}.log",
        "error": spec.attempt_dir / f"rank{rank}.error.json",
        "stack": spec.attempt_dir / f"rank{rank}.stacks.txt",
        "heartbeat": spec.attempt_dir / f"rank{rank}.heartbeat",
    }


def spawn(spec: GroupSpec, spares: list[Spare] | None = None) -> list[Worker]:
    """Start the local workers, handing ranks to warm spares first (see start_spare, ForkServer).

    Call from the agent loop's thread: the parent-death signal the bootstrap arms fires when the
    *thread* that forked the child exits."""
    safeio.mkdir(spec.attempt_dir)  # fresh in our fresh run directory: an existing one was planted
    spares = spares if spares is not None else []
    workers = []
    for local_rank in range(spec.nproc):
        rank = spec.rank_base + local_rank
        paths = _paths(spec, rank)
        health.create(str(paths["heartbeat"]))
        env = worker_env(spec, local_rank, paths)
        args = spec.worker_args(local_rank)
        proc = None
        while spares and proc is None:
            proc = _assign(spares.pop(0), env, args, paths["log"])
        if proc is None:
            with os.fdopen(safeio.create(paths["log"]), "ab") as out:
                proc = subprocess.Popen(
                    proctitle.command(
                        "elasticd.worker.bootstrap", proctitle.title(spec.entrypoint, args), args
                    ),
                    env=env,
                    stdin=subprocess.DEVNULL,
                    stdout=out,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                    close_fds=True,
                )
        workers.append(
            Worker(
                local_rank,
                rank,
                proc,
                paths["log"],
                paths["error"],
                paths["stack"],
                paths["heartbeat"],
                time.monotonic(),
            )
        )
    return workers


def _spare_env(token: str, nproc: int, preload: tuple[str, ...]) -> dict[str, str]:
    """The environment every worker shares, so what is read at import or library load
    (OMP_NUM_THREADS, PYTHONUNBUFFERED) is already right in a warm process."""
    env = systemd.child_env(dict(os.environ))
    env.update(
        {
            names.AGENT: token,
            names.DAEMON_PID: str(os.getpid()),
            names.WARM_PRELOAD: ",".join(preload),
        }
    )
    if nproc > 1 and "OMP_NUM_THREADS" not in os.environ:
        env["OMP_NUM_THREADS"] = "1"
    env.setdefault("PYTHONUNBUFFERED", "1")
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
    """Daemon side of elasticd.worker.forkserver: asks for spares and collects them (pid and the write
    end of the spare's job pipe) without blocking the agent loop. `shown`: the workers' command
    line (proctitle.title); the server's own has room for it, and its forks inherit that."""

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

    def collect(self, timeout: float = 0.0) -> list[Spare]:
        """The spares forked since the last call; with `timeout`, wait that long for all pending."""
        got: list[Spare] = []
        deadline = time.monotonic() + timeout
        while self.pending and self.usable:
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
            self.pending -= 1
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


def _assign(spare: Spare, env: dict[str, str], args: tuple[str, ...], log: Path):
    """Give a spare its rank; None if it died meanwhile (then the caller takes another or a cold start)."""
    if spare.proc.poll() is not None:
        return None
    try:
        spare.job.write(
            json.dumps({"env": env, "args": list(args), "log": str(log)}).encode() + b"\n"
        )
        spare.job.close()
    except (BrokenPipeError, OSError):
        spare.proc.kill()
        spare.proc.wait()
        return None
    return spare.proc


def discard_spares(spares: list[Spare]) -> None:
    """Spares exit on EOF; kill any that do not."""
    for p in spares:
        with contextlib.suppress(OSError):
            p.job.close()
    for p in spares:
        try:
            p.proc.wait(timeout=2)
        except subprocess.TimeoutExpired:
            p.proc.kill()
            p.proc.wait()
    spares.clear()


def start_guard(token: str) -> subprocess.Popen:
    """See elasticd.daemon.guard: kills our workers' tree if the daemon dies without doing it."""
    env = systemd.child_env(dict(os.environ))
    env.pop(names.AGENT, None)
    return subprocess.Popen(
        [sys.executable, "-m", "elasticd.daemon.guard", token],
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
    keep: frozenset[int] = frozenset(),
    cut_short=lambda: False,
    spared: frozenset[int] = frozenset(),
) -> list[int]:
    """SIGTERM every worker's process group, wait up to `grace`, SIGKILL what is left, then sweep
    the whole tree (sparing the processes `keep` and the sessions `spared`). `cut_short()`
    turning true ends the grace early (a second stop signal). Every wait is bounded: returns the
    pids that could not be reaped (a process in uninterruptible sleep cannot be), which the
    caller reports. A sweep that cannot read /proc (no file descriptor left) is tried again
    until `kill_timeout`, then said in one line: the job goes on (the guard sweeps if the daemon
    dies)."""
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
            leftover = [
                p
                for p in find_tree(token, workers, spared)
                if p.pid not in done and p.pid not in keep
            ]
            failed = None
        except (OSError, psutil.Error) as e:  # EMFILE: /proc cannot be read now
            failed = e
        for p in leftover:
            try:
                p.kill()
            except (OSError, psutil.Error):
                pass
        reap_orphans(workers, keep)
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


MAX_ERROR_FILE = 1 << 20  # bytes of a rank's error file read; torch's format is a few KiB
MAX_EXCEPTION_TEXT = (
    2000  # characters of its message kept: it goes into status, logs and peers' stores
)


def read_error_file(path: Path) -> str | None:
    """The exception line of torch's error-file format (ours or the script's @record), for the
    failure report. The worker wrote it, and the operator's terminal and the peers show it: it
    comes back escaped (logs.printable) and cut short; None for a missing or malformed file (the
    exit code still tells). Opened without following links or blocking, as a worker could leave a
    FIFO or a link there."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return None
        data = json.loads(os.read(fd, MAX_ERROR_FILE))
    except (OSError, ValueError, RecursionError):
        return None
    finally:
        os.close(fd)
    msg = data.get("message") if isinstance(data, dict) else None
    if isinstance(msg, dict):
        extra = msg.get("extraInfo")
        stack = extra.get("py_callstack") if isinstance(extra, dict) else None
        text = msg.get("message")
        if not (isinstance(text, str) and text.strip()):
            text = (
                stack.strip().splitlines()[-1] if isinstance(stack, str) and stack.strip() else None
            )
    else:
        text = msg if isinstance(msg, str) else None
    if not text:
        return None
    text = logs.printable(text)
    return text if len(text) <= MAX_EXCEPTION_TEXT else text[:MAX_EXCEPTION_TEXT] + "..."


MAX_ECHO_LINE = 64 * 1024  # bytes; a longer line is echoed in pieces, each with the prefix
REDRAW_INTERVAL = 0.5  # seconds; a progress bar's redraws are echoed at most this often per rank
READ_CHUNK = 1 << 20  # bytes the Tee reads of a file at once, into the one buffer it reuses
_LATE = 0.005  # seconds the Tee wakes after a redraw comes due (a timed wait may end a hair early)


def echo_line(prefix: str, raw: bytes) -> str:
    """One line of a worker's output as the console shows it: the rank prefix, then the text with
    every control character escaped (logs.printable), so a worker can neither drive the
    operator's terminal nor print a line without its prefix. The Tee has already split the
    output at carriage returns (see Tee): one that is left here is escaped like the rest."""
    return prefix + logs.printable(raw.decode(errors="backslashreplace")) + "\n"


def _cut(line: bytes, size: int = MAX_ECHO_LINE) -> list[bytes]:
    """`line` in pieces of at most `size` bytes, cut between UTF-8 characters."""
    pieces = []
    while len(line) > size:
        at = size
        while at > size - 4 and line[at] & 0xC0 == 0x80:  # a continuation byte: step back
            at -= 1
        pieces.append(line[:at])
        line = line[at:]
    pieces.append(line)
    return pieces


def _split(
    data: bytes | bytearray, final: bool, end: int | None = None
) -> tuple[list[bytes], bytes | None, bytes]:
    """Output (`data[:end]`) as the console echoes it: (finished lines, the latest finished
    redraw or None, the unfinished rest). A line is what a terminal would show of it, the text
    after its last carriage return ("\r\n" ends a line). A redraw is a segment ended by "\r"
    after the last newline: a progress bar draws each state as "\r" + text, so the text after
    the last "\r" is still being drawn and waits for the next "\r" or "\n" (or the file's end).

    Scanned from the end by index: of a bar's thousands of redraws only the last two carriage
    returns are looked for, and nothing is copied but what is returned (and the lines)."""
    view = memoryview(data)
    end = len(data) if end is None else end
    nl = data.rfind(b"\n", 0, end)
    lines = (
        [
            piece
            for ln in bytes(view[:nl]).split(b"\n")
            for piece in _cut(ln.removesuffix(b"\r").rpartition(b"\r")[2])
        ]
        if nl >= 0
        else []
    )
    start = nl + 1
    held = b""
    if not final and end > start and data[end - 1] == 0x0D:  # maybe the first half of "\r\n"
        end, held = end - 1, b"\r"
    redraw = None
    cr = data.rfind(b"\r", start, end)
    if cr >= 0:
        begin = max(start, data.rfind(b"\r", start, cr) + 1)
        redraw = _cut(bytes(view[begin : min(cr, begin + MAX_ECHO_LINE + 1)]))[0]
        start = cr + 1
    *long, rest = _cut(bytes(view[start:end]) + held)
    return lines + long, redraw or None, rest


@dataclass
class _Followed:
    """A rank log the Tee follows: where it read up to, what it holds back (an unfinished line,
    a redraw not yet due), and the file, open from the moment it exists."""

    prefix: str
    offset: int
    partial: bytes = b""
    redraw: bytes | None = None
    next_redraw: float = 0.0
    fd: int | None = None


class Tee:
    """Echo new lines of the rank logs to the daemon's stdout, prefixed with the rank, escaped
    (echo_line), a line longer than MAX_ECHO_LINE in pieces.

    A progress bar (tqdm: "\r" + the bar, again and again, one newline at the end) is echoed as
    a prefixed line per redraw, the latest one at most every REDRAW_INTERVAL, the rest dropped
    (the log file keeps every byte). Never "\r" + prefix on a terminal: worker bytes must not
    move the operator's cursor, and a line without the prefix must never show. The bar is held
    as at most one unfinished segment, so memory stays bounded: each file is read into one
    buffer the Tee reuses (READ_CHUNK, behind the segment held back), scanned from its end.

    One thread polls the files, so workers write straight to disk and are never slowed by us.
    Each file stays open while followed: a poll with nothing new is one pread per file. Each
    wake-up costs the daemon CPU (on a VM, more than the reading), so the thread wakes only when
    there can be something to echo: every `interval` while lines flow; while only a bar flows
    (output with no newline), when its next redraw comes due (a redraw_interval apart); backing
    off to `idle_interval` while nothing flows. A quiet job, and one drawing a bar, cost next to
    nothing to watch (a tqdm bar: 0.04% of a core, 0.24% when polled every `interval`)."""

    def __init__(
        self,
        out=None,
        interval: float = 0.05,
        idle_interval: float = 0.25,
        redraw_interval: float = REDRAW_INTERVAL,
    ):
        self._out = out or sys.stdout
        self._interval = interval
        self._idle_interval = idle_interval
        self._redraw_interval = redraw_interval
        self._files: dict[Path, _Followed] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._buf = bytearray(
            MAX_ECHO_LINE + READ_CHUNK
        )  # the segment held back, then what is read
        self._thread = supervise.thread("tee", self._run)

    def start(self) -> None:
        self._thread.start()

    def follow(self, path: Path, prefix: str) -> None:
        with self._lock:
            self._files[path] = _Followed(prefix, path.stat().st_size if path.exists() else 0)

    def forget(self, paths: list[Path]) -> None:
        """Print what is left of these files (their last lines) and stop following them."""
        with self._lock:
            for p in paths:
                self._pump(p, final=True)
                entry = self._files.pop(p, None)
                if entry is not None and entry.fd is not None:
                    os.close(entry.fd)

    def close(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=2)
        self.forget(list(self._files))

    def _run(self) -> None:
        wait = self._interval
        while not self._stop.wait(wait):
            with self._lock:
                due = [d for d in [self._pump(p) for p in list(self._files)] if d is not None]
            wait = min(due) if due else min(2 * wait, self._idle_interval)

    def _pump(self, path: Path, final: bool = False) -> float | None:
        """Echo what the file gained since the last call, and a redraw that has come due; how
        soon the file wants looking at again (None: it gained nothing and holds nothing due)."""
        entry = self._files.get(path)
        if entry is None:
            return None
        lines: list[bytes] = []
        gained = full = False
        while True:  # once, or until the file's end when it is the last call
            held = len(entry.partial)
            self._buf[:held] = entry.partial  # the unfinished segment, then what follows it
            try:
                if (
                    entry.fd is None
                ):  # a warm spare opens its rank's log itself, maybe after follow()
                    entry.fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
                n = os.preadv(
                    entry.fd, [memoryview(self._buf)[held : held + READ_CHUNK]], entry.offset
                )
            except OSError:
                n = 0
            full = n == READ_CHUNK
            if not (n or final):
                break
            entry.offset += n
            gained = gained or n > 0
            done, redraw, entry.partial = _split(self._buf, final and not full, held + n)
            if done or redraw:
                entry.redraw = redraw  # a later line or redraw replaces one not yet shown
            lines += done
            if not (final and full):
                break
        flowing = bool(lines)  # lines came (before any redraw is added below)
        now = time.monotonic()
        if final:
            lines += [entry.partial] if entry.partial else [entry.redraw] if entry.redraw else []
            entry.partial, entry.redraw = b"", None
        elif entry.redraw is not None and now >= entry.next_redraw:
            lines.append(entry.redraw)
            entry.redraw, entry.next_redraw = None, now + self._redraw_interval
        if lines:
            text = "".join(echo_line(entry.prefix, ln) for ln in lines)
            try:
                self._out.write(text)
                self._out.flush()
            except (OSError, ValueError):
                pass
        if flowing or full:
            return self._interval
        if (
            gained or entry.redraw is not None
        ):  # a bar: nothing to echo before its next redraw is due
            left = entry.next_redraw - now
            return left + _LATE if left > 0 else self._redraw_interval
        return None
