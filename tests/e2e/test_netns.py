"""Nodes in network namespaces of their own (tests/netns.py), each on its own address."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time

from harness import FAST_NODES as FAST
from harness import ROOT, gone, script, secret_flags, wait_until
from netns import DEV, ip, netns_fixture, sweep_orphans  # noqa: F401 (the netns fixture)

PORT = 29400  # a fresh namespace has every port free


def _store_host_job(
    daemons, net, extra=(), args=None, script_name="ddp_tutorial.py", other_extra=()
):
    """Node 0 hosts the store on its address, node 1 joins it: (host, other, a function that
    starts node 0 again with the same command line)."""
    flags = (
        "--nproc-per-node",
        "1",
        "--rdzv-endpoint",
        f"{net.addr(0)}:{PORT}",
        "--rdzv-id",
        "job",
        *FAST,
        *secret_flags(),
        *extra,
    )
    args = args or ["--steps", "400", "--step-time", "0.05"]
    env = {"GLOO_SOCKET_IFNAME": DEV}

    def node(i: int, name: str, more=()):
        return daemons(
            script(script_name), *flags, *more, name=name, args=args, env=env, prefix=net.prefix(i)
        )

    host = node(0, "host")
    wait_until(
        lambda: any(e.get("event") == "rendezvous_store" for e in host.events()),
        60,
        what="the store",
    )
    other = node(1, "other", other_extra)
    return host, other, lambda: node(0, "host")


def test_store_host_killed_and_not_back_peer_stops_its_workers_then_fails_with_one_line(
    daemons, netns
):
    """Two nodes on two addresses, the store on node 0's, whose daemon is SIGKILLed for good
    (judge_host_not_back)."""
    net = netns(2)
    store = f"{net.addr(0)}:{PORT}"
    # a fixed size: the first round waits for both (the other's short --join-timeout would not
    # always see the host take it in as a scale-up while the host's spares still import torch)
    host, other, _ = _store_host_job(
        daemons, net, ("--nnodes", "2"), other_extra=("--join-timeout", "5")
    )
    pids = wait_until(
        lambda: other.worker_pids() if re.search(r"^step \d+", other.all_logs(), re.M) else None,
        60,
        what="both nodes training",
    )
    assert net.pids(net.nodes[1]) and set(pids.values()) <= set(net.pids(net.nodes[1]))
    judge_host_not_back(host, other, pids, store, join_timeout=5)


def judge_host_not_back(host, other, pids: dict, store: str, join_timeout: int) -> None:
    """SIGKILL the store's host for good: the other node stops its workers at once (the host
    refuses the connection: no --peer-timeout to wait out), keeps its in-memory state while it
    waits --join-timeout for the host to come back, then exits 1 with one line saying so."""
    t0 = time.monotonic()
    host.kill()
    said = wait_until(
        lambda: [e for e in other.events() if e.get("event") == "store_unreachable"],
        10,
        what="the other node saying the store's host is down",
    )
    why = said[0]["why"]
    assert "refused the connection" in why and "the node hosting it is down" in why, why
    assert time.monotonic() - t0 < 3 + 3  # at once, plus the teardown (more under load)
    wait_until(
        lambda: gone(pids.values()),
        10,
        what="its workers gone",
    )
    memory = [e["directory"] for e in other.events() if e.get("event") == "memory_state"]
    assert memory and other.proc.poll() is None
    assert os.path.isdir(memory[0])  # kept while it waits (its slots: the restart test)
    assert other.wait(30) == 1, other.stderr()[-3000:]
    took = time.monotonic() - t0
    assert join_timeout <= took < join_timeout + 3 + 5, took  # after the teardown
    err = other.stderr()
    assert "Traceback" not in err and "frame #" not in err, err[-3000:]
    last = err.strip().splitlines()[-1]
    assert last.startswith("elasticd: job failed") and f"the rendezvous store at {store}" in last
    assert f"did not come back within --join-timeout {join_timeout}s" in last, last
    # torch's own warnings came as JSON events too
    assert [ln for ln in err.splitlines() if ln.strip() and not ln.startswith("{")] == [last]


LOADED = re.compile(r"checkpoint_loaded.*?\bpath=(\S+).*?\bsource=(\w+).*?\bstep=(\d+)")


def test_store_host_restarted_peer_resumes_from_memory(daemons, netns):
    """SIGKILL the store host's daemon (its guard kills its workers) and start it again 3 s
    later with the same command line: it hosts a fresh store (a new run), the other node, which
    stopped its workers and kept its in-memory state, joins it, and its workers resume from
    memory at the step they had reached (at most one refresh interval lost: the cadence they
    logged, 1-3 steps here), not from disk; both nodes finish the job, exit 0."""
    net = netns(2, subnet=34)
    host, other, restart_host = _store_host_job(
        daemons,
        net,
        ("--nnodes", "2", "--join-timeout", "30"),
        args=["60", "0.02"],
        script_name="node_train.py",
    )
    step = re.compile(r"^step (\d+) world 2 ", re.M)
    wait_until(lambda: len(step.findall(other.all_logs())) >= 15, 60, what="both nodes training")
    attempt = other.attempt_dirs()[-1]
    host.kill()
    time.sleep(3)
    logs = "".join(p.read_text(errors="replace") for p in attempt.glob("rank*.log"))
    before = max(int(n) for n in step.findall(logs))  # its workers stopped: they wait on the host
    # the in-memory cadence the ranks had agreed on last (adaptive: 1-3 steps here), which
    # only rank 0 logs: its node may be either
    said = logs + host.all_logs()
    every = ([1] + [int(n) for n in re.findall(r"memory_cadence .*?\bevery=(\d+)", said)])[-1]
    assert other.attempt_dirs()[-1] == attempt and other.proc.poll() is None
    t_start = time.time()
    host = restart_host()
    assert other.wait(90) == 0, other.stderr()[-3000:]
    assert host.wait(30) == 0, host.stderr()[-3000:]
    events = other.events()
    adopted = [e for e in events if e.get("event") == "rendezvous_store_restarted"]
    assert len(adopted) == 1 and adopted[0]["run"] != adopted[0]["previous_run"], adopted
    resumed = LOADED.findall(other.all_logs())
    assert len(resumed) == 1, other.all_logs()[-3000:]
    path, source, at = resumed[0][0], resumed[0][1], int(resumed[0][2])
    again = min(
        float(t) for t in re.findall(r"^step \d+ world 2 t ([\d.]+) ", other.all_logs(), re.M)
    )
    print(
        f"store host restarted: the other node resumed from {source} at step {at} "
        f"(stepped to {before} before the kill, cadence {every}), stepping again "
        f"{again - t_start:.1f}s after "
        "the host's daemon was started again"
    )
    assert source == "memory" and path.startswith("memory:"), resumed
    assert before - every <= at <= before, (at, before, every)  # at most one refresh interval
    assert re.search(rf"^resumed at step {at} world 2$", other.all_logs(), re.M)


def test_a_cut_link_loses_packets_until_healed(netns):
    """The partition primitive: node 1 reaches node 0 (a closed port answers at once), loses every
    packet while its link is cut (the connect times out), and reaches it again once healed."""
    net = netns(2)
    probe = (
        "import socket, sys\ntry:\n    socket.create_connection((sys.argv[1], 1), timeout=1)\n"
        "except OSError as e:\n    print(type(e).__name__)"
    )

    def connect() -> str:
        done = subprocess.run(
            [*net.prefix(1), sys.executable, "-c", probe, net.addr(0)],
            capture_output=True,
            text=True,
            timeout=30,
        )
        return done.stdout.strip()

    assert connect() == "ConnectionRefusedError"
    net.cut(1)
    assert connect() == "TimeoutError"
    net.heal(1)
    assert connect() == "ConnectionRefusedError"


def test_namespaces_of_a_killed_test_process_are_swept_by_the_next(netns):
    """A test process SIGKILLed before its teardown leaves its namespaces behind; the next
    Network made deletes them (and only namespaces whose owner is gone)."""
    code = (
        "import time; from netns import Network; "
        "print(Network(2, 250).switch, flush=True); time.sleep(60)"
    )
    p = subprocess.Popen(
        [sys.executable, "-c", code],
        stdout=subprocess.PIPE,
        text=True,
        cwd=ROOT / "tests",
    )
    try:
        switch = p.stdout.readline().strip()
        assert switch.endswith("sw"), switch
        p.kill()
        p.wait(10)
        listed = lambda: ip("netns", "list")  # noqa: E731
        assert switch in listed()
        mine = netns(1, subnet=251)  # this process's, made after: the orphans go first
        assert switch not in listed() and switch.replace("sw", "n1") not in listed()
        assert mine.switch in listed()
    finally:
        p.kill()
        p.wait(10)
        sweep_orphans()
