"""Start a node's workers with torchrun's environment contract, cold or by handing a rank to a
warm spare, and read back what torch's error file says of a worker that failed.

Each worker gets its own session (so its process group can be signalled as one), its output goes
straight to a per-rank file (a slow daemon can never block a worker on a full pipe), and it
carries ELASTICD_AGENT=<token> so a sweep finds every descendant, even one that left the session.

`GroupSpec` is what a start needs, `worker_env` a worker's environment, `master_name` torchrun's
host name for a loopback worker store. `read_error_file` gives the error file's exception line,
escaped and cut short (the worker wrote it; the operator's terminal and the peers show it).
"""

from __future__ import annotations

import functools
import json
import os
import socket
import stat
import string
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

from elasticd import logs, names, safeio
from elasticd.daemon import forkclient, systemd, tee
from elasticd.daemon.forkclient import Child, Spare
from elasticd.worker import flight, heartbeat, proctitle


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
    signals_to_handle: tuple[str, ...] = ("SIGTERM", "SIGINT", "SIGHUP", "SIGQUIT")
    extra_env: dict[str, str] = field(default_factory=dict)

    def worker_args(self, local_rank: int) -> tuple[str, ...]:
        """The script's arguments with torchrun's ${local_rank} macro filled in (string.Template's
        safe_substitute, as torch.distributed.elastic.utils.macros does)."""
        return tuple(
            string.Template(a).safe_substitute(local_rank=str(local_rank)) for a in self.args
        )


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
    env: dict[str, str] = field(default_factory=dict, repr=False)  # what it was started with
    err_path: Path | None = None  # its stderr (log_path holds its stdout), as torchrun's files

    @property
    def pid(self) -> int:
        return self.proc.pid


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
        MASTER_ADDR=master_name(spec.master_addr),
        MASTER_PORT=str(spec.master_port),
        TORCHELASTIC_RESTART_COUNT=str(spec.restart_count),
        TORCHELASTIC_MAX_RESTARTS=str(spec.max_restarts),
        TORCHELASTIC_RUN_ID=spec.run_id,
        TORCHELASTIC_USE_AGENT_STORE="True",
        TORCH_NCCL_ASYNC_ERROR_HANDLING=os.environ.get("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1"),
        TORCHELASTIC_ERROR_FILE=str(paths["error"]),
        # torchrun's agent puts this in its own environment, which its workers inherit
        TORCHELASTIC_SIGNALS_TO_HANDLE=",".join(spec.signals_to_handle),
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
    else:  # torch's Flight Recorder, read when the daemon asks (worker/flight.py)
        env[names.COLLECTIVES_FILE] = str(paths["collectives"])
    if spec.checkpoint_dir:
        env.setdefault(names.CHECKPOINT_DIR, spec.checkpoint_dir)
    env.update(forkclient.worker_defaults(spec.nproc))
    # Unbuffered output (the log is a file) comes from -u, as torchrun's `python -u`:
    # proctitle.command. Not PYTHONUNBUFFERED, which the script's own subprocesses would inherit.
    for key, value in tee.display_env().items():  # a Rich bar as live as on torchrun's terminal
        env.setdefault(key, value)
    env.update(spec.extra_env)
    return env


LOOPBACK = ("127.0.0.1", "::1")


@functools.cache
def master_name(address: str) -> str:
    """MASTER_ADDR for the workers' store at `address`: torchrun gives rank 0's host name
    (socket.getfqdn(), "localhost" on some machines), so where the store is this machine's on a
    loopback address (a single node's) the workers get that name when it leads there; otherwise
    the address, which is all a node learns of its peers' (docs/running.md). Once per address: a
    name lookup can be slow."""
    if address not in LOOPBACK:
        return address
    name = socket.getfqdn()
    try:
        found = {info[4][0] for info in socket.getaddrinfo(name, None, proto=socket.IPPROTO_TCP)}
    except (OSError, UnicodeError):
        return address
    return name if address in found else address


def _paths(spec: GroupSpec, rank: int) -> dict[str, Path]:
    return {
        "log": spec.attempt_dir / f"rank{rank}.log",
        "stderr": spec.attempt_dir / f"rank{rank}.stderr.log",
        "error": spec.attempt_dir / f"rank{rank}.error.json",
        "stack": spec.attempt_dir / f"rank{rank}.stacks.txt",
        "heartbeat": spec.attempt_dir / f"rank{rank}.heartbeat",
        "collectives": spec.attempt_dir / f"rank{rank}.collectives.json",
    }


def _ask_fifo(dump: Path) -> None:
    """The FIFO through which the daemon asks a rank for its collectives (worker/flight.py); a
    filesystem without FIFOs costs that evidence only (the stacks still judge a hang)."""
    try:
        os.mkfifo(flight.ask_path(str(dump)), 0o600)
    except OSError as e:
        logs.get("elasticd.workers").warning("collectives_fifo_failed", path=str(dump), why=str(e))


def spawn(
    spec: GroupSpec, spares: list[Spare] | None = None, local_ranks: list[int] | None = None
) -> list[Worker]:
    """Start the local workers (`local_ranks`: only those, replacing failed ones in place),
    handing ranks to warm spares first (see forkclient).

    Call from the agent loop's thread: the parent-death signal the bootstrap arms fires when the
    *thread* that forked the child exits."""
    safeio.mkdir(spec.attempt_dir)  # fresh in our fresh run directory: an existing one was planted
    spares = spares if spares is not None else []
    workers = []
    for local_rank in range(spec.nproc) if local_ranks is None else local_ranks:
        rank = spec.rank_base + local_rank
        paths = _paths(spec, rank)
        heartbeat.create(str(paths["heartbeat"]))
        if not spec.no_python:
            _ask_fifo(paths["collectives"])
        env = worker_env(spec, local_rank, paths)
        args = spec.worker_args(local_rank)
        proc = None
        while proc is None and (spare := _pick(spares, env)) is not None:
            proc = assign(spare, env, args, paths["log"], paths["stderr"])
        if proc is None:
            with (
                os.fdopen(safeio.create(paths["log"]), "ab") as out,
                os.fdopen(safeio.create(paths["stderr"]), "ab") as err,
            ):
                proc = subprocess.Popen(
                    proctitle.command(
                        "elasticd.worker.bootstrap", proctitle.title(spec.entrypoint, args), args
                    ),
                    env=env,
                    stdin=subprocess.DEVNULL,
                    stdout=out,
                    stderr=err,
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
                env=env,
                err_path=paths["stderr"],
            )
        )
    return workers


def _pick(spares: list[Spare], env: dict[str, str]) -> Spare | None:
    """The spare for the rank whose environment is `env`: one bound to it ahead (its imports
    already done, worker/bound.py), else one not bound to any rank; taken out of `spares`."""
    for bound in (True, False):
        for i, spare in enumerate(spares):
            if (spare.bound is not None) == bound and spare.fits(env):
                return spares.pop(i)
    return None


def assign(
    spare: Spare, env: dict[str, str], args: tuple[str, ...], log: Path, err: Path | None = None
):
    """Give a spare its rank and its stdout and stderr files (new files: the spare creates them;
    no `err`: stderr to `log` too); None if it died meanwhile (then the caller takes another or a
    cold start). The referee hands its replays to spares so too."""
    if spare.proc.poll() is not None:
        return None
    job = {"env": env, "args": list(args), "log": str(log)}
    if err is not None:
        job["err"] = str(err)
    try:
        spare.job.write(json.dumps(job).encode() + b"\n")
        spare.job.close()
    except (BrokenPipeError, OSError):
        spare.proc.kill()
        spare.proc.wait()
        return None
    return spare.proc


MAX_ERROR_FILE = 1 << 20  # bytes of a rank's error file read; torch's format is a few KiB
MAX_EXCEPTION_TEXT = (
    2000  # characters of its message kept: it goes into status, logs and peers' stores
)


def read_error_file(path: Path) -> str | None:
    """The exception line of torch's error-file format (ours or the script's @record), for the
    failure report (read_error_report's first part)."""
    return read_error_report(path)[0]


def error_written(path: Path) -> float | None:
    """When the worker wrote its error file (its modification time, Unix time: finer than the
    file's own whole-second `timestamp`, and the same for ours and the script's @record); None
    where there is none, or it is not a regular file."""
    try:
        st = os.lstat(path)
    except OSError:
        return None
    return st.st_mtime if stat.S_ISREG(st.st_mode) else None


def read_error_report(path: Path) -> tuple[str | None, str | None]:
    """The exception line of torch's error-file format (ours or the script's @record) and its
    traceback (`py_callstack`, for triage's signature). The worker wrote it, and the operator's
    terminal and the peers show it: the line comes back escaped (logs.printable) and cut short;
    None for a missing or malformed file (the exit code still tells). Opened without following
    links or blocking, as a worker could leave a FIFO or a link there."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return None, None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return None, None
        data = json.loads(os.read(fd, MAX_ERROR_FILE))
    except (OSError, ValueError, RecursionError):
        return None, None
    finally:
        os.close(fd)
    msg = data.get("message") if isinstance(data, dict) else None
    stack = None
    if isinstance(msg, dict):
        extra = msg.get("extraInfo")
        stack = extra.get("py_callstack") if isinstance(extra, dict) else None
        stack = stack if isinstance(stack, str) else None
        text = msg.get("message")
        if not (isinstance(text, str) and text.strip()):
            text = stack.strip().splitlines()[-1] if stack and stack.strip() else None
    else:
        text = msg if isinstance(msg, str) else None
    if not text:
        return None, stack
    text = logs.printable(text)
    return (text if len(text) <= MAX_EXCEPTION_TEXT else text[:MAX_EXCEPTION_TEXT] + "..."), stack
