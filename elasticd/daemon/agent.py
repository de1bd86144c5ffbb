"""The agent's main loop (`Agent`: rendezvous -> run -> watch -> restart / stop / exit barrier):
the only code that changes daemon state.

It walks the state machine of elasticd/lifecycle/states.py (State, and the TRANSITIONS that
set_state checks at every change).

Signals and control commands only post to the inbox; the loop waits in one place (waits.py's idle),
which feeds the watchdog, takes forked spares and drains the inbox at every wake-up; while running,
it polls workers (exits, heartbeats, process state) and peers every monitor_interval (and at once on
SIGCHLD), acts, and publishes an immutable status snapshot for the control socket. Its helpers each
own one concern: the local workers (group.py), the warm spares (spares.py), the other nodes
(cluster/peers.py), backoff and recovery timeline (recovery.py), the status snapshot and the
operators' figures in it (status.py: reporting/figures.py, reporting/stragglers.py), the inbox and
stop requests (inbox.py), the waits (waits.py); and the node's health check (daemon/healthcheck.py),
which it calls at a few hooks.

The collaborators that reach outside the daemon (store and rounds, peers, local group, spares,
health check, subreaper) are made from factories `Agent` is given, the real ones by default:
tests/unit/daemon/test_agent.py gives fakes and drives every edge of `TRANSITIONS`.
"""

from __future__ import annotations

import dataclasses
import math
import socket
import time
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, Any

from elasticd import logs
from elasticd.checkpoint.memory import directory
from elasticd.cluster import kv as kvmod
from elasticd.cluster import reverse_dns, silence
from elasticd.cluster.errors import BudgetSpent, Deterministic, RendezvousFailed, StoreUnreachable
from elasticd.cluster.peers import Peers
from elasticd.cluster.rendezvous import Rendezvous
from elasticd.cluster.rounds import Round
from elasticd.cluster.timing import LOST_SILENCE
from elasticd.config import Config
from elasticd.daemon import (
    grow,
    hangs,
    inplace,
    processes,
    referee,
    replay_elsewhere,
    replay_verdict,
    sdc,
)
from elasticd.daemon.group import LocalGroup
from elasticd.daemon.healthcheck import HealthCheck
from elasticd.daemon.inbox import Inbox, StopRequest, Stops
from elasticd.daemon.quarantine import Quarantine
from elasticd.daemon.recovery import Recovery
from elasticd.daemon.spares import SparePool
from elasticd.daemon.status import StatusBoard
from elasticd.daemon.waits import Interrupted, Waits
from elasticd.exit_codes import ExitCode
from elasticd.lifecycle import supervise, triage
from elasticd.lifecycle.states import (
    Failure,
    RestartCause,
    Scale,
    State,
    check_transition,
    first_elsewhere,
    restart_request,
)
from elasticd.lifecycle.triage import FailureClass

if TYPE_CHECKING:
    from elasticd.daemon import healthcheck
    from elasticd.reporting import metrics

log = logs.get("elasticd.agent")

# seconds a start waits for spares still being forked (a cold start takes as long)
SPARE_WAIT = 20.0
# seconds a replay waits for one: a replay in a fresh interpreter took 3-7 s on the 2-core VM
REPLAY_SPARE_WAIT = 3.0


class Agent:
    """The loop and its state. The collaborators that reach outside the daemon (the store and its
    rounds, the peers, the workers, the spares, the health check, the subreaper) are made from
    the factories given, the real ones by default: a unit test gives fakes."""

    def __init__(
        self,
        cfg: Config,
        run_dir: Path,
        on_snapshot=None,
        *,
        rendezvous=Rendezvous,  # (cfg) -> the store and its rounds
        peers=Peers,
        group=LocalGroup,
        spares=SparePool,
        health_check=HealthCheck,
        subreaper=processes.make_subreaper,  # () -> whether the daemon became one
    ):
        self.cfg = cfg
        self.node = socket.gethostname()
        self.token = uuid.uuid4().hex
        self.state = State.INIT
        self.rdzv: Rendezvous | None = None
        self.round: Round | None = None
        self.restart_count = 0
        self.first_failure: Failure | None = None
        self.last_failure: Failure | None = None
        self._failed_in: int | None = None  # the round whose attempt last_failure ended
        self._held: float | None = None  # since when a local consequence waits (`_behind`)
        # in-memory state directory (elasticd.checkpoint.memory), ours to remove
        self.memory_dir: str | None = None
        self.recovery_path = None  # daemon/inplace.Path, chosen at start (serve.py)
        self.forming = None  # daemon/inplace.Forming: the generation whose handles are awaited
        self.in_place_kv = None  # (round number, its workers' store's client): inplace.store
        self.in_place_watch = None  # the round's wait for the next generation: inplace_watch.py
        # monotonic: since when a rank waits, unwound, for a generation not announced yet
        # (inplace.follow): the peers' evidence that a silent node is gone, as a rank's death
        self.in_place_waits = None
        self.hang_hold = None  # daemon/hangs.Hold: a hang judged across nodes in place, waited on
        self.hang_answered = (-1, -1)  # (round, inquiry) this node last gave its stacks for
        self.notify = None  # elasticd.daemon.systemd once serve() wires it
        self._connect, self._peers, self._subreaper = rendezvous, peers, subreaper
        self.inbox = Inbox()
        self.stops = Stops(self.inbox, cfg.signals_to_handle, cfg.stop_grace, self.event)
        self.status = StatusBoard(cfg, self.node, run_dir, self.event, on_snapshot)
        self.group = group(cfg, self.token, run_dir, self.node, self.event)
        self.spares = spares(cfg, self.token, run_dir, self.event)
        self.waits = Waits(
            self.inbox,
            cfg.monitor_interval,
            chores=self._chores,
            waitables=self.spares.waitables,
            stopping=lambda: self.stop_request is not None,
            notify=lambda: self.notify,
        )
        self.recovery = Recovery(cfg)
        self.peers: Peers | None = None  # once the store is reached
        self.health_check = health_check(
            cfg, self.token, self.event, wake=lambda: self.post(("wake",))
        )
        self.quarantine = Quarantine(cfg, self.node, self.event)  # the node's failures, kept
        self.sdc = sdc.Corruption(self.event)  # the replicas' audit's verdicts
        self.metrics: metrics.Exporter | None = None  # serve() binds it
        self.left_line: str | None = None  # the one line a node that left the job exits with
        self.reaper: bool | None = None  # whether the daemon became a subreaper (warm_up)
        supervise.report_to(self.event)

    def warm_up(self) -> None:
        """Become the spares' subreaper and start the fork server, whose torch import then runs
        beside the rest of the daemon's start (serve() calls it early; run() otherwise)."""
        if self.reaper is None:
            logs.bind(run_id=self.cfg.rdzv_id, node=self.node)
            self.reaper = self._subreaper()  # a fork server's spares are reparented to us
            self.spares.start(self.reaper)  # they import torch while the nodes meet

    # --- the inbox: the only way other threads and signal handlers reach the loop ---

    def post(self, item: tuple) -> None:
        self.inbox.post(item)

    def install_signals(self) -> None:
        self.stops.install_signals()

    @property
    def stop_request(self) -> StopRequest | None:
        return self.stops.request

    def _drain_inbox(self) -> None:
        self.inbox.drain(self.stops, lambda: self.group.stacks(self.state.value))

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
        """A status snapshot (status.py, with the operators' figures) and, if served, metrics."""
        now = time.monotonic()
        self.status.publish(
            state=self.state,
            rnd=self.round,
            group=self.group,
            restarts=self.restart_count,
            last_failure=self.last_failure,
            last_recovery=self.recovery.last,
            memory_dir=self.memory_dir,
            health={**self.health_check.report(), **self.quarantine.report()},
            peers=self.peers.silences(now) if self.peers is not None else {},
            now=now,
        )
        if self.metrics is not None:
            self.metrics.published(self.status.snapshot, now)

    # --- the loop ---

    def run(self) -> int:
        """Run the job to the end; returns the daemon's exit code."""
        self.warm_up()
        if self.group.tee:
            self.group.tee.start()
        self.set_state(State.RENDEZVOUS)
        self.memory_dir = directory.create(self.cfg.rdzv_id) if self.cfg.memory_state else None
        if self.memory_dir:
            log.info("memory_state", directory=self.memory_dir)
        try:
            self.rdzv = self.waits.blocking(self._connect, self.cfg)
            self.rdzv.in_place = self.group.in_place  # its record says where it cannot join so
            self.peers = self._peers(
                self.cfg, self.rdzv, self.node, wake=lambda: self.post(("wake",))
            )
            log.info(
                "rendezvous_store",
                endpoint=self.rdzv.endpoint,
                hosted_here=self.rdzv.is_host,
                node_id=self.rdzv.node_id,
            )
            self._watch_lookups(self.rdzv.addr, "" if self.cfg.etcd else self.cfg.rdzv_host)
            code = self._loop()
        except Interrupted:  # a stop while blocked on the store
            code = self._interrupted()
        except BudgetSpent as e:  # the round after a failure (ours or not): spent, or deterministic
            code = self._verdict(e)
        except RendezvousFailed as e:
            why = Failure(RestartCause.RENDEZVOUS, str(e), node=self.node)
            self.last_failure = self.first_failure = why
            code = self._finish(State.FAILED, ExitCode.FAILED)
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

    @staticmethod
    def _watch_lookups(*hosts: str) -> None:
        """The stores' addresses whose name torch's TCPStore looks up on every connection: this
        node's (the store's host looks it up), the rendezvous store's, the round's workers'
        store's; a slow lookup is one warning line (cluster/reverse_dns.py)."""
        for host in hosts:
            reverse_dns.watch(host)

    def _interrupted(self) -> int:
        """A stop that came while the loop waited on the store: running (the referee's wait for
        the other node's word), a stop as any other, the workers given the grace; joining, or
        in a restart (a replay's word), the workers are down already: stopped there; meeting a
        round with its workers running (daemon/grow.py), they are given the grace too."""
        if self.state is State.RUNNING or (self.rdzv is not None and self.rdzv.carry is not None):
            return self._stop()
        return self._finish(State.STOPPED, ExitCode.OK)

    def _verdict(self, e: BudgetSpent) -> int:
        """The job's end as the round after a failure wrote it (cluster/closing.py): the budget
        spent, or the failure deterministic, whose line (naming both attempts) is the final one."""
        det = isinstance(e, Deterministic)
        klass = self.last_failure.failure_class if self.last_failure else ""
        name = "deterministic_failure" if det else "restart_budget_spent"
        self.event(name, level="error", max_restarts=self.cfg.max_restarts, why=str(e))
        why = Failure(
            RestartCause.RENDEZVOUS, f"the job failed: {e}", node=self.node, failure_class=klass
        )
        self.last_failure, self.first_failure = why, why if det else self.first_failure or why
        return self._finish(State.FAILED, ExitCode.DETERMINISTIC if det else ExitCode.FAILED)

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
            self.waits.idle(time.monotonic() + cfg.monitor_interval)
            if self.stop_request is not None:
                continue
            why = self._local()
            if why is self.HOLD:
                continue
            if why is None and self.group.finished:
                return self._succeed()
            if why is None:
                try:
                    why = self._peers_check()
                except StoreUnreachable as e:
                    why = Failure(RestartCause.STORE_UNREACHABLE, str(e), node=self.node)
            if why is None:
                now = time.monotonic()
                unhealthy = self.health_check.poll(now)
                if unhealthy is not None:
                    return self._leave(unhealthy)
                why = self._quiet(now)
                if why is None:
                    continue
            code = self._recover(why)
            if code is not None:
                return code

    def _recover(self, why: Failure | Scale) -> int | None:
        """A failure's culprit named, judged and recovered (in place or by a restart): None to
        go on, or the daemon's exit code."""
        why = hangs.name_culprit(why, self)
        if why is None:  # judged across nodes in place: the verdict is waited for
            return None
        why, left = self._judge(why)
        if left is not None:
            return left
        return self._restart(why)

    def _quiet(self, now: float) -> Failure | None:
        """A tick where nothing failed: the start-up's report, the generation in place (one
        another node announced; a survivor stuck, or one that finished meanwhile, which no
        generation can then form without: that is a failure), another node's hang inquiry and
        its verdict (hangs.answer: a rank of ours named is a failure), the spares' learning,
        status."""
        self._after_start_up(now)
        inplace.follow(self, now)
        why = hangs.answer(self, now) or inplace.unstick(self, now)
        if why is None:
            self.spares.learn(self.group.workers)
            if self.status.due(now):
                self.publish()
        return why

    def _peers_check(self) -> Failure | Scale | None:
        """The peers' check; ranks waiting, unwound, for a generation nobody announced
        (inplace.follow) are its evidence as a worker's death of a closed connection is."""
        return self.peers.check(
            self.round,
            time.monotonic(),
            self.group.beats,
            died_at=self.in_place_waits,  # None: no rank waits; died_of then says nothing
            died_of=silence.WAITING,
        )

    def _judge(self, why: Failure | Scale) -> tuple[Failure | Scale, int | None]:
        """Whether a failure strikes this node, and whether it leaves the job for it (an exit
        code). Never a strike by its text: the GPU driver's own evidence (daemon/driver.py), the
        replicas' audit's numbers (daemon/sdc.py) or the health check before the restart."""
        if not isinstance(why, Failure):
            return why, None
        if why.driver and self.quarantine.strike(why):
            return why, self._leave_job(why, *self.quarantine.departure(self.round is not None))
        if why.failure_class == FailureClass.SDC.value:
            why, blamed, again = self.sdc.judge(why, self.group.beats(), self.round, self._referee)
            self.status.figures.on_sdc(self.sdc.report())
            # one of this node's ranks outvoted: a strike; again in this run: quarantined
            if blamed and self.quarantine.strike(why, at_once=again):
                return why, self._leave_job(why, *self.quarantine.departure(True))
        return why, None

    def _referee(self, step: int) -> referee.Call:
        """Two replicas disagreed at `step`: the referee's replay of it (daemon/referee.py),
        within --replay-timeout."""
        spec = self.group.spec
        if self.cfg.replay_timeout <= 0:
            return referee.Call(None, "--replay-timeout 0: no replay", 0.0)
        across = replay_elsewhere.referee_across(self, step)  # the two ranks on two nodes
        if across is not None:
            return across
        return referee.referee(
            spec.attempt_dir if spec is not None else None,
            step,
            self.cfg.replay_timeout,
            lambda until, done: self.waits.idle(until, done),
            self.spare,
        )

    def spare(self) -> Any:
        """A warm spare for a replay (a forkclient.Spare), waiting up to REPLAY_SPARE_WAIT for one
        the fork server is forking (a refill after the start the failure ended, say): a replay in
        a fresh interpreter costs more. None if none came (one line saying why)."""
        pool, t0 = self.spares, time.monotonic()
        self.waits.idle(t0 + REPLAY_SPARE_WAIT, pool.ready_or_none_coming)
        spare = pool.take()
        if spare is None:  # the replay runs cold: seconds more, and why, for whoever reads on
            self.event("replay_spare_missing", waited=round(time.monotonic() - t0, 2),
                       pool=pool.missing())  # fmt: skip
        return spare

    def _succeed(self) -> int:
        """Every local worker exited 0: the exit barrier, then the job's end."""
        self.set_state(State.EXIT_BARRIER)
        if not self._barrier():
            timeout = self.cfg.exit_barrier_timeout
            self.event("exit_barrier_timeout", level="warning", timeout=timeout)
        return self._finish(State.SUCCEEDED, ExitCode.OK)

    HOLD: Any = object()  # `_behind`: still looking for the failure a local one follows

    def _local(self) -> Failure | None | Any:
        """This node's workers' failure (LocalGroup.check), looked behind (`_behind`)."""
        why, exited = self.group.check(), True
        if why is None and self._several():
            # a rank that raised and still exits (its interpreter's teardown can take a second):
            # a death of a closed connection is looked behind from its error file
            why, exited = self.group.raised(), False
        return self._behind(why, exited)

    def _several(self) -> bool:
        return self.round is not None and self.round.group_world_size > 1

    def _behind(self, why: Failure | None, exited: bool = True) -> Failure | Scale | None | Any:
        """A local worker's death of a closed connection (triage.consequence) in a job of several
        nodes follows another node's going: for up to LOST_SILENCE, look for it (HOLD meanwhile)
        - a watched node silent since about then (lost: silence.judge, two beats) or another
        node's restart request - and make that the cause, ours a consequence of it; past that,
        ours as it is (the next round's closing may still find the node lost: _first_elsewhere),
        or, for a rank that has not `exited` yet, None (its exit is acted on). Any other
        failure, or none, as it is."""
        rnd = self.round
        if not (
            isinstance(why, Failure)
            and why.kind in (RestartCause.CRASH, RestartCause.SIGNAL)
            and triage.consequence(why.exception)
            and rnd is not None
            and self._several()
        ):
            self._held = None
            return why if exited else None  # a rank still exiting: its exit is acted on
        now = time.monotonic()
        if self._held is None:
            self._held = now
            self.event("consequence_held", rank=why.rank, why=(why.exception or "")[:200])
        died_at = now - max(0.0, time.time() - why.at)  # its error file's time, monotonic
        try:
            theirs = self.peers.check(rnd, now, self.group.beats, died_at=died_at)
        except StoreUnreachable:
            theirs = None
        if isinstance(theirs, Failure) and (theirs.lost or theirs.kind is RestartCause.PEER):
            self._held = None
            then = f"rank {why.rank} (node {why.node}): {why.exception}"[:160]
            then += f" (+{max(0.0, why.at - theirs.at):.2f} s)" if theirs.lost else ""
            return dataclasses.replace(theirs, consequences=(then, *theirs.consequences))
        if now - self._held < LOST_SILENCE:
            return self.HOLD
        if not exited:
            return None  # still exiting: its exit is acted on as it is
        self._held = None
        return why

    def _chores(self) -> None:
        """What the loop owes at every wake-up of its waits (besides systemd's watchdog): take
        the spares forked, answer the inbox."""
        self.spares.collect()
        self._drain_inbox()

    def _start_round(self) -> int | None:
        """Meet the other nodes and start this node's workers; an exit code if this node must
        not start (its health check failed)."""
        first = self.round is None
        if first and (unhealthy := self._health_gate()):
            # never joined: a fixed-size job waits for it, an elastic one goes on
            return self._leave(unhealthy)
        previous = self.round
        self.round = rnd = self.waits.blocking(self.rdzv.next_round, self.cfg.nproc_per_node)
        self._watch_lookups(rnd.master_addr)
        carried = self.rdzv.carry is not None
        kept = grow.joined(self, previous, rnd)
        if carried and not kept:  # the group did not go on: its workers stop, as at a restart
            self._stop_workers(self.cfg.restart_grace)
        if previous is not None:
            self._first_elsewhere(previous)
        if not first and (unhealthy := self._health_gate()):
            return self._leave(unhealthy)  # the check begun at the restart's teardown failed
        self.recovery.mark("rendezvous_done")
        self.restart_count = self.waits.blocking(self.rdzv.restarts_used)
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
        if self.group.in_place and rnd.fresh:
            why = f"{grow.cannot_start(rnd.fresh)}: this round's workers start as torch's"
            self.event("recovery_path", path="restart", why=f"{why}, a failure restarts the group")
        if not kept:
            self.waits.idle(
                time.monotonic() + SPARE_WAIT, lambda: not self.spares.pending, stoppable=False
            )
            self.group.start(
                rnd, self.restart_count, self.memory_dir, self.spares.spares, grow.joining(rnd)
            )
        self.recovery.mark("spawned")
        self.spares.after_spawn([w.env for w in self.group.workers])
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
        self.waits.idle(math.inf, lambda: not self.health_check.running, stoppable=True)
        if self.stop_request is not None:
            return None  # acted on by the loop
        result = self.health_check.take() or self.health_check.last
        return result if result is not None and not result.ok else None

    def _leave(self, check: healthcheck.Result) -> int:
        """This node's health check failed: it leaves the job (`_leave_job`), exit code 5, or 7
        where that failure quarantines it (daemon/quarantine.py)."""
        why = self.health_check.failure(check, self.node)
        if self.quarantine.strike(why):
            return self._leave_job(why, *self.quarantine.departure(self.round is not None))
        summary = self.health_check.left_summary(check, self.node)
        line = self.health_check.left_line(why, joined=self.round is not None)
        return self._leave_job(why, summary, line, ExitCode.UNHEALTHY)

    def _leave_job(self, why: Failure, summary: str, line: str, code: int) -> int:
        """Stop this node's workers, ask the other nodes to restart with `summary` (their status
        shows it) and leave the job with `line` and `code`. The rendezvous is not closed: the
        others go on without this node (elastic), or wait for it to come back (fixed size)."""
        self.last_failure = self.first_failure = why
        self.status.figures.on_failure(why.failure_class)
        if self.round is not None and self.round.group_world_size > 1:
            # named lost: the next round does not wait for this node
            lost, klass = [self.rdzv.node_id], why.failure_class
            self._ask_restart({"summary": summary, "node": self.node, "lost": lost, "class": klass})
        self._teardown(self.cfg.restart_grace, abandon=True)
        self.left_line = line
        self.set_state(State.LEFT, exit_code=code, cause=why.summary())
        return code

    def _after_start_up(self, now: float) -> None:
        """Once every new worker has stepped (first beat): report the recovery timeline and
        refill the spares, whose imports would otherwise slow the workers' own start (or 10 s)."""
        if self.spares.refill_due is None and not self.recovery.marks:
            return
        beats = self.group.beats()
        since = self.recovery.marks.get("detected", 0.0)  # in place: the survivors step again
        stepped = all(b and b.beats and b.last >= since for b in beats)
        if stepped and self.recovery.marks:
            timeline = self.recovery.report(beats)
            self.event("recovered", **timeline)
            self.status.figures.on_recovered(timeline)
        self.spares.refill_if_due(stepped, now)

    def _restart(self, why: Failure | Scale) -> int | None:
        """Tear the group down and decide: next round, or the job has failed. The restart
        request tells every node why; whether it costs the job's budget is decided by the next
        round's closing (cluster/closing.py), which knows whether a node was lost. On the in-place
        path a rank's failure replaces that rank alone (daemon/inplace.py), the others staying."""
        if grow.carry(self, why):
            return self._carry_on(why)
        if inplace.replace(self, why):
            return None
        self.recovery.detected()
        self._held = None  # the next attempt's deaths are looked behind afresh
        why = self._first_here(why)
        if isinstance(why, Failure):
            theirs = inplace.waited_for(self, why)
            if theirs is not why:  # the job's failure, which our ranks waited in place for
                self.first_failure = self.first_failure or theirs
            why = theirs
        self.status.figures.on_restart(why, self.group.beats())
        self.health_check.peer_left(why)
        self.set_state(State.RESTARTING, cause=why.summary(), failure_class=why.failure_class)
        spends = why.kind.spends_budget
        # ours, a node lost, another node's failure ours followed (`_behind`)
        if spends or (isinstance(why, Failure) and (why.lost or why.consequences)):
            self.last_failure = why
        if spends:
            self.first_failure = self.first_failure or why
            self._failed_in = self.round.number if self.round is not None else None
        if why.kind is RestartCause.STORE_UNREACHABLE:
            self.event("store_unreachable", level="error", why=why.reason)
        reason = restart_request(why, self.node)
        if reason is not None and isinstance(why, Failure):
            replay_elsewhere.offer(self, why, reason)  # which node replays its step too
        if reason is not None:
            self._ask_restart(reason)
        trained = self.recovery.trained(self.group.beats())
        # a node joining finds every rank healthy: they may save at their next boundary; after a
        # failure the group is broken, and a handler that talks to it only delays the restart
        broken = why.kind is not RestartCause.SCALE
        self._teardown(self.cfg.crash_grace if broken else self.cfg.restart_grace, abandon=broken)
        self.recovery.mark("torn_down")
        if reason is not None and isinstance(why, Failure):
            why = self._replayed(why, reason)
            # reproduced on this node only: its hardware (quarantine off: a restart as before)
            if why.replayed == replay_verdict.HARDWARE and self.quarantine.strike(why, True):
                return self._leave_job(why, *self.quarantine.departure(True))
        if why.kind is not RestartCause.SCALE and not why.replayed:
            replay_elsewhere.for_peer(self)  # where another node's request asks this one
        # before the next start: runs beside the backoff and the rendezvous
        self.health_check.begin()
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
            self.waits.idle(time.monotonic() + delay, lambda: self.stop_request is not None)
        self.set_state(State.RENDEZVOUS)
        return None

    def _carry_on(self, why: Failure | Scale) -> None:
        """Nodes wait to join and this node's workers go on in their group (daemon/grow.py):
        the restart asked (where it is this node's Scale), the next round met, no teardown."""
        self.status.figures.on_restart(why, self.group.beats(), in_place=True)
        self.set_state(State.RESTARTING, cause=why.summary(), failure_class=why.failure_class)
        reason = restart_request(why, self.node)
        if reason is not None:
            self._ask_restart(reason)
        self.set_state(State.RENDEZVOUS)
        return None

    def _replayed(self, why: Failure, reason: dict[str, Any]) -> Failure:
        """The failure with its replay's verdict (daemon/replay_verdict.py), where the failed
        rank left a repro bundle; the restart request amended to carry it to the closing."""
        spec = self.group.spec
        path = replay_verdict.bundle_of(why, spec.attempt_dir if spec is not None else None)
        if path is None or self.cfg.replay_timeout <= 0 or self.round is None:
            return why
        why = replay_verdict.judge(
            why,
            path,
            self.cfg.replay_timeout,
            lambda until, done: self.waits.idle(until, done),
            self.event,
            self.spare,
            replay_elsewhere.start(self, why, reason, path),
        )
        if why.replayed:
            self.last_failure = why
            amended = restart_request(why, self.node)
            if amended is not None:
                if why.replayed == replay_verdict.HARDWARE:  # the next round does not wait
                    amended["lost"] = [self.rdzv.node_id]
                self.rdzv.amend_restart(self.round, reason, amended)
        return why

    def _first_here(self, why: Failure | Scale) -> Failure | Scale:
        """Told by another node to restart for its failure: a failure of a local rank that came
        before it (a rank that raised, where theirs died of its going) takes the request's place
        (rendezvous.request_restart) and is this restart's cause; else `why`."""
        if why.kind is not RestartCause.PEER:
            return why
        mine = self.group.failed_now()
        reason = restart_request(mine, self.node) if mine is not None else None
        if reason is None:
            return why
        try:
            return mine if self.rdzv.request_restart(self.round, reason) else why
        except StoreUnreachable:
            return why

    def _first_elsewhere(self, previous: Round) -> None:
        """Once the round after a failure of ours closed (its closing read the restart request
        for good): where the request names another node's failure that came first, that is the
        last failure status shows, ours a consequence of it."""
        if self._failed_in != previous.number or not isinstance(self.last_failure, Failure):
            return
        try:
            request = self.waits.blocking(self.rdzv.read_restart, self.rdzv.kv, previous)
        except (StoreUnreachable, kvmod.Unreachable):
            return
        first = first_elsewhere(request, self.last_failure, self.round.lost)
        if first is not None:
            if self.first_failure is self.last_failure:
                self.first_failure = first  # the job's first failure was that one, too
            self.last_failure = first
            self.event(
                "first_failure_elsewhere",
                rank=first.rank,
                node=first.node,
                lost=list(first.lost),
                why=first.reason,
            )

    def _ask_restart(self, reason: dict[str, Any]) -> None:
        """Ask every node of the round to restart, for `reason` (rendezvous.request_restart)."""
        try:
            self.rdzv.request_restart(self.round, reason)
        except StoreUnreachable as e:
            self.event("restart_request_failed", level="warning", why=str(e))

    def _fail_job(self, failure: Failure) -> int:
        # the job's closing carries why: a node arriving later leaves with it
        return self._finish(
            State.FAILED, ExitCode.FAILED, why=f"failed: {failure.summary()} (node {self.node})"
        )

    def _teardown(self, grace: float, abandon: bool = False) -> None:
        """Stop the local group (see LocalGroup.stop) and close its round's worker store."""
        if not self.group.workers:
            return
        self._stop_workers(grace, abandon)
        if self.round is not None:
            self.round.close()

    def _stop_workers(self, grace: float, abandon: bool = False) -> None:
        self.group.stop(
            0.0 if self.stops.forced() else grace,
            abandon=abandon,
            keep=lambda: self.spares.keep() | self.health_check.pids(),
            cut_short=self.stops.forced,
            spared=self.health_check.sessions(),
        )

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
        return self._finish(State.STOPPED, ExitCode.OK)

    def _barrier(self) -> bool:
        """The exit barrier (rendezvous.exit_barrier); a store that stops answering ends it."""
        try:
            return self.waits.blocking(
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
        fields: dict[str, Any] = {"exit_code": int(code), "restarts": self.restart_count}
        if state == State.FAILED and self.first_failure:
            fields["first_failure"] = self.first_failure.summary()
        self.set_state(state, **fields)
        return code
