"""The agent's main loop: the only code that changes daemon state.

INIT -> RENDEZVOUS -> RUNNING --all local workers exit 0--> EXIT_BARRIER -> SUCCEEDED
             ^            | worker failed / hung / peer asked for restart / node joined
             |            v
             +------ RESTARTING (stop the local group, budget + backoff) --budget spent--> FAILED
RUNNING / RESTARTING --stop request or SIGTERM--> STOPPING -> STOPPED

Signals and control commands only append to an inbox and poke a wake-up pipe; the loop drains
the inbox, polls workers (exits, heartbeats, process state) and peers every monitor_interval (and
at once on SIGCHLD), acts, and publishes an immutable status snapshot for the control socket.
"""

from __future__ import annotations

import collections
import enum
import os
import select
import signal
import socket
import threading
import time
import uuid
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import tenacity

from elasticd import health, logs, memory, proctitle, workers
from elasticd.config import Config
from elasticd.rendezvous import Rendezvous, RendezvousFailed, Round

log = logs.get("elasticd.agent")


class State(str, enum.Enum):
    INIT = "INIT"
    RENDEZVOUS = "RENDEZVOUS"
    RUNNING = "RUNNING"
    RESTARTING = "RESTARTING"
    EXIT_BARRIER = "EXIT_BARRIER"
    SUCCEEDED = "SUCCEEDED"
    FAILED = "FAILED"
    STOPPING = "STOPPING"
    STOPPED = "STOPPED"


EXIT_OK, EXIT_FAILED = 0, 1
PUBLISH_EVERY = 0.5  # seconds between status snapshots while running
RESUME_READ_EVERY = 2.0  # seconds between reads of the checkpoint and in-memory state for status
SPARE_WAIT = 20.0  # seconds a start waits for spares still being forked (a cold start takes as long)
# seconds `elasticd stacks` may wait for the loop: a rendezvous wait or teardown drains its inbox
# late, and the dump itself takes up to a second
STACKS_ANSWER = 10.0
PEER_BEAT_EVERY = 1.0  # seconds between liveness beats to peers, and at most a tenth of --peer-timeout


@dataclass(frozen=True)
class Failure:
    """What went wrong first, with everything an engineer needs to find it."""

    kind: str  # exited | signaled | hung | peer | fatal
    reason: str
    rank: int | None = None
    pid: int | None = None
    exit_code: int | None = None
    exception: str | None = None
    log_path: str | None = None
    stacks: tuple[str, ...] = ()
    node: str = ""
    at: float = field(default_factory=time.time)

    def summary(self) -> str:
        parts = [f"rank {self.rank}" if self.rank is not None else f"node {self.node}", self.reason]
        if self.exception:
            parts.append(self.exception)
        if self.log_path:
            parts.append(f"log {self.log_path}")
        if self.stacks:
            parts.append(f"stacks {', '.join(self.stacks)}")
        return "; ".join(parts)


class _Interrupted(Exception):
    """Raised from a signal handler to leave a blocking rendezvous."""


def backoff_delay(cfg: Config, attempt: int) -> float:
    """Exponential backoff with jitter (tenacity's policy) before restart number `attempt`."""
    if cfg.restart_backoff <= 0:
        return 0.0
    wait = tenacity.wait_exponential_jitter(initial=cfg.restart_backoff, max=cfg.restart_backoff_max,
                                            jitter=cfg.restart_backoff)
    state = tenacity.RetryCallState(retry_object=tenacity.Retrying(), fn=None, args=(), kwargs={})
    state.attempt_number = attempt
    return float(wait(state))


class Agent:
    def __init__(self, cfg: Config, run_dir: Path, on_snapshot=None):
        self.cfg = cfg
        self.run_dir = run_dir
        self.node = socket.gethostname()
        self.token = uuid.uuid4().hex
        self.state = State.INIT
        self.started = time.time()
        self.rdzv: Rendezvous | None = None
        self.round: Round | None = None
        self.workers: list[workers.Worker] = []
        self.attempt = 0  # local attempts, used for directory names
        self.restart_count = 0
        self.first_failure: Failure | None = None
        self.last_failure: Failure | None = None
        self.events: collections.deque = collections.deque(maxlen=50)
        self.stop_requested: float | None = None  # grace for the stop
        self.force = False
        self.seen_beats = False
        self._inbox: collections.deque = collections.deque()
        self._wake_r, self._wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        self._on_snapshot = on_snapshot or (lambda snap: None)
        self._snapshot: dict[str, Any] = {}
        self._last_waiting_check = 0.0
        self._next_peer_beat = 0.0
        self._last_publish = 0.0
        self._last_checkpoint: str | None = None  # path of the newest checkpoint reported
        self._checkpoint: dict[str, Any] | None = None  # its manifest entry, as last read
        self._memory_step: int | None = None  # the newest in-memory state, as last read
        self._next_resume_read = 0.0
        self._odd_since: dict[int, float] = {}  # pid -> when it was first seen stopped or a zombie
        self._watches: dict[int, tuple[health.Reader, health.ProcessWatch]] = {}  # pid -> held-open files
        self.notify = None  # elasticd.systemd once serve() wires it
        self._next_watchdog = 0.0
        self.tee = workers.Tee() if cfg.tee else None
        self.spares: list[workers.Spare] = []  # warm processes waiting for a rank
        self.forkserver: workers.ForkServer | None = None  # forks the spares (fresh interpreters where unfit)
        self.memory_dir: str | None = None  # in-memory state directory (elasticd.memory), ours to remove
        self._spares_due: float | None = None
        # Recovery timeline of the latest restart: monotonic marks, reported once every rank stepped.
        self._timeline: dict[str, float] = {}
        self.last_recovery: dict[str, float] | None = None
        self._attempt_started = time.monotonic()
        self._crash_streak = 0  # consecutive failed attempts that never trained (backoff exponent)

    # --- inbox: the only way other threads and signal handlers reach the loop ---

    def post(self, item: tuple) -> None:
        """Thread- and signal-safe: deque.append is atomic, the pipe write wakes the loop."""
        self._inbox.append(item)
        try:
            os.write(self._wake_w, b"!")
        except BlockingIOError:
            pass

    def _on_signal(self, signum, _frame) -> None:
        if signum == signal.SIGCHLD:
            return  # the wake-up fd already woke the loop
        if self.stop_requested is not None:
            self.force = True  # a second signal: cut the grace short even mid-teardown
        self.post(("signal", signum))

    def install_signals(self) -> None:
        signal.set_wakeup_fd(self._wake_w, warn_on_full_buffer=False)
        for name in (*self.cfg.signals_to_handle, "SIGCHLD"):
            signal.signal(getattr(signal, name), self._on_signal)

    def _wait(self, timeout: float) -> None:
        try:
            select.select([self._wake_r], [], [], max(0.0, timeout))
        except InterruptedError:
            pass
        try:
            while os.read(self._wake_r, 4096):
                pass
        except BlockingIOError:
            pass

    def _drain_inbox(self) -> None:
        asking = []  # `elasticd stacks` requests: however many came, one dump answers them all
        while self._inbox:
            kind, *rest = self._inbox.popleft()
            if kind == "signal":
                self.request_stop(self.cfg.stop_grace, f"signal {signal.Signals(rest[0]).name}")
            elif kind == "stop":
                timeout = rest[0] if rest and rest[0] is not None else self.cfg.stop_grace
                self.request_stop(float(timeout), "stop command")
            elif kind == "stacks":
                asking.append(rest[0])
        if asking:
            reply = self._stacks()
            for deferred in asking:
                deferred.give(reply)

    def _stacks(self) -> dict:
        """`elasticd stacks`: every live local worker's threads, as they are now."""
        if self.cfg.no_python:
            return {"ok": False, "error": "--no-python workers are not Python: they cannot dump their stacks"}
        dumps = workers.dump_stacks([w for w in self.workers if w.exit_code is None], self.cfg.stack_signal)
        if not dumps:
            return {"ok": False, "error": f"no worker is running right now (state {self.state.value}); try again"}
        self.event("stacks_dumped", ranks=[w.global_rank for w, _ in dumps])
        return {"ok": True, "stacks": [{"rank": w.global_rank, "local_rank": w.local_rank, "pid": w.pid,
                                        "path": str(w.stack_path), "text": text} for w, text in dumps]}

    def request_stop(self, grace: float, why: str) -> None:
        if self.stop_requested is not None:
            self.force = True
            self.event("stop_forced", why=why)
            return
        self.stop_requested = grace
        self.event("stop_requested", why=why, grace=grace)

    # --- bookkeeping ---

    def event(self, name: str, level: str = "info", **fields: Any) -> None:
        getattr(log, level)(name, state=self.state.value, **fields)
        self.events.append({"time": time.time(), "event": name, **fields})

    def set_state(self, state: State, **fields: Any) -> None:
        self.state = state
        self.event("state", new=state.value, **fields)
        self._next_resume_read = 0.0  # a new state's snapshot reads everything afresh
        self.publish()
        if self.notify is not None:
            self.notify.status(f"{state.value}: run {self.cfg.rdzv_id}, restarts {self.restart_count}/"
                               f"{self.cfg.max_restarts}")

    def publish(self) -> None:
        now = self._last_publish = time.monotonic()
        ranks = []
        for w in self.workers:
            beat = self._beat(w)
            ranks.append({
                "rank": w.global_rank, "local_rank": w.local_rank, "pid": w.pid,
                "state": "running" if w.exit_code is None else workers.describe_exit(w.exit_code),
                "heartbeat_age": round(now - beat.last, 3) if beat and beat.beats else None,
                "step": beat.step if beat and beat.beats else None,
                "rss_bytes": self._watch(w)[1].rss() if w.exit_code is None else None,
                "log": str(w.log_path),
            })
        rnd = self.round
        checkpoint, memory_step = self._resume_points(now)
        self._snapshot = {
            "state": self.state.value,
            "run_id": self.cfg.rdzv_id,
            "node": self.node,
            "pid": os.getpid(),
            "group_rank": rnd.group_rank if rnd else None,
            "group_world_size": rnd.group_world_size if rnd else None,
            "world_size": rnd.world_size if rnd else None,
            "round": self.attempt,
            "restarts": self.restart_count,
            "max_restarts": self.cfg.max_restarts,
            "uptime": round(time.time() - self.started, 1),
            "run_dir": str(self.run_dir),
            "entrypoint": self.cfg.entrypoint,
            "workers": ranks,
            # seconds since each peer node's liveness beat last moved (--peer-timeout: lost)
            "peers": {r: round(now - seen, 1) for r, (_, seen) in sorted(rnd.peer_seen.items())} if rnd else {},
            "last_failure": asdict(self.last_failure) if self.last_failure else None,
            "last_recovery": self.last_recovery,
            "checkpoint": checkpoint,
            "memory_step": memory_step,
            "events": list(self.events)[-10:],
        }
        self._on_snapshot(self._snapshot)

    def _resume_points(self, now: float) -> tuple[dict[str, Any] | None, int | None]:
        """What a restart would resume from: the newest checkpoint on this node (with its age)
        and the newest in-memory step. Read every RESUME_READ_EVERY seconds, not at every
        publish: they are files (the checkpoint directory perhaps on a shared filesystem that
        every node's daemon would keep busy), and status does not need them to the step."""
        if now >= self._next_resume_read:
            self._next_resume_read = now + RESUME_READ_EVERY
            self._checkpoint = self._read_checkpoint()
            self._memory_step = memory.newest_step(self.memory_dir)
        info = self._checkpoint
        if info and info.get("time"):
            info = {**info, "age": round(time.time() - info["time"], 1)}
        return info, self._memory_step

    def _read_checkpoint(self) -> dict[str, Any] | None:
        """The newest checkpoint on this node, from its manifest (the daemon never writes any)."""
        directory = os.environ.get("ELASTICD_CHECKPOINT_DIR") or self.cfg.checkpoint_dir
        if not directory:
            return None
        from elasticd.checkpoint.format import latest_info

        try:
            info = latest_info(directory)
        except Exception:  # noqa: BLE001 - status must never fail on a damaged directory
            return None
        if not info:
            return None
        if info.get("path") != self._last_checkpoint:
            self._last_checkpoint = info.get("path")
            self.event("checkpoint_seen", step=info.get("step"), epoch=info.get("epoch"), path=info.get("path"))
        return info

    @property
    def snapshot(self) -> dict[str, Any]:
        return self._snapshot

    # --- the loop ---

    def run(self) -> int:
        """Run the job to the end; returns the daemon's exit code."""
        logs.bind(run_id=self.cfg.rdzv_id, node=self.node)
        reaper = workers.make_subreaper()  # a fork server's spares are reparented to us
        if self.tee:
            self.tee.start()
        self.set_state(State.RENDEZVOUS)
        if self.cfg.warm_spawn and reaper:
            self.forkserver = workers.ForkServer(self.token, self.cfg.nproc_per_node, self.cfg.preload,
                                                 self.run_dir / "spares.log", self._shown())
        self._top_up_spares()  # they import torch while the nodes meet
        self.memory_dir = memory.create(self.cfg.rdzv_id) if self.cfg.memory_state else None
        if self.memory_dir:
            log.info("memory_state", directory=self.memory_dir)
        try:
            self.rdzv = self._blocking(Rendezvous, self.cfg)
            log.info("rendezvous_store", endpoint=self.rdzv.endpoint, hosted_here=self.rdzv.is_host)
            code = self._loop()
        except _Interrupted:
            code = self._finish(State.STOPPED, EXIT_OK)
        except RendezvousFailed as e:
            self.last_failure = self.first_failure = Failure("fatal", str(e), node=self.node)
            code = self._finish(State.FAILED, EXIT_FAILED)
        finally:
            self._teardown(0.0)
            workers.discard_spares(self.spares)
            if self.forkserver:
                self.forkserver.close()
            memory.remove(self.memory_dir)  # workers are gone: nobody resumes from it any more
            if self.tee:
                self.tee.close()
        return code

    def _top_up_spares(self) -> None:
        """Ask the fork server for the spares missing, or start fresh interpreters where it is unfit."""
        if not self.cfg.warm_spawn:
            return
        self._collect_spares()
        self.spares = [p for p in self.spares if p.proc.poll() is None]
        fs = self.forkserver
        missing = self.cfg.nproc_per_node - len(self.spares) - (fs.pending if fs else 0)
        if fs:
            fs.request(missing)
        else:
            self.spares += [workers.start_spare(self.token, self.cfg.nproc_per_node, self.cfg.preload,
                                                self.run_dir / "spares.log", self._shown()) for _ in range(missing)]
        self._spares_due = None

    def _shown(self) -> list[str]:
        """The workers' command line as ps shows it (see proctitle)."""
        return proctitle.title(self.cfg.entrypoint, self.cfg.args)

    def _keep(self) -> frozenset[int]:
        """Processes a teardown sweep must spare: the spares and their fork server."""
        keep = {p.pid for p in self.spares}
        if self.forkserver:
            keep.add(self.forkserver.proc.pid)
        return frozenset(keep)

    def _collect_spares(self, timeout: float = 0.0) -> None:
        """Take the spares the fork server forked; if it quit, say why and fall back."""
        fs = self.forkserver
        if fs is None:
            return
        if fs.pending:
            self.spares += fs.collect(timeout)
        if not fs.usable:
            self.event("fork_server_off", level="warning",
                       reason=fs.unfit or workers.describe_exit(fs.proc.poll() or 0),
                       fallback="warm spares are fresh interpreters importing torch themselves")
            fs.close()
            self.forkserver = None
            self._top_up_spares()

    def _wait_for_spares(self) -> None:
        """At the first start the fork server may still be importing torch, and a cold start
        would take as long: wait for its spares (up to SPARE_WAIT) while the loop keeps its
        duties, above all this node's liveness beat, without which peers would take the node for
        dead after --peer-timeout. A peer found silent meanwhile is acted on once running."""
        deadline = time.monotonic() + SPARE_WAIT
        while self.forkserver and self.forkserver.pending and time.monotonic() < deadline:
            self._collect_spares(self.cfg.monitor_interval)
            self._tick()
            self._drain_inbox()
            self._beat_peers(time.monotonic())

    def _after_start_up(self, now: float) -> None:
        """Once every new worker has stepped (first beat): report the recovery timeline and
        refill the spares, whose imports would otherwise slow the workers' own start (or 10 s)."""
        if self._spares_due is None and not self._timeline:
            return
        beats = [self._beat(w) for w in self.workers]
        stepped = all(b and b.beats for b in beats)
        if stepped and self._timeline:
            t = dict(self._timeline)
            # the workers' own marks: the slowest rank decides when the group is ready
            for mark in ("pg_ready", "state_loaded"):
                if all(getattr(b, mark) for b in beats):
                    t[mark] = max(getattr(b, mark) for b in beats)
            t["first_step"] = max(b.first for b in beats)
            # seconds since the failure was detected, in the order they happen
            self.last_recovery = {k: round(t[k] - t["detected"], 3) for k in
                                  ("torn_down", "rendezvous_done", "spawned", "pg_ready", "state_loaded",
                                   "first_step") if k in t}
            self.event("recovered", **self.last_recovery)
            self._timeline = {}
        if self._spares_due is not None and (stepped or now >= self._spares_due):
            self._top_up_spares()

    def _loop(self) -> int:
        cfg = self.cfg
        while True:
            self._drain_inbox()
            if self.stop_requested is not None:
                return self._stop()

            if self.state == State.RENDEZVOUS:
                self._start_round()
                continue

            # RUNNING: act on exits, hangs and peers.
            self._wait(cfg.monitor_interval)
            self._tick()
            self._collect_spares()
            self._drain_inbox()
            if self.stop_requested is not None:
                continue
            failure = self._check_workers()
            if failure == "done":
                self.set_state(State.EXIT_BARRIER)
                ok = self._blocking(self.rdzv.exit_barrier, self.round, cfg.exit_barrier_timeout, stoppable=False)
                if not ok:
                    self.event("exit_barrier_timeout", level="warning", timeout=cfg.exit_barrier_timeout)
                return self._finish(State.SUCCEEDED, EXIT_OK)
            if failure is None:
                failure = self._check_peers()
            if failure is None:
                now = time.monotonic()
                self._after_start_up(now)
                if now - self._last_publish > PUBLISH_EVERY:
                    self.publish()
                continue
            code = self._restart(failure)
            if code is not None:
                return code

    def _blocking(self, fn, *args, stoppable: bool = True):
        """Run a long blocking call (store connect, rendezvous join, exit barrier) on a helper
        thread while this loop keeps the watchdog fed and, if `stoppable`, answers a stop request.
        Workers are still spawned from this thread."""
        box: dict[str, Any] = {}
        done = threading.Event()

        def call():
            try:
                box["value"] = fn(*args)
            except BaseException as e:  # noqa: BLE001 - handed to the loop
                box["error"] = e
            finally:
                done.set()
                self.post(("wake",))

        threading.Thread(target=call, name="elasticd-rendezvous", daemon=True).start()
        while not done.is_set():
            self._wait(self.cfg.monitor_interval)
            self._tick()
            self._drain_inbox()
            if stoppable and self.stop_requested is not None:
                raise _Interrupted()
        if "error" in box:
            raise box["error"]
        return box["value"]

    def _tick(self) -> None:
        """Feed systemd's watchdog: only from this loop, so a wedged loop starves it."""
        if self.notify is not None and time.monotonic() >= self._next_watchdog:
            interval = self.notify.watchdog_interval()
            if interval:
                self.notify.watchdog()
                self._next_watchdog = time.monotonic() + interval
            else:
                self._next_watchdog = float("inf")

    def _start_round(self) -> None:
        if self._timeline:
            self._timeline["rendezvous"] = time.monotonic()
        self.round = rnd = self._blocking(self.rdzv.next_round, self.cfg.nproc_per_node)
        if self._timeline:
            self._timeline["rendezvous_done"] = time.monotonic()
        self.restart_count = self.rdzv.restarts_used()
        logs.bind(group_rank=rnd.group_rank, restart=self.restart_count)
        self.attempt += 1
        self._attempt_started = time.monotonic()
        self._next_peer_beat = 0.0  # a new round tells its peers at once that we are alive
        spec = workers.GroupSpec(
            entrypoint=self.cfg.entrypoint, args=self.cfg.args, nproc=self.cfg.nproc_per_node,
            rank_base=rnd.rank_base, world_size=rnd.world_size, group_rank=rnd.group_rank,
            group_world_size=rnd.group_world_size, master_addr=rnd.master_addr,
            master_port=rnd.master_port, restart_count=self.restart_count,
            max_restarts=self.cfg.max_restarts, run_id=self.cfg.rdzv_id,
            attempt_dir=self.run_dir / f"attempt{self.attempt}", token=self.token,
            stack_signal=self.cfg.stack_signal, checkpoint_dir=self.cfg.checkpoint_dir, role=self.cfg.role,
            virtual_local_rank=self.cfg.virtual_local_rank, no_python=self.cfg.no_python,
            extra_env={memory.ENV: self.memory_dir} if self.memory_dir else {},
        )
        self._wait_for_spares()
        self.workers = workers.spawn(spec, self.spares)
        if self._timeline:
            self._timeline["spawned"] = time.monotonic()
        if self.forkserver:
            self._top_up_spares()  # a fork each: nothing the starting workers would notice
        elif self.cfg.warm_spawn:
            self._spares_due = time.monotonic() + 10.0
        for w in self.workers:
            if self.tee and self.cfg.echoed(w.local_rank):
                self.tee.follow(w.log_path, workers.console_prefix(self.cfg.role, w.global_rank, w.local_rank))
        self.set_state(State.RUNNING, world_size=rnd.world_size, group_rank=rnd.group_rank,
                       group_world_size=rnd.group_world_size, pids={w.global_rank: w.pid for w in self.workers},
                       master=f"{rnd.master_addr}:{rnd.master_port}")

    def _check_workers(self) -> Failure | str | None:
        exited = workers.poll(self.workers)
        bad = [w for w in exited if w.exit_code != 0]
        if bad:
            w = min(bad, key=lambda w: (w.exit_code >= 0, w.global_rank))  # a signal death is the cause
            kind = "signaled" if w.exit_code < 0 else "exited"
            return Failure(kind, workers.describe_exit(w.exit_code), rank=w.global_rank, pid=w.pid,
                           exit_code=w.exit_code, exception=workers.read_error_file(w.error_path),
                           log_path=str(w.log_path), node=self.node)
        if all(w.exit_code is not None for w in self.workers):
            return "done"
        now = time.monotonic()
        for w in self.workers:
            if w.exit_code is not None:
                continue
            beat = self._beat(w)
            if beat and beat.beats:
                self.seen_beats = True
            why = self._lasting(w.pid, self._watch(w)[1].verdict(), now) or health.verdict(
                beat, w.started, now, expect_beats=self.cfg.require_heartbeat or self.seen_beats,
                heartbeat_timeout=self.cfg.heartbeat_timeout, startup_timeout=self.cfg.startup_timeout)
            if why and w.proc.poll() is not None:
                return self._check_workers()  # it exited just now: report the exit, not a hang
            if why:
                # a --no-python worker has no stack-dump handler: the signal would only end it
                dumps = [] if self.cfg.no_python else workers.dump_stacks(self.workers, self.cfg.stack_signal)
                return Failure("hung", f"hung: {why}", rank=w.global_rank, pid=w.pid, log_path=str(w.log_path),
                               stacks=tuple(str(d.stack_path) for d, _ in dumps), node=self.node)
        return None

    def _watch(self, w: workers.Worker) -> tuple[health.Reader, health.ProcessWatch]:
        """The worker's heartbeat file and /proc entries, opened once per attempt: the loop reads
        them every tick, and opening (and parsing through psutil) each time was most of its CPU."""
        watch = self._watches.get(w.pid)
        if watch is None:
            watch = self._watches[w.pid] = (health.Reader(str(w.heartbeat_path)), health.ProcessWatch(w.pid))
        return watch

    def _beat(self, w: workers.Worker) -> health.Beat | None:
        return self._watch(w)[0].read()

    def _close_watches(self) -> None:
        for reader, proc in self._watches.values():
            reader.close()
            proc.close()
        self._watches.clear()

    def _beat_peers(self, now: float) -> int | None:
        """Beat this node's liveness, at most every min(1 s, --peer-timeout / 10); returns the
        group rank of a peer silent for --peer-timeout."""
        if now < self._next_peer_beat:
            return None
        self._next_peer_beat = now + min(PEER_BEAT_EVERY, self.cfg.peer_timeout / 10)
        return self.rdzv.beat_and_check_peers(self.round, now)

    def _lasting(self, pid: int, why: str | None, now: float, hold: float = 1.0) -> str | None:
        """A process state counts only once it has lasted `hold` seconds: a dying multi-threaded
        process shows as a zombie, and a debugger attaching stops it, for a moment."""
        if why is None:
            self._odd_since.pop(pid, None)
            return None
        return why if now - self._odd_since.setdefault(pid, now) >= hold else None

    def _check_peers(self) -> Failure | None:
        rnd = self.round
        now = time.monotonic()
        if rnd.group_world_size > 1:
            # A restart request is read every tick (a failure anywhere restarts every node within
            # one); liveness only has to beat --peer-timeout, so its round trips come less often.
            reason = self.rdzv.restart_reason(rnd)
            if reason is not None:
                return Failure("peer", f"peer asked for restart: {reason.get('summary', reason)}",
                               node=reason.get("node", "?"))
            lost = self._beat_peers(now)
            if lost is not None:
                return Failure("peer", f"node with group rank {lost} went silent for {self.cfg.peer_timeout:g}s",
                               node=self.node)
        if rnd.group_world_size < self.cfg.max_nodes and now - self._last_waiting_check > 1.0:
            self._last_waiting_check = now
            waiting = self.rdzv.nodes_waiting()
            if waiting:
                return Failure("scale", f"{waiting} node(s) waiting to join", node=self.node)
        return None

    def _restart(self, failure: Failure) -> int | None:
        """Tear the group down and decide: next round, or the job has failed."""
        self._timeline = {"detected": time.monotonic()}
        self.set_state(State.RESTARTING, cause=failure.summary())
        spends = failure.kind in ("exited", "signaled", "hung")
        if spends:
            self.last_failure = failure
            self.first_failure = self.first_failure or failure
            self.rdzv.request_restart(self.round, {"summary": failure.summary(), "node": self.node})
        elif failure.kind == "scale":
            self.rdzv.request_restart(self.round, {"summary": failure.reason, "node": self.node, "scale": True})
        trained = self._attempt_trained()
        # a node joining finds every rank healthy: they may save at their next boundary
        self._teardown(self.cfg.restart_grace, abandon=failure.kind != "scale")
        self._timeline["torn_down"] = time.monotonic()
        if failure.kind in ("exited",) and failure.exit_code in self.cfg.fatal_exit_codes:
            self.event("fatal_exit_code", level="error", exit_code=failure.exit_code, rank=failure.rank)
            return self._fail_job(failure)
        if spends:
            used = self.rdzv.spend_restart()
            if used > self.cfg.max_restarts:
                self.event("restart_budget_spent", level="error", max_restarts=self.cfg.max_restarts)
                return self._fail_job(failure)
            self._crash_streak = 0 if trained else self._crash_streak + 1
            delay = backoff_delay(self.cfg, max(1, self._crash_streak))
            self.event("restart_backoff", delay=round(delay, 3), restart=used, budget=self.cfg.max_restarts,
                       crash_streak=self._crash_streak)
            self._sleep(delay)
        self.set_state(State.RENDEZVOUS)
        return None

    def _attempt_trained(self) -> bool:
        """Did the failed attempt get anywhere? Every rank stepped, or (for a script that never
        beats) it ran longer than the longest backoff. Such a failure starts a new crash streak:
        backoff is for crash loops, and a job that trained for hours must not pay 30 s per crash."""
        if time.monotonic() - self._attempt_started >= self.cfg.restart_backoff_max:
            return True
        beats = [self._beat(w) for w in self.workers]
        return bool(beats) and all(b and b.beats for b in beats)

    def _sleep(self, seconds: float) -> None:
        """Wait out a backoff in full (signals such as SIGCHLD wake _wait early), feeding the
        watchdog and giving up early only for a stop request."""
        deadline = time.monotonic() + seconds
        while (left := deadline - time.monotonic()) > 0 and self.stop_requested is None:
            self._wait(min(left, self.cfg.monitor_interval))
            self._tick()
            self._drain_inbox()

    def _fail_job(self, failure: Failure) -> int:
        self.rdzv.record_job_failure(f"{failure.summary()} (node {self.node})")
        self.rdzv.close(job_finished=True)
        return self._finish(State.FAILED, EXIT_FAILED)

    def _teardown(self, grace: float, abandon: bool = False) -> None:
        """Stop the local group. `abandon`: a restart after a failure; the workers are told (a
        heartbeat-file mark) so that the checkpoint library ends them at SIGTERM instead of
        waiting for a step boundary that a broken collective will never reach."""
        if not self.workers:
            return
        t0 = time.monotonic()
        if abandon:
            for w in self.workers:
                health.mark(str(w.heartbeat_path), "abandon")
        stuck = workers.stop(self.workers, self.token, 0.0 if self.force else grace, self.cfg.kill_timeout,
                             keep=self._keep(), cut_short=lambda: self.force)
        if self.tee:
            self.tee.forget([w.log_path for w in self.workers])
        self.event("workers_stopped", seconds=round(time.monotonic() - t0, 3),
                   exits={w.global_rank: w.exit_code for w in self.workers}, unkillable=stuck)
        self.workers = []
        self._close_watches()
        if self.round is not None:
            self.round.close()

    def _stop(self) -> int:
        self.set_state(State.STOPPING)
        if self.notify is not None:
            self.notify.stopping()
            self.notify.extend_timeout(self.stop_requested + self.cfg.kill_timeout + self.cfg.exit_barrier_timeout)
        self._teardown(self.stop_requested or 0.0)
        if self.round is not None and self.round.group_world_size > 1:
            self._blocking(self.rdzv.exit_barrier, self.round, self.cfg.exit_barrier_timeout, stoppable=False)
        return self._finish(State.STOPPED, EXIT_OK)

    def _finish(self, state: State, code: int) -> int:
        self._teardown(0.0)
        if self.rdzv is not None:
            self.rdzv.close(job_finished=state in (State.SUCCEEDED, State.FAILED))
        fields: dict[str, Any] = {"exit_code": code, "restarts": self.restart_count}
        if state == State.FAILED and self.first_failure:
            fields["first_failure"] = self.first_failure.summary()
        self.set_state(state, **fields)
        return code


def serve(cfg: Config, run_dir: Path) -> int:
    """Run the daemon: control socket, sd_notify, death guard, then the agent loop."""
    from elasticd import control, systemd

    logs.adopt_torch()
    agent = Agent(cfg, run_dir)
    agent.install_signals()
    guard = workers.start_guard(agent.token)

    def listen(path: Path) -> control.ControlServer:
        server = control.ControlServer(path, snapshot=lambda: agent.snapshot,
                                       command=lambda req: _accept_command(agent, req),
                                       operators_group=cfg.operators_group or None)
        server.start()
        return server

    try:
        try:
            server = listen(Path(cfg.socket) if cfg.socket else control.default_socket_path())
        except control.AlreadyRunning:
            if cfg.socket:  # a path the user chose is theirs to change
                raise
            # another job of this user on this node holds the default: listen beside it
            server = listen(control.second_socket_path(control.default_socket_path(), cfg.rdzv_id))
    except control.ControlError as e:
        guard.stdin.close()
        from elasticd.config import ConfigError

        raise ConfigError(str(e)) from None
    agent.notify = systemd
    systemd.ready(f"{agent.state.value} run {cfg.rdzv_id}")
    log.info("daemon_started", run_dir=str(run_dir), socket=str(server.path), entrypoint=cfg.entrypoint,
             nproc_per_node=cfg.nproc_per_node, nnodes=cfg.nnodes, pid=os.getpid())
    try:
        code = agent.run()
    finally:
        server.close()
        guard.stdin.close()
        try:
            guard.wait(timeout=10)
        except Exception:  # noqa: BLE001 - never hang the exit on the guard
            guard.kill()
    if agent.state == State.FAILED and agent.first_failure:
        sys_err(f"elasticd: job failed after {agent.restart_count} restart(s): {agent.first_failure.summary()}")
    return code


def _accept_command(agent: Agent, req: dict) -> dict | control.Deferred:
    if req.get("command") == "stop":
        agent.post(("stop", req.get("timeout")))
        return {"ok": True, "accepted": "stop"}
    if req.get("command") == "stacks":  # the loop dumps them, and answers, at its next tick
        from elasticd import control

        reply = control.Deferred(timeout=STACKS_ANSWER)
        agent.post(("stacks", reply))
        return reply
    return {"ok": False, "error": f"unknown command {req.get('command')!r}"}


def sys_err(line: str) -> None:
    import sys

    sys.stderr.write(logs.printable(line) + "\n")  # it quotes a worker's exception
    sys.stderr.flush()
