"""The status snapshot as types: what the control socket serves, `elasticd status` shows and
/metrics exports, field by field, in one place.

The daemon builds a `Snapshot` at every publish (daemon/status.py) and serves its JSON form
(`to_json`: the fields in the order `status --json` has always printed them); the CLI and the
metrics read it back with `from_json` and then by attribute. Operators' scripts read the JSON,
so it is the contract: a field is added at the end of its record, never renamed. `from_json`
takes what a daemon of another version wrote as the readers always took it: a key it does not
know is ignored, a missing one (or a record that is not one) is the field's default.

Imports nothing of elasticd and no torch: the CLI reads it in the operator's shell.
"""

from __future__ import annotations

import dataclasses
import functools
import types
import typing
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

# the steps of a recovery, in the order they happen; reported as seconds since the failure was
# detected (status's last_recovery, the metrics' phases, bench/recovery.py's timeline), measured
# by daemon/recovery.py
STEPS = ("torn_down", "rendezvous_done", "spawned", "pg_ready", "state_loaded", "first_step")

T = TypeVar("T")


@dataclass(frozen=True)
class Worker:
    """A local worker of the current attempt (daemon/group.py's row, with its figures)."""

    rank: int | None = None
    local_rank: int | None = None
    pid: int | None = None
    state: str | None = None  # "running", or how it exited
    heartbeat_age: float | None = None  # seconds since its last beat; None before the first
    step: int | None = None
    rss_bytes: int | None = None
    log: str | None = None
    step_time: float | None = None  # seconds per step, beat to beat (figures.py)
    work_time: float | None = None  # own work per step, outside the gradient sync
    straggler_ratio: float | None = None  # own work over the node's median (stragglers.py)
    straggler: bool = False
    # a sharded job's replica of its shards on the next node (reporting/replication.py): on, or why
    # not (None: undecided), and its exchanges' bytes this attempt, the last one's bytes and time
    replica: str | None = None
    replica_bytes: int | None = None
    replica_last_bytes: int | None = None
    replica_last_seconds: float | None = None


@dataclass(frozen=True)
class LastFailure:
    """states.Failure as the wire carries it (its fields, one for one: a unit test checks)."""

    kind: str | None = None  # a RestartCause's value
    reason: str | None = None
    rank: int | None = None
    pid: int | None = None
    exit_code: int | None = None
    exception: str | None = None
    log_path: str | None = None
    stacks: list[str] = field(default_factory=list)
    node: str | None = None
    lost: list[str] = field(default_factory=list)
    at: float | None = None  # Unix time
    failure_class: str | None = None  # lifecycle/triage.py's FailureClass value
    signature: str | None = None  # what the repeat rule compares ("" where it does not judge)
    step: int | None = None  # the failing rank's last step (None: before its first)
    frame: str | None = None  # its traceback's innermost frame of user code (FILE:LINE in FUNC)
    consequences: list[str] = field(default_factory=list)  # the attempt's later failures
    driver: str | None = None  # the GPU driver's evidence of a fault meanwhile (driver.py)
    replayed: str | None = None  # the replay's verdict (replay_verdict.py): reproduced or transient
    across: bool | None = None  # a hang proven only by every node's stacks (daemon/hangs.py)


@dataclass(frozen=True)
class Part:
    """One of elasticd's own processes or threads (lifecycle/supervise.py)."""

    state: str | None = None  # up, restarting or off
    restarts: int = 0
    why: str | None = None


@dataclass(frozen=True)
class Goodput:
    ratio: float | None = None  # None until something trained
    productive_seconds: float | None = None
    wall_seconds: float | None = None
    lost_seconds: float | None = None


@dataclass(frozen=True)
class StepsLost:
    total: int | None = 0  # None once a restart's loss could not be told
    last: int | None = None
    unknown: int = 0  # restarts whose loss could not be told


@dataclass(frozen=True)
class Recoveries:
    """The recovery histogram: count, sum and [upper bound, count] per bucket ("+Inf" last)."""

    count: int = 0
    sum: float = 0.0
    buckets: list[list[Any]] = field(default_factory=list)


@dataclass(frozen=True)
class CheckpointCosts:
    saves: int | None = None
    stall_seconds_total: float | None = None
    write_seconds_total: float | None = None
    last_stall_seconds: float | None = None
    last_write_seconds: float | None = None


@dataclass(frozen=True)
class MemoryRefresh:
    refreshes: int | None = None
    seconds_total: float | None = None
    last_seconds: float | None = None
    every: int | None = None  # steps between refreshes


@dataclass(frozen=True)
class SdcAudit:
    """The replicas' audit (checkpoint/audit.py, daemon/sdc.py): audits run by this node's ranks
    (each audit counted once: its ranks run it together), the seconds they took, and the silent
    data corruption this node's ranks saw: how often it blamed this node, how often no majority
    named one, and by node blamed (the job's view as this node saw it; "undecided" too)."""

    audits: int = 0
    seconds_total: float = 0.0
    detected: int = 0
    undecided: int = 0
    by_node: dict[str, int] = field(default_factory=dict)


@dataclass(frozen=True)
class MemoryReplica:
    """This node's side of a sharded job's replication (reporting/replication.py), and the /dev/shm
    bytes it holds for the in-memory state."""

    state: str | None = None  # on, or off and why; None before the first sharded refresh
    sends: int = 0  # exchanges completed by this node's ranks, all attempts
    bytes_total: int = 0  # bytes they sent, all attempts
    last_bytes: int = 0  # bytes of each rank's last exchange, summed: one refresh's cost
    seconds_total: float = 0.0  # background seconds of the exchanges, summed over ranks
    last_seconds: float = 0.0  # the slowest rank's last exchange
    shm_own_bytes: int = 0  # /dev/shm held by this node's ranks' own slots
    shm_replica_bytes: int = 0  # ... and by the replicas of another node's ranks


@dataclass(frozen=True)
class Straggler:
    """A rank found slow for the whole window: what a report shows and an action would act on
    (reporting/stragglers.py makes them)."""

    rank: int | None = None
    local_rank: int | None = None
    node: str | None = None
    ratio: float | None = None  # its own work per step over the node's median, over the window
    work_time: float | None = None  # its seconds of own work per step, over the window
    median: float | None = None  # the node's median, over the window
    since: float | None = None  # wall-clock time it was first above the threshold


@dataclass(frozen=True)
class HealthResult:
    """One run of the health check (daemon/healthcheck.py makes them)."""

    ok: bool = False
    reason: str | None = None  # "passed" or why it failed: exit code or signal, last line
    output: str | None = None  # its last line of output (escaped, cut)
    seconds: float | None = None
    at: float | None = None  # wall-clock time it finished


@dataclass(frozen=True)
class PeerLeft:
    """Another node that left the job after failing its health check."""

    node: str | None = None
    reason: str | None = None
    at: float | None = None


@dataclass(frozen=True)
class Health:
    check: str | None = None  # the command, None without --health-check
    state: str | None = None  # off, unknown, passing or failing
    interval: float | None = None
    runs: int | None = None
    failures: int | None = None
    last: HealthResult | None = None
    running: bool = False
    peers_left: list[PeerLeft] = field(default_factory=list)
    # this node's record (daemon/quarantine.py): quarantined, and its failures within the window
    quarantined: bool = False
    quarantined_since: float | None = None
    quarantine_reason: str | None = None
    strikes: int = 0
    quarantine_after: int | None = None
    state_dir: str | None = None


@dataclass(frozen=True)
class Snapshot:
    """The daemon's state as status shows it. The fields after `parts` are the operators'
    figures (reporting/figures.py, stragglers.py, healthcheck.py)."""

    state: str | None = None  # a states.State's value
    run_id: str | None = None
    node: str | None = None
    pid: int | None = None
    group_rank: int | None = None
    group_world_size: int | None = None
    world_size: int | None = None
    round: int | None = None  # attempts this node started
    restarts: int | None = None  # the job's restart budget spent
    max_restarts: int | None = None
    budget_left: int | None = None
    uptime: float | None = None
    run_dir: str | None = None
    entrypoint: str | None = None
    workers: list[Worker] = field(default_factory=list)
    # seconds since each watched peer node's liveness beat last moved, by its group rank
    peers: dict[Any, float] = field(default_factory=dict)
    node_id: str | None = None
    lost_nodes: list[str] = field(default_factory=list)  # of the previous round, found lost
    # seconds a rank may be silent before it is a suspect (daemon/deadlines.py), and how it was
    # made: learned from the job's step gaps, or --heartbeat-timeout while learning
    hang_deadline: float | None = None
    hang_deadline_basis: str | None = None
    last_failure: LastFailure | None = None
    last_recovery: dict[str, float] | None = None  # phase -> seconds after detection
    # the newest checkpoint's manifest entry (checkpoint/disk/format.py's), its path and age
    checkpoint: dict[str, Any] | None = None
    memory_step: int | None = None
    parts: dict[str, Part] = field(default_factory=dict)
    goodput: Goodput = field(default_factory=Goodput)
    restarts_by_cause: dict[str, int] = field(default_factory=dict)  # by RestartCause.label
    # failures recovered in place, the survivors kept (daemon/inplace.py): by the same labels
    in_place_by_cause: dict[str, int] = field(default_factory=dict)
    # hang inquiries this node asked or answered, by how each ended (figures.INQUIRY_VERDICTS)
    hang_inquiries: dict[str, int] = field(default_factory=dict)
    steps_lost: StepsLost = field(default_factory=StepsLost)
    recoveries: Recoveries | None = None
    step: int | None = None
    step_time: float | None = None
    work_time: float | None = None
    checkpoint_costs: CheckpointCosts = field(default_factory=CheckpointCosts)
    memory_refresh: MemoryRefresh = field(default_factory=MemoryRefresh)
    stragglers: list[Straggler] = field(default_factory=list)
    straggler_reports: int = 0
    health: Health = field(default_factory=Health)
    events: list[dict[str, Any]] = field(default_factory=list)  # the latest, newest last
    # the failures this node saw, by class (triage.FailureClass's values)
    failures_by_class: dict[str, int] = field(default_factory=dict)
    memory_replica: MemoryReplica = field(default_factory=MemoryReplica)
    sdc_audit: SdcAudit = field(default_factory=SdcAudit)

    def to_json(self) -> dict[str, Any]:
        return to_json(self)


def to_json(value: Any) -> Any:
    """A record (and what it holds) as JSON values, fields in their declared order."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: to_json(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, (list, tuple)):
        return [to_json(v) for v in value]
    if isinstance(value, dict):
        return {k: to_json(v) for k, v in value.items()}
    return value


def from_json(cls: type[T], data: Any) -> T:
    """A record from its JSON form: unknown keys ignored, missing ones (and a record that is
    not a JSON object) the defaults."""
    return cls(**fields_from_json(cls, data if isinstance(data, dict) else {}))


def fields_from_json(cls: type, data: dict[str, Any]) -> dict[str, Any]:
    """The fields of `cls` that `data` holds, each read as its declared type."""
    return {name: read(data[name]) for name, read in _plan(cls) if name in data}


@functools.cache
def _plan(cls: type) -> tuple[tuple[str, Callable[[Any], Any]], ...]:
    """How to read each field of `cls`, worked out once per record type (the daemon reads a
    snapshot at every publish, twice a second)."""
    hints = typing.get_type_hints(cls)
    return tuple((f.name, _reader(hints[f.name])) for f in dataclasses.fields(cls))


def _reader(hint: Any) -> Callable[[Any], Any]:
    """A value of JSON as `hint`: records as records (`from_json`), lists and dicts of them
    item by item (anything else there: empty), `X | None` as X unless None, the rest as is."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):  # X | None
        (inner,) = [a for a in args if a is not type(None)]
        read = _reader(inner)
        return lambda v: None if v is None else read(v)
    if dataclasses.is_dataclass(hint):
        return functools.partial(from_json, hint)
    if origin is list:
        item = _reader(args[0])
        return lambda v: [item(x) for x in v] if isinstance(v, (list, tuple)) else []
    if origin is dict:
        item = _reader(args[1])
        return lambda v: {k: item(x) for k, x in v.items()} if isinstance(v, dict) else {}
    return _as_is


def _as_is(value: Any) -> Any:
    return value
