"""A constant global batch and exact mode across world changes: two nodes in network namespaces
(tests/netns.py; the store on a third, as in test_nodeloss.py), one worker each, training
tests/scripts/global_train.py under --ledger. Node b's daemon is SIGKILLed (world 2 -> 1) and
started again (1 -> 2); the run must train every step on exactly the global batch an
uninterrupted run trains on, `elasticd ledger check` must prove each epoch's samples once and
every step's size G, and in exact mode the run must end with the same weights and optimizer state
as an uninterrupted two-worker run, bit for bit."""

from __future__ import annotations

import re
from collections import Counter, defaultdict

from e2e.test_nodeloss import PORT, _nodes, _start_store
from elasticd.global_batch import GlobalBatch
from harness import run_cli, secret_flags, wait_until
from netns import DEV, netns_fixture  # noqa: F401 (the netns fixture)

STEPS = 90
GLOBAL, MICRO = 10, 4  # 3 micro-batches: 2 + 1 over two ranks (the uneven split's line)
ENV = {"GB_EXACT": "1", "GB_GLOBAL": str(GLOBAL), "GB_MICRO": str(MICRO), "GB_SAMPLES": "64"}
SLOW_ALONE = {"GB_DELAY1": "0.25"}  # a world of one steps slowly: time for b to come back
LINE = re.compile(r"^gstep (\d+) world (\d+) rank (\d+) round (\d+) samples ([\d,]*)$", re.M)


def logs(d) -> str:
    """Every rank log of every attempt of a daemon."""
    return "".join(
        p.read_text(errors="replace") for a in d.attempt_dirs() for p in sorted(a.glob("rank*.log"))
    )


def trained(*nodes) -> dict[tuple[int, int], dict]:
    """(round, step) -> {"world": W, "ranks": {rank: samples}} from the nodes' logs."""
    out: dict[tuple[int, int], dict] = defaultdict(lambda: {"world": 0, "ranks": {}})
    for d in nodes:
        for step, world, rank, tag, samples in LINE.findall(logs(d)):
            entry = out[(int(tag), int(step))]
            entry["world"] = int(world)
            entry["ranks"][int(rank)] = [int(i) for i in samples.split(",") if i]
    return out


def finals(*nodes) -> list[str]:
    return [h for d in nodes for h in re.findall(r"^final ([0-9a-f]{64})$", logs(d), re.M)]


def worlds_at(run: dict, world: int) -> list[int]:
    return sorted(s for (_, s), e in run.items() if e["world"] == world)


def run_2_1_2(daemons, netns, env: dict, subnet: int):
    """The job on nodes a and b in namespaces; b's daemon SIGKILLed once both train (2 -> 1) and
    started again once a trained alone (1 -> 2); every daemon ends with exit 0."""
    net = netns(3, subnet=subnet)
    store = _start_store(net)
    try:
        env = {**env, **SLOW_ALONE}
        flags = dict(steps=STEPS, delay=0.02, env=env, job="global_train.py", extra=("--ledger",))
        a, b = _nodes(daemons, net, ["a", "b"], **flags)
        wait_until(lambda: worlds_at(trained(a, b), 2)[-1:] >= [8], 90, what="both training")
        b.kill()  # SIGKILL of b's daemon: its guard takes its worker with it
        wait_until(lambda: len(worlds_at(trained(a), 1)) >= 3, 60, what="a training alone")
        back = daemons(
            "tests/scripts/global_train.py",
            "--nproc-per-node",
            "1",
            "--nnodes",
            "1:2",
            "--rdzv-endpoint",
            f"{net.addr(0)}:{PORT}",
            "--rdzv-id",
            "job",
            "--ledger",
            *secret_flags(),
            name="b-again",
            args=[str(STEPS), "0.02"],
            env={"GLOO_SOCKET_IFNAME": DEV, **env},
            prefix=net.prefix(2),
        )
        for d in (a, back):
            assert d.wait(120) == 0, d.stderr()[-3000:]
    finally:
        store.kill()
        store.wait(10)
    return a, b, back


def check_every_step(run: dict, expected: dict) -> None:
    """The run went 2 -> 1 -> 2 and trained every step whole on the expected samples (a step a
    node's loss cut short, or retrained after a resume, is a part or a copy of the same)."""
    alone, paired = worlds_at(run, 1), worlds_at(run, 2)
    print(
        f"world 1 for steps {alone[:1]}..{alone[-1:]}, steps trained twice: "
        f"{len(alone) + len(paired) - STEPS}"
    )
    assert alone and min(paired) < min(alone) and max(alone) < max(paired) == STEPS, (alone,)
    whole = set()
    for (_, step), e in run.items():
        got = Counter(i for s in e["ranks"].values() for i in s)
        assert not got - expected[step], (step, e)
        if sorted(e["ranks"]) == list(range(e["world"])):
            assert got == expected[step], (step, e)
            whole.add(step)
    assert whole == set(expected)


def check_ledger(*nodes) -> None:
    """The ledger proves it too: each finished epoch's samples once, every step exactly GLOBAL."""
    r = run_cli("ledger", "check", *(str(d.log_dir) for d in nodes))
    assert r.returncode == 0 and "exactly once: yes" in r.stdout, r.stdout + r.stderr
    assert "epoch 13: 64 samples seen, 64 once, 0 twice or more, 0 never" in r.stdout, r.stdout
    sizes = set(re.findall(r"(\d+) samples x \d+ steps", r.stdout))
    assert sizes == {str(GLOBAL)}, r.stdout


def test_global_batch_and_exact_weights_survive_2_1_2(daemons, netns):
    reference = daemons(
        "tests/scripts/global_train.py",
        "--nproc-per-node",
        "2",
        "--restart-grace",
        "1",
        name="reference",
        args=[str(STEPS), "0"],
        env=ENV,
    )
    a, b, back = run_2_1_2(daemons, netns, ENV, subnet=61)
    assert reference.wait(120) == 0, reference.stderr()[-3000:]
    ref, run = trained(reference), trained(a, b, back)
    # the reference: every step once, on both ranks, exactly GLOBAL samples
    expected = {}
    for (_, step), e in ref.items():
        assert e["world"] == 2 and sorted(e["ranks"]) == [0, 1], (step, e)
        expected[step] = Counter(i for s in e["ranks"].values() for i in s)
        assert sum(expected[step].values()) == GLOBAL
    assert sorted(expected) == list(range(1, STEPS + 1))
    check_every_step(run, expected)
    # bit for bit: the same weights and optimizer state as the uninterrupted run
    assert finals(reference) and finals(a, b, back) == finals(reference)
    check_ledger(a, b, back)
    # the uneven split said once per attempt at two ranks, never at one
    said = reference.all_logs().count("global_batch_split")
    assert said == 1, said


def test_normal_mode_keeps_every_step_s_global_batch_across_2_1_2(daemons, netns):
    """Normal mode (DDP's all-reduce, even shares): not bit-exact, but every step trains on the
    global batch the stream deals at that step whatever the world: the one GlobalBatch computes
    for a world of one."""
    a, b, back = run_2_1_2(daemons, netns, {**ENV, "GB_EXACT": "0"}, subnet=62)
    n = int(ENV["GB_SAMPLES"])
    stream = GlobalBatch(range(n), GLOBAL, MICRO, seed=7, num_replicas=1, rank=0)
    expected = {  # step s: the stream's positions (s-1)*G on, across epochs' ends
        s: Counter(stream.global_indices(*divmod((s - 1) * GLOBAL, n))) for s in range(1, STEPS + 1)
    }
    check_every_step(trained(a, b, back), expected)
    check_ledger(a, b, back)
