"""The per-sample ledger (elasticd/ledger.py): files written as the sampler trains, read back
(a record cut short by a kill ignored), and `elasticd ledger check` run as the CLI on a run
with a rollback, a duplicate, a missing node's directory and input that is not a ledger."""

from __future__ import annotations

import time

import pytest

from elasticd import ledger
from elasticd.sampler import ResumableDistributedSampler
from harness import assert_one_error, run_cli


def attempt(monkeypatch, tmp_path, node: str, name: str, port: int, world: int):
    """A directory per rank-file set, as an attempt's directory on `node`; the env of its round."""
    d = tmp_path / node / name
    d.mkdir(parents=True)
    monkeypatch.setenv("WORLD_SIZE", str(world))
    monkeypatch.setenv("MASTER_PORT", str(port))
    monkeypatch.setenv("ELASTICD_ROUND", str(port))
    return d


def train(monkeypatch, d, n, world, ranks, steps, state=None, b=2):
    """`steps` steps of the usual loop for `ranks` (of `world`), each rank writing its own
    ledger in `d`; returns rank 0's state after each step."""
    samplers, writers = [], []
    for r in ranks:
        monkeypatch.setenv("RANK", str(r))
        w = ledger.Writer(str(d))
        monkeypatch.setattr(ledger, "_writer", w)
        monkeypatch.setattr(ledger, "_checked", True)
        s = ResumableDistributedSampler(list(range(n)), world, r, seed=2, batch_size=b)
        if state is not None:
            s.load_state_dict(state)
        s.set_epoch(s.epoch)
        samplers.append(s)
        writers.append(w)
    states = []
    for _ in range(steps):
        for s, w in zip(samplers, writers):
            monkeypatch.setattr(ledger, "_writer", w)
            if s.epoch_done:
                s.set_epoch(s.epoch + 1)
            s.advance(b)
        states.append(samplers[0].state_dict())
    monkeypatch.setattr(ledger, "_writer", None)
    return states


def test_round_trip_and_a_record_cut_short(monkeypatch, tmp_path):
    d = attempt(monkeypatch, tmp_path, "a", "attempt1", 100, 1)
    monkeypatch.setenv("RANK", "0")
    w = ledger.Writer(str(d))
    w.dataset_size(10)
    w.record(0, 1, [3, 4])
    w.record([0, 1], 2, [5, 9])
    (path,) = d.glob("*.ledger")
    with open(path, "ab") as f:
        f.write(b"S\x03\x00")  # a SIGKILL mid-write
    got = ledger.read(path)
    assert (got.rank, got.world, got.resumed, got.dataset_size, got.torn) == (0, 1, 0, 10, True)
    assert got.steps == {1: [([3, 4], [0, 0])], 2: [([5, 9], [0, 1])]}
    assert got.attempt.endswith("/100/:100")
    with pytest.raises(ValueError, match="2 epochs for 1 indices"):
        w.record([0, 1], 3, [1])


def test_check_proves_exactly_once_across_a_rollback_and_a_world_change(monkeypatch, tmp_path):
    n = 24
    # attempt 1: world 2 on nodes a and b, 5 steps; attempt 2 resumes after step 3 at world 3
    d = attempt(monkeypatch, tmp_path, "a", "attempt1", 101, 2)
    states = train(monkeypatch, d, n, 2, [0], 5)
    d = attempt(monkeypatch, tmp_path, "b", "attempt1", 101, 2)
    train(monkeypatch, d, n, 2, [1], 5)
    time.sleep(0.01)
    d = attempt(monkeypatch, tmp_path, "a", "attempt2", 102, 3)
    train(monkeypatch, d, n, 3, [0, 1], 8, state=states[2])
    d = attempt(monkeypatch, tmp_path, "b", "attempt2", 102, 3)
    train(monkeypatch, d, n, 3, [2], 8, state=states[2])
    r = run_cli("ledger", "check", str(tmp_path / "a"), str(tmp_path / "b"))
    assert r.returncode == 0, r.stdout + r.stderr
    assert "epoch 0: 24 samples seen, 24 once, 0 twice or more, 0 never" in r.stdout
    assert "epoch 1: 24 samples seen, 24 once, 0 twice or more, 0 never" in r.stdout
    assert "4 samples x 3 steps (2 ranks)" in r.stdout  # the steps before the resume
    assert "6 samples x 8 steps (3 ranks)" in r.stdout
    assert "(2 steps rolled back" in r.stdout and "exactly once: yes" in r.stdout
    # without node b's directory the history has holes: said, exit 1
    r = run_cli("ledger", "check", str(tmp_path / "a"))
    assert r.returncode == 1 and "exactly once: NO" in r.stdout
    # a sample trained twice (a rank's record repeated in a later step) is named
    monkeypatch.setenv("RANK", "5")
    w = ledger.Writer(str(tmp_path / "b" / "attempt2"))
    w.resumed(3)
    w.record(1, 11, [7])
    r = run_cli("ledger", "check", str(tmp_path))
    assert r.returncode == 1, r.stdout
    assert "twice or more: 7" in r.stdout and "exactly once: NO" in r.stdout


def test_a_script_run_again_in_place_is_an_attempt_of_its_own(monkeypatch, tmp_path):
    """Recovered in place, a survivor's script runs again in the same process (its ledger
    writer kept) from a state of its own: what it and the lost rank recorded past that state
    was rolled back. Each generation of the group is an attempt (names.IN_PLACE_GEN): without
    it, the rolled-back step counted twice (a node lost at world 2, A's re-entry at world 1)."""
    n = 24
    d = attempt(monkeypatch, tmp_path, "a", "attempt1", 103, 2)
    monkeypatch.setenv("ELASTICD_IN_PLACE_GEN", "0")
    states = train(monkeypatch, d, n, 2, [0], 5)  # rank 0 and the lost rank 1 record step 5,
    train(monkeypatch, attempt(monkeypatch, tmp_path, "b", "attempt1", 103, 2), n, 2, [1], 5)
    time.sleep(0.01)
    monkeypatch.setenv("ELASTICD_IN_PLACE_GEN", "1")  # ... but the state kept is step 4's
    train(monkeypatch, d, n, 1, [0], 9, state=states[3])
    r = run_cli("ledger", "check", str(tmp_path / "a"), str(tmp_path / "b"))
    assert r.returncode == 0 and "exactly once: yes" in r.stdout, r.stdout + r.stderr
    assert "(1 steps rolled back" in r.stdout and "2 samples x 9 steps (1 rank)" in r.stdout
    # one writer, kept across the re-entry: a file of its own for the new generation
    monkeypatch.setenv("ELASTICD_IN_PLACE_GEN", "0")
    w = ledger.Writer(str(tmp_path / "one"))
    (tmp_path / "one").mkdir()
    w.record(0, 1, [1])
    first = w.path
    monkeypatch.setenv("ELASTICD_IN_PLACE_GEN", "2")
    w.resumed(0)
    w.record(0, 1, [1])
    assert w.path != first and w.path.name == "rank0.g2.ledger"
    assert ledger.read(w.path).attempt == ledger.read(first).attempt + "/g2"


def test_check_refuses_what_is_not_a_ledger(tmp_path):
    assert_one_error(run_cli("ledger", "check", str(tmp_path)), "no ledger files", "--ledger")
    assert_one_error(run_cli("ledger", "check", str(tmp_path / "nope")), "no such file")
    (tmp_path / "rank0.ledger").write_bytes(b"hello")
    assert_one_error(run_cli("ledger", "check", str(tmp_path)), "not an elasticd ledger")


def test_per_step_cost_is_microseconds(monkeypatch, tmp_path):
    """advance() with the ledger on against off (a batch of 32): prints both."""
    monkeypatch.setenv("RANK", "0")
    costs = {}
    for on in (False, True):
        monkeypatch.setattr(ledger, "_writer", ledger.Writer(str(tmp_path)) if on else None)
        monkeypatch.setattr(ledger, "_checked", True)
        s = ResumableDistributedSampler(list(range(64_000)), 2, 0, batch_size=32)
        list(s)
        t = time.perf_counter()
        for _ in range(900):
            s.advance(32)
        costs[on] = (time.perf_counter() - t) / 900 * 1e6
    print(f"advance(): {costs[False]:.1f} us off, {costs[True]:.1f} us with the ledger")
    assert costs[True] < 500  # microseconds, with room for a loaded 2-core box


def test_the_ledger_setting_gives_each_attempt_its_directory(monkeypatch, tmp_path):
    """--ledger (here ELASTICD_LEDGER=1) -> the workers' ELASTICD_LEDGER_DIR, the attempt's
    directory; without it only the round's number."""
    from elasticd import config
    from elasticd.cluster.rounds import Round
    from elasticd.daemon.group import LocalGroup

    for on in ("1", "0"):
        monkeypatch.setenv("ELASTICD_LEDGER", on)
        cfg = config.build({"nproc_per_node": "1"}, None)
        group = LocalGroup(cfg, "token", tmp_path, "node", lambda *a, **k: None)
        group.attempt = 3
        env = group._extra_env(Round(number=5, group_rank=0, members=[]), None)
        want = {"ELASTICD_ROUND": "5"}
        if on == "1":
            want["ELASTICD_LEDGER_DIR"] = str(tmp_path / "attempt3")
        assert env == want
