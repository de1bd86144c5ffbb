"""Heartbeat files (a worker writes, the daemon reads): one-off marks and running figures; the
daemon's `Reader`, which takes only values in their range; and hang verdicts.

A heartbeat is a few stores into a per-rank memory-mapped file: no syscall, no lock, a couple of
microseconds, so it can sit in every optimizer step. The daemon pre-creates each file and passes
its path in ELASTICD_HEARTBEAT_FILE. Times are CLOCK_MONOTONIC, which every process on the host
shares, so the daemon compares them with its own clock.

Layout (little endian): magic b"EDHB", version u32, beats u64, step i64, last f64, first f64, then
one-off marks (0.0 until set): exiting f64 (the entrypoint returned or raised), pg_ready f64
(init_process_group returned), state_loaded f64 (the checkpoint library loaded its state), all
written by the worker; and abandon f64, written by the daemon just before it SIGTERMs a group it is
restarting after a failure. The marks feed the hang verdict (exiting), the recovery timeline, and
the checkpoint library's SIGTERM handling (abandon: die now, nothing to save). One more mark, at the
file's end, says the entrypoint returned or exited 0 (returned: written before interpreter teardown,
read with `marked`); the 8 bytes before it, written by the daemon, the generation of the group in
place its ranks are to re-form as at their next step boundary (`ask_regroup`: a node joins,
daemon/grow.py), which the checkpoint library reads at its boundaries (`regroup_asked`).

Then running figures, f64 each, written by the worker for status and metrics (FIGURES): its own work
per step (the time outside the gradient sync, summed, and the steps that measured it: what the
straggler check compares), the step the checkpoint library resumed from, and the library's save and
in-memory refresh costs and cadence, a sharded job's replication (what it sends to the next
node, how long that took, whether it is on: REPLICA_STATES), and the replicas' audit (its count and
cost, and its verdict on a disagreement). Each is one aligned store into the
mapping, at most a few per step.

The worker owns the file and may write anything into it: the daemon's Reader takes only values
in their range (counts and figures finite, from 0 to MAX_FIGURE; times finite, not negative and
not ahead of the host's clock; beats not negative; a step from -1) and keeps the last good
reading of a field in place of anything else (`sanitised`), said once per field and reader. A
NaN or an infinity must never reach the daemon's arithmetic (int(nan) raises, and ended the
daemon).
"""

from __future__ import annotations

import math
import mmap
import os
import struct
import time
from dataclasses import dataclass, replace

from elasticd import safeio

_LAYOUT = struct.Struct("<4sIqqdddddd")
MAGIC = b"EDHB"
SIZE = 512
_BEATS, _STEP, _LAST, _FIRST = 8, 16, 24, 32  # offsets of the fields a beat writes
MARKS = {"exiting": 40, "pg_ready": 48, "state_loaded": 56, "abandon": 64}  # offsets
# One more one-off mark, in the file's last 8 bytes (the figures may grow towards it): the
# entrypoint returned or exited 0, written before interpreter teardown (read with `marked`).
_MARK_AT = {**MARKS, "returned": SIZE - 8}
_REGROUP_AT = SIZE - 16  # the daemon's: the generation to re-form as at the next step boundary
# Running figures after the marks, in this order from offset 72 (f64 each; counts too):
FIGURES = (
    # seconds of the rank's own work (outside backward()'s gradient sync), summed over steps
    "work_total",
    "work_steps",  # steps that measured it
    # the step the checkpoint library resumed from (0: a fresh start); valid once state_loaded
    "resumed",
    "saves",  # CheckpointManager.save() calls
    "save_stall_total",
    "save_write_total",  # seconds: training blocked / background write (rank 0)
    "save_stall_last",
    "save_write_last",
    "refreshes",
    "refresh_total",
    "refresh_last",  # in-memory refreshes and the seconds they blocked training
    "refresh_every",  # the in-memory cadence: steps between refreshes (0: off)
    # a sharded job's replica (checkpoint/memory/replica.py): REPLICA_STATES' index, exchanges
    # done, bytes sent (total, last) and the seconds they took in the background (total, last)
    "replica_state",
    "replica_sends",
    "replica_bytes_total",
    "replica_bytes_last",
    "replica_seconds_total",
    "replica_seconds_last",
    # the replicas' audit (checkpoint/audit.py): audits run and their seconds (summed); and its
    # verdict when they disagreed: disagreements found, the step, the rank outvoted plus one
    # (0: undecided, no majority)
    "sdc_audits",
    "audit_total",
    "sdc_found",
    "sdc_step",
    "sdc_rank",
)
# the replica_state figure's values, by index: not decided yet (no sharded refresh), on, or off
# and why: one node (no other to hold a replica), nodes of unequal or unknown size, no memory
# directory on this node, a partner that failed (memory_replica_off in the worker's log); a node
# whose ranks differ shows the last of these any rank is in (reporting/replication.py)
REPLICA_STATES = ("", "on", "one_node", "uneven_nodes", "no_directory", "failed")
_FIGURES = struct.Struct(f"<{len(FIGURES)}d")
_FIGURES_AT = 72
_FIGURE_INDEX = {
    name: _FIGURES_AT // 8 + i for i, name in enumerate(FIGURES)
}  # index of the f64 view
EXIT_TIMEOUT = 60.0  # the least time a finished rank gets to leave the interpreter
MAX_FIGURE = float(
    2**53
)  # the largest count or total a f64 holds exactly; anything above is no figure
CLOCK_SLACK = 1.0  # seconds a worker's time may be ahead of the daemon's reading (the same clock)


@dataclass(frozen=True)
class Beat:
    beats: int
    step: int  # -1 when the worker never said which step
    last: float  # CLOCK_MONOTONIC of the latest beat; 0.0 before the first
    first: float
    exiting: float = 0.0  # CLOCK_MONOTONIC when the entrypoint finished; 0.0 while it runs
    pg_ready: float = 0.0
    state_loaded: float = 0.0
    abandon: float = 0.0
    figures: tuple[float, ...] = (0.0,) * len(FIGURES)  # FIGURES, in order

    def figure(self, name: str) -> float:
        return self.figures[FIGURES.index(name)]


_READ = _FIGURES_AT + _FIGURES.size
_TIMES = ("last", "first", *MARKS)
_UNWRITTEN = Beat(0, -1, 0.0, 0.0)  # what create() writes


def sanitised(
    beat: Beat, now: float, kept: Beat | None = None
) -> tuple[Beat, list[tuple[str, float]]]:
    """`beat` with every value out of its range replaced by the last good reading of it (`kept`,
    else the value of a file never written: 0, -1 for the step), and the (field, value) pairs
    dropped (see the module's docstring). With no good time of its latest beat, a rank counts as
    not yet beaten: a bad time must not make it silent since the host booted (a hang at once)."""
    base = kept or _UNWRITTEN
    dropped: list[tuple[str, float]] = []
    fields: dict = {}
    if beat.beats < 0:
        dropped.append(("beats", beat.beats))
        fields["beats"] = base.beats
    if beat.step < -1:
        dropped.append(("step", beat.step))
        fields["step"] = base.step
    for name in _TIMES:
        t = getattr(beat, name)
        if not 0.0 <= t <= now + CLOCK_SLACK:  # false for NaN too
            dropped.append((name, t))
            fields[name] = getattr(base, name)
    figures = []
    for name, value, good in zip(FIGURES, beat.figures, base.figures):
        if not 0.0 <= value <= MAX_FIGURE:
            dropped.append((name, value))
            value = good
        figures.append(value)
    if not dropped:
        return beat, dropped
    if fields.get("last", 1.0) == 0.0 or fields.get("first", 1.0) == 0.0:
        fields["beats"] = 0
    return replace(beat, **fields, figures=tuple(figures)), dropped


def create(path: str) -> None:
    """Daemon side: an empty heartbeat file for one rank and attempt, created fresh (never through
    a symlink someone planted; see safeio)."""
    with os.fdopen(safeio.create(path), "wb") as f:
        f.write(_LAYOUT.pack(MAGIC, 1, 0, -1, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0).ljust(SIZE, b"\0"))


def read(path: str) -> Beat | None:
    reader = Reader(path)
    try:
        return reader.read()
    finally:
        reader.close()


class Reader:
    """Daemon side: one rank's heartbeat file held open, so the monitor loop reads it with a
    pread per tick instead of open/read/close (the loop runs ten times a second, for days)."""

    def __init__(self, path: str):
        self.path = path
        self._fd: int | None = None
        self._said: set[str] = set()  # fields whose dropped values were logged
        self._kept: Beat | None = None  # the latest reading, every value in its range

    def read(self) -> Beat | None:
        """The fields as of one instant: a read that a beat overlapped can mix old and new bytes
        (a step count of 0, a last beat at 0.0: "silent for hours"), so read until two reads
        agree."""
        if self._fd is None:
            try:
                self._fd = safeio.open_existing(self.path)
            except OSError:
                return None
        try:
            data = os.pread(self._fd, _READ, 0)
            for _ in range(10):
                again = os.pread(self._fd, _READ, 0)
                if again == data:
                    break
                data = again
        except OSError:
            return None
        if len(data) < _LAYOUT.size:
            return None
        magic, _version, beats, step, last, first, *marks = _LAYOUT.unpack_from(data)
        if magic != MAGIC:
            return None
        figures = (
            _FIGURES.unpack_from(data, _FIGURES_AT) if len(data) >= _READ else (0.0,) * len(FIGURES)
        )
        beat, dropped = sanitised(
            Beat(beats, step, last, first, *marks, figures=figures), time.monotonic(), self._kept
        )
        for name, value in dropped:
            self._say(name, value)
        self._kept = beat
        return beat

    def _say(self, name: str, value: float) -> None:
        """One line per field and reader (a worker rewrites a bad value at every step)."""
        if name in self._said:
            return
        self._said.add(name)
        from elasticd import logs  # daemon side only: workers import this module for Writer

        logs.get("elasticd.health").warning(
            "heartbeat_value_dropped",
            path=self.path,
            field=name,
            value=repr(value),
            hint="out of its range: read as never written",
        )

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


def mark(path: str, name: str) -> None:
    """Record that `name` (a key of MARKS, or "returned") happened now. One pwrite, no mmap, so
    it also works from code that never beats.

    "exiting": from here on the interpreter only tears down (destroy_process_group, atexit,
    module GC: over a second with torch on a busy host), which no optimizer step will ever
    report, so the daemon switches to the exit timeout."""
    try:
        fd = safeio.open_existing(path, os.O_WRONLY)
    except OSError:
        return
    try:
        os.pwrite(fd, struct.pack("<d", time.monotonic()), _MARK_AT[name])
    finally:
        os.close(fd)


class Writer:
    """Worker side. Opened once; `beat()` only writes into shared memory.

    Each field is one aligned 8-byte store through a native-order view (every platform torch
    runs on is little-endian, as the layout): struct.pack_into would zero the fields before
    writing them, and a daemon reading in between would see a rank that never beat."""

    def __init__(self, path: str):
        fd = safeio.open_existing(path, os.O_RDWR)
        try:
            self._map = mmap.mmap(fd, SIZE)
        finally:
            os.close(fd)
        self._ints = memoryview(self._map).cast("q")
        self._floats = memoryview(self._map).cast("d")
        self.beats = 0
        self.step = -1
        self._explicit = False  # once the script names its step, automatic beats keep it
        # the rank's own work per step (bootstrap's backward() wrapper sets the times)
        self.backward_in = 0.0  # CLOCK_MONOTONIC when the latest backward() began
        self.backward_out = 0.0  # ... and when it returned (the gradients synced)
        self._synced = 0.0  # backward_out as of the previous optimizer step
        self._work_total = 0.0
        self._work_steps = 0

    def beat(self, step: int | None = None) -> None:
        now = time.monotonic()
        self.beats += 1
        if step is not None:
            self.step, self._explicit = int(step), True
        elif not self._explicit:
            self.step += 1
        if self.beats == 1:
            self._floats[_FIRST // 8] = now
        self._floats[_LAST // 8] = now
        self._ints[_STEP // 8] = self.step
        self._ints[_BEATS // 8] = self.beats

    def optimizer_stepped(self) -> None:
        """An optimizer step: a beat, and the rank's own work since the previous step's gradient
        sync, if backward() ran in between: from the sync's end to the next backward()'s start
        (data, forward, optimizer, anything the script does; not the wait for other ranks in
        DDP's gradient all-reduce, which ends backward() at the same time on every rank)."""
        self.beat()
        start, end = self._synced, self.backward_in
        if start and end > start:
            self._work_total += end - start
            self._work_steps += 1
            self._floats[_FIGURE_INDEX["work_total"]] = self._work_total
            self._floats[_FIGURE_INDEX["work_steps"]] = self._work_steps
        self._synced = self.backward_out

    def name_step(self, step: int) -> None:
        """The script's own step number from now on (the checkpoint library's), without a beat."""
        self.step, self._explicit = int(step), True
        self._ints[_STEP // 8] = self.step

    def note(self, name: str, value: float) -> None:
        """Set one of FIGURES."""
        self._floats[_FIGURE_INDEX[name]] = value

    def add(self, name: str, value: float) -> None:
        """Add to one of FIGURES (a count or a total)."""
        self._floats[_FIGURE_INDEX[name]] += value


def ask_regroup(path: str, generation: int) -> None:
    """The daemon's word to a rank: re-form as `generation` at your next step boundary (a node
    joins the group in place, daemon/grow.py). One pwrite."""
    try:
        fd = safeio.open_existing(path, os.O_WRONLY)
    except OSError:
        return
    try:
        os.pwrite(fd, struct.pack("<d", float(generation)), _REGROUP_AT)
    finally:
        os.close(fd)


def regroup_asked(path: str | None) -> int:
    """The generation the daemon asked this rank to re-form as (0: none asked)."""
    if not path:
        return 0
    try:
        fd = safeio.open_existing(path)
    except OSError:
        return 0
    try:
        data = os.pread(fd, 8, _REGROUP_AT)
    finally:
        os.close(fd)
    value = struct.unpack("<d", data)[0] if len(data) == 8 else 0.0
    return int(value) if math.isfinite(value) and 0 < value < 1 << 53 else 0


def marked(path: str | None, name: str) -> bool:
    """Has `name` been marked? (The worker asks for "abandon", the daemon for "returned".)"""
    if not path:
        return False
    try:
        fd = safeio.open_existing(path)
    except OSError:
        return False
    try:
        data = os.pread(fd, 8, _MARK_AT[name])
    finally:
        os.close(fd)
    return len(data) == 8 and struct.unpack("<d", data)[0] > 0.0


def verdict(
    beat: Beat | None,
    started: float,
    now: float,
    *,
    expect_beats: bool,
    heartbeat_timeout: float,
    startup_timeout: float,
) -> str | None:
    """Why a running worker counts as hung, or None. `started` is its spawn time (monotonic)."""
    if beat is not None and beat.exiting:
        slow = now - beat.exiting
        limit = max(heartbeat_timeout, EXIT_TIMEOUT)
        if slow > limit:
            return (
                f"still running {slow:.1f}s after its entrypoint returned "
                f"(interpreter exit hung; limit {limit:g}s)"
            )
        return None
    if beat is None or beat.beats == 0:
        if expect_beats and now - started > startup_timeout:
            return f"no heartbeat within startup timeout ({startup_timeout:g}s)"
        return None
    silent = now - beat.last
    if silent > heartbeat_timeout:
        return (
            f"no heartbeat for {silent:.1f}s "
            f"(heartbeat timeout {heartbeat_timeout:g}s, last step {beat.step})"
        )
    return None


def process_verdict(pid: int) -> str | None:
    """A worker that is alive but a zombie never beats again. A stopped one (state T: SIGSTOP, or
    t: a debugger, strace or py-spy attached) is not judged by its state: someone inspecting a
    slow or stuck job must not have it restarted under them, and a stop that lasts is caught by
    the heartbeat timeout like any other silence (a SIGSTOP past the deadline learned from the
    job sooner: daemon/suspicion.py, which judges state T, never t)."""
    import psutil  # daemon side only: workers import this module for Writer

    try:
        status = psutil.Process(pid).status()
    except psutil.Error:
        return None
    return _status_verdict(status)


def _status_verdict(status: str) -> str | None:
    import psutil

    return "process is a zombie" if status == psutil.STATUS_ZOMBIE else None


class ProcessWatch:
    """Daemon side: one worker's /proc/<pid>/stat and statm held open and read with a pread,
    where psutil would build a Process and open and parse the file (per worker, ten times a
    second). An open file pins the process: once it is reaped, reads fail (no verdict, no size)
    rather than describe a new process that reused the pid."""

    # proc(5) state letters that mean "will never beat again", named as psutil names them
    _STATUS = {b"Z": "zombie"}
    _PAGE = os.sysconf("SC_PAGE_SIZE")

    def __init__(self, pid: int):
        self.pid = pid
        self._stat = self._open("stat")
        self._statm = self._open("statm")

    def _open(self, name: str) -> int | None:
        try:
            return os.open(f"/proc/{self.pid}/{name}", os.O_RDONLY | os.O_CLOEXEC)
        except OSError:
            return None  # already gone: nothing to judge

    @staticmethod
    def _read(fd: int | None) -> bytes:
        if fd is None:
            return b""
        try:
            return os.pread(fd, 4096, 0)
        except OSError:
            return b""

    def verdict(self) -> str | None:
        """process_verdict, for this process."""
        data = self._read(self._stat)
        end = data.rfind(b")")  # the command name before it may hold spaces and parentheses
        status = self._STATUS.get(data[end + 2 : end + 3]) if end >= 0 else None
        return _status_verdict(status) if status else None

    def sample(self) -> tuple[str, int] | None:
        """The process's state letter (proc(5): R, S, D, T stopped by a signal, t by a tracer, Z)
        and the CPU time it has used (user + system, clock ticks); None once gone."""
        data = self._read(self._stat)
        end = data.rfind(b")")
        fields = data[end + 2 :].split() if end >= 0 else []
        if len(fields) < 13:
            return None
        return fields[0].decode(errors="replace"), int(fields[11]) + int(fields[12])

    def rss(self) -> int | None:
        """Resident set size in bytes (what psutil's memory_info().rss reads), None once gone."""
        fields = self._read(self._statm).split()
        return int(fields[1]) * self._PAGE if len(fields) > 1 else None

    def close(self) -> None:
        for fd in (self._stat, self._statm):
            if fd is not None:
                os.close(fd)
        self._stat = self._statm = None


_process_writer: Writer | None = None
_opened = False


def writer() -> Writer | None:
    """This process's heartbeat file writer, opened at the first call from the path in
    ELASTICD_HEARTBEAT_FILE; None outside elasticd (or when the file cannot be opened). The public
    `elasticd.heartbeat()`, the bootstrap's hooks and the checkpoint library all write through
    it."""
    global _process_writer, _opened
    if not _opened:
        _opened = True
        from elasticd import names

        path = os.environ.get(names.HEARTBEAT_FILE)
        if path:
            try:
                _process_writer = Writer(path)
            except OSError:
                _process_writer = None
    return _process_writer
