"""The status snapshot as types (elasticd/reporting/status_snapshot.py): its JSON form is the wire
format that `elasticd status --json` prints and operators' scripts read, so the record must
round-trip through JSON unchanged, and a reader must take what another version of the daemon
wrote as it always did (unknown keys ignored, missing ones empty)."""

from __future__ import annotations

import dataclasses
import json

from elasticd.lifecycle.states import Failure, RestartCause
from elasticd.ops import render
from elasticd.reporting.status_snapshot import (
    Goodput,
    Health,
    HealthResult,
    LastFailure,
    Part,
    PeerLeft,
    Recoveries,
    Snapshot,
    StepsLost,
    Straggler,
    Worker,
    from_json,
)

FULL = Snapshot(
    state="RUNNING",
    run_id="job",
    node="n1",
    pid=42,
    group_rank=0,
    group_world_size=2,
    world_size=4,
    round=3,
    restarts=1,
    max_restarts=3,
    budget_left=2,
    uptime=12.5,
    run_dir="/runs/job",
    entrypoint="train.py",
    workers=[Worker(rank=0, local_rank=0, pid=7, state="running", step=5, straggler=True)],
    peers={"1": 0.2},
    node_id="abc",
    lost_nodes=["n9"],
    last_failure=LastFailure(
        kind="exited",
        reason="exit 1",
        rank=1,
        stacks=["s.txt"],
        at=1.5,
        failure_class="oom",
        node="n2",
        frame="train.py:40 in step",
        consequences=["rank 0: RuntimeError: Connection closed by peer (+0.41 s)"],
        driver="the GPU driver reported gpu 0 xid 79",
    ),
    last_recovery={"torn_down": 0.1, "first_step": 0.4},
    checkpoint={"step": 5, "epoch": 0, "path": "/c/5", "time": 1.0, "age": 2.0, "extra": [1]},
    memory_step=5,
    parts={"control": Part(state="up", restarts=0, why=None)},
    goodput=Goodput(ratio=0.9, productive_seconds=9.0, wall_seconds=10.0, lost_seconds=0.0),
    restarts_by_cause={"crash": 1, "store_unreachable": 0},
    hang_inquiries={"hang": 1, "cleared": 2, "none": 0},
    steps_lost=StepsLost(total=3, last=3, unknown=0),
    recoveries=Recoveries(count=1, sum=0.4, buckets=[[0.5, 1], ["+Inf", 0]]),
    step=5,
    stragglers=[Straggler(rank=0, local_rank=0, node="n1", ratio=1.5, since=1.0)],
    straggler_reports=1,
    health=Health(
        check="/bin/true",
        state="failing",
        last=HealthResult(ok=False, reason="exit 1", seconds=0.1, at=2.0),
        peers_left=[PeerLeft(node="n2", reason="gpu", at=3.0)],
    ),
    events=[{"time": 1.0, "event": "state", "new": "RUNNING"}],
    failures_by_class={"oom": 1, "user": 2},
)


def test_round_trips_through_json():
    wire = json.loads(json.dumps(FULL.to_json()))
    assert from_json(Snapshot, wire) == FULL
    assert from_json(Snapshot, wire).to_json() == wire
    assert list(wire) == [f.name for f in dataclasses.fields(Snapshot)]  # status --json's order


def test_another_versions_snapshot_reads_as_before():
    wire = FULL.to_json()
    newer = {**wire, "new_field": {"x": 1}, "goodput": {**wire["goodput"], "new": 2}}
    assert from_json(Snapshot, newer) == FULL  # what this version does not know is ignored
    older = {"state": "RUNNING", "run_id": "job", "goodput": None, "workers": None}
    s = from_json(Snapshot, older)  # what it lacks is empty, as the readers' .get() took it
    assert (s.state, s.node, s.workers, s.goodput, s.steps_lost) == (
        "RUNNING",
        None,
        [],
        Goodput(),
        StepsLost(total=0, last=None, unknown=0),
    )
    assert s.recoveries is None and s.last_failure is None and s.health == Health()
    assert from_json(Snapshot, ["not", "a", "snapshot"]) == Snapshot()
    assert "elasticd RUNNING  run job" in render.status(s)
    assert "checkpoint none" in render.status(from_json(Snapshot, {}))


def test_render_reads_every_part():
    text = render.status(FULL, socket="/tmp/s")
    for part in (
        "socket /tmp/s",
        "checkpoint step 5 epoch 0",
        "restarts by cause: crash 1; budget left 2",
        "hang inquiries: hang 1, cleared 2\n",
        "health check failing: /bin/true (exit 1",
        "node n2 left the job: health check failed: gpu",
        "straggler: rank 0 (local 0) on node n1: 1.50x",
        "last failure: rank 1 (node n2) exit 1 (train.py:40 in step)",
        "then rank 0: RuntimeError: Connection closed by peer (+0.41 s)",
        "GPU driver: the GPU driver reported gpu 0 xid 79",
        "[class oom]",
        "failures by class: oom 1, user 2",
        "stacks s.txt",
        "torn down 0.100",
    ):
        assert part in text, (part, text)


def test_records_the_daemon_makes_are_its_own_fields():
    """The wire's failure record holds every field of the daemon's Failure, in its order."""
    names = [f.name for f in dataclasses.fields(LastFailure)]
    assert names == [f.name for f in dataclasses.fields(Failure)]
    failure = Failure(RestartCause.HANG, "silent", rank=2, stacks=("a",), lost=("n3",))
    read = from_json(LastFailure, json.loads(json.dumps(dataclasses.asdict(failure))))
    assert (read.kind, read.stacks, read.lost) == ("hung", ["a"], ["n3"])
