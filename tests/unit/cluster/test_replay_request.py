"""A replay's verdict on the job's store (daemon/replay_verdict.py's part in cluster/): the
restart request amended with it only while it is still ours, and the next closing calling a
reproduced failure deterministic at its first time, reading the request as it is when it closes."""

from __future__ import annotations

import json

from elasticd import names
from elasticd.cluster import closing
from elasticd.cluster.rendezvous import Rendezvous
from elasticd.cluster.rounds import Member, Round
from elasticd.config import Config

SIG = "ValueError: sample N has a malformed label at step N at train.py:52 in main (step 6)"
OURS = {"summary": "rank 1; ValueError", "node": "a", "spends": True, "sig": SIG, "rank": 1}


def _round(rz: Rendezvous, number: int = 0) -> Round:
    members = [Member("a", 2, "127.0.0.1")]
    key = rz.round_key(number, names.MEMBERS)
    rz.kv.set(key, rz.seal(key, json.dumps({"members": [["a", 2, "127.0.0.1"]], "lost": []})))
    return Round(number, 0, members, world_size=2)


def test_the_verdict_amends_our_request_and_never_another_nodes():
    rz = Rendezvous(Config())
    rnd = _round(rz)
    ours = {**OURS, "at": 100.0}
    assert rz.request_restart(rnd, ours)
    amended = {**ours, "replayed": "reproduced"}
    assert rz.amend_restart(rnd, ours, amended)
    assert rz.read_restart(rz.kv, rnd)["replayed"] == "reproduced"
    # another node's failure came first and took the request's place: ours is not amended in
    theirs = {**OURS, "node": "b", "rank": 3, "at": 99.0}
    assert rz.request_restart(rnd, theirs)
    assert not rz.amend_restart(rnd, ours, {**ours, "replayed": "transient"})
    assert rz.read_restart(rz.kv, rnd) == theirs


def test_the_closing_calls_a_reproduced_failure_deterministic_at_once():
    rz = Rendezvous(Config())
    _round(rz)
    found = closing._repeats(rz, 1, {**OURS, "replayed": "reproduced"})
    assert found["deterministic"] and found["repeats"] == 1
    assert found["failed"].startswith(
        "deterministic failure: its replay from the repro bundle, in one process, failed the "
        f"same way ({SIG}); not restarted: rank 1; ValueError"
    )
    for verdict in ("transient", ""):  # the repeat rule as before: a first failure restarts
        assert not closing._repeats(rz, 1, {**OURS, "replayed": verdict})["deterministic"]
    off = Rendezvous(Config(deterministic_retries=0))
    _round(off)
    assert not closing._repeats(off, 1, {**OURS, "replayed": "reproduced"})["deterministic"]


def test_the_closing_reads_the_request_as_it_is_when_it_closes():
    rz = Rendezvous(Config())
    rnd = _round(rz)
    ours = {**OURS, "at": 100.0}
    rz.request_restart(rnd, ours)
    assert "replayed" not in closing._restart_request(rz, 1)
    rz.amend_restart(rnd, ours, {**ours, "replayed": "reproduced"})
    assert closing._restart_request(rz, 1)["replayed"] == "reproduced"
