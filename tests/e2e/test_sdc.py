"""Silent data corruption under `elasticd run`: one rank flips a bit of its own weights (the test
script, tests/scripts/exact_job.py, from outside the library); the replicas' audit finds it at the
next keep, every rank rolls back to the newest certified state and goes on. A one-off flip ends
bit-identical to the fault-free run beside it; a persistent one quarantines the node (exit 7),
and an elastic job goes on without it. The same with FSDP2, whose shards are audited in time
(checkpoint/audit.py)."""

from __future__ import annotations

import json
import re

import pytest

from elasticd import exit_codes
from elasticd.daemon import quarantine
from harness import FAST, free_port, node_flags, script, wait_until
from scripts.exact_job import first_difference

STEPS = 10
FLIP_AT = 4


def _job(daemons, tmp, name: str, nproc: int, cfg: dict, *flags: str):
    env = {"EXACT_JOB": json.dumps({**cfg, "steps": STEPS, "out": str(tmp / f"{name}.out")})}
    return daemons(
        script("exact_job.py"),
        *("--nproc-per-node", str(nproc), "--max-restarts", "3"),
        *("--checkpoint-dir", str(tmp / f"{name}.ckpt"), "--state-dir", str(tmp / f"{name}.state")),
        *FAST,
        *flags,
        name=name,
        env=env,
    )


def _events(d, name: str) -> list[dict]:
    return [e for e in d.events() if e.get("event") == name]


@pytest.mark.parametrize("nproc", [2, 3, 4])
def test_a_one_off_flip_is_found_rolled_back_and_ends_bit_identical(daemons, tmp_path, nproc):
    clean = _job(daemons, tmp_path, "clean", nproc, {})
    faulty = _job(daemons, tmp_path, "faulty", nproc, {"flip_at": FLIP_AT}, "--ledger")
    for d in (clean, faulty):
        assert d.wait(120) == 0, d.stderr()[-3000:]
    assert (tmp_path / "faulty.out.flipped").read_text() == "flip\n"
    suspected = _events(faulty, "sdc_suspected")
    assert len(suspected) == 1, suspected
    found = suspected[0]
    assert found["step"] == FLIP_AT + 1, found  # the next keep after the flip
    if nproc >= 3:  # a majority names the odd one out (2 of 3, 3 of 4)
        assert found["rank"] == 1 and found["node"] and not found["undecided"], found
    else:  # two replicas: the flip reached both through the all-reduce; the referee says so
        assert found["rank"] is None and found["undecided"], found
        (left,) = _events(faulty, "sdc_referee_undecided")
        assert "reproduced neither" in left["said"], left
    assert not _events(faulty, "sdc_confirmed")
    assert "resumed from step" not in clean.stdout()
    # rolled back to the state certified before the flip, from memory
    loaded = [e for e in faulty.events() if e.get("event") == "recovered"]
    assert loaded, "no restart after the detection"
    assert "silent data corruption" in faulty.stdout() + faulty.stderr(workers=True)
    clean_out, faulty_out = tmp_path / "clean.out", tmp_path / "faulty.out"
    same = clean_out.read_text() == faulty_out.read_text()
    assert same, first_difference(str(clean_out), str(faulty_out), nproc)


REFEREED = {"flip_at": FLIP_AT, "flip_in": "update"}  # only rank 1's update is off


def test_two_replicas_the_referee_names_the_flipped_rank_and_the_run_ends_bit_identical(
    daemons, tmp_path
):
    """Two ranks, no majority: the referee replays the disputed step from the certified state,
    in the pool's two warm spares, reproduces rank 0's digest and names rank 1 (its node struck
    once, not quarantined)."""
    clean = _job(daemons, tmp_path, "clean", 2, {})
    faulty = _job(daemons, tmp_path, "faulty", 2, REFEREED, "--ledger")
    for d in (clean, faulty):
        assert d.wait(150) == 0, d.stderr()[-3000:]
    (found,) = _events(faulty, "sdc_suspected")
    assert (found["rank"], found["step"], found["undecided"]) == (1, FLIP_AT + 1, False), found
    assert "referee" in found and "reproduced rank 0's digest" in found["referee"], found
    assert found["referee_warm"] == 2, found
    assert not _events(faulty, "sdc_confirmed") and not _events(faulty, "sdc_referee_undecided")
    record = quarantine.read(tmp_path / "faulty.state")
    assert not record.quarantined and record.strikes, record
    clean_out, faulty_out = tmp_path / "clean.out", tmp_path / "faulty.out"
    same = clean_out.read_text() == faulty_out.read_text()
    assert same, first_difference(str(clean_out), str(faulty_out), 2)


def test_two_replicas_a_persistent_flip_the_referee_names_twice_quarantines(daemons, tmp_path):
    """Without warm spares (--no-warm-spawn) the referee's replays run in fresh interpreters."""
    cfg = {**REFEREED, "flip_persistent": True}
    faulty = _job(daemons, tmp_path, "faulty", 2, cfg, "--ledger", "--no-warm-spawn")
    assert faulty.wait(150) == exit_codes.ExitCode.QUARANTINED, faulty.stderr()[-3000:]
    suspected = _events(faulty, "sdc_suspected")
    assert [(e["rank"], e["step"]) for e in suspected] == [(1, 5), (1, 6)], suspected
    assert all("referee" in e and e["referee_warm"] == 0 for e in suspected), suspected
    (confirmed,) = _events(faulty, "sdc_confirmed")
    assert confirmed["rank"] == 1, confirmed
    record = quarantine.read(tmp_path / "faulty.state")
    assert record.quarantined and "silent data corruption" in record.quarantined["why"], record


def test_a_one_off_flip_in_a_sharded_state_is_found_rolled_back_and_ends_bit_identical(
    daemons, tmp_path
):
    """FSDP2 (issue 44, point 4): rank 1 flips a bit of its own shard after step 4's boundary;
    the audit in time finds its shard changed before step 5's update and names rank 1 (no
    majority needed), every rank rolls back to step 4 from memory and the run ends bit-identical
    to the fault-free one."""
    clean = _job(daemons, tmp_path, "clean", 2, {"sharded": True})
    faulty = _job(daemons, tmp_path, "faulty", 2, {"sharded": True, "flip_at": FLIP_AT})
    for d in (clean, faulty):
        assert d.wait(180) == 0, d.stderr()[-3000:]
    assert (tmp_path / "faulty.out.flipped").read_text() == "flip\n"
    suspected = _events(faulty, "sdc_suspected")
    assert [(e["rank"], e["undecided"]) for e in suspected] == [(1, False)], suspected
    assert _in_a_window(faulty, suspected[0]["step"], FLIP_AT), suspected
    assert not _events(faulty, "sdc_confirmed") and not _events(clean, "sdc_suspected")
    assert "sdc_audit_off" not in faulty.stdout()
    assert "changed at rest" in faulty.stdout() + faulty.stderr(workers=True)
    clean_out, faulty_out = tmp_path / "clean.out", tmp_path / "faulty.out"
    same = clean_out.read_text() == faulty_out.read_text()
    assert same, first_difference(str(clean_out), str(faulty_out), 2)


def _in_a_window(d, found: int, flipped: int) -> bool:
    """A sharded flip after `flipped`'s boundary is found before the update of the next step
    whose window is due: within the windows' cadence (every step until five were measured, then
    as the budget allows: `sdc_audit_cadence every=N`, rank 0's line)."""
    said = re.findall(r"sdc_audit_cadence .*?\bevery=(\d+)", d.stderr(workers=True))
    return flipped < found <= flipped + max([1, *map(int, said)])


def test_a_persistent_flip_in_a_sharded_state_quarantines_the_node(daemons, tmp_path):
    cfg = {"sharded": True, "flip_at": FLIP_AT, "flip_persistent": True}
    faulty = _job(daemons, tmp_path, "faulty", 2, cfg)
    assert faulty.wait(180) == exit_codes.ExitCode.QUARANTINED, faulty.stderr()[-3000:]
    suspected = _events(faulty, "sdc_suspected")
    assert [e["rank"] for e in suspected] == [1, 1], suspected
    # each found within a window of its flip: the first after step 4, the next (rolled back to
    # the newest certified state) after step `first`, the first step it takes again
    first, then = (e["step"] for e in suspected)
    assert _in_a_window(faulty, first, FLIP_AT) and _in_a_window(faulty, then, first), suspected
    confirmed = _events(faulty, "sdc_confirmed")
    assert len(confirmed) == 1 and confirmed[0]["rank"] == 1, confirmed


def test_a_persistent_flip_quarantines_the_node(daemons, tmp_path):
    faulty = _job(daemons, tmp_path, "faulty", 3, {"flip_at": FLIP_AT, "flip_persistent": True})
    assert faulty.wait(120) == exit_codes.ExitCode.QUARANTINED, faulty.stderr()[-3000:]
    assert (tmp_path / "faulty.out.flipped").read_text() == "flip\n" * 2
    suspected = _events(faulty, "sdc_suspected")
    confirmed = _events(faulty, "sdc_confirmed")
    # after the rollback to step 4 its first flip comes after step 5: found at step 6
    assert [(e["rank"], e["step"]) for e in suspected] == [(1, 5), (1, 6)], suspected
    assert len(confirmed) == 1 and confirmed[0]["rank"] == 1, confirmed
    record = quarantine.read(tmp_path / "faulty.state")
    assert record.quarantined and "silent data corruption" in record.quarantined["why"], record


def _nodes_one_faulty(daemons, tmp_path, names: str, nnodes: str, *flags: str, **job) -> dict:
    """One daemon of one rank per name, node b's part faulty (it flips persistently, whatever
    rank it runs); a starts first and hosts the c10d store. `flags`: more of the daemons';
    `job`: more of the job's config."""
    port = free_port()
    cfg = {"flip_at": FLIP_AT, "flip_persistent": True, "flip_rank": None, "steps": STEPS, **job}
    env = {"EXACT_JOB": json.dumps({**cfg, "out": str(tmp_path / "job.out")})}
    nodes = {}
    for name in names:
        nodes[name] = daemons(
            script("exact_job.py"),
            *("--nproc-per-node", "1", "--max-restarts", "4"),
            *("--checkpoint-dir", str(tmp_path / "ckpt"), "--state-dir", str(tmp_path / name)),
            *node_flags(port, nnodes, "sdc"),
            *flags,
            name=name,
            env={**env, **({"EXACT_FLIP_HERE": "1"} if name == "b" else {})},
        )
        if name == "a":  # alone, it can only be in a run it began: it hosts the store
            wait_until(lambda: _events(nodes["a"], "rendezvous_run"), 30, what="a's store")
    return nodes


def _b_left_and_the_others_finished(nodes: dict, tmp_path) -> None:
    codes = {name: d.wait(150) for name, d in nodes.items()}
    want = {n: exit_codes.ExitCode.QUARANTINED if n == "b" else 0 for n in nodes}
    assert codes == want, {n: d.stderr()[-2000:] for n, d in nodes.items()}
    confirmed = _events(nodes["b"], "sdc_confirmed")
    assert len(confirmed) == 1 and confirmed[0]["node"], confirmed
    assert quarantine.read(tmp_path / "b").quarantined is not None
    for name in nodes:
        if name != "b":  # they saw it too, and were never struck
            assert quarantine.read(tmp_path / name).quarantined is None
            assert [e["node"] for e in _events(nodes[name], "sdc_suspected")] == [
                confirmed[0]["node"]
            ] * 2


def test_a_node_quarantined_for_persistent_corruption_leaves_and_the_job_goes_on(daemons, tmp_path):
    """Three nodes of one rank; the bad part is node b's, whatever rank it runs: outvoted twice,
    b is quarantined (exit 7) and the others finish at two ranks from their own memory. Node a
    starts first and hosts the c10d store: a quarantined node that hosts it takes the store with
    it when it leaves (to go on past that, a job needs etcd: docs/multinode.md)."""
    nodes = _nodes_one_faulty(daemons, tmp_path, "abc", "2:3")
    _b_left_and_the_others_finished(nodes, tmp_path)


def test_two_nodes_the_referee_meets_both_bundles_and_quarantines_the_flipping_one(
    daemons, tmp_path
):
    """Two nodes of one rank, node b's update flipped after every step from step 4: no majority,
    so b's rank's bundle goes to a through the checkpoint directory they share, a referees and
    tells b (daemon/replay_elsewhere.py); both name b's rank twice, b is quarantined (exit 7)
    and a finishes alone."""
    last_call = ("--last-call-timeout", "30")  # the first round waits for both
    nodes = _nodes_one_faulty(
        daemons, tmp_path, "ab", "1:2", "--ledger", *last_call, flip_in="update"
    )
    codes = {name: d.wait(150) for name, d in nodes.items()}
    assert codes == {"a": 0, "b": exit_codes.ExitCode.QUARANTINED}, {
        n: d.stderr()[-2000:] for n, d in nodes.items()
    }
    found = {n: _events(d, "sdc_suspected") for n, d in nodes.items()}
    b_node = _events(nodes["b"], "sdc_confirmed")[0]["node"]
    for name, seen in found.items():  # each node names b, by the referee's replay, twice
        assert [(e["node"], e["undecided"]) for e in seen] == [(b_node, False)] * 2, (name, seen)
        assert all("reproduced rank" in e["referee"] for e in seen), seen
    # a's pool holds one spare per local rank: one replay warm, the other in a fresh interpreter
    assert all(e["referee_warm"] >= 1 for e in found["a"]), found["a"]
    assert quarantine.read(tmp_path / "b").quarantined is not None
    assert quarantine.read(tmp_path / "a").quarantined is None
    assert not list((tmp_path / "ckpt" / "repro").iterdir())  # each copy removed once refereed


def test_four_ranks_a_persistent_flip_is_outvoted_quarantined_and_three_go_on(daemons, tmp_path):
    """Four nodes of one rank, node b's part faulty: a majority of three outvotes it twice, b is
    quarantined and the other three finish at a world of three (--nnodes 3:4)."""
    nodes = _nodes_one_faulty(daemons, tmp_path, "abcd", "3:4")
    _b_left_and_the_others_finished(nodes, tmp_path)


def test_a_node_quarantined_for_corruption_in_its_shards_leaves_and_the_job_goes_on(
    daemons, tmp_path
):
    """FSDP2 over three nodes of one rank, node b's shard flipped after every step from step 4:
    the audit in time names b's rank twice, b is quarantined (exit 7), and a and c finish at a
    world of two, b's shards taken from the replicas they hold of it."""
    nodes = _nodes_one_faulty(daemons, tmp_path, "abc", "2:3", sharded=True)
    _b_left_and_the_others_finished(nodes, tmp_path)
    out = nodes["a"].stdout() + nodes["c"].stdout()
    # rank 0 says how the world of two was resumed: b's old rank from a replica held of it
    resumed = re.findall(r"memory_state_sharded .*from_replicas=\[(\d+)\].* world=2 ", out)
    assert len(resumed) == 1, out[-3000:]
    assert "sharded-replicas" in out and "(step None)" not in out
