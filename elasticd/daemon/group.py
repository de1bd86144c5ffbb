"""This node's workers of the current attempt, and what the agent loop reads of them: exits,
heartbeats and process states (files held open per attempt), hang verdicts, their output on the
daemon's stdout (the tee), stack dumps on request, and the teardown.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from elasticd import logs, names
from elasticd.checkpoint.memory import directory
from elasticd.cluster.rounds import Round
from elasticd.config import Config
from elasticd.daemon import (
    collective_seq,
    deadlines,
    driver,
    forkclient,
    oom,
    processes,
    sdc,
    spawn,
    suspicion,
    tee,
)
from elasticd.lifecycle import triage
from elasticd.lifecycle.states import Failure, RestartCause
from elasticd.worker import heartbeat

ODD_STATE_HOLD = 1.0  # seconds a zombie worker must stay so before it counts as hung
MAX_CONSEQUENCES = 8  # the later failures a failure names
SEQ_WAIT = 1.0  # seconds the collectives' dumps get after the stacks' (2000 entries: 0.1-1.3 s)


@dataclass(frozen=True)
class Seen:
    """A failed worker as `LocalGroup._failed` found it."""

    w: spawn.Worker
    exception: str | None
    stack: str | None
    when: float  # Unix time: its error file's, else when its exit was seen

    def told(self, after: float) -> str:
        """As a consequence: "rank R: what (+T s)"."""
        code = self.w.exit_code
        what = self.exception or (processes.describe_exit(code) if code is not None else "?")
        return f"rank {self.w.global_rank}: {what[:120]} (+{max(0.0, self.when - after):.2f} s)"


class LocalGroup:
    def __init__(
        self, cfg: Config, token: str, run_dir: Path, node: str, event: Callable[..., None]
    ) -> None:
        self.cfg = cfg
        self.token = token
        self.run_dir = run_dir
        self.node = node
        self.event = event  # Agent.event: logged and shown in status
        self.workers: list[spawn.Worker] = []
        self.attempt = 0  # local attempts, used for directory names
        self.seen_beats = False  # a worker of this run has beaten: from then on every worker must
        self.tee = tee.Tee() if cfg.tee else None
        self._watches: dict[
            int, tuple[heartbeat.Reader, heartbeat.ProcessWatch]
        ] = {}  # pid -> held-open files
        self._odd_since: dict[int, float] = {}  # pid -> when it was first seen a zombie
        self._exit_seen: dict[int, float] = {}  # pid -> when its exit was reaped (Unix time)
        self._returned: set[int] = set()  # pids that died after their script returned
        self.oom = oom.Counters([])  # the OOM counters as this attempt started
        self.gpu_sources = driver.Sources.found()  # the GPU driver's evidence, where it has one
        self.gpu = driver.Watch(driver.Sources(None))  # over this attempt
        self.dumps: list[dict[str, Any]] = []  # the stacks the last hang verdict took (_rows)
        self.in_place = False  # on the in-place path (daemon/inplace.py): workers re-form
        self.spec: spawn.GroupSpec | None = None  # this attempt's, for a rank replaced in place
        self.generation = 0  # of the group in place: raised at each rank replaced (replace)
        self.quiet_from = 0.0  # monotonic: the last in-place replacement (a silence starts there)
        self.started_in_place = 0  # replacements started in place (a folder of its own each)
        self._raised: list[Seen] = []  # error files written, none exited (as of the last check)
        self.steps = deadlines.StepTimes()  # the gaps between beats: the learned deadline
        self.deadline = deadlines.Deadline(cfg.heartbeat_timeout, False)
        self.suspects = suspicion.Suspicion()  # ranks past it: the evidence
        self._learned_said = False

    def start(
        self,
        rnd: Round,
        restart_count: int,
        memory_dir: str | None,
        spares: list[forkclient.Spare],
        joining: tuple[int, int] | None = None,
    ) -> None:
        """Spawn the workers of a new attempt, taking warm spares first. From the loop's thread
        (see spawn.spawn). `joining`: the round and generation of a group that goes on in place
        (daemon/grow.py), which these workers join late, as a replacement does."""
        self.attempt += 1
        cfg = self.cfg
        spec = spawn.GroupSpec(
            entrypoint=cfg.entrypoint,
            args=cfg.args,
            nproc=cfg.nproc_per_node,
            rank_base=rnd.rank_base,
            world_size=rnd.world_size,
            group_rank=rnd.group_rank,
            group_world_size=rnd.group_world_size,
            master_addr=rnd.master_addr,
            master_port=rnd.master_port,
            restart_count=restart_count,
            max_restarts=cfg.max_restarts,
            run_id=cfg.rdzv_id,
            attempt_dir=self.run_dir / f"attempt{self.attempt}",
            token=self.token,
            stack_signal=cfg.stack_signal,
            checkpoint_dir=cfg.checkpoint_dir,
            role=cfg.role,
            virtual_local_rank=cfg.virtual_local_rank,
            no_python=cfg.no_python,
            signals_to_handle=cfg.signals_to_handle,
            extra_env=self._extra_env(rnd, memory_dir, joining),
        )
        self.gpu.close()
        self.gpu = driver.Watch(self.gpu_sources)  # before the workers: what rises is theirs
        self.spec, self.generation = spec, joining[1] if joining else 0
        self.workers = spawn.spawn(spec, spares)
        self._exit_seen, self._returned = {}, set()
        self.oom = oom.Counters([w.pid for w in self.workers])
        self._follow(self.workers)

    def replace(
        self, dead: list[spawn.Worker], spares: list[forkclient.Spare], again: bool = False
    ) -> list[int]:
        """Start new workers for the `dead` ones' ranks, in place (daemon/inplace.py): the next
        generation of the group (`again`: the one forming, for a rank killed while it formed),
        in a directory of its own under the attempt's; their pids."""
        self.generation += 0 if again else 1
        self.started_in_place += 1
        self.quiet_from = time.monotonic()  # the survivors' silence is judged from here
        spec = dataclasses.replace(
            self.spec,
            attempt_dir=self.spec.attempt_dir
            / f"in-place{self.generation}{f'-{self.started_in_place}' if again else ''}",
            extra_env={**self.spec.extra_env, names.IN_PLACE_GEN: str(self.generation)},
        )
        new = spawn.spawn(spec, spares, [w.local_rank for w in dead])
        for old, w in zip(dead, new):
            self.workers[self.workers.index(old)] = w
            reader, proc = self._watches.pop(old.pid, (None, None))
            if reader is not None:
                reader.close()
                proc.close()
        self._follow(new)
        return [w.pid for w in new]

    def _follow(self, workers: list[spawn.Worker]) -> None:
        """Echo the workers' output on the daemon's (the tee)."""
        for w in workers:
            prefix = tee.console_prefix(
                self.cfg.role, w.global_rank, w.local_rank, self.cfg.log_line_prefix_template
            )
            if self.tee and self.cfg.echoed(w.local_rank, 1):  # its stdout to the daemon's stdout
                self.tee.follow(w.log_path, prefix)
            if self.tee and w.err_path and self.cfg.echoed(w.local_rank, 2):  # stderr to stderr
                self.tee.follow(w.err_path, prefix, stderr=True)

    def _extra_env(
        self, rnd: Round, memory_dir: str | None, joining: tuple[int, int] | None = None
    ) -> dict[str, str]:
        env = {names.ROUND_NUMBER: str(joining[0] if joining else rnd.number)}
        if memory_dir or self.in_place:  # the key signs state and in-place handles
            env[names.STATE_KEY] = rnd.state_key.hex()
        if memory_dir:
            env[directory.ENV] = memory_dir
        if self.in_place and not rnd.fresh:
            # in place only where every node's ranks form so: a rank on torch's own init and one
            # on the in-place one never meet in one group
            env[names.IN_PLACE_GEN] = str(joining[1] if joining else 0)
        if self.cfg.ledger:  # elasticd/ledger.py: beside the ranks' logs
            env[names.LEDGER_DIR] = str(self.run_dir / f"attempt{self.attempt}")
        return env

    @property
    def finished(self) -> bool:
        """Every worker has exited (as of the last check)."""
        return all(w.exit_code is not None for w in self.workers)

    def check(self) -> Failure | None:
        """The failure that came first among this node's workers (`_first`), or one that hung,
        or None."""
        now_wall = self._reap()
        failed = self._failed()
        if any(s.w.exit_code is not None for s in failed):
            first = self._first(failed, now_wall)
            self._raised = failed if first is None else []  # a death of a peer's going, waited
            return first
        self._raised = failed  # error files written, their workers still exiting
        now = time.monotonic()
        self.deadline = self.steps.deadline(
            self.cfg.heartbeat_timeout, len(self.workers), self.cfg.monitor_interval
        )
        self._say_learned()
        live = [w for w in self.workers if w.exit_code is None]
        if self.quiet_from and any(not getattr(self.beat(w), "beats", 0) for w in live):
            # a rank started in place has not stepped yet: the others wait for it in their
            # first collective, and its startup is what is judged (startup_timeout), not them
            self.quiet_from = now
        late: list[suspicion.Silent] = []
        for w in self.workers:
            if w.exit_code is not None:
                continue
            beat = self.beat(w)
            if beat and beat.beats:
                self.seen_beats = True
                self.steps.observe(w.pid, beat.beats, beat.last, since=self.quiet_from)
                if beat.last < self.quiet_from:  # silent since before a generation in place
                    beat = dataclasses.replace(beat, last=self.quiet_from)
            sample = self._watch(w)[1].sample()
            self.suspects.sample(w.pid, now, sample)
            odd = "process is a zombie" if sample and sample[0] == "Z" else None
            why = self._lasting(w.pid, odd, now) or heartbeat.verdict(
                beat,
                w.started,
                now,
                expect_beats=self.cfg.require_heartbeat or self.seen_beats,
                heartbeat_timeout=self.cfg.heartbeat_timeout,
                startup_timeout=self.cfg.startup_timeout,
            )
            if why and w.proc.poll() is not None:
                return self.check()  # it exited just now: report the exit, not a hang
            if why:
                return self._hung(w, why)
            if self._late(beat, now, self.suspects.stopped(w.pid)):
                late.append(suspicion.Silent(w.global_rank, w.pid, beat.last, beat.step))
        return self._suspect(late, now) if late else None

    def _late(self, beat: heartbeat.Beat | None, now: float, stopped: bool) -> bool:
        """Silent past the learned deadline (deadlines.py; a rank `stopped` by a signal: its
        own, 2 x p99, which stands where a tail put the job's over the ceiling), after its
        attempt's warm-up."""
        d = self.deadline
        return (
            (d.learned or (stopped and d.stopped > 0))
            and beat is not None
            and beat.beats >= deadlines.RANK_WARMUP
            and not beat.exiting
            and now - beat.last > (d.for_stopped if stopped else d.seconds)
        )

    def _suspect(self, late: list[suspicion.Silent], now: float) -> Failure | None:
        """Ranks past the learned deadline: a hang where the evidence says so (suspicion.py)."""
        late.sort(key=lambda s: s.last)  # the longest silent first: the others waited on it
        if self.cfg.no_python or not self.suspects.due(late[0], now):
            return None
        taken: list[tuple[spawn.Worker, str]] = []

        seqs: dict[int, str] = {}

        def dumps() -> list[dict[str, Any]]:
            taken[:], found = self._dump(self.workers)
            seqs.update(found)
            return _rows(taken, found)

        def passed(first: suspicion.Silent, why: str, basis: str) -> None:
            self.event(
                "hang_deadline_passed",
                rank=first.rank,
                silent=round(now - first.last, 3),
                deadline=basis,
                why=why[:300],
            )

        basis = self.deadline.basis()
        across = self.spec is not None and self.spec.group_world_size > 1
        verdict = self.suspects.judge(late, now, dumps, passed, basis, across)
        if verdict is None:
            return None
        w = next(w for w in self.workers if w.global_rank == verdict.rank)
        silent = next(s for s in late if s.rank == verdict.rank)
        if self.suspects.stopped(silent.pid):
            basis = self.deadline.basis(stopped=True)
        why = (
            f"no heartbeat for {now - silent.last:.1f}s ({basis}; last step {silent.step}); "
            f"{verdict.why}"
        )
        return dataclasses.replace(self._hung(w, why, taken, seqs), across=verdict.across)

    def idle(self, now: float) -> set[int]:
        """This node's live ranks asleep and off the CPU through their latest silence, or stopped
        by a signal (suspicion.py), as the loop's samples say: what another node's verdict needs
        to call one of them hung rather than a straggler (daemon/hangs.py)."""
        found = set()
        for w in self.workers:
            beat = self.beat(w)
            silence = max(0.0, now - (beat.last if beat and beat.beats else w.started))
            if w.exit_code is None and (
                self.suspects.stopped(w.pid) or self.suspects.idle(w.pid, now, silence)
            ):
                found.add(w.global_rank)
        return found

    def _dump(self, workers: list[spawn.Worker]) -> tuple[list[tuple[spawn.Worker, str]], dict]:
        """Every live worker's stacks and collectives (their Flight Recorder's, asked first so
        that both are taken in the same wait), before anything is killed: (worker, stack text)
        and pid -> its collectives' compact form (collective_seq.py)."""
        live = [w for w in workers if w.exit_code is None]
        paths = {collectives_path(w): w.pid for w in live}
        asked = collective_seq.ask(list(paths))
        taken = processes.dump_stacks(live, self.cfg.stack_signal)
        found = collective_seq.collect(asked, SEQ_WAIT)
        return taken, {
            paths[p]: collective_seq.compact(collective_seq.progress(text))
            for p, text in found.items()
        }

    def _say_learned(self) -> None:
        """One event when the deadline is first learned (and the ceiling no longer rules)."""
        d = self.deadline
        if d.learned and not self._learned_said:
            self._learned_said = True
            self.event(
                "hang_deadline_learned",
                seconds=round(d.seconds, 3),
                p99=round(d.p99, 4),
                longest=round(d.longest, 4),
                steps=d.steps,
                ceiling=self.cfg.heartbeat_timeout,
            )

    def _hung(
        self,
        w: spawn.Worker,
        why: str,
        dumps: list[tuple[spawn.Worker, str]] | None = None,
        seqs: dict[int, str] | None = None,
    ) -> Failure:
        """The hang put on `w`, with every live rank's stacks and collectives (taken now unless
        given)."""
        if dumps is None:
            # a --no-python worker has no stack-dump handler: the signal would only end it
            dumps, seqs = ([], {}) if self.cfg.no_python else self._dump(self.workers)
        self.dumps = _rows(dumps, seqs or {})
        fault = self.gpu.since()  # a GPU off the bus hangs its ranks' collectives
        klass = triage.classify(None, None, False, hung=True, driver_fault=bool(fault))
        return Failure(
            RestartCause.HANG,
            f"hung: {why}",
            rank=w.global_rank,
            pid=w.pid,
            log_path=str(w.log_path),
            stacks=tuple(str(d.stack_path) for d, _ in dumps),
            node=self.node,
            failure_class=klass.value,
            driver=fault,
        )

    def _failed(self) -> list[Seen]:
        """Every worker that failed (exited non-zero, but not after its script returned), with
        what its error file says and when it happened: the error file's time, else when its exit
        was seen; once one has, those still exiting that wrote an error file (they raised)."""
        seen = []
        for w in self.workers:
            exited = w.exit_code is not None and w.exit_code != 0
            if w.pid in self._returned:
                continue
            written = spawn.error_written(w.error_path)
            if exited or (w.exit_code is None and written is not None):
                exception, stack = spawn.read_error_report(w.error_path)
                when = written or self._exit_seen.get(w.pid, time.time())
                seen.append(Seen(w, exception, stack, when))
        return seen

    def raised(self) -> Failure | None:
        """The failure among the workers the last check found failed but did not act on yet
        (error files written, none exited; or a death of a peer's going it waits behind,
        `_first`): triage.first's cause, or None. What the agent may look behind before the check
        acts (a death of a closed connection in a job of several nodes, Agent._behind)."""
        if not self._raised:
            return None
        return self._first(self._raised, time.time(), wait=False)

    def failed_now(self) -> Failure | None:
        """A failure among this node's workers, whether or not one has exited (a rank that
        raised and still exits counts): what a node told to restart by another offers in its
        place where it came first (Agent._restart)."""
        now = self._reap()
        failed = self._failed()
        return self._first(failed, now, wait=False) if failed else None

    def _reap(self) -> float:
        """Reap the exits (when each was seen; whether it died after its script returned): the
        time, Unix."""
        now = time.time()
        for w in processes.poll(self.workers):
            self._exit_seen[w.pid] = now
            if self._died_after_return(w):
                self._returned.add(w.pid)
        return now

    def _first(self, failed: list[Seen], now: float, wait: bool = True) -> Failure | None:
        """The cause among the failed (triage.first: the earliest, a rank that died of its
        peer's going yielding to a failure that came about then), the others its consequences;
        None while the cause is such a death of under triage.CLOCK_SLACK ago and a worker still runs
        (the failure it follows may be about to show)."""
        order = triage.first([(s.when, triage.consequence(s.exception)) for s in failed])
        cause, rest = failed[order[0]], [failed[i] for i in order[1:]]
        failing = {s.w.pid for s in failed}
        waiting = any(w.exit_code is None and w.pid not in failing for w in self.workers)
        soon = now - cause.when < triage.CLOCK_SLACK
        if wait and triage.consequence(cause.exception) and waiting and soon:
            return None
        w = cause.w
        code = w.exit_code
        kind = RestartCause.SIGNAL if code is not None and code < 0 else RestartCause.CRASH
        return Failure(
            kind,
            processes.describe_exit(code) if code is not None else "raised, exiting",
            rank=w.global_rank,
            pid=w.pid,
            exit_code=code,
            exception=cause.exception,
            log_path=str(w.err_path or w.log_path),  # where its traceback is
            node=self.node,
            at=cause.when,
            frame=triage.user_frame(cause.stack),
            consequences=tuple(s.told(cause.when) for s in rest[:MAX_CONSEQUENCES]),
            **self._triage(w, cause.exception, cause.stack),
        )

    def _triage(self, w: spawn.Worker, exception: str | None, stack: str | None) -> dict[str, Any]:
        """A failed worker's class, signature and step (lifecycle/triage.py): the Failure's
        fields."""
        beat = self.beat(w)
        step = beat.step if beat and beat.beats and beat.step >= 0 else None
        killed = w.exit_code is not None and w.exit_code != 0 and self.oom.killed(w.pid)
        fault = self.gpu.since()  # the driver's own evidence: never the job's words
        klass = triage.classify(w.exit_code, exception, killed, driver_fault=bool(fault))
        # the audit's verdict (its numbers, and how it ended), which daemon/sdc.py judges
        if klass is triage.FailureClass.USER and sdc.ended_by_audit(w.exit_code, beat):
            klass = triage.FailureClass.SDC
        sig = ""
        if triage.judged(klass):
            sig = triage.signature(w.exit_code, exception, stack)
            sig = logs.printable(f"{sig} ({triage.at_step(step)})")
        return {"failure_class": klass.value, "signature": sig, "step": step, "driver": fault}

    def beat(self, w: spawn.Worker) -> heartbeat.Beat | None:
        return self._watch(w)[0].read()

    def beats(self) -> list[heartbeat.Beat | None]:
        return [self.beat(w) for w in self.workers]

    def rows(self, now: float) -> list[dict[str, Any]]:
        """Each worker as status shows it."""
        rows = []
        for w in self.workers:
            beat = self.beat(w)
            rows.append(
                {
                    "rank": w.global_rank,
                    "local_rank": w.local_rank,
                    "pid": w.pid,
                    "state": "running"
                    if w.exit_code is None
                    else processes.describe_exit(w.exit_code),
                    "heartbeat_age": round(now - beat.last, 3) if beat and beat.beats else None,
                    "step": beat.step if beat and beat.beats else None,
                    "rss_bytes": self._watch(w)[1].rss() if w.exit_code is None else None,
                    "log": str(w.log_path),
                }
            )
        return rows

    def stacks(self, state: str) -> dict:
        """`elasticd stacks`: every live local worker's threads, as they are now."""
        if self.cfg.no_python:
            return {
                "ok": False,
                "error": "--no-python workers are not Python: they cannot dump their stacks",
            }
        dumps, seqs = self._dump(self.workers)
        if not dumps:
            return {
                "ok": False,
                "error": f"no worker is running right now (state {state}); try again",
            }
        self.event("stacks_dumped", ranks=[w.global_rank for w, _ in dumps])
        return {"ok": True, "stacks": _rows(dumps, seqs)}

    def stop(
        self,
        grace: float,
        *,
        abandon: bool,
        keep: Callable[[], frozenset[int]],
        cut_short: Callable[[], bool],
        spared: frozenset[int] = frozenset(),
    ) -> None:
        """Stop every worker (see processes.stop; what `keep()` names and the sessions `spared` are
        left alone).
        `abandon`: a restart after a failure; the workers are told (a heartbeat-file mark) so that
        the checkpoint library ends them at SIGTERM instead of waiting for a step boundary that a
        broken collective will never reach."""
        t0 = time.monotonic()
        if abandon:
            for w in self.workers:
                heartbeat.mark(str(w.heartbeat_path), "abandon")
        stuck = processes.stop(
            self.workers,
            self.token,
            grace,
            self.cfg.kill_timeout,
            keep=keep,
            cut_short=cut_short,
            spared=spared,
        )
        if self.tee:
            self.tee.forget([p for w in self.workers for p in (w.log_path, w.err_path) if p])
        self.event(
            "workers_stopped",
            seconds=round(time.monotonic() - t0, 3),
            exits={w.global_rank: w.exit_code for w in self.workers},
            unkillable=stuck,
        )
        self.workers = []
        self.steps.forget(set())
        self.suspects.forget()
        for reader, proc in self._watches.values():
            reader.close()
            proc.close()
        self._watches.clear()

    def _died_after_return(self, w: spawn.Worker) -> bool:
        """Killed by a signal after its entrypoint returned (marked before interpreter teardown):
        its work is done, so the job does not fail or restart for it; one warning. A C++ thread
        ended badly at exit (std::terminate's SIGABRT) is the usual cause (issue 31). An exit
        code is the script's own choice and still counts."""
        if w.exit_code is None or w.exit_code >= 0:
            return False
        if not heartbeat.marked(str(w.heartbeat_path), "returned"):
            return False
        self.event(
            "died_after_return",
            level="warning",
            rank=w.global_rank,
            exit=processes.describe_exit(w.exit_code),
            log=str(w.log_path),
        )
        return True

    def _watch(self, w: spawn.Worker) -> tuple[heartbeat.Reader, heartbeat.ProcessWatch]:
        """The worker's heartbeat file and /proc entries, opened once per attempt: the loop reads
        them every tick, and opening (and parsing through psutil) each time was most of its CPU."""
        watch = self._watches.get(w.pid)
        if watch is None:
            watch = self._watches[w.pid] = (
                heartbeat.Reader(str(w.heartbeat_path)),
                heartbeat.ProcessWatch(w.pid),
            )
        return watch

    def _lasting(self, pid: int, why: str | None, now: float) -> str | None:
        """A process state counts only once it has lasted ODD_STATE_HOLD seconds: a dying
        multi-threaded process shows as a zombie for a moment."""
        if why is None:
            self._odd_since.pop(pid, None)
            return None
        return why if now - self._odd_since.setdefault(pid, now) >= ODD_STATE_HOLD else None


def _rows(dumps: list[tuple[spawn.Worker, str]], seqs: dict[int, str]) -> list[dict[str, Any]]:
    """Stack dumps as `elasticd stacks` answers them (and daemon/hangs.py reads them), each with
    its rank's collectives (collective_seq's compact form, "" without)."""
    return [
        {
            "rank": w.global_rank,
            "local_rank": w.local_rank,
            "pid": w.pid,
            "path": str(w.stack_path),
            "text": text,
            "collectives": seqs.get(w.pid, ""),
        }
        for w, text in dumps
    ]


def collectives_path(w: spawn.Worker) -> Path:
    """Where the worker writes its Flight Recorder's dump (spawn's paths)."""
    return w.stack_path.with_name(f"rank{w.global_rank}.collectives.json")
