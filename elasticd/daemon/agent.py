"""The agent's main loop: the only code that changes daemon state.

It walks the state machine of elasticd/daemon/states.py (State, and the TRANSITIONS that set_state
checks at every change).

Signals and control commands only post to the inbox; the loop waits in one place (_idle), which
feeds the watchdog, takes forked spares and drains the inbox at every wake-up; while running, it
polls workers (exits, heartbeats, process state) and peers every monitor_interval (and at once on
SIGCHLD), acts, and publishes an immutable status snapshot for the control socket. Its helpers
each own one concern: the local workers (group.py), the warm spares (spares.py), the other nodes
(peers.py), backoff and recovery timeline (recovery.py), the status snapshot (status.py), the
inbox (inbox.py); and, for operators, the job's figures (figures.py), stragglers (stragglers.py)
and the node's health check (healthcheck.py), which it calls at a few hooks.
"""

from __future__ import annotations

import math
import os
import signal
import socket
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from elasticd import logs, names
from elasticd.checkpoint.memory import directory
from elasticd.cluster.peers import Peers
from elasticd.cluster.rendezvous import (
    BudgetSpent,
    Rendezvous,
    RendezvousFailed,
    Round,
    StoreUnreachable,
)
from elasticd.config import Config
from elasticd.daemon import processes, supervise
from elasticd.daemon.group import LocalGroup
from elasticd.daemon.inbox import Inbox
from elasticd.daemon.recovery import Recovery
from elasticd.daemon.spares import SparePool
from elasticd.daemon.states import Failure, RestartCause, Scale, State, check_transition
from elasticd.daemon.status import StatusBoard
from elasticd.ops.figures import Figures
from elasticd.ops.healthcheck import EXIT_UNHEALTHY, HealthCheck
from elasticd.ops.stragglers import Stragglers

if TYPE_CHECKING:
    from elasticd.control import channel as control
    from elasticd.ops import healthcheck, metrics

log = logs.get("elasticd.agent")

EXIT_OK, EXIT_FAILED = 0, 1
SPARE_WAIT = (
    20.0  # seconds a start waits for spares still being forked (a cold start takes as long)
)
# seconds `elasticd stacks` may wait for the loop: a rendezvous wait or teardown drains its inbox
# late, and the dump itself takes up to a second
STACKS_ANSWER = 10.0


@dataclass
class StopRequest:
    grace: float  # seconds the workers get to checkpoint and exit
    force: bool = False  # a second stop signal or command: cut the grace short, even mid-teardown


class _Interrupted(Exception):
    """Raised from a signal handler to leave a blocking rendezvous."""


class Agent:
    def __init__(self, cfg: Config, run_dir: Path, on_snapshot=None):
        self.cfg = cfg
        self.node = socket.gethostname()
        self.token = uuid.uuid4().hex
        self.state = State.INIT
        self.rdzv: Rendezvous | None = None
        self.round: Round | None = None
        self.restart_count = 0
        self.first_failure: Failure | None = None
        self.last_failure: Failure | None = None
        self.stop_request: StopRequest | None = None
        self.memory_dir: str | None = (
            None  # in-memory state directory (elasticd.checkpoint.memory), ours to remove
        )
        self.notify = None  # elasticd.daemon.systemd once serve() wires it
        self._next_watchdog = 0.0
        self.inbox = Inbox()
        self.status = StatusBoard(cfg, self.node, run_dir, self.event, on_snapshot)
        self.group = LocalGroup(cfg, self.token, run_dir, self.node, self.event)
        self.spares = SparePool(cfg, self.token, run_dir, self.event)
        self.recovery = Recovery(cfg)
        self.peers: Peers | None = None  # once the store is reached
        self.figures = Figures(time.monotonic())
        self.stragglers = Stragglers(cfg, self.node, self.event, time.time)
        self.health_check = HealthCheck(
            cfg, self.token, self.event, wake=lambda: self.post(("wake",))
        )
        self.metrics: metrics.Exporter | None = None  # serve() binds it
        self.left_line: str | None = None  # the one line a node that left the job exits with
        supervise.report_to(self.event)

    # --- the inbox: the only way other threads and signal handlers reach the loop ---

    def post(self, item: tuple) -> None:
        self.inbox.post(item)

    def _on_signal(self, signum, _frame) -> None:
        if signum == signal.SIGCHLD:
            return  # the wake-up fd already woke the loop
        if self.stop_request is not None:
            self.stop_request.force = True  # a second signal: cut the grace short even mid-teardown
        self.post(("signal", signum))

    def install_signals(self) -> None:
        self.inbox.wake_on_signals()
        for name in (*self.cfg.signals_to_handle, "SIGCHLD"):
            signal.signal(getattr(signal, name), self._on_signal)

    def _drain_inbox(self) -> None:
        asking = []  # `elasticd stacks` requests: however many came, one dump answers them all
        for kind, *rest in self.inbox.take():
            if kind == "signal":
                self.request_stop(self.cfg.stop_grace, f"signal {signal.Signals(rest[0]).name}")
            elif kind == names.STOP:
                timeout = rest[0] if rest and rest[0] is not None else self.cfg.stop_grace
                self.request_stop(float(timeout), "stop command")
            elif kind == names.STACKS:
                asking.append(rest[0])
        if asking:
            reply = self.group.stacks(self.state.value)
            for deferred in asking:
                deferred.give(reply)

    def request_stop(self, grace: float, why: str) -> None:
        if self.stop_request is not None:
            self.stop_request.force = True
            self.event("stop_forced", why=why)
            return
        self.stop_request = StopRequest(grace)
        self.event("stop_requested", why=why, grace=grace)

    def _forced(self) -> bool:
        return self.stop_request is not None and self.stop_request.force

    # --- bookkeeping ---

    def event(self, name: str, level: str = "info", **fields: Any) -> None:
        getattr(log, level)(name, state=self.state.value, **fields)
        self.status.record(name, fields)

    def set_state(self, state: State, **fields: Any) -> None:
        """The one place the state changes: an illegal transition raises (a bug, see states.py)."""
        check_transition(self.state, state)
        self.state = state
        self.event("state", new=state.value, **fields)
        self.status.read_afresh()  # a new state's snapshot reads everything afresh
        self.publish()
        if self.notify is not None:
            self.notify.status(
                f"{state.value}: run {self.cfg.rdzv_id}, restarts {self.restart_count}/"
                f"{self.cfg.max_restarts}"
            )

    def publish(self) -> None:
        now = time.monotonic()
        ranks = self.group.rows(now)
        self.status.publish(
            state=self.state,
            rnd=self.round,
            attempt=self.group.attempt,
            restarts=self.restart_count,
            ranks=ranks,
            last_failure=self.last_failure,
            last_recovery=self.recovery.last,
            memory_dir=self.memory_dir,
            now=now,
            figures=self._figures(ranks, now),
        )
        if self.metrics is not None:
            self.metrics.published(self.status.snapshot, now)

    def _figures(self, ranks: list[dict], now: float) -> dict[str, Any]:
        """The operators' figures of a status snapshot (and so of the metrics), from the
        workers' heartbeats as of now; each worker's row gets its own."""
        beats = self.group.beats()
        self.figures.observe(
            self.group.attempt, [w.local_rank for w in self.group.workers], beats, now
        )
        self.stragglers.observe(
            self.group.attempt,
            [(w.global_rank, w.local_rank) for w in self.group.workers],
            beats,
            now,
        )
        self.figures.annotate(ranks)
        self.stragglers.annotate(ranks)
        return {
            **self.figures.report(now),
            "stragglers": self.stragglers.report(),
            "straggler_reports": self.stragglers.reports,
            "health": self.health_check.report(),
        }

    # --- the loop ---

    def run(self) -> int:
        """Run the job to the end; returns the daemon's exit code."""
        logs.bind(run_id=self.cfg.rdzv_id, node=self.node)
        reaper = processes.make_subreaper()  # a fork server's spares are reparented to us
        if self.group.tee:
            self.group.tee.start()
        self.set_state(State.RENDEZVOUS)
        self.spares.start(reaper)  # they import torch while the nodes meet
        self.memory_dir = directory.create(self.cfg.rdzv_id) if self.cfg.memory_state else None
        if self.memory_dir:
            log.info("memory_state", directory=self.memory_dir)
        try:
            self.rdzv = self._blocking(Rendezvous, self.cfg)
            self.peers = Peers(self.cfg, self.rdzv, self.node, wake=lambda: self.post(("wake",)))
            log.info(
                "rendezvous_store",
                endpoint=self.rdzv.endpoint,
                hosted_here=self.rdzv.is_host,
                node_id=self.rdzv.node_id,
            )
            code = self._loop()
        except _Interrupted:
            code = self._finish(State.STOPPED, EXIT_OK)
        except BudgetSpent as e:
            # the round after our failure (or another node's) found the budget spent
            self.event(
                "restart_budget_spent",
                level="error",
                max_restarts=self.cfg.max_restarts,
                why=str(e),
            )
            self.last_failure = Failure(
                RestartCause.RENDEZVOUS, f"the job failed: {e}", node=self.node
            )
            self.first_failure = self.first_failure or self.last_failure
            code = self._finish(State.FAILED, EXIT_FAILED)
        except RendezvousFailed as e:
            self.last_failure = self.first_failure = Failure(
                RestartCause.RENDEZVOUS, str(e), node=self.node
            )
            code = self._finish(State.FAILED, EXIT_FAILED)
        finally:
            if self.peers is not None:
                self.peers.close()
            self.health_check.close()
            self._teardown(0.0)
            self.spares.close()
            directory.remove(self.memory_dir)  # workers are gone: nobody resumes from it any more
            if self.group.tee:
                self.group.tee.close()
        return code

    def _loop(self) -> int:
        cfg = self.cfg
        while True:
            self._drain_inbox()
            if self.stop_request is not None:
                return self._stop()

            if self.state == State.RENDEZVOUS:
                code = self._start_round()
                if code is not None:
                    return code
                continue

            # RUNNING: act on exits, hangs and peers.
            self._idle(time.monotonic() + cfg.monitor_interval)
            if self.stop_request is not None:
                continue
            why = self.group.check()
            if why is None and self.group.finished:
                self.set_state(State.EXIT_BARRIER)
                ok = self._barrier()
                if not ok:
                    self.event(
                        "exit_barrier_timeout", level="warning", timeout=cfg.exit_barrier_timeout
                    )
                return self._finish(State.SUCCEEDED, EXIT_OK)
            if why is None:
                try:
                    why = self.peers.check(self.round, time.monotonic(), self.group.beats)
                except StoreUnreachable as e:
                    why = Failure(RestartCause.STORE_UNREACHABLE, str(e), node=self.node)
            if why is None:
                now = time.monotonic()
                unhealthy = self.health_check.poll(now)
                if unhealthy is not None:
                    return self._leave(unhealthy)
                self._after_start_up(now)
                if self.status.due(now):
                    self.publish()
                continue
            code = self._restart(why)
            if code is not None:
                return code

    def _idle(
        self, until: float, done: Callable[[], bool] | None = None, *, stoppable: bool = True
    ) -> None:
        """The loop's one way to wait: until `done()` holds (checked before every wait), the
        monotonic deadline `until` passes or, if `stoppable`, a stop is requested; without
        `done`, until the first wake-up (the running loop looks at its workers after each). It
        wakes at least every monitor_interval, and at once for a signal (SIGCHLD too), a command,
        a helper thread's result or a spare, and each time does what the loop owes meanwhile:
        feed systemd's watchdog, take the spares forked, answer the inbox. (The peers' liveness
        beats on a thread of its own, peers.py, whatever the loop does.)"""
        while not (done and done()) and (left := until - time.monotonic()) > 0:
            self.inbox.wait(min(left, self.cfg.monitor_interval), also=self.spares.waitables())
            self._tick()
            self.spares.collect()
            self._drain_inbox()
            if done is None or (stoppable and self.stop_request is not None):
                return

    def _blocking(self, fn, *args, stoppable: bool = True):
        """Run a long blocking call (store connect, rendezvous join, exit barrier) on a helper
        thread while this loop idles and, if `stoppable`, answers a stop request by leaving it.
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
        self._idle(math.inf, done.is_set, stoppable=stoppable)
        if stoppable and self.stop_request is not None:
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

    def _start_round(self) -> int | None:
        """Meet the other nodes and start this node's workers; an exit code if this node must
        not start (its health check failed)."""
        first = self.round is None
        if first and (unhealthy := self._health_gate()):
            return self._leave(
                unhealthy
            )  # never joined: a fixed-size job waits for it, an elastic one goes on
        self.round = rnd = self._blocking(self.rdzv.next_round, self.cfg.nproc_per_node)
        if not first and (unhealthy := self._health_gate()):
            return self._leave(unhealthy)  # the check begun at the restart's teardown failed
        self.recovery.mark("rendezvous_done")
        self.restart_count = self._blocking(self.rdzv.restarts_used)
        logs.bind(group_rank=rnd.group_rank, restart=self.restart_count)
        if rnd.lost:
            self.event(
                "nodes_lost",
                level="warning",
                lost=rnd.lost,
                round=rnd.number,
                group_world_size=rnd.group_world_size,
            )
        self.recovery.started()
        self.peers.new_round(rnd)
        # At the first start the fork server may still be importing torch, and a cold start would
        # take as long: wait for its spares (the peers' liveness beats meanwhile on its own thread).
        # A peer found silent meanwhile is acted on once running.
        self._idle(time.monotonic() + SPARE_WAIT, lambda: not self.spares.pending, stoppable=False)
        self.group.start(rnd, self.restart_count, self.memory_dir, self.spares.spares)
        self.recovery.mark("spawned")
        self.spares.after_spawn()
        self.set_state(
            State.RUNNING,
            world_size=rnd.world_size,
            group_rank=rnd.group_rank,
            group_world_size=rnd.group_world_size,
            pids={w.global_rank: w.pid for w in self.group.workers},
            master=f"{rnd.master_addr}:{rnd.master_port}",
        )
        return None

    def _health_gate(self) -> healthcheck.Result | None:
        """Before a start: the health check's result (waiting for it, stoppable), if it failed."""
        if not self.health_check.on:
            return None
        self.health_check.begin()  # unless the one begun at the restart's teardown still runs
        self._idle(math.inf, lambda: not self.health_check.running, stoppable=True)
        if self.stop_request is not None:
            return None  # acted on by the loop
        result = self.health_check.take() or self.health_check.last
        return result if result is not None and not result.ok else None

    def _leave(self, check: healthcheck.Result) -> int:
        """This node's health check failed: stop its workers, ask the other nodes to restart
        with the reason (their status shows it) and leave the job, exit code 5. The rendezvous
        is not closed: the others go on without this node (elastic), or wait for it to come
        back healthy (fixed size: systemd starts it again)."""
        why = self.health_check.failure(check, self.node)
        self.last_failure = self.first_failure = why
        if self.round is not None and self.round.group_world_size > 1:
            try:  # named lost: the next round does not wait for this node
                self.rdzv.request_restart(
                    self.round,
                    {
                        "summary": self.health_check.left_summary(check, self.node),
                        "node": self.node,
                        "lost": [self.rdzv.node_id],
                    },
                )
            except StoreUnreachable as e:
                self.event("restart_request_failed", level="warning", why=str(e))
        self._teardown(self.cfg.restart_grace, abandon=True)
        joined = self.round is not None
        self.left_line = (
            f"elasticd: this node left the job: {why.reason}"
            if joined
            else f"elasticd: not starting: this node's {why.reason}"
        )
        self.set_state(State.LEFT, exit_code=EXIT_UNHEALTHY, cause=why.summary())
        return EXIT_UNHEALTHY

    def _after_start_up(self, now: float) -> None:
        """Once every new worker has stepped (first beat): report the recovery timeline and
        refill the spares, whose imports would otherwise slow the workers' own start (or 10 s)."""
        if self.spares.refill_due is None and not self.recovery.marks:
            return
        beats = self.group.beats()
        stepped = all(b and b.beats for b in beats)
        if stepped and self.recovery.marks:
            timeline = self.recovery.report(beats)
            self.event("recovered", **timeline)
            self.figures.on_recovered(timeline)
        self.spares.refill_if_due(stepped, now)

    def _restart(self, why: Failure | Scale) -> int | None:
        """Tear the group down and decide: next round, or the job has failed. The restart
        request tells every node why; whether it costs the job's budget is decided by the next
        round's closing (rendezvous.py), which knows whether a node was lost."""
        self.recovery.detected()
        self.figures.on_restart(why, self.group.beats())
        self.health_check.peer_left(why)
        self.set_state(State.RESTARTING, cause=why.summary())
        spends = why.kind.spends_budget
        if spends:
            self.last_failure = why
            self.first_failure = self.first_failure or why
        reason: dict[str, Any] | None = {"summary": why.summary(), "node": self.node}
        if spends:
            reason["spends"] = True
        elif why.kind is RestartCause.SCALE:
            reason.update(summary=why.reason, scale=True, waiting=list(why.ids))
        elif why.kind is RestartCause.NODE_LOST:
            reason["lost"] = list(why.lost)
        else:  # another node asked (its reason is in the store), or we cannot reach the store
            reason = None
        if why.kind is RestartCause.STORE_UNREACHABLE:
            self.event("store_unreachable", level="error", why=why.reason)
        if reason is not None:
            try:
                self.rdzv.request_restart(self.round, reason)
            except StoreUnreachable as e:
                self.event("restart_request_failed", level="warning", why=str(e))
        trained = self.recovery.trained(self.group.beats())
        # a node joining finds every rank healthy: they may save at their next boundary
        self._teardown(self.cfg.restart_grace, abandon=why.kind is not RestartCause.SCALE)
        self.recovery.mark("torn_down")
        self.health_check.begin()  # before the next start: runs beside the backoff and the rendezvous
        if why.kind is RestartCause.CRASH and why.exit_code in self.cfg.fatal_exit_codes:
            self.event("fatal_exit_code", level="error", exit_code=why.exit_code, rank=why.rank)
            return self._fail_job(why)
        # a failure that will find the budget spent (unless a node was lost) waits no backoff
        if spends and self.rdzv.restarts_used() < self.cfg.max_restarts:
            delay = self.recovery.backoff(trained)
            self.event(
                "restart_backoff",
                delay=round(delay, 3),
                restarts_used=self.restart_count,
                budget=self.cfg.max_restarts,
                crash_streak=self.recovery.crash_streak,
            )
            # waited out in full (a SIGCHLD must not cut it short), but not past a stop request
            self._idle(time.monotonic() + delay, lambda: self.stop_request is not None)
        self.set_state(State.RENDEZVOUS)
        return None

    def _fail_job(self, failure: Failure) -> int:
        # the job's closing carries why: a node arriving later leaves with it
        return self._finish(
            State.FAILED, EXIT_FAILED, why=f"failed: {failure.summary()} (node {self.node})"
        )

    def _teardown(self, grace: float, abandon: bool = False) -> None:
        """Stop the local group (see LocalGroup.stop) and close its round's worker store."""
        if not self.group.workers:
            return
        self.group.stop(
            0.0 if self._forced() else grace,
            abandon=abandon,
            keep=self.spares.keep() | self.health_check.pids(),
            cut_short=self._forced,
            spared=self.health_check.sessions(),
        )
        if self.round is not None:
            self.round.close()

    def _stop(self) -> int:
        grace = self.stop_request.grace
        self.set_state(State.STOPPING, cause=RestartCause.STOP.value)
        if self.notify is not None:
            self.notify.stopping()
            self.notify.extend_timeout(
                grace + self.cfg.kill_timeout + self.cfg.exit_barrier_timeout
            )
        self._teardown(grace)
        if self.round is not None and self.round.group_world_size > 1:
            self._barrier()
        return self._finish(State.STOPPED, EXIT_OK)

    def _barrier(self) -> bool:
        """The exit barrier (rendezvous.exit_barrier); a store that stops answering ends it."""
        try:
            return self._blocking(
                self.rdzv.exit_barrier, self.round, self.cfg.exit_barrier_timeout, stoppable=False
            )
        except StoreUnreachable as e:
            self.event("exit_barrier_store_unreachable", level="warning", why=str(e))
            return False

    def _finish(self, state: State, code: int, why: str = "") -> int:
        self._teardown(0.0)
        if self.rdzv is not None:
            self.rdzv.close(
                job_finished=state in (State.SUCCEEDED, State.FAILED),
                why=why or ("finished" if state == State.SUCCEEDED else "failed"),
            )
        fields: dict[str, Any] = {"exit_code": code, "restarts": self.restart_count}
        if state == State.FAILED and self.first_failure:
            fields["first_failure"] = self.first_failure.summary()
        self.set_state(state, **fields)
        return code


def serve(cfg: Config, run_dir: Path) -> int:
    """Run the daemon: control socket, sd_notify, death guard, then the agent loop."""
    from elasticd.control import channel as control
    from elasticd.daemon import systemd

    logs.adopt_torch()
    agent = Agent(cfg, run_dir)
    agent.install_signals()
    exporter = _metrics_exporter(cfg, agent)
    guard = supervise.Kept(
        "guard",
        lambda: processes.start_guard(agent.token),
        risk="until a new guard is up, a SIGKILLed daemon leaves its workers' children behind",
    )

    def listen(path: Path) -> control.ControlServer:
        server = control.ControlServer(
            path,
            snapshot=lambda: agent.status.snapshot,
            command=lambda req: _accept_command(agent, req),
            operators_group=cfg.operators_group or None,
        )
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
        guard.close()
        if exporter is not None:
            exporter.close()
        from elasticd.config import ConfigError

        raise ConfigError(str(e)) from None
    agent.notify = systemd
    systemd.ready(f"{agent.state.value} run {cfg.rdzv_id}")
    log.info(
        "daemon_started",
        run_dir=str(run_dir),
        socket=str(server.path),
        entrypoint=cfg.entrypoint,
        nproc_per_node=cfg.nproc_per_node,
        nnodes=cfg.nnodes,
        pid=os.getpid(),
    )
    try:
        code = agent.run()
    finally:
        server.close()
        guard.close()
        if exporter is not None:
            exporter.close()
    if agent.left_line:
        sys_err(agent.left_line)
    elif agent.state == State.FAILED and agent.first_failure:
        sys_err(
            f"elasticd: job failed after {agent.restart_count} restart(s): {agent.first_failure.summary()}"
        )
    return code


def _metrics_exporter(cfg: Config, agent: Agent) -> metrics.Exporter | None:
    """--metrics-address / --metrics-textfile: the exporter, serving (bound) before the job starts;
    an address that cannot be bound is a ConfigError (one line, exit 2)."""
    if not (cfg.metrics_address or cfg.metrics_textfile):
        return None
    from elasticd.config import ConfigError, parse_metrics_address
    from elasticd.ops import metrics

    address = parse_metrics_address(cfg.metrics_address) if cfg.metrics_address else None
    exporter = metrics.Exporter(
        address, cfg.metrics_textfile or None, lambda: agent.status.snapshot
    )
    try:
        exporter.start()
    except OSError as e:
        raise ConfigError(
            f"--metrics-address {cfg.metrics_address} cannot be bound here ({e.strerror or e}): "
            "give a free port on one of this node's addresses"
        ) from None
    agent.metrics = exporter
    return exporter


def _accept_command(agent: Agent, req: dict) -> dict | control.Deferred:
    """The loop's side of the control commands the server forwards (control.COMMANDS), by name."""
    handler = FORWARDED.get(req.get("command"))
    return (
        handler(agent, req)
        if handler
        else {"ok": False, "error": f"unknown command {req.get('command')!r}"}
    )


def _stop_command(agent: Agent, req: dict) -> dict:
    agent.post((names.STOP, req.get("timeout")))
    return {"ok": True, "accepted": names.STOP}


def _stacks_command(agent: Agent, req: dict) -> control.Deferred:
    """The loop dumps them, and answers, at its next tick."""
    from elasticd.control import channel as control

    reply = control.Deferred(timeout=STACKS_ANSWER)
    agent.post((names.STACKS, reply))
    return reply


FORWARDED = {names.STOP: _stop_command, names.STACKS: _stacks_command}


def sys_err(line: str) -> None:
    import sys

    sys.stderr.write(logs.printable(line) + "\n")  # it quotes a worker's exception
    sys.stderr.flush()
