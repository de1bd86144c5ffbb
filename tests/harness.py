"""Test harness: real daemons as subprocesses, their run directories, and leak checks."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parent.parent
SCRIPTS = ROOT / "tests" / "scripts"


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# Short graces, so the tests' daemons restart and stop in seconds; multi-node jobs also give up on a
# silent peer in 3 s.
FAST = ("--restart-grace", "1", "--stop-grace", "3")
FAST_STOP5 = ("--restart-grace", "1", "--stop-grace", "5")  # workers that take a while to stop
FAST_NODES = (*FAST, "--peer-timeout", "3", "--last-call-timeout", "0.5")
# The whole-group restart, for a test whose subject it is (attempt directories, every pid new,
# TORCHELASTIC_RESTART_COUNT, the restart's spares and triage): with --in-place auto, the
# default, a rank's crash or hang is recovered in place where torch can re-form a group
RESTART = ("--in-place", "off")


def node_flags(
    port: int, nnodes: str, job: str = "job", secret: bool = True, host: str = "127.0.0.1"
) -> tuple[str, ...]:
    """One node of a multi-node c10d job whose store is on `host`:`port` (loopback unless a
    namespace's address is given)."""
    return (
        "--nnodes",
        nnodes,
        "--rdzv-endpoint",
        f"{host}:{port}",
        "--rdzv-id",
        job,
        *FAST_NODES,
        *(secret_flags() if secret else ()),
    )


def run_cli(
    *args: str, timeout: float = 120, cwd=None, env: dict | None = None
) -> subprocess.CompletedProcess:
    """`python -m elasticd ARGS` to its end (bounded), its output captured."""
    return subprocess.run(
        [sys.executable, "-m", "elasticd", *args],
        capture_output=True,
        text=True,
        check=False,
        timeout=timeout,
        cwd=cwd or ROOT,
        env=dict(os.environ, **(env or {})),
    )


def assert_one_error(r: subprocess.CompletedProcess, *needles: str) -> None:
    """Bad input's contract: exit 2 and one line `elasticd: error: ...` holding every needle."""
    assert r.returncode == 2, (r.returncode, r.stdout[-2000:], r.stderr[-2000:])
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("elasticd: error: "), r.stderr
    for n in needles:
        assert n in lines[0], lines[0]


def final_lines(stderr: str) -> list[str]:
    """What the daemon wrote besides its JSON events: the lines an operator reads."""
    return [ln for ln in stderr.splitlines() if ln.strip() and not ln.startswith("{")]


def wait_until(predicate, timeout: float, interval: float = 0.05, what: str = "condition"):
    """Poll `predicate` until truthy; fail the test (never hang) after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(interval)


# Every daemon a test session starts carries this tag, and so does everything it starts: the leak
# check then judges only this session's processes, never another test run's on the same machine.
SESSION = f"{os.getpid()}-{time.time_ns()}"


def leftover_processes(exclude: set[int] = frozenset()) -> list[psutil.Process]:
    """Processes of this test session that carry a worker or daemon environment (a leak)."""
    me = os.getpid()
    found = []
    for p in psutil.process_iter():
        if p.pid == me or p.pid in exclude:
            continue
        try:
            env = p.environ()
            if p.status() == psutil.STATUS_ZOMBIE:
                continue
        except psutil.Error:
            continue
        if env.get("ELASTICD_TEST_SESSION") == SESSION:
            found.append(p)
    return found


def alive(pid: int) -> bool:
    """Whether the process runs (a zombie does not: it has exited, its parent has not reaped it)."""
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def gone(pids) -> bool:
    """Whether every one of these processes has exited (the workers of a node, for instance)."""
    return not any(alive(p) for p in pids)


ECHOED = re.compile(r"\[rank\d+\]: ")  # a line of a worker's output, as the daemon echoes it


class Daemon:
    """One `elasticd run` as a separate process (a node), with its own log dir and socket; `prefix`
    runs it through a command that execs it (netns.Network.prefix: inside a network namespace)."""

    def __init__(
        self,
        tmp_path: Path,
        entrypoint: str | None,
        *flags: str,
        args=(),
        name: str = "node0",
        env: dict | None = None,
        log_format: str = "json",
        prefix: tuple[str, ...] = (),
    ):
        self.dir = tmp_path / name
        self.dir.mkdir(parents=True, exist_ok=True)
        self.log_dir = self.dir / "logs"
        self.socket = self.dir / "control.sock"
        cmd = [
            *prefix,
            sys.executable,
            "-m",
            "elasticd",
            "run",
            "--log-dir",
            str(self.log_dir),
            "--socket",
            str(self.socket),
            "--log-format",
            log_format,
            *flags,
        ]
        if entrypoint:
            cmd.append(entrypoint)
        if args:
            cmd += ["--", *args]
        self.stdout_path, self.stderr_path = self.dir / "stdout.txt", self.dir / "stderr.txt"
        full_env = dict(
            os.environ, ELASTICD_TEST_SESSION=SESSION, PYTHONUNBUFFERED="1", **(env or {})
        )
        with open(self.stdout_path, "wb") as out, open(self.stderr_path, "wb") as err:
            self.proc = subprocess.Popen(
                cmd,
                stdout=out,
                stderr=err,
                stdin=subprocess.DEVNULL,
                cwd=ROOT,
                env=full_env,
                start_new_session=True,
            )

    @property
    def pid(self) -> int:
        return self.proc.pid

    def wait(self, timeout: float) -> int:
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            raise AssertionError(
                f"daemon did not finish within {timeout}s\n{self.stderr()[-4000:]}"
            ) from None

    def kill(self, sig: int = signal.SIGKILL) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)

    def stdout(self) -> str:
        return self.stdout_path.read_text(errors="replace")

    def stderr(self, workers: bool = False) -> str:
        """The daemon's own stderr: its events and its lines for people. With `workers`, also
        the workers' stderr it echoes there (`[rankR]: ...`, as a terminal shows both), which
        would otherwise pass for the daemon's (a worker's traceback is no daemon's crash)."""
        text = self.stderr_path.read_text(errors="replace")
        if workers:
            return text
        return "".join(ln for ln in text.splitlines(keepends=True) if not ECHOED.match(ln))

    def events(self) -> list[dict]:
        out = []
        for line in self.stderr().splitlines():
            if line.startswith("{"):
                try:
                    out.append(json.loads(line))
                except ValueError:
                    pass
        return out

    def run_dir(self) -> Path:
        dirs = wait_until(
            lambda: [
                d
                for d in self.log_dir.glob("*")
                if d.is_dir() and d.name not in ("checkpoints", "state")  # state: --state-dir's
            ],
            30,
            what="run dir",
        )
        return dirs[0]

    def attempt_dirs(self) -> list[Path]:
        return sorted(self.run_dir().glob("attempt*"), key=lambda p: int(p.name[7:]))

    def worker_pids(self) -> dict[int, int]:
        """Global rank -> pid of this daemon's live workers of the latest attempt, from its events
        (warm-spawned workers get their environment after exec, so /proc/PID/environ won't tell)."""
        running = [
            e for e in self.events() if e.get("event") == "state" and e.get("new") == "RUNNING"
        ]
        if not running:
            return {}
        return {int(rank): pid for rank, pid in running[-1]["pids"].items() if alive(pid)}

    def log_text(self, rank: int, attempt: int | None = None) -> str:
        dirs = self.attempt_dirs()
        if not dirs:
            return ""
        d = dirs[-1] if attempt is None else self.run_dir() / f"attempt{attempt}"
        text = ""
        for name in (f"rank{rank}.log", f"rank{rank}.stderr.log"):  # its stdout, then its stderr
            try:
                text += (d / name).read_text(errors="replace")
            except OSError:
                pass
        return text

    def all_logs(self) -> str:
        """Every rank log of the latest attempt: which group rank (and so which global ranks) a
        node gets depends on the order the nodes arrived in."""
        dirs = self.attempt_dirs()
        return (
            "".join(p.read_text(errors="replace") for p in sorted(dirs[-1].glob("rank*.log")))
            if dirs
            else ""
        )

    def wait_for_step(
        self, rank: int, step: int, timeout: float, attempt: int | None = None
    ) -> None:
        pat = re.compile(rf"^step {step}\b", re.M)
        wait_until(
            lambda: pat.search(self.log_text(rank, attempt)),
            timeout,
            what=f"rank {rank} to reach step {step}",
        )

    def status(self, *extra: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            [sys.executable, "-m", "elasticd", "status", "--socket", str(self.socket), *extra],
            capture_output=True,
            text=True,
            timeout=30,
            cwd=ROOT,
        )


def end_soon(stop_file: Path, *daemons: Daemon, margin: int = 20) -> int:
    """End a ddp_tutorial.py --stop-file job a few steps from now instead of training out a step
    count long enough for the slowest machine: writes a step `margin` past the furthest any rank
    of the daemons' latest attempts has logged (ranks of a group are within a step of each
    other, so every rank reads it before it gets there and all end at that step)."""
    pat = re.compile(r"^step (\d+)\b", re.M)
    latest = wait_until(
        lambda: max((int(s) for d in daemons for s in pat.findall(d.all_logs())), default=0),
        60,
        what="a step logged",
    )
    tmp = stop_file.with_name(stop_file.name + ".tmp")
    tmp.write_text(str(latest + margin))
    os.replace(tmp, stop_file)
    return latest + margin


def rdzv_config(nnodes: str):
    """The Config of one node of a job on a rendezvous at 127.0.0.1:29400, with the session's
    secret: what the unit tests of the rendezvous' parts build their Rendezvous and Peers from."""
    from elasticd import config

    fields = {"entrypoint": "x.py", "nnodes": nnodes, "rdzv_id": "job"}
    fields |= {"rdzv_endpoint": "127.0.0.1:29400", "rdzv_secret_file": secret_flags()[1]}
    return config.build(fields, None, environ={})


def secret_flags() -> tuple[str, ...]:
    """--rdzv-secret-file with a secret shared by every node a test starts (a multi-node job
    refuses to run without one): a mode-600 file in this session's own temporary directory."""
    if not _secret:
        import atexit
        import shutil
        import tempfile

        folder = tempfile.mkdtemp(prefix="elasticd-test-secret-")
        atexit.register(shutil.rmtree, folder, True)  # the session leaves no file behind
        path = Path(folder) / "job.secret"
        path.write_bytes(os.urandom(24).hex().encode())
        path.chmod(0o600)
        _secret.append(str(path))
    return ("--rdzv-secret-file", _secret[0])


_secret: list[str] = []


def bench(name: str, *args: str, timeout: float) -> subprocess.CompletedProcess:
    """bench/NAME ARGS with this checkout's elasticd, bounded; it must exit 0."""
    env = dict(
        os.environ,
        PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
    )
    r = subprocess.run(
        [sys.executable, str(ROOT / "bench" / name), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=ROOT,
        env=env,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    return r


def script(name: str) -> str:
    return str(SCRIPTS / name)


def as_user(
    uid: int,
    fn,
    *args,
    gid: int | None = None,
    timeout: float = 20.0,
    clear_env: tuple[str, ...] = (),
):
    """fn(*args) in a forked child switched to uid/gid (no supplementary groups): a real
    unprivileged process (root only). Its JSON-able result comes back; an exception it raises
    comes back as {"raised": "Type: message"}. Bounded: the child is killed after `timeout`."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: no pytest machinery, just fn
        code = 1
        try:
            os.close(r)
            for var in clear_env:
                os.environ.pop(var, None)
            os.setgroups([])
            os.setgid(uid if gid is None else gid)
            os.setuid(uid)
            try:
                result = fn(*args)
            except Exception as e:  # noqa: BLE001 - reported to the test
                result = {"raised": f"{type(e).__name__}: {e}"}
            os.write(w, json.dumps(result, default=str).encode())
            code = 0
        finally:
            os._exit(code)
    os.close(w)
    deadline = time.monotonic() + timeout
    try:
        while os.waitpid(pid, os.WNOHANG) == (0, 0):
            if time.monotonic() > deadline:
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
                raise AssertionError(f"the process as uid {uid} did not finish in {timeout:g} s")
            time.sleep(0.01)
        chunks = []
        while chunk := os.read(r, 65536):
            chunks.append(chunk)
    finally:
        os.close(r)
    return json.loads(b"".join(chunks) or b"null")
