"""The replay on another node's parts that need no daemon (daemon/replay_elsewhere.py): which node
replays, the bundle's copy, what the node named refuses to run, and the verdict made of both
replays. The protocol end to end: tests/e2e/test_replay_nodes.py; the agent's part:
tests/unit/daemon/test_agent.py."""

from __future__ import annotations

import hashlib

import pytest

from elasticd.cluster.rounds import Member, Round
from elasticd.daemon import replay_elsewhere as elsewhere


def _round(ids: list[str]) -> Round:
    members = [Member(i, 1, "127.0.0.1") for i in ids]
    return Round(3, 0, members, world_size=len(ids))


def test_the_next_member_in_group_order_replays():
    rnd = _round(["a", "b", "c"])
    assert [elsewhere.target(rnd, n) for n in "abc"] == ["b", "c", "a"]
    assert elsewhere.target(_round(["a"]), "a") is None  # alone: nobody else
    assert elsewhere.target(None, "a") is None and elsewhere.target(rnd, "z") is None
    # the node whose word the one named waits for (and whose silence ends that wait)
    assert [elsewhere.source(rnd, elsewhere.target(rnd, n)) for n in "abc"] == list("abc")
    assert elsewhere.source(_round(["a"]), "a") is None and elsewhere.source(rnd, "z") is None


def test_the_copy_is_whole_and_its_digest_the_files(tmp_path):
    bundle = tmp_path / "rank1.repro"
    bundle.write_bytes(b"x" * (3 << 20) + b"end")
    dest = elsewhere.copy_path(str(tmp_path / "ckpt"), "job", _round(["a", "b"]), 1)
    sha, failed = elsewhere.publish(bundle, dest)
    assert not failed and dest.read_bytes() == bundle.read_bytes()
    assert sha == hashlib.sha256(bundle.read_bytes()).hexdigest()
    assert [p.name for p in dest.parent.iterdir()] == ["job-r3-rank1.repro"]  # no temporary left
    sha, failed = elsewhere.publish(tmp_path / "missing.repro", dest)
    assert sha == "" and "could not copy the bundle" in failed


@pytest.mark.parametrize("case", ["outside", "digest", "missing", "no-ask", "no-folder"])
def test_the_node_named_runs_nothing_it_cannot_verify(tmp_path, case):
    """Refused (or undecided) before any replay runs: a path outside its own checkpoint
    directory's repro folder, a file whose SHA-256 is not the one the failed node wrote, one
    it cannot read, no word of the bundle, no checkpoint directory."""
    ckpt = tmp_path / "ckpt"
    inside = ckpt / elsewhere.FOLDER / "job-r0-rank0.repro"
    inside.parent.mkdir(parents=True)
    inside.write_bytes(b"bundle")
    outside = tmp_path / "elsewhere.repro"
    outside.write_bytes(b"bundle")
    sha = hashlib.sha256(b"bundle").hexdigest()
    ask = {
        "outside": {"path": str(outside), "sha256": sha},
        "digest": {"path": str(inside), "sha256": "0" * 64},
        "missing": {"path": str(inside.with_name("gone.repro")), "sha256": sha},
        "no-ask": None,
        "no-folder": {"path": str(inside), "sha256": sha},
    }[case]

    def never(*_):
        raise AssertionError("nothing may run")

    directory = "" if case == "no-folder" else str(ckpt)
    log = tmp_path / "attempt" / "node-a-rank0.replay.log"
    log.parent.mkdir()
    code, said, warm = elsewhere.serve(ask, directory, log, 5.0, never, never)
    assert warm is False
    if case == "no-ask":
        assert code == elsewhere.UNDECIDED and "said nothing of its bundle" in said
    else:
        assert code == elsewhere.REFUSED and said.startswith("refused: "), said
        if case != "digest":
            assert "one --checkpoint-dir every node shares" in said, said
    assert not list(log.parent.iterdir())  # no copy of what it refused kept
    assert inside.read_bytes() == outside.read_bytes() == b"bundle"  # nor anything removed


def test_what_runs_is_a_private_copy_whose_digest_was_checked(tmp_path):
    """The shared copy is fetched into the node's own directory, checked there, and removed:
    a file swapped in after the check never runs."""
    ckpt = tmp_path / "ckpt"
    shared = ckpt / elsewhere.FOLDER / "job-r0-rank0.repro"
    shared.parent.mkdir(parents=True)
    shared.write_bytes(b"bundle")
    ask = {"path": str(shared), "sha256": hashlib.sha256(b"bundle").hexdigest()}
    into = tmp_path / "rank1.sdc.repro"
    path, why = elsewhere.fetched(ask, str(ckpt), into)
    assert (path, why) == (into, "") and into.read_bytes() == b"bundle"
    assert not shared.exists()  # it was for this replay alone
    assert elsewhere.fetched({"none": "no bundle"}, str(ckpt), into) == (None, "no bundle")


@pytest.mark.parametrize(
    "answer, verdict, says",
    [
        ({"node": "b", "code": 1, "said": "did not reproduce"}, "hardware", "node b: did not"),
        ({"node": "b", "code": 0, "said": "reproduced"}, "reproduced", "node b: reproduced"),
        ({"node": "b", "code": 2, "said": "refused: x"}, "reproduced", "undecided: node b"),
        (None, "reproduced", "none: no word"),
    ],
)
def test_the_verdict_of_both_replays(answer, verdict, says):
    got, fields = elsewhere.combine(answer, "no word")
    assert got == verdict and fields["elsewhere"].startswith(says), fields
