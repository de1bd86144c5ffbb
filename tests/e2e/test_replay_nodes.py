"""The replay's verdict over two nodes, each in a network namespace of its own (issue 44, point 3):
a failure whose replay reproduces on its own node is replayed on the other node too, from the
bundle copied into the checkpoint directory they share (daemon/replay_elsewhere.py). A fault of
one machine's (tests/scripts/replay_job.py --bad-node: the rank on the node with that address
raises, every attempt) completes there: the node's hardware, quarantined at once (exit 7), and
the other node trains on alone. A data bug reproduces on both: deterministic, exit 6 on both,
after one failure. The store runs in a namespace of its own (test_nodeloss.py's harness)."""

from __future__ import annotations

from e2e.test_nodeloss import _nodes, _start_store
from elasticd import exit_codes
from netns import netns_fixture  # noqa: F401 (the netns fixture)


def _events(d, name: str) -> list[dict]:
    return [e for e in d.events() if e.get("event") == name]


def _pair(daemons, net, tmp_path, *args: str):
    shared = ("--checkpoint-dir", str(tmp_path / "ckpt"), "--ledger", "--max-restarts", "3")
    return _nodes(daemons, net, ["a", "b"], 0, extra=shared, job="replay_job.py", args=args)


def test_a_fault_of_one_machine_replays_clean_on_the_other_and_quarantines_it(
    daemons, netns, tmp_path
):
    net = netns(3, subnet=42)
    store = _start_store(net)
    try:  # node a is in namespace 1: its address is the bad one
        a, b = _pair(daemons, net, tmp_path, "--steps", "24", "--bad-node", net.addr(1),
                     "--bad-node-step", "5")  # fmt: skip
        assert a.wait(120) == exit_codes.ExitCode.QUARANTINED, a.stderr()[-3000:]
        assert b.wait(120) == 0, b.stderr()[-3000:]
        (verdict,) = _events(a, "replay_verdict")
        assert verdict["verdict"] == "hardware" and verdict["warm"], verdict
        assert verdict["said"].startswith("elasticd replay: reproduced at step 5"), verdict
        assert verdict["elsewhere"].startswith(f"node {b.events()[-1]['node']}: "), verdict
        assert "did not reproduce: step 5 completed" in verdict["elsewhere"], verdict
        (quarantined,) = _events(a, "node_quarantined")
        assert "this node's hardware" in quarantined["why"], quarantined
        (replayed,) = _events(b, "replayed_for_node")
        assert replayed["verdict"] == "transient" and replayed["node"] == verdict["node"], replayed
        assert "this node left the job" in a.stderr(), a.stderr()[-2000:]
        # b went on alone from the state before the failure, to the end
        runs = [e for e in _events(b, "state") if e.get("new") == "RUNNING"]
        assert runs[-1]["world_size"] == 1 and "done" in b.stdout(), runs
        # the copy b replayed, removed once replayed (a keeps its own bundle)
        assert not list((tmp_path / "ckpt" / "repro").iterdir())
        assert (a.attempt_dirs()[0] / "rank0.repro").is_file()
    finally:
        store.kill()
        store.wait()


def test_a_data_bug_reproduces_on_both_nodes_and_ends_deterministic_after_one_failure(
    daemons, netns, tmp_path
):
    net = netns(3, subnet=43)
    store = _start_store(net)
    try:
        a, b = _pair(daemons, net, tmp_path, "--steps", "24", "--bad-sample", "37")
        for d in (a, b):
            assert d.wait(120) == exit_codes.ExitCode.DETERMINISTIC, d.stderr()[-3000:]
        failed, other = (a, b) if _events(a, "replay_verdict") else (b, a)
        (verdict,) = _events(failed, "replay_verdict")
        assert verdict["verdict"] == "reproduced", verdict
        assert "elasticd replay: reproduced at step 7" in verdict["elsewhere"], verdict
        (replayed,) = _events(other, "replayed_for_node")
        assert replayed["verdict"] == "reproduced", replayed
        assert not _events(failed, "node_quarantined")
    finally:
        store.kill()
        store.wait()
