"""A replay's verdict on the job's store (daemon/replay_verdict.py's part in cluster/): the
restart request amended with it only while it is still ours, and the next closing calling a
reproduced failure deterministic at its first time, reading the request as it is when it closes."""

from __future__ import annotations

import json

from elasticd import names
from elasticd.cluster import closing, values
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


def test_the_replay_on_another_node_is_asked_and_answered_through_the_round():
    """daemon/replay_elsewhere.py's keys: the request names the node that replays, the failed
    node says where the bundle is, the other answers; a value not of its form is never taken."""
    rz = Rendezvous(Config())
    rnd = _round(rz)
    ours = {**OURS, "at": 100.0, "replay_on": "node-b"}
    assert rz.request_restart(rnd, ours)
    assert rz.read_restart(rz.kv, rnd)["replay_on"] == "node-b"
    assert rz.replay_noted(rnd, names.REPLAY_ASK, 0.05) is None  # nothing yet: None in time
    ask = {"path": "/ckpt/repro/job-r0-rank1.repro", "sha256": "ab" * 32}
    rz.note_replay(rnd, names.REPLAY_ASK, ask)
    assert rz.replay_noted(rnd, names.REPLAY_ASK, 1.0) == ask
    answer = {"node": "b", "code": 1, "said": "elasticd replay: did not reproduce", "warm": True}
    rz.note_replay(rnd, names.REPLAYED_ELSEWHERE, answer)
    assert rz.replay_noted(rnd, names.REPLAYED_ELSEWHERE, 1.0) == answer
    hardware = {**ours, "replayed": "hardware", "class": "hardware", "lost": ["node-a"]}
    assert rz.amend_restart(rnd, ours, hardware)
    assert rz.read_restart(rz.kv, rnd) == hardware


def test_replay_values_not_of_their_form_are_refused():
    assert values.reason(json.dumps({**OURS, "replay_on": "../etc"})) is None
    assert values.reason(json.dumps({**OURS, "replayed": "maybe"})) is None
    assert values.replay_ask(json.dumps({"path": "relative.repro", "sha256": "ab" * 32})) is None
    assert values.replay_ask(json.dumps({"path": "/a.repro", "sha256": "xyz"})) is None
    assert values.replay_ask(json.dumps({"none": "could not copy"})) == {"none": "could not copy"}
    for bad in ({"node": "b", "code": 7, "said": ""}, {"node": "b", "code": True, "said": ""},
                {"node": "b c", "code": 1, "said": ""}, {"node": "b", "code": 1}):  # fmt: skip
        assert values.replay_answer(json.dumps(bad)) is None, bad
    # the referee's verdict for the other node of two replicas: the odd rank 0, 1 or none
    for good in ({"odd": 1, "said": "x", "warm": 2}, {"odd": None, "said": "", "warm": 0}):
        assert values.refereed(json.dumps(good)) == good
    for bad in ({"odd": 2, "said": "", "warm": 0}, {"odd": True, "said": "", "warm": 0},
                {"odd": 0, "said": 1, "warm": 0}, {"odd": 0, "said": "", "warm": 3}):  # fmt: skip
        assert values.refereed(json.dumps(bad)) is None, bad
