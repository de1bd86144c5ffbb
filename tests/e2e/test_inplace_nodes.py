"""In-place recovery over several nodes (--in-place auto, two daemons on loopback as nodes): a
rank killed on one node is replaced alone on that node; every other rank, on both nodes,
re-enters in its own process. The generation is announced and the handles exchanged, signed,
in the round's workers' store that both nodes' workers share (daemon/inplace.py `store`); the
node that did not fail follows the generation (`in_place_followed`). Needs torch>=2.14 (.ci/run's
second environment)."""

from __future__ import annotations

import ast
import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest
import torch
import torch.distributed as dist

from e2e.test_inplace import events
from e2e.test_nodeloss import _nodes, _start_store, stepping_alone, training_together
from e2e.test_resume import final_state, tensors
from etcd_cluster import SKIP_REASON, EtcdCluster, etcd_binary
from harness import (
    FAST_NODES,
    SESSION,
    alive,
    bench,
    free_port,
    gone,
    leftover_processes,
    node_flags,
    script,
    secret_flags,
    wait_until,
)
from netns import netns_fixture  # noqa: F401 (the netns fixture)

pytestmark = pytest.mark.skipif(
    not hasattr(dist, "_reconfigure"),
    reason=f"torch {torch.__version__} cannot re-form a group in place (needs torch>=2.14)",
)

ARGS = ["--steps", "60", "--checkpoint-every", "5", "--log-every", "1", "--samples", "1024"]
ARGS += ["--hidden", "32", "--memory-every", "1", "--step-delay", "0.05"]
FLAGS = ("--nproc-per-node", "2", "--in-place", "auto", "--max-restarts", "3")


def two_nodes(daemons, tmp_path, job="job", nproc: int = 2, args=ARGS):
    """Two nodes of `nproc` ranks each, one job; returned as (the node of rank 0, the other)."""
    port = free_port()
    nodes = [
        daemons(
            "entrypoints.train",
            *FLAGS[2:],  # all but its --nproc-per-node
            "--nproc-per-node",
            str(nproc),
            *node_flags(port, "2", job=job),
            "--checkpoint-dir",
            str(tmp_path / f"ckpt{i}"),
            name=f"n{i}",
            args=args,
        )  # fmt: skip
        for i in range(2)
    ]
    wait_until(lambda: all(len(n.worker_pids()) == nproc for n in nodes), 90, what="every worker")
    return sorted(nodes, key=lambda n: min(n.worker_pids()))


def in_order(daemons, tmp_path, flags, n: int, args=ARGS, shared_ckpt: bool = False) -> list:
    """`n` nodes started one after another, each waited for at the store, so that they take
    group ranks 0, 1, ... in that order (group rank 0's node hosts the workers' store); every
    node its own checkpoint directory, or one for all (`shared_ckpt`)."""
    nodes = []
    for i in range(n):
        ckpt = tmp_path / ("c" if shared_ckpt else f"c{i}")
        nodes.append(
            daemons(
                "entrypoints.train", *flags, "--checkpoint-dir", str(ckpt), name=f"n{i}", args=args
            )
        )
        wait_until(
            lambda: any(e.get("event") == "rendezvous_store" for e in nodes[-1].events()),
            60, what="at the store",
        )  # fmt: skip
    return nodes


def fault_and_reentry(host, other, before: dict, victim: int, sig: int) -> dict:
    """`sig` to rank `victim` (pids `before`, by rank); once every other rank re-entered in its
    own process: rank -> its node, for those survivors."""
    os.kill(before[victim], sig)
    survivors = {r: p for r, p in before.items() if r != victim}
    node = {r: host if r in host.worker_pids() else other for r in survivors}
    wait_until(
        lambda: all("re_entered" in node[r].log_text(r, 1) for r in survivors),
        60,
        what="every survivor re-entered",
    )
    assert all(alive(p) for p in survivors.values()), "a survivor left its process"
    return node


@pytest.mark.parametrize("nproc", [2, 1], ids=["2-ranks-a-node", "1-rank-a-node"])
def test_a_rank_killed_on_one_node_is_replaced_there_alone(daemons, tmp_path, nproc):
    """With one rank a node, the node whose rank died keeps no survivor of its own: the other
    node's rank is the survivor (before, "every rank has exited" restarted the group)."""
    host, other = two_nodes(daemons, tmp_path, nproc=nproc)
    victim = max(other.worker_pids())
    wait_until(lambda: re.search(r"^step 12/60", host.log_text(0, 1), re.M), 90, what="step 12")
    before = {**host.worker_pids(), **other.worker_pids()}
    node = fault_and_reentry(host, other, before, victim, signal.SIGKILL)  # survivor -> node
    # each node's status counts it in place: the failed rank's node by its cause, the other as a
    # peer's (as a restart another node asked for)
    for n, cause in ((other, "signal"), (host, "peer")):
        shown = json.loads(n.status("--json").stdout)
        assert shown["in_place_by_cause"][cause] == 1, (cause, shown["in_place_by_cause"])
        assert sum(shown["restarts_by_cause"].values()) == 0, shown["restarts_by_cause"]
    for n in (host, other):
        assert n.wait(120) == 0, n.stderr()[-3000:]
    replaced = events(other, "replaced_in_place")
    assert len(replaced) == 1 and replaced[0]["ranks"] == [victim], replaced
    followed = events(host, "in_place_followed")
    assert len(followed) == 1 and followed[0]["ranks"] == [victim], followed
    assert followed[0]["generation"] == replaced[0]["generation"] == 1
    assert not events(host, "replaced_in_place")
    for n in (host, other):
        assert [e["path"] for e in events(n, "recovery_path")] == ["in_place"]
        assert not events(n, "in_place_refused") and len(n.attempt_dirs()) == 1
        assert not [e for e in events(n, "state") if e.get("new") == "RESTARTING"]
    for r, n in node.items():
        assert "in_place_fallback" not in n.log_text(r, 1), r
    # rank 0 (it prints it) resumed from the in-memory state it held: the step in flight lost
    resumed = [int(m) for m in re.findall(r"resumed from step (\d+)", host.log_text(0, 1))]
    assert len(resumed) == 1 and resumed[0] >= 11, resumed
    assert not leftover_processes()


def test_a_rank_stopped_on_one_node_is_replaced_there_alone(daemons, tmp_path):
    """SIGSTOP of a rank of node B once both nodes learned the job's step times: B names it hung
    at a stopped rank's deadline and replaces it in place, asking node A for no stacks (that
    request was a restart of every node, found by bench/chaos_nodes.py); every other rank, on A
    and B, re-enters in its own process."""
    host, other = two_nodes(daemons, tmp_path, args=with_steps(ARGS, 400))
    wait_until(
        lambda: all(events(n, "hang_deadline_learned") for n in (host, other)),
        90, what="the step times learned",
    )  # fmt: skip
    before = {**host.worker_pids(), **other.worker_pids()}
    victim = max(other.worker_pids())
    fault_and_reentry(host, other, before, victim, signal.SIGSTOP)
    assert not alive(before[victim])
    (culprit,) = events(other, "hang_culprit")
    assert f"rank {victim} is stopped by a signal (state T), the culprit" in culprit["verdict"]
    replaced = events(other, "replaced_in_place")
    assert len(replaced) == 1 and replaced[0]["ranks"] == [victim], replaced
    assert "a stopped rank's deadline" in replaced[0]["cause"], replaced
    for n in (host, other):
        assert n.wait(120) == 0, n.stderr()[-3000:]
        assert not events(n, "in_place_refused") and len(n.attempt_dirs()) == 1
        assert not [e for e in events(n, "state") if e.get("new") == "RESTARTING"]
    # read once the job is over: node A's ranks read the announcement from the store themselves
    # and may re-enter before A's daemon, polling, logs that it followed
    followed = events(host, "in_place_followed")
    assert len(followed) == 1 and followed[0]["ranks"] == [victim], followed
    assert not leftover_processes()


def assert_cause_names(cause: str, lost_id: str) -> None:
    """A lost node's cause names it and what was seen: its daemon's held connection closed
    (cluster/links.py), or, with no connection, the ranks waiting in place - never a worker's
    death of a closed connection, which did not happen on the in-place path."""
    assert cause.startswith(f"node {lost_id}; lost: group rank 1 "), cause
    assert f"node {lost_id}: its daemon died" in cause or "wait for a generation" in cause, cause
    assert "died of a closed connection" not in cause, cause


def one_rank_nodes(where) -> tuple:
    """The flags of a job of up to three nodes of one rank each, on the rendezvous `where`."""
    return (
        "--nproc-per-node", "1", "--in-place", "auto", "--max-restarts", "3",
        "--nnodes", "1:3", *where, "--rdzv-id", "job", *FAST_NODES, *secret_flags(),
        "--last-call-timeout", "30",
    )  # fmt: skip


def with_steps(args, steps: int) -> list:
    """`args` with --steps set to `steps`."""
    out = [*args]
    out[out.index("--steps") + 1] = str(steps)
    return out


def rank_logs(d, rank: int) -> str:
    """A rank's log over its processes in the first attempt: its first one's, then those of the
    processes started again for it in place (attempt1/in-place<G>[-<n>]/), oldest first."""
    first = d.attempt_dirs()[0]
    again = sorted(first.glob(f"in-place*/rank{rank}.log"), key=lambda p: p.stat().st_mtime)
    return d.log_text(rank, 1) + "".join(p.read_text(errors="replace") for p in again)


def assert_as_uninterrupted(daemons, tmp_path, args, steps: int = 60) -> None:
    """Node A's final checkpoint (c0) is bit for bit the one an uninterrupted run of the same
    job (exact mode) at world 2 on one node writes: model and optimizer. It runs without the
    step delay, which only gave the faults time and changes no number."""
    args = [*args]
    args[args.index("--step-delay") + 1] = "0"
    clean = daemons(
        "entrypoints.train", "--nproc-per-node", "2", "--checkpoint-dir",
        str(tmp_path / "clean"), name="clean", args=args,
    )  # fmt: skip
    assert clean.wait(240) == 0, clean.stderr()[-3000:]
    want, got = final_state(tmp_path / "clean", steps), final_state(tmp_path / "c0", steps)
    for part in ("model", "optimizer"):
        tw, tg = dict(tensors(want[part])), dict(tensors(got[part]))
        assert tw.keys() == tg.keys() and tw
        assert all(torch.equal(tw[k], tg[k]) for k in tw), part


def store_host(port: int):
    """The job's rendezvous store, hosted by no node (tests/scripts/store_server.py), so that
    losing a node never loses the store."""
    proc = subprocess.Popen(
        [sys.executable, script("store_server.py"), "127.0.0.1", str(port), "job",
         secret_flags()[1]],
        stdout=subprocess.PIPE, text=True, env=dict(os.environ, ELASTICD_TEST_SESSION=SESSION),
    )  # fmt: skip
    assert proc.stdout.readline().strip() == "serving"
    return proc


@contextlib.contextmanager
def rendezvous(backend: str, tmp_path):
    """A rendezvous store hosted by no node, as a node's flags name it: a c10d TCPStore
    (tests/scripts/store_server.py) or a 1-member etcd cluster."""
    if backend == "etcd":
        if etcd_binary() is None:
            pytest.skip(SKIP_REASON)
        cluster = EtcdCluster(tmp_path / "etcd", size=1).start()
        try:
            yield ("--rdzv-backend", "etcd", "--rdzv-endpoint", cluster.endpoints)
        finally:
            cluster.stop()
        return
    port = free_port()
    store = store_host(port)
    try:
        yield ("--rdzv-endpoint", f"127.0.0.1:{port}")
    finally:
        store.kill()
        store.wait(10)


@pytest.mark.parametrize("backend, exact", [("c10d", False), ("etcd", False), ("c10d", True)])
def test_a_lost_node_s_survivors_re_form_at_the_smaller_world_in_place(
    daemons, tmp_path, backend, exact
):
    """Node B's daemon SIGKILLed (its guard kills its workers): node A's ranks re-form at world 2
    in their own processes (GlobalBatch keeps the global batch) and train to the end; no
    restart, A's pids unchanged (but for at most one survivor blocked where no abort reaches,
    started again into the generation). The same on etcd: nothing of it goes through the rendezvous
    store. In exact mode the run ends bit for bit where an uninterrupted one at world 2 does."""
    args = [*ARGS, "--exact"] if exact else ARGS
    with rendezvous(backend, tmp_path) as where:
        flags = (
            *FLAGS, "--nnodes", "1:2", *where, "--rdzv-id", "job", *FAST_NODES, *secret_flags(),
            "--last-call-timeout", "30",
        )  # fmt: skip
        # the first at the store takes group rank 0 (the workers' store)
        nodes = in_order(daemons, tmp_path, flags, 2, args)
        a, b = nodes
        wait_until(lambda: re.search(r"^step 12/60", a.log_text(0, 1), re.M), 120, what="step 12")
        before = a.worker_pids()
        assert sorted(before) == [0, 1], before
        b.kill(signal.SIGKILL)
        assert a.wait(120) == 0, a.stderr()[-3000:]
    shrunk = events(a, "shrunk_in_place")
    assert len(shrunk) == 1 and shrunk[0]["world"] == 2, shrunk
    assert sorted(shrunk[0]["survivors"]) == sorted(before.values())
    (b_id,) = [e["node_id"] for e in b.events() if e.get("event") == "rendezvous_store"]
    assert_cause_names(shrunk[0]["cause"], b_id)
    assert not events(a, "in_place_refused") and len(a.attempt_dirs()) == 1
    assert not [e for e in events(a, "state") if e.get("new") == "RESTARTING"]
    # a survivor blocked where no abort reaches (gloo: a send that met the closed connection,
    # docs/in-place.md) is killed and its rank started again into the same generation
    # (in_place_unstuck): its log goes on in in-place<G>-<n>/
    unstuck = {r for e in events(a, "in_place_unstuck") for r in e["ranks"]}
    assert len(unstuck) <= 1, unstuck  # the other survivor re-formed in its own process
    for r in (0, 1):
        own = a.log_text(r, 1)
        if r in unstuck:
            assert "joined_in_place" in rank_logs(a, r)
        else:
            assert "re_entered" in own and "in_place_fallback" not in own, own[-2000:]
    log0 = rank_logs(a, 0)
    resumed = [int(m) for m in re.findall(r"resumed from step (\d+)", log0)]
    assert len(resumed) == 1 and resumed[0] >= 11, resumed
    assert re.search(r"^step 60/60", log0, re.M)
    if exact:
        assert_as_uninterrupted(daemons, tmp_path, args)
    wait_until(lambda: not leftover_processes(), 30, what="no process left")


def test_a_partitioned_node_s_survivor_unwinds_from_outside_and_goes_on_in_place(daemons, netns):
    """Node B cut off (its packets lost: nothing closes, nothing fails fast). Node A's rank,
    blocked in its all-reduce with B's, would wait out gloo's timeout; A's daemon, having judged
    B lost and announced the smaller world, shuts down that rank's connections of the failed
    generation from outside its process (daemon/outside_abort.py): it unwinds and re-forms at
    world 1 in its own process. Before, it was killed as stuck after about a step and started
    again (in_place_unstuck, its process lost: all three partition runs)."""
    net = netns(3, subnet=44)
    store = _start_store(net)
    try:
        a, b = _nodes(
            daemons, net, ["a", "b"], steps=100000, delay=0.02, extra=("--in-place", "auto")
        )
        wait_until(lambda: training_together((a, b), 30), 90, what="both nodes training")
        before = a.worker_pids()
        t_cut = time.time()
        net.cut(2)
        wait_until(lambda: stepping_alone(a, t_cut), 30, what="a stepping alone")
        shrunk = events(a, "shrunk_in_place")
        assert len(shrunk) == 1 and shrunk[0]["survivors"] == list(before.values()), shrunk
        aborted = events(a, "in_place_aborted")
        assert aborted and aborted[0]["generation"] == shrunk[0]["generation"], aborted
        assert not events(a, "in_place_unstuck"), events(a, "in_place_unstuck")
        assert a.worker_pids() == before and len(a.attempt_dirs()) == 1
        assert "re_entered" in a.log_text(0, 1)
        for d in (a, b):
            d.proc.send_signal(signal.SIGTERM)
        assert a.wait(60) == 0, a.stderr()[-3000:]
        b.wait(60)
    finally:
        store.kill()
        store.wait(10)
    wait_until(lambda: gone(before.values()) and not leftover_processes(), 30, what="no process")


def test_the_node_loss_bench_runs_in_place():
    """bench/nodeloss.py's smoke run: one node lost, its survivors stepping again at the smaller
    world in their own processes; then a node back, taken in by them in the same processes."""
    r = bench("nodeloss.py", "--trials", "1", "--modes", "in-place", "--rejoin", timeout=240)
    row = re.search(r"^in-place +([\d.]+) .* (\d+)/1 +(\d+)$", r.stdout, re.M)
    assert row and row[2] == "1" and row[3] == "1", r.stdout + r.stderr[-2000:]
    back = re.search(r"^in-place +[\d.]+ s median, 1/1 taken in, A's pids kept 1$", r.stdout, re.M)
    assert back, r.stdout + r.stderr[-2000:]


def test_a_lost_node_that_held_the_workers_store_falls_back_to_the_restart(daemons, tmp_path):
    """Node A (group rank 0) lost: the survivors' handles have nowhere to go; node B says why
    in one line and restarts as today, alone at the smaller world, to the end."""
    with rendezvous("c10d", tmp_path) as where:
        flags = (*FLAGS, "--nnodes", "1:2", *where, "--rdzv-id", "job", *FAST_NODES,
                 *secret_flags(), "--last-call-timeout", "30")  # fmt: skip
        nodes = in_order(daemons, tmp_path, flags, 2, shared_ckpt=True)
        a, b = nodes
        wait_until(lambda: re.search(r"^step 12/60", a.log_text(0, 1), re.M), 120, what="step 12")
        a.kill(signal.SIGKILL)
        assert b.wait(180) == 0, b.stderr()[-3000:]
    refused = events(b, "in_place_refused")
    assert len(refused) == 1 and "hosted the workers' store" in refused[0]["why"], refused
    assert not events(b, "shrunk_in_place") and len(b.attempt_dirs()) == 2
    wait_until(lambda: not leftover_processes(), 30, what="no process left")


def test_a_survivor_after_the_lost_node_is_renumbered_in_place(daemons, tmp_path):
    """Three nodes of one rank each; the middle one (group rank 1) lost: node C's rank 2 moves
    down to rank 1 in its own process (`in_place_renumbered`), re-forms at world 2 with A's
    rank 0, and the run ends bit for bit where an uninterrupted one at world 2 does (exact
    mode: each rank's share of the global batch follows its number, so a survivor training
    under its old number, or two ranks under one, ends elsewhere)."""
    args = [*ARGS, "--exact"]
    with rendezvous("c10d", tmp_path) as where:
        flags = one_rank_nodes(where)
        nodes = in_order(daemons, tmp_path, flags, 3, args)  # group ranks 0, 1, 2
        a, b, c = nodes
        wait_until(lambda: re.search(r"^step 12/60", a.log_text(0, 1), re.M), 120, what="step 12")
        assert (list(a.worker_pids()), list(b.worker_pids()), list(c.worker_pids())) == (
            [0], [1], [2]
        )  # fmt: skip
        before = {**a.worker_pids(), **c.worker_pids()}
        b.kill(signal.SIGKILL)
        for n in (a, c):
            assert n.wait(120) == 0, n.stderr()[-3000:]
    for n in (a, c):
        shrunk = events(n, "shrunk_in_place")
        assert len(shrunk) == 1 and shrunk[0]["world"] == 2, shrunk
        assert shrunk[0]["ranks"] == {"0": 0, "2": 1}, shrunk
        assert not events(n, "in_place_refused") and len(n.attempt_dirs()) == 1
        assert not [e for e in events(n, "state") if e.get("new") == "RESTARTING"]
    assert sorted(shrunk[0]["survivors"]) == [before[2]]  # C's survivor, its pid kept
    (b_id,) = [e["node_id"] for e in b.events() if e.get("event") == "rendezvous_store"]
    causes = [events(n, "shrunk_in_place")[0]["cause"] for n in (a, c)]
    claimed = [x for x in causes if "followed" not in x]  # the other followed its announcement
    assert len(claimed) == 1, causes
    assert_cause_names(claimed[0], b_id)
    assert "re_entered" in a.log_text(0, 1) and re.search(r"^step 60/60", a.log_text(0, 1), re.M)
    assert_as_uninterrupted(daemons, tmp_path, args)
    wait_until(lambda: not leftover_processes(), 30, what="no process left")
    if events(c, "in_place_unstuck"):
        # gloo's rare stuck send (docs/in-place.md): C's rank was started again as rank 1, so
        # the renumbering in its own process is not seen this run; the rest held
        (unstuck,) = events(c, "in_place_unstuck")
        assert unstuck["ranks"] == [1], unstuck
        assert "joined_in_place" in rank_logs(c, 1), rank_logs(c, 1)[-2000:]
        return
    log2 = c.log_text(2, 1)
    assert "re_entered" in log2 and "in_place_fallback" not in log2, log2[-3000:]
    renumbered = [ln for ln in log2.splitlines() if "in_place_renumbered" in ln]
    assert len(renumbered) == 1 and re.search(r"new_rank.{0,4}1\b", renumbered[0]), renumbered
    # the script run again sees its new number, in the group torch re-formed and in RANK
    entered = [ln for ln in log2.splitlines() if "re_entered" in ln]
    assert len(entered) == 1, entered
    assert re.search(r"torch_rank.{0,4}1\b", entered[0]), entered
    assert re.search(r"env_rank.{0,4}1\b", entered[0]), entered


@pytest.mark.parametrize("backend, exact", [("c10d", True), ("etcd", False)])
def test_a_node_that_comes_back_joins_by_reconfigure_the_survivors_in_their_processes(
    daemons, tmp_path, backend, exact
):
    """Node B lost (its daemon SIGKILLed): A's ranks re-form at world 2 in place. Then a node
    comes back (B's daemon started again, a new node to the job): A carries its workers into
    the next round instead of stopping them (`carrying_in_place`), and once the round closes
    they re-form at world 4 in their own processes (`grown_in_place`), at a step boundary every
    rank agreed on (none trained again), while the new node's ranks join that generation late
    (`joined_in_place`), their state from A's memory. A's pids are
    the same from start to end, one attempt, and in exact mode the run ends bit for bit where
    an uninterrupted one does. The same on etcd (the round goes through the rendezvous store).
    Before, the node came in by a whole-group restart (every pid new)."""
    args = with_steps([*ARGS, "--exact"] if exact else ARGS, 300)
    with rendezvous(backend, tmp_path) as where:
        flags = (
            *FLAGS, "--nnodes", "1:2", *where, "--rdzv-id", "job", *FAST_NODES, *secret_flags(),
            "--last-call-timeout", "30",
        )  # fmt: skip
        a, b = in_order(daemons, tmp_path, flags, 2, args)
        wait_until(lambda: re.search(r"^step 12/300", a.log_text(0, 1), re.M), 120, what="step 12")
        before = a.worker_pids()
        b.kill(signal.SIGKILL)
        wait_until(lambda: events(a, "shrunk_in_place"), 60, what="a shrunk in place")
        back = daemons(
            "entrypoints.train", *flags, "--checkpoint-dir", str(tmp_path / "c1b"), name="back",
            args=args,
        )  # fmt: skip
        wait_until(lambda: events(a, "grown_in_place"), 90, what="a grown in place")
        assert a.wait(180) == 0, a.stderr()[-3000:]
        assert back.wait(60) == 0, back.stderr()[-3000:]
    grown = events(a, "grown_in_place")
    assert len(grown) == 1 and grown[0]["world"] == 4 and grown[0]["starting"] == [2, 3], grown
    assert sorted(grown[0]["survivors"]) == sorted(before.values()), (grown, before)
    assert grown[0]["ranks"] == {"0": 0, "1": 1}, grown
    assert not events(a, "grow_in_place_refused") and not events(a, "in_place_refused")
    assert len(a.attempt_dirs()) == 1 and a.worker_pids() == {}  # finished: none alive
    final = [e for e in events(a, "state") if e.get("new") == "RUNNING"][-1]["pids"]
    assert sorted(final.values()) == sorted(before.values()), (final, before)
    log0 = a.log_text(0, 1)
    assert log0.count("re_entered") == 2 and "in_place_fallback" not in log0, log0[-3000:]
    assert re.search(r"^step 300/300", log0, re.M)
    # taken in at a step boundary every rank agreed on, kept in memory: no step trained again
    (boundary,) = re.findall(r"regroup_at_boundary\s+step=(\d+)", log0)
    assert re.findall(r"resumed from step (\d+)", log0)[-1] == boundary, log0[-3000:]
    joined = back.all_logs()
    assert joined.count("joined_in_place") == 2 and "in_place_fallback" not in joined
    assert not [e for e in events(back, "state") if e.get("new") == "RESTARTING"]
    if exact:
        assert_as_uninterrupted(daemons, tmp_path, args, steps=300)
    wait_until(lambda: not leftover_processes(), 30, what="no process left")


def test_two_nodes_carry_their_workers_and_a_third_joins_them(daemons, tmp_path):
    """Three nodes of one rank; C lost, A and B re-form at world 2. A node comes back: both A
    (which hosts the workers' store and announces) and B (which follows) carry their workers
    into the next round, and the new node's rank joins as rank 2; A's and B's pids the same from
    the shrink's end to the job's, each taken in at the same step boundary. (A survivor of the
    shrink may itself have been replaced, `in_place_unstuck`: the rare one its abort does not
    reach; the pids the join carries are those the shrink ended with.)"""
    args = with_steps(ARGS, 300)
    with rendezvous("c10d", tmp_path) as where:
        flags = one_rank_nodes(where)
        a, b, c = in_order(daemons, tmp_path, flags, 3, args)  # group ranks 0, 1, 2
        wait_until(lambda: re.search(r"^step 12/300", a.log_text(0, 1), re.M), 120, what="step 12")
        c.kill(signal.SIGKILL)
        wait_until(lambda: all(events(n, "shrunk_in_place") for n in (a, b)), 60, what="shrunk")
        wait_until(
            lambda: all("generation=1" in rank_logs(n, r) for n, r in ((a, 0), (b, 1))),
            60, what="both re-formed at world 2",
        )  # fmt: skip
        before = {**a.worker_pids(), **b.worker_pids()}
        back = daemons(
            "entrypoints.train", *flags, "--checkpoint-dir", str(tmp_path / "c2b"), name="back",
            args=args,
        )  # fmt: skip
        for n in (a, b, back):
            assert n.wait(180) == 0, n.stderr()[-3000:]
    for n, rank in ((a, 0), (b, 1)):
        grown = events(n, "grown_in_place")
        assert len(grown) == 1 and grown[0]["world"] == 3 and grown[0]["starting"] == [2], grown
        assert grown[0]["ranks"] == {str(rank): rank} and grown[0]["survivors"] == [before[rank]]
        assert len(n.attempt_dirs()) == 1 and not events(n, "grow_in_place_refused")
        log = rank_logs(n, rank)  # the process the shrink ended with wrote its last part
        assert re.search(r"re_entered .*generation=2", log), log[-2000:]
        assert "in_place_fallback" not in log, log[-2000:]
    assert re.search(r"^step 300/300", rank_logs(a, 0), re.M)  # rank 0 logs the steps
    steps = {re.findall(r"regroup_at_boundary\s+step=(\d+)", rank_logs(n, r))[0] for n, r in
             ((a, 0), (b, 1))}  # fmt: skip
    assert len(steps) == 1, steps  # one boundary, agreed by every rank
    assert "joined_in_place" in back.all_logs()
    wait_until(lambda: not leftover_processes(), 30, what="no process left")


def alone_then_b(daemons, tmp_path, entrypoint: str, *b_flags: str, env=None) -> tuple:
    """Node A trains alone (one rank, in place, 200 steps) to step 8, then node B (`entrypoint`,
    `b_flags`, `env`) joins; both waited for to a clean end. (a, b)."""
    args = with_steps(ARGS, 200)
    with rendezvous("c10d", tmp_path) as where:
        flags = (*one_rank_nodes(where), "--last-call-timeout", "2")
        (a,) = in_order(daemons, tmp_path, flags, 1, args)
        wait_until(lambda: re.search(r"^step 8/200", a.log_text(0, 1), re.M), 120, what="step 8")
        b = daemons(
            entrypoint, *flags, *b_flags, "--checkpoint-dir", str(tmp_path / "c1"), name="b",
            args=args, env=env,
        )  # fmt: skip
        for n in (a, b):
            assert n.wait(120) == 0, n.stderr()[-3000:]
    return a, b


def test_the_running_ranks_train_on_while_a_joining_node_s_ranks_start(daemons, tmp_path):
    """A runs alone on the in-place path; B joins, its workers taking 4 s to start (as a GPU
    node's do). A's ranks are asked to re-form only once B's rank has given its handle
    (`regroup_asked`, about those 4 s after the round closed), and they train meanwhile: they
    give their own handles at their next step boundary after it, and wait for B's for no more
    than a step. Before, they were asked at once and waited at their boundary for B's start."""
    a, b = alone_then_b(
        daemons, tmp_path, str(script("slow_start.py")), env={"ELASTICD_TEST_SLOW_START": "4"}
    )
    assert len(events(a, "grown_in_place")) == 1 and not events(a, "in_place_refused")
    (asked,) = events(a, "regroup_asked")
    assert asked["waited"] >= 3.0, asked  # B's start, trained through
    assert len(a.attempt_dirs()) == 1
    log0 = a.log_text(0, 1)
    assert len(re.findall(r"regroup_at_boundary\s+step=(\d+)", log0)) == 1, log0[-3000:]
    # A's rank gave its handle once B's was in: its wait for the others' is short
    (entered,) = re.findall(r"re_entered .*phases=(\{[^}]*\})", log0)
    phases = ast.literal_eval(entered)
    assert phases["handles"] - phases["collected"] < 2.0, phases  # before: B's 4 s start
    assert re.search(r"^step 200/200", log0, re.M)
    assert "joined_in_place" in b.all_logs() and "in_place_fallback" not in log0
    wait_until(lambda: not leftover_processes(), 30, what="no process left")


def test_a_node_that_cannot_start_its_ranks_in_place_joins_by_a_restart(daemons, tmp_path):
    """A runs alone on the in-place path; B joins with `--in-place off` (as a node whose torch
    has no reconfigure would): its ranks cannot start into A's group in place, so the group
    does not go on, with one line saying why, and the job takes B in by a whole-group restart
    (A's workers stopped and started again at world 2) instead of B's ranks waiting for a fresh
    group nobody forms."""
    # before: b's rank waited in a fresh init nobody else made
    a, b = alone_then_b(daemons, tmp_path, "entrypoints.train", "--in-place", "off")
    refused = events(a, "grow_in_place_refused")
    assert refused and "cannot start their ranks into a group in place" in refused[0]["why"]
    assert not events(a, "grown_in_place") and len(a.attempt_dirs()) == 2
    # the round's workers start as torch's, on every node: said once, where it was in place
    path = [e for e in events(a, "recovery_path") if e["path"] == "restart"]
    assert len(path) == 1 and "this round's workers start as torch's" in path[0]["why"], path
    assert re.search(r"^step 200/200", a.log_text(0, 2), re.M)
    assert "in_place_fallback" not in a.log_text(0, 2) + b.log_text(1)
    wait_until(lambda: not leftover_processes(), 30, what="no process left")
