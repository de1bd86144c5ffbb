"""A hang's culprit named from the stacks: one rank sleeps in `read_batch` while the others wait
in all_reduce; the restart cause names that rank (and, across two nodes in network namespaces of
their own (tests/netns.py), its node)."""

from __future__ import annotations

import json
import re
from datetime import datetime
from pathlib import Path

from harness import RESTART, free_port, node_flags, script, wait_until
from netns import DEV, netns_fixture  # noqa: F401 (the netns fixture)

HB = ("--heartbeat-timeout", "2", "--startup-timeout", "60", "--restart-grace", "0.5")
STUCK = ["--steps", "6", "--mode", "stuck", "--at", "3", "--step-time", "0.02"]
PORT = 29400  # a fresh namespace has every port free


def sleep_line() -> int:
    """The line of hang.py where the stuck rank sleeps (its innermost frame)."""
    lines = open(script("hang.py")).read().splitlines()
    return next(i for i, ln in enumerate(lines, 1) if "time.sleep(3600)" in ln)


def culprit_events(d) -> list[dict]:
    return [e for e in d.events() if e.get("event") == "hang_culprit"]


def restart_causes(d) -> list[str]:
    """The causes of the job's recoveries: its restarts, or (--in-place auto, the default on
    torch>=2.14) the hung rank replaced in place."""
    return [
        e["cause"]
        for e in d.events()
        if e.get("new") == "RESTARTING" or e.get("event") == "replaced_in_place"
    ]


def test_one_node_names_the_sleeping_rank(daemons):
    d = daemons(
        script("hang.py"),
        *RESTART,
        "--nproc-per-node",
        "3",
        *HB,
        "--max-restarts",
        "1",
        args=[*STUCK, "--rank", "1"],
    )
    assert d.wait(90) == 0, d.stderr()[-3000:]
    (ev,) = culprit_events(d)
    assert ev["culprits"] == [1] and ev["waited_in"] == "all_reduce", ev
    stacks = d.run_dir() / "attempt1" / "rank1.stacks.txt"
    where = f"`read_batch` (hang.py:{sleep_line()}) [stacks {stacks}]"
    assert f"rank 1 was in {where} while 2 ranks waited in all_reduce" in restart_causes(d)[0]
    assert "read_batch" in stacks.read_text()


def test_two_nodes_name_the_node_and_rank(daemons, netns):
    """Two nodes, each in a network namespace on its own address, node 0's hosting the store:
    rank 0 on one node waits in all_reduce, rank 1 on the other sleeps. Both nodes' verdicts name
    rank 1 and its node, one of them having read it from the other's summary in the store."""
    net = netns(2, subnet=37)
    nodes = [
        daemons(
            script("hang.py"),
            *RESTART,  # in place, both nodes act on the hang at once (docs/in-place.md)
            "--nproc-per-node",
            "1",
            *node_flags(PORT, "2", host=net.addr(0)),
            *HB,
            "--max-restarts",
            "1",
            name=name,
            args=[*STUCK, "--rank", "1"],
            env={"GLOO_SOCKET_IFNAME": DEV},
            prefix=net.prefix(i),
        )
        for i, name in enumerate(("a", "b"))  # started together: node b retries until a hosts
    ]
    for n in nodes:
        assert n.wait(120) == 0, n.stderr()[-3000:]
    # whichever node arrived second holds rank 1: its id is what both verdicts must name
    holder = next(n for n in nodes if "1" in next(e for e in n.events() if e.get("pids"))["pids"])
    b_id = next(e["node_id"] for e in holder.events() if e.get("event") == "rendezvous_store")
    for n in nodes:
        evs = culprit_events(n)
        assert evs and evs[0]["culprits"] == [1] and evs[0]["waited_in"] == "all_reduce", evs
        # the collectives first (rank 1 never called seq 3), then where the stacks found it
        said = f"rank 1 (node {b_id}, its last seq 2, all_reduce) never arrived at seq 3 "
        assert evs[0]["verdict"].startswith(said), evs
        assert f"; rank 1 (node {b_id}) was in `read_batch`" in evs[0]["verdict"], evs
        assert "while 1 rank waited in all_reduce" in evs[0]["verdict"], evs
        assert "no stacks from" not in evs[0]["verdict"], evs
        print("naming the culprit took", evs[0]["seconds"], "s")  # measured: see the report


def test_a_stopped_rank_s_node_names_it_alone_and_the_told_node_finds_its_stacks(daemons):
    """Two nodes on loopback, the restart path: rank 1 stops itself (SIGSTOP) on node b, whose
    2 s heartbeat timeout comes first (node a's is 30 s). Node b names its stopped rank without
    asking node a; node a, told of the hang by b's restart, finds b's stacks in the store (before
    the fix: b published none when it asked nothing, and a waited out the 3 s gather and said
    "no stacks from node(s) b")."""
    port = free_port()
    job = [*STUCK[:2], "--mode", "stop", *STUCK[4:], "--rank", "1"]
    flags = (*RESTART, "--nproc-per-node", "1", *node_flags(port, "2"), "--max-restarts", "1")
    a = daemons(script("hang.py"), *flags, "--heartbeat-timeout", "30", name="a", args=job)
    wait_until(lambda: [e for e in a.events() if e.get("event") == "rendezvous_store"], 60,
               what="a at the store")  # fmt: skip
    b = daemons(script("hang.py"), *flags, *HB, name="b", args=job)
    for n in (a, b):
        assert n.wait(120) == 0, n.stderr()[-3000:]
    (on_b,) = culprit_events(b)
    assert on_b["verdict"].startswith("rank 1 is stopped by a signal (state T), the culprit"), on_b
    (on_a,) = culprit_events(a)
    assert "no stacks from" not in on_a["verdict"], on_a
    assert on_a["seconds"] < 3.0, on_a  # hang_summaries' gather: not waited out


def test_the_hangs_fields_are_the_culprits(daemons):
    """Two ranks, rank 1 stuck in `read_batch`, rank 0 waiting in all_reduce: both stop beating,
    and rank 0's silence is read first. The failure's rank, log and first words are rank 1's, in
    the restart cause and in status's last_failure (before: rank 0's, the text alone naming 1)."""
    job = ["--steps", "400", "--mode", "stuck", "--at", "3", "--step-time", "0.02"]
    d = daemons(
        script("hang.py"), *RESTART, "--nproc-per-node", "2", *HB, "--max-restarts", "1", args=job
    )
    wait_until(lambda: restart_causes(d), 90, what="the hang's restart")
    (cause,) = restart_causes(d)
    assert cause.startswith("rank 1 (node "), cause
    assert "rank 1 was in `read_batch`" in cause and "while 1 rank waited in " in cause, cause
    failure = wait_until(lambda: _last_failure(d), 60, what="the hang in status")
    assert failure["rank"] == 1 and failure["kind"] == "hung", failure
    assert failure["log_path"].endswith(("/rank1.stderr.log", "/rank1.log")), failure
    pids = next(e for e in d.events() if e.get("pids"))["pids"]  # the first attempt's
    assert failure["pid"] == pids["1"], (failure, pids)
    assert d.wait(120) == 0, d.stderr()[-3000:]


def _last_failure(d) -> dict | None:
    r = d.status("--json")
    return json.loads(r.stdout).get("last_failure") if r.returncode == 0 else None


def test_a_desync_names_the_odd_rank(daemons):
    """Three ranks: rank 1 waits in recv while ranks 0 and 2 wait in all_reduce. Reported as a
    desync naming rank 1, in its fields too (before: no word of a desync)."""
    job = [
        "--steps",
        "300",
        "--mode",
        "deadlock",
        "--at",
        "3",
        "--rank",
        "1",
        "--step-time",
        "0.02",
    ]
    d = daemons(script("hang.py"), "--nproc-per-node", "3", *HB, "--max-restarts", "1", args=job)
    (ev,) = wait_until(lambda: culprit_events(d), 90, what="the hang's verdict")
    assert ev["desync"] is True and ev["culprits"] == [1], ev
    # the collectives first (rank 1 never called seq 3's all_reduce), then the stacks
    assert ev["collectives"] == "never_arrived" and ev["seq"] == 3, ev
    said = "rank 1 (its last seq 2, all_reduce) never arrived at seq 3 "
    assert ev["verdict"].startswith(said), ev
    assert "; desync: rank 1 waited in recv [stacks " in ev["verdict"], ev
    assert ev["verdict"].endswith("while 2 ranks waited in all_reduce"), ev
    (cause,) = wait_until(lambda: restart_causes(d), 30, what="the restart")
    assert cause.startswith("rank 1 (node ") and "; desync: rank 1 waited in recv" in cause, cause
    assert d.wait(120) == 0, d.stderr()[-3000:]


def test_a_hang_judged_across_two_nodes_is_recovered_in_place(daemons):
    """Two nodes on loopback, in place (the default on torch>=2.14): rank 1 sleeps in
    `read_batch` on one node while rank 0 waits in all_reduce on the other, neither stopped by a
    signal, both nodes' 2 s heartbeat timeout passing at once. The node that declares the hang
    asks the other for its stacks by an inquiry, which restarts nothing (the other node, if it
    declared it too, joins it); both name rank 1 and its node; rank 1's node replaces it in
    place and rank 0 re-enters in its own process (before: the request for the stacks was a
    restart of every node)."""
    port = free_port()
    flags = ("--nproc-per-node", "1", *node_flags(port, "2"), *HB, "--max-restarts", "1")
    a = daemons(script("hang.py"), *flags, name="a", args=[*STUCK, "--rank", "1"])
    wait_until(lambda: [e for e in a.events() if e.get("event") == "rendezvous_store"], 60,
               what="a at the store")  # fmt: skip
    b = daemons(script("hang.py"), *flags, name="b", args=[*STUCK, "--rank", "1"])
    for n in (a, b):
        assert n.wait(120) == 0, n.stderr()[-3000:]
    nodes = (a, b)
    holder = next(n for n in nodes if "1" in next(e for e in n.events() if e.get("pids"))["pids"])
    other = b if holder is a else a
    holder_id = next(e["node_id"] for e in holder.events() if e.get("event") == "rendezvous_store")
    asked = [e for n in nodes for e in n.events() if e.get("event") == "hang_inquiry"]
    assert len(asked) == 1, asked
    for n in nodes:
        (ev,) = culprit_events(n)
        assert ev["culprits"] == [1], ev
        assert f"rank 1 (node {holder_id}) was in `read_batch`" in ev["verdict"], ev
        assert "no stacks from" not in ev["verdict"], ev
        assert not [e for e in n.events() if e.get("new") == "RESTARTING"], "a restart"
        assert not [e for e in n.events() if e.get("event") == "in_place_refused"]
        assert len(n.attempt_dirs()) == 1
    (replaced,) = [e for e in holder.events() if e.get("event") == "replaced_in_place"]
    assert replaced["ranks"] == [1] and "was in `read_batch`" in replaced["cause"], replaced
    (followed,) = [e for e in other.events() if e.get("event") == "in_place_followed"]
    assert followed["ranks"] == [1], followed
    assert "re_entered" in other.log_text(0, 1)  # rank 0, in its own process


# the learned deadline across nodes: no --heartbeat-timeout (300 s, the ceiling); 20 ms steps
# teach each node its 1 s floor by step 50, and the fault comes at step 70
LEARN = ["--steps", "100", "--at", "70", "--step-time", "0.02", "--rank", "1"]


def _pair(daemons, *job: str, flags: tuple = (), prom: Path | None = None):
    """Nodes a (the store's host) and b on loopback, one rank each, in place (or as `flags`
    say); with `prom`, each writes its metrics to <prom>/<name>.prom."""
    port = free_port()
    flags += ("--nproc-per-node", "1", *node_flags(port, "2"), "--max-restarts", "1")
    flags += ("--startup-timeout", "60", "--restart-grace", "0.5")

    def node(name: str):
        own = ("--metrics-textfile", str(prom / f"{name}.prom")) if prom else ()
        return daemons(script("hang.py"), *flags, *own, name=name, args=list(job))

    a = node("a")
    wait_until(lambda: [e for e in a.events() if e.get("event") == "rendezvous_store"], 60,
               what="a at the store")  # fmt: skip
    return a, node("b")


def _holder(nodes):
    """The node that holds rank 1 (whichever arrived second), and the other."""
    a, b = nodes
    holder = next(n for n in nodes if "1" in next(e for e in n.events() if e.get("pids"))["pids"])
    return holder, (b if holder is a else a)


def _at(event: dict) -> float:
    return datetime.fromisoformat(event["timestamp"]).timestamp()


def test_a_hang_no_node_proves_alone_is_found_at_the_learned_deadline(daemons):
    """One rank a node: rank 1 sleeps in `read_batch`, rank 0 waits in all_reduce. Each node
    sees only its own rank idle (one in a data read, one waiting in a collective), which proves
    nothing alone, so each waited for the 300 s ceiling (before). Now the first past its learned
    deadline asks every node for its stacks (an inquiry, `proven` False), the stacks name rank 1
    idle, and its node replaces it in place: within seconds, not 300."""
    nodes = _pair(daemons, "--mode", "stuck", *LEARN)
    for n in nodes:
        assert n.wait(90) == 0, n.stderr()[-3000:]
    holder, other = _holder(nodes)
    asked = [e for n in nodes for e in n.events() if e.get("event") == "hang_inquiry"]
    assert len(asked) == 1 and asked[0]["proven"] is False, asked
    for n in nodes:
        (ev,) = culprit_events(n)
        assert ev["culprits"] == [1] and "was in `read_batch`" in ev["verdict"], ev
        assert not [e for e in n.events() if e.get("new") == "RESTARTING"], "a restart"
    (replaced,) = [e for e in holder.events() if e.get("event") == "replaced_in_place"]
    assert replaced["ranks"] == [1], replaced
    assert "re_entered" in other.log_text(0, 1)  # rank 0, in its own process
    stuck = float(holder.log_text(1, 1).split("stuck reading a batch at ")[1].split()[0])
    learned = max(e["seconds"] for n in nodes for e in n.events()
                  if e.get("event") == "hang_deadline_learned")  # fmt: skip
    took = _at(replaced) - stuck
    print(f"stuck -> replaced in place: {took:.2f}s (learned deadline {learned}s)")
    assert took < learned + 3.0, (took, learned)


def test_on_the_restart_path_too_it_is_found_at_the_learned_deadline(daemons):
    """The same hang with --in-place off (the only path on torch<2.14): the inquiry names rank 1
    idle, and its node restarts the group for it, once, within seconds (before: 300)."""
    nodes = _pair(daemons, "--mode", "stuck", *LEARN, flags=RESTART)
    for n in nodes:
        assert n.wait(90) == 0, n.stderr()[-3000:]
    holder, _ = _holder(nodes)
    asked = [e for n in nodes for e in n.events() if e.get("event") == "hang_inquiry"]
    assert len(asked) == 1 and asked[0]["proven"] is False, asked
    restarts = [e for e in holder.events() if e.get("new") == "RESTARTING"]
    assert len(restarts) == 1 and "was in `read_batch`" in restarts[0]["cause"], restarts
    assert restarts[0]["cause"].startswith("rank 1 (node "), restarts
    assert not [e for n in nodes for e in n.events() if e.get("event") == "replaced_in_place"]
    stuck = float(holder.log_text(1, 1).split("stuck reading a batch at ")[1].split()[0])
    took = _at(restarts[0]) - stuck
    print(f"stuck -> the group restarting: {took:.2f}s")
    assert took < 5.0, took


def test_a_straggler_on_another_node_is_asked_about_and_left_alone(daemons, tmp_path):
    """Rank 1 computes for 3 s (a straggler) while rank 0 waits in all_reduce on the other node.
    Rank 0's node, past its learned deadline, asks; rank 1's node answers that its rank uses the
    CPU; the verdict is no hang (`hang_cleared`, on both nodes, and in each one's metrics), and
    the job goes on: no rank replaced, no restart, rank 1 the same process."""
    prom = tmp_path / "text"
    prom.mkdir(mode=0o755)
    nodes = _pair(daemons, "--mode", "spin", "--spin", "3", *LEARN, prom=prom)
    for n in nodes:
        assert n.wait(90) == 0, n.stderr()[-3000:]
    holder, other = _holder(nodes)
    cleared = [e for e in other.events() if e.get("event") == "hang_cleared"]
    assert cleared and "uses the CPU (a straggler?)" in cleared[0]["why"], other.events()[-20:]
    told = [e for e in holder.events() if e.get("event") == "hang_cleared" and e.get("told")]
    assert told, holder.events()[-20:]
    for n in nodes:
        assert not culprit_events(n), culprit_events(n)
        assert not [e for e in n.events() if e.get("new") == "RESTARTING"], "a restart"
        assert not [e for e in n.events() if e.get("event") == "replaced_in_place"]
        assert len(n.attempt_dirs()) == 1
    assert "computes for 3s" in holder.log_text(1, 1) and "done" in holder.log_text(1, 1)
    for n in nodes:  # the textfile as the node's last state change (SUCCEEDED) wrote it
        text = (prom / f"{n.dir.name}.prom").read_text()
        ask = r'^elasticd_hang_inquiries_total\{.*verdict="%s"\} (\S+)$'
        cleared = re.search(ask % "cleared", text, re.M)
        assert cleared and float(cleared[1]) >= 1, text[-2000:]
        assert float(re.search(ask % "hang", text, re.M)[1]) == 0, text[-2000:]
