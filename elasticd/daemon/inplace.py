"""Which recovery path a job is on (`choose`): `in_place` (a failed rank is replaced by a warm
spare, the other ranks re-form their group in their own processes through torch's reconfigure)
or `restart` (today's whole-group restart), with the reason, said once at the daemon's start as
one `recovery_path` event.

The daemon decides what it can know before any worker runs: the setting (--in-place), the
interpreter's torch (worker/reconfigure.py, feature-detected), and the job's shape. The backend
is the script's choice, made later: a worker whose group's backend cannot re-form, or that
cannot vouch for its own state, falls back to the restart with its own line.

A survivor whose pending collective neither fails nor is ended by an abort (gloo: about 1 in 8
kills on a loaded 2-core VM left one blocked in DDP's all-reduce; neither its peers' abort nor
its own, from another thread, ended the wait) never unwinds, nor does a script that catches the
collective's error and goes on: `unstick` kills a survivor that neither gave its handle nor said
it unwound (names.in_place_unwound_key) once the generation has waited `stuck_after` for it
(about one step of the job), and starts a spare for its rank into the same generation, with one
`in_place_unstuck` line, long before the hang deadline would restart the whole group.

On that path, `replace` is the agent's first answer to a local worker's crash or signal death:
the dead ranks are started again from warm spares (LocalGroup.replace) as the group's next
generation, announced in the workers' store (signed), while the others stay in their processes,
unwind their script and re-form the group with them (worker/reconfigure.py). A hang is answered
the same way once its rank is killed (the others' pending collective then fails, and they
re-enter). Anything else (a hang with the GPU driver's evidence or no rank named, or one while
a generation forms, a peer, every rank dead, a rank that stopped on SIGTERM (exit 143: every
rank stops with it), a second fault before the last replacement stepped, the job's restart
budget spent: each recovery in place spends one, cluster/budget.py) goes the restart's way,
with one `in_place_refused` line.

Over several nodes the same: every daemon reaches the round's workers' store (`store`, hosted by
group rank 0's daemon, whatever the rendezvous backend), the generation numbers are one roll in
it (`announce_generation`: a node that takes a number past the one it knows refuses: two nodes'
faults at once), and a node whose ranks all run takes another node's generation as its own
(`follow`): its survivors' silence counts from then, and it unsticks its own survivors. It reads
the store for that only once the round's watch (daemon/inplace_watch.py: one held wait, not a
look at every tick) saw ranks wait for the generation or its announcement.
"""

from __future__ import annotations

import dataclasses
import itertools
import os
import signal
import subprocess
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import psutil

from elasticd import logs, names
from elasticd.cluster.errors import RendezvousFailed, StoreUnreachable
from elasticd.cluster.kv import Unreachable
from elasticd.config import Config, parse_nnodes
from elasticd.daemon import outside_abort, processes
from elasticd.daemon.inplace_watch import Watch
from elasticd.lifecycle import triage
from elasticd.lifecycle.states import Failure, RestartCause, requested
from elasticd.worker import heartbeat, reconfigure

if TYPE_CHECKING:
    from elasticd.daemon.agent import Agent

log = logs.get("elasticd.agent")

IN_PLACE, RESTART = "in_place", "restart"
STUCK_FLOOR = 0.3  # seconds a survivor may take to give its handle, at least (`stuck_after`)
STUCK_UNLEARNED = 1.0  # the same before the job's step times are learned
# CPU seconds a survivor past `stuck_after` must have used since the loop's previous look to be
# taken for one still unwinding (starved on a loaded host), not one blocked where no abort reaches
BUSY_CPU = 0.005
REAP_WAIT = 2.0  # seconds for a stuck survivor killed to exit
STACKS_WAIT = 0.3  # seconds a stuck survivor's stack dump is waited for, before its kill
STORE_TIMEOUT = 2.0  # seconds any one call to the workers' store may take (from any node)
# a rank's exit after its stop request (checkpoint/stop.py): its peers agreed to stop and exit too
STOPPED = 128 + signal.SIGTERM


@dataclass(frozen=True)
class Path:
    """A job's recovery path and why (one line for people)."""

    name: str
    why: str

    @property
    def in_place(self) -> bool:
        return self.name == IN_PLACE


def choose(cfg: Config, dist=None) -> Path:
    """The path of this job; `dist` is torch.distributed (imported when not given)."""
    if cfg.in_place == "off":
        return Path(RESTART, "--in-place off: every failure restarts the whole group")
    if cfg.no_python:
        return Path(RESTART, "--no-python: the entrypoint is not Python, it cannot re-enter")
    found = reconfigure.support(dist)
    if not found.ok:
        return Path(RESTART, found.why)
    return Path(
        IN_PLACE,
        f"{found.why}: a gloo group re-forms in place (NCCL where this torch's NCCL group has "
        "reconfigure); another backend, or a rank that cannot vouch for its state, restarts",
    )


def announce(cfg: Config, dist=None) -> Path:
    """Choose and say it: one `recovery_path` event."""
    path = choose(cfg, dist)
    log.info("recovery_path", path=path.name, why=path.why)
    return path


def _refused(agent: Agent, why: Failure) -> str | None:
    """Why this failure cannot be recovered in place (None: it can)."""
    group = agent.group
    kinds = (RestartCause.CRASH, RestartCause.SIGNAL, RestartCause.HANG)
    if not isinstance(why, Failure) or why.kind not in kinds:
        kind = getattr(why, "kind", None)
        return f"a failure of kind {getattr(kind, 'value', 'scale')} restarts the group"
    if why.kind is RestartCause.HANG and (hang := _hang_refused(agent, why)):
        return hang
    if why.kind is RestartCause.CRASH and why.exit_code in agent.cfg.fatal_exit_codes:
        return "a fatal exit code"
    if why.failure_class == triage.FailureClass.SDC.value or why.exit_code == names.SDC_EXIT:
        return (
            "silent data corruption: every rank rolls back to the certified state together, and "
            "each rank's exit of the audit is one finding, not a second"
        )
    if why.consequences:
        return f"other ranks failed too: {'; '.join(why.consequences)[:300]}"
    if why.signature and not triage.consequence(why.exception):
        # a class the repeat rule judges (user, oom, hardware: triage.judged): not an outside
        # kill, a hang or a lost node, which in place is for
        return (
            f"a failure of the rank's own (class {why.failure_class}): the group restarts, where "
            "the replay and the repeat rule judge whether it is deterministic"
        )
    if why.kind is RestartCause.CRASH and why.exit_code == STOPPED:
        return (
            f"exit {STOPPED}: the rank stopped on SIGTERM (the checkpoint library saves and every "
            "rank stops with it)"
        )
    kv = store(agent)
    if kv is None:
        return "the workers' store is not known to this node"
    if any(b is None or not b.beats for b in group.beats()):
        return "a rank had not stepped yet (a second fault during re-entry, or at the start)"
    if off := not_formed(agent, kv):
        return off
    if spent := _budget_spent(agent):
        return spent
    alive = [w for w in group.workers if w.exit_code is None and w.proc.poll() is None]
    if not alive and agent.round.group_world_size <= 1:
        # polled: ranks killed together die a moment apart; with other nodes, their ranks
        # survive (one rank a node: this node's only one died), and say otherwise themselves
        return "every rank has exited"
    return None


def _hang_refused(agent: Agent, why: Failure) -> str | None:
    if why.rank is None or why.driver:
        return "a hang with no rank to blame, or the GPU driver's evidence, restarts the group"
    if agent.forming is not None:
        return "a hang while a generation formed in place"
    if not any(w.global_rank == why.rank for w in agent.group.workers):
        # (daemon/hangs.py: the verdict named it, and its node let the handoff pass)
        return f"a hang of another node's rank, which its node ({why.node}) did not replace"
    return None


def _budget_spent(agent: Agent) -> str | None:
    """The job's restart budget, which a recovery in place spends too (cluster/budget.py), as
    this node last saw it: read from memory, as the rendezvous store may be the one cut off. Two
    nodes recovering at once may each spend the last one: the next failure finds it spent."""
    used = agent.rdzv.budget.seen
    if used >= agent.cfg.max_restarts:
        return (
            f"the restart budget is spent ({used} of --max-restarts {agent.cfg.max_restarts}: "
            "restarts and recoveries in place alike)"
        )
    return None


def _spend(agent: Agent) -> None:
    """One of the job's restart budget spent for a recovery in place, once its replacement is
    started (a round trip to the rendezvous store, kept off the survivors' path)."""
    budget = agent.rdzv.budget
    try:
        agent.restart_count = budget.spend_in_place()
    except (Unreachable, RendezvousFailed) as e:
        budget.seen += 1  # counted here; the store's count catches up at the next spend
        agent.restart_count = budget.seen
        log.warning("in_place_budget_unrecorded", why=str(e), restarts_used=budget.seen)
    agent.publish()  # status's restarts and budget left


def not_formed(agent: Agent, kv) -> str | None:
    """Why not every rank of the world is in the generation the group stands at (None: each
    gave its handle): a rank whose init_process_group fell back (NCCL where this torch's cannot
    re-form, an init_method of the script's, its `in_place_fallback` line) cannot re-enter, and
    its group must restart as today, not wait for survivors that will never come."""
    gen, world = agent.group.generation, agent.round.world_size
    keys = [names.in_place_key(gen, r) for r in range(world)]
    try:
        if kv.check(keys):
            return None
        missing = list(itertools.islice((r for r, k in enumerate(keys) if not _has(kv, k)), 8))
    except Unreachable as e:
        return f"the workers' store cannot be read: {e}"
    if not missing:
        return None  # the last handle came between the two reads
    return (
        f"rank(s) {', '.join(map(str, missing))} did not form their group in place at generation "
        f"{gen} (their init_process_group fell back: see its in_place_fallback line)"
    )


@dataclass
class Forming:
    """A generation announced whose running ranks' handles are awaited (`unstick`)."""

    generation: int
    since: float  # monotonic, when it was announced
    after: float  # seconds a running rank may take (stuck_after)
    running: tuple[int, ...]  # global ranks of this node's survivors, which give their handle
    starting: tuple[int, ...] = ()  # global ranks started for it (on any node)
    # pid -> the CPU seconds a survivor yet to give its handle had used at the loop's last look
    cpu: dict[int, float] = dataclasses.field(default_factory=dict, compare=False)
    # monotonic: when to end the survivors' pending collective from outside, where they were
    # asked to re-form at their next step boundary first (daemon/grow.py); 0: done, or never
    abort_at: float = 0.0
    # a join (daemon/grow.py): the survivors train on until every rank started for the
    # generation gave its handle, and only then are asked to re-form at their next boundary
    ask_when_started: bool = False


# seconds past about a step (stuck_after) that the survivors' next step boundary is waited for,
# once asked, before their pending collective is ended from outside (a script without the
# checkpoint library never reaches one the daemon can see)
BOUNDARY_SLACK = 0.5


def regroup(agent: Agent, forming: Forming, now: float) -> Forming:
    """Ask this node's survivors to re-form at their next step boundary (the checkpoint library
    agrees on it across ranks in the call it makes at each one): `forming` from now on, its
    stuck clock and the outside abort counted from the ask."""
    for w in agent.group.workers:
        heartbeat.ask_regroup(str(w.heartbeat_path), forming.generation)
    agent.group.quiet_from = now
    return dataclasses.replace(
        forming, since=now, abort_at=now + forming.after + BOUNDARY_SLACK, ask_when_started=False
    )


def _cpu(pid: int) -> float | None:
    try:
        t = psutil.Process(pid).cpu_times()
    except psutil.Error:
        return None
    return t.user + t.system


def _still_unwinding(forming: Forming, workers, now: float, deadline) -> list:
    """Of survivors past `stuck_after`, those that used CPU since the loop's last look: starved
    on a loaded host (two test files of several ranks each on 2 cores), they still unwind, where
    one blocked in a collective no abort ends uses none. Held to half the hang deadline at most,
    as `stuck_after` is (a script that caught the collective's error and spins on is killed
    then)."""
    limit = deadline.seconds / 2 if deadline is not None else 5 * STUCK_UNLEARNED
    if now - forming.since >= max(forming.after, limit):
        return []
    busy = []
    for w in workers:
        used, before = _cpu(w.pid), forming.cpu.get(w.pid)
        if used is not None and before is not None and used - before >= BUSY_CPU:
            busy.append(w)
    return busy


def _sample_cpu(forming: Forming, workers) -> None:
    for w in workers:
        if (used := _cpu(w.pid)) is not None:
            forming.cpu[w.pid] = used


def stuck_after(deadline) -> float:
    """Seconds a survivor may take to unwind and give its handle: about one step of the job
    (2 x the p99 of its step gaps, at least STUCK_FLOOR), under half its hang deadline (so the
    rank is replaced before the group is judged hung); STUCK_UNLEARNED before it is learned."""
    if deadline is None or not deadline.learned:
        return STUCK_UNLEARNED
    return min(max(STUCK_FLOOR, 2 * deadline.p99), deadline.seconds / 2)


def _kill(*workers) -> None:
    """SIGKILL workers' process groups and reap them (bounded)."""
    for w in workers:
        try:
            os.killpg(w.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    for w in workers:
        try:
            w.exit_code = w.proc.wait(timeout=REAP_WAIT)
        except subprocess.TimeoutExpired:
            log.warning("in_place_unreaped", pid=w.pid)


def store(agent: Agent):
    """This node's client of the round's workers' store (MASTER_ADDR:MASTER_PORT, hosted by
    group rank 0's daemon), where the generations are announced and the handles exchanged: the
    one store every node's workers already share, each value signed with the job's state key.
    Every call bounded (cluster/tcpstore.py); None before a round."""
    from elasticd.cluster.tcpstore import TCPStoreKV, tcp_connector

    rnd = agent.round
    if rnd is None or not rnd.master_port:
        return None
    held = agent.in_place_kv
    if held is None or held[0] != rnd.number:
        where = f"{rnd.master_addr}:{rnd.master_port}"
        kv = TCPStoreKV(tcp_connector(rnd.master_addr, rnd.master_port), where, STORE_TIMEOUT)
        agent.in_place_kv = held = (rnd.number, kv)
    return held[1]


def _has(kv, key: str) -> bool:
    return kv.check([key])  # never a compare_set read: it wakes the ranks waiting on the key


def _starting(agent: Agent, forming: Forming, store) -> bool:
    """Whether a rank started for the generation has not given its handle yet: the survivors,
    which gave theirs, then wait in form without beating (a replacement's start takes seconds
    on a loaded machine; measured: a survivor named hung at a 2 s heartbeat timeout while it
    waited, and the group restarted). Their silence counts from when the handles are in; the
    starting rank is judged by the startup timeout, and the survivors' own wait is bounded."""
    return any(not _has(store, names.in_place_key(forming.generation, r)) for r in forming.starting)


def _end_children(dead) -> None:
    """SIGKILL what is left of dead ranks' process groups: a child a rank forked after its group
    formed (a DataLoader worker) holds the rank's gloo sockets open, and the survivors' pending
    collective with it fails only when the last holder closes them (the DataLoader's own check
    of its parent comes seconds later). Measured: 2 ranks with a DataLoader worker, every
    survivor (6 of 6) stayed blocked until `unstick` killed it."""
    for w in dead:
        try:
            os.killpg(w.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


def _innermost(dump: str) -> str:
    """The main thread's innermost frame of a faulthandler dump ("" if none)."""
    main = dump.split("Current thread", 1)[-1] if "Current thread" in dump else dump
    frame = next((ln.strip() for ln in main.splitlines() if ln.strip().startswith("File ")), "")
    return frame[:200]


def _finished(w) -> bool:
    """Whether a rank's script has returned: it exited 0, or it says so in its heartbeat and
    its interpreter is tearing down (seconds with torch on a loaded host: not stuck)."""
    if w.exit_code is not None:
        return w.exit_code == 0
    return heartbeat.marked(str(w.heartbeat_path), "returned")


def unstick(agent: Agent, now: float) -> Failure | None:
    """While a generation forms: a survivor that gave no handle within `Forming.after` is
    blocked where its abort does not reach; kill it and start its rank again into the same
    generation, which the others still wait for (worker/reconfigure.py). A survivor that
    finished its script meanwhile (it was past its last collective) can never join:
    that is a failure for the restart, returned."""
    forming = agent.forming
    if forming is None:
        return None
    kv = store(agent)
    if kv is None or forming.generation != agent.group.generation:
        agent.forming = None
        return None
    if forming.ask_when_started:
        try:
            if _starting(agent, forming, kv):
                return None  # the survivors train on while the joining ranks start
        except Exception:  # noqa: BLE001 - the store's trouble is the peers' thread's to judge
            return None
        agent.forming = regroup(agent, forming, now)
        agent.event(
            "regroup_asked", generation=forming.generation, waited=round(now - forming.since, 3)
        )
        return None
    if forming.abort_at:
        if now < forming.abort_at:
            return None  # their step boundary comes first: none is stuck before it
        # a plain script never reaches one (no checkpoint library): its next collective fails
        agent.forming = forming = dataclasses.replace(forming, abort_at=0.0, since=now)
        _abort_survivors(agent)
    gen = forming.generation
    done = [w for w in agent.group.workers if w.global_rank in forming.running and _finished(w)]
    if done:
        agent.forming = None
        return Failure(
            RestartCause.CRASH,
            f"rank {done[0].global_rank} finished its script (returned) while generation {gen} "
            "formed in place: the rank started for it cannot join a group that ended",
            rank=done[0].global_rank, pid=done[0].pid, exit_code=0, node=agent.node,
        )  # fmt: skip
    try:
        missing = [r for r in forming.running if not _has(kv, names.in_place_key(gen, r))]
        if not missing:
            if _starting(agent, forming, kv):
                agent.group.quiet_from = now  # the survivors wait in form for a starting rank
            else:
                agent.forming = None
            return None
        if now - forming.since < forming.after:
            _sample_cpu(forming, [w for w in agent.group.workers if w.global_rank in missing])
            return None
        # a rank that unwound re-forms or falls back (exits) on its own
        missing = [r for r in missing if not _has(kv, names.in_place_unwound_key(gen, r))]
    except Exception:  # noqa: BLE001 - the store's trouble is the peers' thread's to judge
        return None
    group = agent.group
    stuck = [w for w in group.workers if w.global_rank in missing and w.exit_code is None]
    deadline = getattr(group, "deadline", None)
    if _still_unwinding(forming, stuck, now, deadline):
        _sample_cpu(forming, stuck)
        return None  # starved, not blocked: it gets its handle in as the host allows
    agent.forming = dataclasses.replace(
        forming, running=tuple(r for r in forming.running if r not in missing)
    )
    if not stuck:
        return None  # exited meanwhile: the loop's check acts on it
    # where it waits is not known yet (docs/in-place.md): its stacks, briefly, before the kill
    dumps = processes.dump_stacks(stuck, agent.cfg.stack_signal, wait=STACKS_WAIT)
    _kill(*stuck)
    pids = group.replace(stuck, agent.spares.spares, again=True)
    agent.spares.after_spawn([w.env for w in group.workers])
    agent.event(
        "in_place_unstuck",
        level="warning",
        why=(
            f"rank(s) {', '.join(str(w.global_rank) for w in stuck)} gave no handle for "
            f"generation {forming.generation} in {now - forming.since:.2f} s (blocked in a "
            "collective its abort did not end): killed and started again into it"
        ),
        generation=forming.generation,
        ranks=[w.global_rank for w in stuck],
        killed=[w.pid for w in stuck],
        pids=pids,
        where=[_innermost(text) for _w, text in dumps],
        stacks=[str(w.stack_path) for w in stuck],
    )


def announce_generation(
    agent: Agent, starting: tuple[int, ...], world: int = 0, mapping: dict[int, int] | None = None
) -> int:
    """Take the round's next generation (the nodes share the roll) and announce it, signed,
    with the ranks that start for it: the survivors on every node wait for this word."""
    kv = store(agent)
    gen = kv.take(names.in_place_counter_key())
    if gen != agent.group.generation + 1:  # another node announced one this node has not seen
        raise ValueError(
            f"generation {gen} taken while this node stood at {agent.group.generation}: "
            "another node's recovery is forming (a second fault at once)"
        )
    # the followers' watch (daemon/inplace_watch.py) wakes on this key: made first, at 0
    kv.compare_set(names.in_place_waiting_key(gen), None, b"0")
    # the job's restart budget spent once this recovery spends its one (`_spend`; a node lost
    # spends none): every rank of the generation, survivor or replacement, sees it as
    # TORCHELASTIC_RESTART_COUNT
    count = agent.rdzv.budget.seen + (mapping is None)
    agent.group.spec = dataclasses.replace(agent.group.spec, restart_count=count)
    said = f"{gen} {','.join(map(str, starting))} {count}"
    if mapping is not None:  # a smaller world: its size, and each surviving rank's new number
        said += f" {world} {','.join(f'{a}:{b}' for a, b in mapping.items())}"
    kv.set(names.in_place_key(gen), reconfigure.sign(agent.round.state_key, gen, -1, said))
    return gen


def _counted(agent: Agent, count: int) -> None:
    """Another node's generation spent the job's budget up to `count`: this node's view of it
    (status's restarts) and the restart count its next replacement starts with."""
    budget = agent.rdzv.budget
    budget.seen = max(budget.seen, count)
    agent.restart_count = budget.seen
    agent.group.spec = dataclasses.replace(agent.group.spec, restart_count=count)


def _holders(rnd, mapping: dict[int, int]) -> set[str]:
    """The nodes whose ranks `mapping` keeps."""
    held, old = set(), 0
    for m in rnd.members:
        if any(r in mapping for r in range(old, old + m.nproc)):
            held.add(m.node_id)
        old += m.nproc
    return held


def _waits(agent: Agent, kv, gen: int, now: float) -> None:
    """Whether ranks wait, unwound, for generation `gen` not announced yet: from when this node
    first saw it (Agent.in_place_waits: the peers' `died_at`, so a silent node is judged lost
    after two beats, not --peer-timeout's silence)."""
    try:
        raw = kv.get(names.in_place_waiting_key(gen))  # nobody waits on this key: a read is fine
    except Unreachable:
        return
    if raw is None or raw == b"0":  # 0: made by announce_generation; none waits
        agent.in_place_waits = None
    elif agent.in_place_waits is None:
        agent.in_place_waits = now


def _watch(agent: Agent, gen: int) -> bool:
    """Whether the store has word of generation `gen` (daemon/inplace_watch.py: one held wait on
    a thread, not a look at every tick); the round's watch is started here."""
    rnd, watch = agent.round, agent.in_place_watch
    if watch is None or watch.number != rnd.number:
        if watch is not None:
            watch.end()
        watch = agent.in_place_watch = Watch(
            rnd.number, rnd.master_addr, rnd.master_port, agent.inbox.post
        )
    return watch.due(gen)


def follow(agent: Agent, now: float) -> None:
    """On a node whose ranks all run: a generation another node announced (it replaced ranks
    of its own) is this node's too. Its survivors unwind and re-form; this node counts their
    silence from now (they wait in form for a rank starting elsewhere) and unsticks the ones
    that never give their handle, as the announcing node does for its own. The store is read
    only once the round's watch saw ranks wait for the generation, or its announcement."""
    path = agent.recovery_path
    if path is None or not path.in_place or agent.forming is not None or agent.round is None:
        return
    if not agent.round.master_port or not _watch(agent, agent.group.generation + 1):
        agent.in_place_waits = None  # no rank waits (a time from an earlier round is no evidence)
        return
    _follow(agent, now)


def _follow(agent: Agent, now: float) -> None:
    """`follow`'s read of the store and what it does with the word it finds."""
    kv = store(agent)
    gen = agent.group.generation + 1
    try:
        key = names.in_place_key(gen)
        value = kv.get(key) if kv is not None and _has(kv, key) else None
    except Unreachable:
        return  # the peers' thread judges the store; the ranks fall back on their own
    if value is None:
        _waits(agent, kv, gen, now)
        return
    agent.in_place_waits = None
    text = reconfigure.opened(agent.round.state_key, gen, -1, value)
    if text is None:
        log.warning("in_place_bad_announcement", generation=gen)
        return
    fields = text.split(" ")
    if len(fields) not in (3, 5):
        log.warning("in_place_bad_announcement", generation=gen, why="its fields")
        return
    starting = tuple(int(r) for r in fields[1].split(",") if r)
    _counted(agent, int(fields[2]))
    if len(fields) == 5:  # a smaller world another survivor announced
        world = int(fields[3])
        mapping = dict(tuple(map(int, p.split(":"))) for p in fields[4].split(",") if p)
        old = {w.global_rank for w in agent.group.workers}
        lost = {m.node_id for m in agent.round.members} - _holders(agent.round, mapping)
        if not old <= mapping.keys():
            log.warning("in_place_bad_announcement", generation=gen, why="this node's ranks left")
            return
        _shrunk(agent, gen, lost, world, mapping, now, Failure(RestartCause.NODE_LOST, "followed"))
        return
    group = agent.group
    group.generation, group.quiet_from = gen, now
    running = tuple(w.global_rank for w in group.workers if w.exit_code is None)
    after = stuck_after(getattr(group, "deadline", None))
    agent.forming = Forming(gen, now, after, running, starting)
    agent.event("in_place_followed", generation=gen, ranks=list(starting), survivors=list(running))
    _abort_survivors(agent)
    ranks = ", ".join(map(str, starting))
    why = f"another node recovered rank(s) {ranks} in place (generation {gen})"
    _count(agent, Failure(RestartCause.PEER, why, node=agent.node))  # as a restart it asked for


def smaller(members, lost) -> tuple[int, dict[int, int]]:
    """The world without the `lost` nodes' ranks, and each surviving rank's new number (in the
    members' order, so every survivor computes the same)."""
    mapping, old = {}, 0
    for m in members:
        for r in range(old, old + m.nproc):
            if m.node_id not in lost:
                mapping[r] = len(mapping)
        old += m.nproc
    return len(mapping), mapping


def _shrink_refused(agent: Agent, why: Failure) -> str | None:
    """Why a lost node cannot be recovered in place here (None: it can)."""
    rnd, lost = agent.round, set(why.lost or ())
    if not lost or rnd is None:
        return "no lost node named"
    if rnd.members[0].node_id in lost:
        return (
            "the lost node hosted the workers' store (group rank 0): the survivors' handles "
            "have nowhere to go"
        )
    left = len([m for m in rnd.members if m.node_id not in lost])
    if left < parse_nnodes(agent.cfg.nnodes)[0]:
        return f"{left} node(s) left, fewer than --nnodes {agent.cfg.nnodes} allows"
    if agent.forming is not None:
        return "a node lost while a generation formed in place"
    if any(w.exit_code is not None for w in agent.group.workers):
        return "a rank of this node died too"
    if any(b is None or not b.beats for b in agent.group.beats()):
        return "a rank had not stepped yet"
    if store(agent) is None:
        return "the workers' store is not known to this node"
    try:  # a node lost costs no budget (as with the restart); the read is the store's answer
        agent.rdzv.budget.answered()
    except Unreachable as e:
        return (
            f"the rendezvous store does not answer ({e}): this node may be the one cut off, "
            "and must not go on alone"
        )
    return None


def _smaller_round(agent: Agent, lost, world: int, mapping: dict[int, int]) -> None:
    """This node's view of the group without the lost nodes: the round's members and its ranks,
    the spec a later replacement starts with, the workers' global ranks (their handles' keys),
    and the peers' watch (the lost node is no longer a neighbour)."""
    rnd, group = agent.round, agent.group
    members = [m for m in rnd.members if m.node_id not in lost]
    here = next(i for i, m in enumerate(members) if m.node_id == rnd.node_id)
    base = sum(m.nproc for m in members[:here])
    agent.round = rnd = dataclasses.replace(
        rnd, members=members, group_rank=here, rank_base=base, world_size=world,
        claimed=rnd.claimed or rnd.group_world_size,
    )  # fmt: skip
    agent.rdzv.last = rnd
    agent.peers.new_round(rnd)
    group.spec = dataclasses.replace(
        group.spec, rank_base=base, world_size=world, group_rank=here,
        group_world_size=len(members),
    )  # fmt: skip
    for w in group.workers:
        w.global_rank = mapping[w.global_rank]


def _take_lost(agent: Agent, lost) -> bool:
    """Whether this node announces the smaller world: the first survivor to claim the lost
    nodes does; the others follow its announcement."""
    key = f"elasticd/in-place/lost/{','.join(sorted(lost))}"
    return store(agent).compare_set(key, None, agent.round.node_id.encode())


def shrink(agent: Agent, why: Failure) -> bool:
    """A node lost, no replacement: this node's ranks (and every survivor's) re-form at the
    smaller world in their own processes. True when done; False: the caller restarts."""
    refused = _shrink_refused(agent, why)
    lost = set(why.lost or ())
    try:
        mine = refused is None and _take_lost(agent, lost)
    except Unreachable as e:
        refused = f"the workers' store: {e}"
    if refused is not None:
        agent.event("in_place_refused", level="warning", why=refused, cause=why.summary())
        return False
    world, mapping = smaller(agent.round.members, lost)
    now = time.monotonic()
    if not mine:  # another survivor announces: follow it (its word comes within a look or two)
        agent.event("in_place_lost_followed", lost=sorted(lost), world=world)
        return _await_shrink(agent, why, now)
    agent.recovery.replaced_in_place()
    agent.recovery.detected()
    try:
        gen = announce_generation(agent, (), world, mapping)
    except (Unreachable, ValueError) as e:
        agent.event("in_place_refused", level="warning", why=str(e), cause=why.summary())
        return False
    _shrunk(agent, gen, lost, world, mapping, now, why)
    return True


def _await_shrink(agent: Agent, why: Failure, now: float) -> bool:
    """Another survivor claimed the lost node: its announcement, waited a moment (bounded)."""
    deadline = now + 5 * STORE_TIMEOUT
    gen = agent.group.generation + 1
    kv = store(agent)
    while time.monotonic() < deadline:
        try:
            if _has(kv, names.in_place_key(gen)):
                _follow(agent, time.monotonic())
                return agent.forming is not None
        except Unreachable:
            break
        time.sleep(0.02)
    agent.event(
        "in_place_refused", level="warning", why="no smaller world announced", cause=why.summary()
    )
    return False


def _shrunk(agent: Agent, gen: int, lost, world: int, mapping: dict[int, int], now, why) -> None:
    """This node's side of a smaller world announced: its view, the generation forming."""
    agent.in_place_waits = None
    _count(agent, why)
    _smaller_round(agent, lost, world, mapping)
    group = agent.group
    group.generation, group.quiet_from = gen, now
    running = tuple(w.global_rank for w in group.workers)
    agent.forming = Forming(gen, now, stuck_after(getattr(group, "deadline", None)), running)
    agent.event(
        "shrunk_in_place",
        level="warning",
        cause=why.summary(),
        generation=gen,
        lost=sorted(lost),
        world=world,
        ranks={str(k): v for k, v in mapping.items()},
        survivors=[w.pid for w in group.workers],
        failed_at=why.at,
    )
    _abort_survivors(agent)


def _abort_survivors(agent: Agent) -> None:
    """End the survivors' pending collective of the failed generation from outside (daemon/
    outside_abort.py): a survivor blocked on a peer that closed nothing (cut off by a partition,
    or two hops away in gloo's ring) unwinds at once, instead of being killed as stuck."""
    forming, shut = agent.forming, {}
    for w in agent.group.workers:
        if w.exit_code is None and w.global_rank in forming.running:
            if n := outside_abort.shut(w.pid, w.heartbeat_path, forming.generation):
                shut[str(w.global_rank)] = n
    if shut:
        log.info("in_place_aborted", generation=forming.generation, sockets=shut)


def _count(agent: Agent, why: Failure) -> None:
    """A failure recovered in place, where status and metrics show it (its cause, its class,
    the steps it lost once every rank has loaded its state again) and as the last failure."""
    agent.status.figures.on_restart(why, agent.group.beats(), in_place=True)
    agent.last_failure = why
    agent.publish()  # no state changes: status would show it only at its next due snapshot


def waited_for(agent: Agent, why: Failure) -> Failure:
    """Another node restarted the group for a failure of its own (one the restart judges: a
    rank's own error) while this node's ranks, their collective failed, waited in place for a
    generation that never came: that failure is this node's too, its ranks its consequences, as
    with the restart path, where they died of it. Else `why`. (Before, such a node showed no
    failure at all: a peer's restart with no consequence.)"""
    path = agent.recovery_path
    if why.kind is not RestartCause.PEER or why.consequences or why.lost:
        return why
    if path is None or not path.in_place or agent.round is None:
        return why
    alive = [w.global_rank for w in agent.group.workers if w.exit_code is None]
    if not alive:
        return why
    try:
        request = agent.rdzv.read_restart(agent.rdzv.kv, agent.round)
    except (StoreUnreachable, Unreachable):
        request = None
    if not request or request.get("rank") is None:
        return why  # not a rank's failure (a node lost, a scale-up): nothing ours waited for
    ranks = ", ".join(map(str, alive))
    then = f"rank(s) {ranks} (node {agent.node}): unwound and waited in place, no generation came"
    return requested(request, why.kind, (then,), why.failure_class)


def replace(agent: Agent, why: Failure) -> bool:
    """Recover the failed ranks in place: True when done (the loop goes on watching), False
    when the caller must restart the group (said in one line)."""
    path = agent.recovery_path
    if path is None or not path.in_place:
        return False
    if isinstance(why, Failure) and why.kind is RestartCause.NODE_LOST:
        return shrink(agent, why)
    refused = _refused(agent, why)
    if refused is not None:
        agent.event("in_place_refused", level="warning", why=refused, cause=why.summary())
        return False
    group = agent.group
    if why.kind is RestartCause.HANG:  # the hung rank dies; the others' collective then fails
        _kill(*[w for w in group.workers if w.global_rank == why.rank and w.exit_code is None])
    dead = [w for w in group.workers if w.exit_code is not None]
    _end_children(dead)
    ranks = tuple(w.global_rank for w in dead)
    try:
        gen = announce_generation(agent, ranks)
    except (Unreachable, ValueError) as e:
        agent.event("in_place_refused", level="warning", why=str(e), cause=why.summary())
        return False
    agent.recovery.replaced_in_place()  # refused above unless every rank had stepped
    agent.recovery.detected()
    _count(agent, why)
    group.generation = gen - 1  # group.replace raises it to the generation announced
    pids = group.replace(dead, agent.spares.spares)
    agent.recovery.mark("spawned")
    agent.forming = Forming(
        gen, time.monotonic(), stuck_after(getattr(group, "deadline", None)),
        tuple(w.global_rank for w in group.workers if w.pid not in pids), ranks,
    )  # fmt: skip
    agent.spares.after_spawn([w.env for w in group.workers])
    agent.event(
        "replaced_in_place",
        level="warning",
        cause=why.summary(),
        failure_class=why.failure_class,
        generation=gen,
        ranks=[w.global_rank for w in dead],
        pids=pids,
        survivors=[w.pid for w in group.workers if w.pid not in pids],
        failed_at=why.at,  # Unix time the exit was seen (bench/recovery.py's timeline)
    )
    _abort_survivors(agent)
    _spend(agent)
    return True
