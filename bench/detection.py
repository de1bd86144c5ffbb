"""Detection time per fault kind: elasticd vs torchrun, same script, same machine, one run.

Each trial starts the launcher afresh on bench/step_logger.py (gloo), lets every rank train for
--warmup seconds (4: elasticd learns its hang deadline from the first 50 steps), injects one
fault into rank 1 (or the node holding it) and times the injection
(the benchmark's clock, read right before it sends the signal, writes the flag or cuts the link)
-> the launcher's own record that it saw the failure:

    crash       kill -9 of rank 1
    stop        hang in compute: SIGSTOP of rank 1
    stuck       hang in a collective: rank 1 sleeps in `read_batch` while the others wait in DDP's
                all_reduce (step_logger.py's flag `sleep`, read at rank 1's next step)
    desync      rank 1 calls all_gather while the others wait in DDP's all_reduce (flag
                `all_gather`)
    node_kill   two launchers on loopback as two nodes of one worker each, the one not hosting the
                store (started second) SIGKILLed whole, launcher and workers at once
    partition   the same two nodes, each in a network namespace of its own (tests/netns.py: root
                and iproute2, else not measured), node 1's link cut
    node_kill_netns  node_kill in those namespaces: node 1's address stays up, its port refuses

elasticd's record: the first JSON event on its stderr (`--log-format json`) that names the failure,
the RESTARTING (or FAILED / LEFT) state event or the hang's verdict, by its own timestamp; the rank
named is the one the RESTARTING cause begins with ("rank R (node ...)"), right when it is rank 1
(node faults: node 1's rank, or the cause names node 1's id, "node ID (group rank G) went
silent").
torchrun's: its agent's first line about the failed group (closing the other workers, "failed
(exitcode ...) local_rank: R", "Worker group FAILED"), by its log timestamp; the rank it names is
the local rank of that "failed" line, mapped to the global rank through the workers' pids. A fault
not seen within --bound seconds is "not within N s".

elasticd runs with its defaults (the hang deadline learned from the job's step gaps under the
--heartbeat-timeout 300 s ceiling, --peer-timeout 10 s);
`--launchers elasticd,elasticd-noprobe` adds, for the node kinds, elasticd as it was before the
probe of a silent node's address (cluster/probe.py): node 1's probe port is held by the benchmark
(bound, not listening), so its daemon cannot listen and node 0 judges it by its beats alone;
`--launchers elasticd,elasticd-before --before DIR` adds elasticd as another checkout of it runs
(DIR, e.g. `git worktree add /tmp/before main`): the same faults, side by side in one run, the
code before a change against the code after it;
`--launchers elasticd,elasticd-hb,torchrun` adds elasticd with `--heartbeat-timeout --hb` (2 s, as
the tests hand-set it) for the three hang kinds.

    PYTHONPATH=$PWD python bench/detection.py --trials 3
    PYTHONPATH=$PWD python bench/detection.py --kinds crash,desync --launchers elasticd --trials 1

`--overhead 20000` instead measures what the collectives' evidence costs a job: --world gloo
ranks (bench/flight_cost.py; 1 by default: no wait for a peer, so the recorder's own CPU cost is
not lost in the noise of a loaded machine) time 20,000 all_reduces of one float (the smallest
collective: where a fixed cost shows most) with torch's Flight Recorder as torch leaves it (on,
2000 entries), off (TORCH_FR_BUFFER_SIZE=0), and off with elasticd's own dispatcher hook in its
place (worker/collective_hook.py), --rounds times each, alternating; and what
answering the daemon's ask takes (the recorder's dump, worker/flight.py). elasticd adds nothing
per collective: the recorder is torch's own, and the daemon reads it only when a rank is past
its deadline.

`--false-alarms 10000` instead runs 10,000 steps at elasticd's defaults with every rank sleeping a
log-normal extra each step (`--jitter MEDIAN,SIGMA`, 10 ms and 1.0 by default: a heavy tail) and
counts the hangs declared (each a false alarm), the suspicions the evidence cleared, the deadline
learned and the step gaps the job showed.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

import psutil

from recovery import HERE, SCRIPT, events, kill_tree, latest_pids, launcher_cmd, read_steps, spawn
from rendezvous import free_port, node_cmd, secret_file

KINDS = ("crash", "stop", "stuck", "desync", "node_kill", "node_kill_netns", "partition")
LABELS = {
    "crash": "crash (kill -9 of rank 1)",
    "stop": "hang in compute (SIGSTOP of rank 1)",
    "stuck": "hang in a collective (rank 1 sleeps outside it)",
    "desync": "desync (rank 1 in all_gather, the others in all_reduce)",
    "node_kill": "node kill (node 1's launcher and worker SIGKILLed)",
    "node_kill_netns": "node kill, nodes in network namespaces",
    "partition": "partition (node 1's link cut)",
}
HANGS = {"stop", "stuck", "desync"}  # what a heartbeat timeout decides
NODES = {"node_kill", "node_kill_netns", "partition"}
NETNS = {"node_kill_netns", "partition"}  # the two-node kinds run in network namespaces
FLAGS = {"stuck": "sleep", "desync": "all_gather"}  # step_logger.py's faults by flag file
# torchrun in these namespaces, told which node hosts its store (rendezvous.node_cmd's is_host:
# its own guess fails there), still never trains: its TCPStore names each connection it accepts
# with a reverse lookup on its one thread, which here fails after about 10 s a connection
# ("The hostname of the client socket cannot be retrieved. err=-3"), so its clients time out (a
# private /etc/hosts and resolv.conf for it, tried, did not shorten that)
UNMEASURED = {
    ("torchrun", kind): "not measured: torchrun's store takes about 10 s per connection "
    "in the namespaces here (a reverse lookup on its one thread), so its clients time out"
    for kind in NETNS
}
VICTIM = 1  # the rank faulted on one node
# elasticd's events that name a failure (daemon/agent.py `set_state`, daemon/hangs.py)
STATES = {"RESTARTING", "FAILED", "LEFT"}
# torchrun's agent seeing a failed worker (torch/distributed/elastic/multiprocessing/api.py, agent)
TORCHRUN_SAW = re.compile(r"closing signal|failed \(exitcode|Worker group (FAILED|UNHEALTHY)")
TORCHRUN_NAMED = re.compile(r"failed \(exitcode: -?\d+\) local_rank: \d+ \(pid: (\d+)\)")
GLOG = re.compile(r"^[IWEF](\d\d)(\d\d) (\d\d):(\d\d):(\d\d)\.(\d{6}) ")
CAUSE_RANK = re.compile(r"^rank (\d+)\b")
# a node lost, by its id: the cause's first words ("node ID; lost: group rank G ...")
CAUSE_NODE = re.compile(r"^node (\S+); lost\b")


@dataclass
class Trial:
    seconds: float | None = None  # injection -> detected; None: not within the bound
    named: str = ""  # what the failure was put on: "rank R", "node ID" ("": nothing named)
    right: bool = False  # that is the rank (node) faulted
    said: str = ""  # what the launcher said, shortened


def elasticd_saw(log: Path, since: float) -> Trial | None:
    """The first event after `since` that names a failure, and the rank its RESTARTING cause
    (when logged yet) begins with."""
    first, cause = None, None
    for e in events(log):
        try:
            at = datetime.fromisoformat(e["timestamp"].replace("Z", "+00:00")).timestamp()
        except (KeyError, AttributeError, ValueError):
            continue
        if at < since:
            continue
        state = e.get("event") == "state" and e.get("new") in STATES
        if first is None and (state or e.get("event") == "hang_culprit"):
            first = at
        if state:
            cause = str(e.get("cause", ""))
            break
    if first is None:
        return None
    rank, node = CAUSE_RANK.match(cause or ""), CAUSE_NODE.search(cause or "")
    named = f"rank {rank[1]}" if rank else f"node {node[1]}" if node else ""
    return Trial(first - since, named, False, (cause or "")[:160])


def torchrun_saw(log: Path, since: float, rank_of: dict[int, int]) -> Trial | None:
    """torchrun's agent's first line about the failed group after `since`, and the rank of the
    worker its "failed (exitcode ...)" line names."""
    first, named, said = None, "", ""
    for line in _text(log).splitlines():
        if not TORCHRUN_SAW.search(line) or (at := _glog_time(line)) is None or at < since:
            continue
        if first is None:
            first, said = at, line.split("] ", 1)[-1][:160]
        if m := TORCHRUN_NAMED.search(line):
            rank, said = rank_of.get(int(m[1])), line.split("] ", 1)[-1][:160]
            named = f"rank {rank}" if rank is not None else "a worker not known"
            break
    return None if first is None else Trial(first - since, named, False, said)


def _glog_time(line: str) -> float | None:
    """The wall time of a torch log line (`W1128 08:49:27.858000 ...`, local time, no year)."""
    m = GLOG.match(line)
    if not m:
        return None
    month, day, hh, mm, ss, us = map(int, m.groups())
    now = datetime.now()
    return datetime(now.year, month, day, hh, mm, ss, us).timestamp()


def _text(path: Path) -> str:
    try:
        return path.read_text(errors="replace")
    except OSError:
        return ""


def _until(predicate, timeout: float, interval: float = 0.05):
    deadline = time.monotonic() + timeout
    while True:
        got = predicate()
        if got or time.monotonic() > deadline:
            return got
        time.sleep(interval)


def sweep(out: Path) -> None:
    """Kill whatever still carries this trial's step log in its environment (a worker left by a
    launcher killed first, a stopped one): every trial leaves no process behind."""
    left = []
    for p in psutil.process_iter():
        try:
            if p.pid != os.getpid() and p.environ().get("BENCH_OUT") == str(out):
                p.kill()
                left.append(p)
        except psutil.Error:
            continue
    psutil.wait_procs(left, timeout=10)


def launcher(kind: str, hb: float) -> tuple[str, tuple[str, ...]]:
    """recovery.py's launcher kind and the flags added for a column of this table."""
    if kind == "elasticd-hb":
        return "elasticd", ("--heartbeat-timeout", f"{hb:g}")
    if kind in ("elasticd-noprobe", "elasticd-before"):
        return "elasticd", ()
    return kind, ()


def checkout(column: str, env: dict, args) -> tuple[dict, Path | None]:
    """The environment and working directory that run this column's elasticd: --before's
    checkout for elasticd-before, else this one."""
    if column != "elasticd-before":
        return env, None
    if not args.before:
        raise SystemExit("elasticd-before needs --before DIR: a checkout of the code before")
    return {**env, "PYTHONPATH": str(args.before)}, args.before


def one_node(column: str, fault: str, args, work: Path) -> Trial:
    out, flag = work / "steps.txt", work / "fault"
    env = dict(os.environ, BENCH_OUT=str(out), BENCH_HANG_FLAG=str(flag))
    kind, extra = launcher(column, args.hb)
    log_path = work / "launcher.log"
    env, cwd = checkout(column, env, args)
    proc = spawn(launcher_cmd(kind, 1, work, extra, nproc=args.nproc), env, log_path, cwd)
    try:
        pids = _training(out, args.nproc, args)
        if pids is None:
            return Trial(said="never trained")
        t = time.time()
        if fault == "crash":
            os.kill(pids[VICTIM], signal.SIGKILL)
        elif fault == "stop":
            os.kill(pids[VICTIM], signal.SIGSTOP)
        else:
            flag.with_name("fault.new").write_text(FLAGS[fault])
            os.replace(flag.with_name("fault.new"), flag.with_name(f"fault.{VICTIM}"))
        rank_of = {pid: rank for rank, pid in pids.items()}
        return _detected(kind, log_path, t, rank_of, args.bound, {f"rank {VICTIM}"})
    finally:
        kill_tree(proc)
        sweep(out)


def _training(out: Path, ranks: int, args) -> dict[int, int] | None:
    """rank -> pid once every rank has stepped and --warmup seconds more have passed."""
    start = time.time()
    if not _until(lambda: len(latest_pids(read_steps(out), start)) >= ranks, args.start_timeout):
        return None
    time.sleep(args.warmup)
    pids = latest_pids(read_steps(out), time.time() - 1.0)
    return pids if len(pids) >= ranks else None


def _detected(
    kind: str, log: Path, t: float, rank_of: dict[int, int], bound: float, right: set[str]
) -> Trial:
    """What the launcher said of the fault injected at `t`, and whether it named one of
    `right`."""

    def saw() -> Trial | None:
        return elasticd_saw(log, t) if kind == "elasticd" else torchrun_saw(log, t, rank_of)

    got = _until(saw, bound, 0.02)
    if got is None:
        return Trial(said=f"not within {bound:g} s")
    if not got.named:  # the verdict, or torchrun closing the others, came first: the name next
        later = _until(lambda: (s := saw()) and s.named and s, 10, 0.05)
        if later:
            got.named, got.said = later.named.strip(), later.said
    got.right = got.named in right
    return got


def two_nodes(column: str, fault: str, args, work: Path) -> Trial:
    """Node 0 (started first, node 1 only once node 0's store answers: it hosts it) and node 1,
    one worker each; node 1 killed whole or cut off; what node 0's launcher says, and whether it
    names node 1's rank (or node 1)."""
    kind, _ = launcher(column, args.hb)
    out, port = work / "steps.txt", free_port()
    net, host, prefix, env = None, "127.0.0.1", [(), ()], dict(os.environ, BENCH_OUT=str(out))
    if fault in NETNS:
        net, dev = _network()
        if net is None:
            return Trial(said=dev)
        host, prefix = net.addr(0), [net.prefix(0), net.prefix(1)]
        env["GLOO_SOCKET_IFNAME"] = dev  # gloo on the namespace's link, not its loopback
    env, cwd = checkout(column, env, args)
    procs, logs = [], [work / "node0.log", work / "node1.log"]
    held = None
    try:
        if net is not None and column == "elasticd-noprobe":
            held = net.call(1, lambda: _hold(net.addr(1), port))
        for i in (0, 1):
            if kind == "elasticd":
                nodes = ("--nnodes", "2", "--rdzv-endpoint", f"{host}:{port}")
                nodes += ("--rdzv-id", "bench", "--rdzv-secret-file", secret_file(work))
                cmd = launcher_cmd(kind, 1, work / f"node{i}", nodes, nproc=1)
            else:
                cmd = node_cmd(kind, 2, port, work, i, SCRIPT, host=host)
            procs.append(spawn([*prefix[i], *cmd], env, logs[i], cwd))
            if i == 0 and not _until(lambda: _answers(net, host, port), args.start_timeout, 0.2):
                return Trial(said="node 0 never hosted the store")
        pids = _training(out, 2, args)
        if pids is None:
            return Trial(said="never trained")
        rank_of = {pid: rank for rank, pid in pids.items()}
        tree = _tree(procs[1])
        right = {f"rank {rank_of[p.pid]}" for p in tree if p.pid in rank_of}
        right |= {f"node {n}" for n in _node_ids(logs[1])}
        t = time.time()
        for victim in tree if fault != "partition" else ():  # the launcher first: it says nothing
            try:
                victim.kill()
            except psutil.Error:
                pass
        if fault == "partition":
            net.cut(1)
        return _detected(kind, logs[0], t, rank_of, args.bound, right)
    finally:
        for p in procs:
            kill_tree(p)
        if held is not None:
            held.close()
        if net is not None:
            net.close()
        sweep(out)


def _hold(addr: str, port: int) -> socket.socket:
    """The port bound and not listening, so the daemon's probe listener cannot take it."""
    sock = socket.socket()
    sock.bind((addr, port))
    return sock


def _answers(net, host: str, port: int) -> bool:
    """Whether the store's port takes a connection (inside node 0's namespace, if any)."""

    def probe() -> bool:
        try:
            socket.create_connection((host, port), timeout=0.5).close()
            return True
        except OSError:
            return False

    return probe() if net is None else net.call(0, probe)


def _node_ids(log: Path) -> set[str]:
    """The node ids an elasticd node's log says it rendezvoused as."""
    return {str(e["node_id"]) for e in events(log) if e.get("event") == "rendezvous_store"}


def _tree(proc: subprocess.Popen) -> list[psutil.Process]:
    """The launcher, then every process under it."""
    try:
        top = psutil.Process(proc.pid)
        return [top, *top.children(recursive=True)]
    except psutil.Error:
        return []


def _network():
    """(two node namespaces on a switch (tests/netns.py), their interface), or (None, why not)."""
    sys.path.insert(0, str(HERE.parent / "tests"))
    try:
        import netns
    except ImportError as e:
        return None, f"not measured: {e}"
    why = netns.unavailable()
    if why:
        return None, f"not measured: {why}"
    try:
        return netns.Network(2, subnet=43), netns.DEV
    except (RuntimeError, OSError, subprocess.SubprocessError) as e:
        return None, f"not measured: {e}"


def false_alarms(args) -> dict:
    """elasticd at its defaults on --false-alarms steps whose every rank sleeps a log-normal
    extra each step (--jitter MEDIAN,SIGMA): the hangs declared (each a false alarm), the
    suspicions the evidence cleared (`hang_deadline_passed`), the deadline learned, and the
    step gaps the job showed (p50, p99, longest, from its own log)."""
    with tempfile.TemporaryDirectory(prefix="bench-detect-jitter-") as tmp:
        work = Path(tmp)
        out, log_path = work / "steps.txt", work / "launcher.log"
        env = dict(
            os.environ,
            BENCH_OUT=str(out),
            BENCH_STEPS=str(args.false_alarms),
            BENCH_JITTER=args.jitter,
        )
        t0 = time.monotonic()
        proc = spawn(launcher_cmd("elasticd", 1, work, (), nproc=args.nproc), env, log_path)
        try:
            code = proc.wait(timeout=args.false_alarms * 0.5 + args.start_timeout)
        except subprocess.TimeoutExpired:
            code = None
        finally:
            kill_tree(proc)
            sweep(out)
        found = events(log_path)
        rows = read_steps(out)
    hangs = [e for e in found if e.get("new") == "RESTARTING" and e.get("failure_class") == "hang"]
    learned = [e for e in found if e.get("event") == "hang_deadline_learned"]
    by_rank: dict[int, list[float]] = {}
    for _, rank, _, _, at in rows:
        by_rank.setdefault(rank, []).append(at)
    gaps = sorted(b - a for ts in by_rank.values() for a, b in zip(ts, ts[1:]))
    return {
        "exit_code": code,
        "steps": max((r[3] for r in rows), default=0),
        "seconds": round(time.monotonic() - t0, 1),
        "hangs": len(hangs),
        "hang_causes": [e.get("cause", "")[:200] for e in hangs],
        "cleared": sum(e.get("event") == "hang_deadline_passed" for e in found),
        "deadline": learned[0] if learned else None,
        "gap_p50": gaps[len(gaps) // 2] if gaps else None,
        "gap_p99": gaps[int(0.99 * len(gaps))] if gaps else None,
        "gap_max": gaps[-1] if gaps else None,
    }


def run(args) -> dict:
    """Every fault's trials, the columns taking turns trial by trial (the same load for each)."""
    results: dict = {}
    for fault in args.kinds:
        columns = [
            c
            for c in args.launchers
            if not (c == "elasticd-hb" and fault not in HANGS)
            and not (c == "elasticd-noprobe" and fault not in NODES)
        ]
        for i in range(args.trials):
            for column in columns:
                with tempfile.TemporaryDirectory(prefix=f"bench-detect-{column}-{fault}-") as tmp:
                    work = Path(tmp)
                    measure = two_nodes if fault in NODES else one_node
                    why = None if args.all else UNMEASURED.get((column, fault))
                    trial = Trial(said=why) if why else measure(column, fault, args, work)
                results.setdefault(fault, {}).setdefault(column, []).append(trial)
                got = (
                    f"{trial.seconds:.3f} s, named {trial.named or '-'} "
                    f"({'right' if trial.right else 'wrong'})"
                    if trial.seconds is not None
                    else "-"
                )
                print(
                    f"  {fault} {column} trial {i + 1}: {got}: {trial.said}",
                    file=sys.stderr,
                    flush=True,
                )
    return results


def cell(trials: list[Trial], bound: float) -> str:
    seen = sorted(t.seconds for t in trials if t.seconds is not None)
    n = f"{len(seen)}/{len(trials)}"
    if not seen:
        why = {t.said for t in trials if t.said.startswith("not measured")}
        return why.pop() if why else f"not within {bound:g} s ({n})"
    med = statistics.median(seen)
    spread = f" ({seen[0]:.3f}–{seen[-1]:.3f})" if len(seen) > 1 else ""
    return f"{med:.3f} s{spread}, {n}"


def named(trials: list[Trial]) -> str:
    seen = [t for t in trials if t.seconds is not None]
    if not seen:
        return "—"
    others = sorted({t.named or "none" for t in seen if not t.right})
    wrong = f" (else {', '.join(others)})" if others else ""
    return f"{sum(t.right for t in seen)}/{len(trials)}{wrong}"


def ratio(ours: list[Trial], theirs: list[Trial], bound: float) -> str:
    a = [t.seconds for t in ours if t.seconds is not None]
    b = [t.seconds for t in theirs if t.seconds is not None]
    if a and b:
        return f"{statistics.median(a) / statistics.median(b):.2f}x"
    if a and not any(t.said.startswith("not measured") for t in theirs):
        return f"< {statistics.median(a) / bound:.2f}x"  # torchrun: more than the bound
    if b and not any(t.said.startswith("not measured") for t in ours):
        return f"> {bound / statistics.median(b):.2f}x"
    return "—"


P99 = re.compile(r"2 x p99 ([\d.]+)s")  # the learned deadline's basis, in the hang's cause


def against_p99(results: dict) -> list[str]:
    """For the hang kinds, each column's detection against 2 x the p99 step gap the daemon had
    learned when it judged (from the cause: "2 x p99 0.215s"): the issue's bound for a SIGSTOP."""
    lines = []
    for fault in sorted(HANGS & set(results)):
        for column, trials in results[fault].items():
            pairs = [
                (t.seconds, 2 * float(m[1]))
                for t in trials
                if t.seconds is not None and (m := P99.search(t.said))
            ]
            if pairs:
                within = sum(s <= bound for s, bound in pairs)
                said = ", ".join(f"{s:.3f} s / {bound:.3f} s" for s, bound in pairs)
                lines.append(
                    f"{fault} {column}: detected within 2 x p99 in {within}/{len(trials)} "
                    f"(detected / 2 x p99: {said})"
                )
    return lines


def table(results: dict, args) -> str:
    cols = [c for c in args.launchers if c != "torchrun"]
    head = ["fault"]
    for c in cols:
        name = {
            "elasticd": "elasticd (defaults, --in-place off)",
            "elasticd-noprobe": "elasticd, no probe (before)",
            "elasticd-before": f"elasticd at {args.before} (before)",
        }.get(c, f"elasticd --heartbeat-timeout {args.hb:g}")
        head += [f"{name}: detected after (median, range), detected", "rank named right"]
    if "torchrun" in args.launchers:
        head += ["torchrun: detected after", "rank named right"]
        head += [f"ratio {c.removeprefix('elasticd-') or c}/torchrun" for c in cols]
    lines = ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    for fault in KINDS:
        got = results.get(fault)
        row = [LABELS[fault]]
        if got is None:
            row += ["not run (--kinds)"] + ["—"] * (len(head) - 2)
            lines.append("| " + " | ".join(row) + " |")
            continue
        for c in cols:
            row += [cell(got[c], args.bound), named(got[c])] if c in got else ["—", "—"]
        if "torchrun" in args.launchers:
            row += [cell(got["torchrun"], args.bound), named(got["torchrun"])]
            row += [ratio(got[c], got["torchrun"], args.bound) if c in got else "—" for c in cols]
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)


def overhead(args) -> dict:
    """Per all_reduce, the Flight Recorder on and off (medians, and the fastest, over --rounds
    runs of each)."""
    runs: dict[str, list[dict]] = {"on": [], "off": [], "hook": []}
    for i in range(args.rounds):
        for mode in ("on", "off", "hook") if i % 2 == 0 else ("hook", "off", "on"):
            env = {**os.environ, "OMP_NUM_THREADS": "1"}
            env.pop("TORCH_FR_BUFFER_SIZE", None)
            if mode != "on":
                env["TORCH_FR_BUFFER_SIZE"] = "0"
            if mode == "hook":
                env["BENCH_HOOK"] = "1"
            port = free_port()
            cmd = [sys.executable, str(HERE / "flight_cost.py")]
            procs = [
                subprocess.Popen(
                    [*cmd, str(r), str(args.world), str(port), str(args.overhead), "1"],
                    env=env,
                    stdout=subprocess.PIPE,
                    text=True,
                )
                for r in range(args.world)
            ]
            try:
                out = procs[0].communicate(timeout=300)[0]
                for p in procs[1:]:
                    p.wait(60)
            finally:
                for p in procs:
                    if p.poll() is None:
                        p.kill()
                        p.wait(10)
            got = json.loads(out.strip().splitlines()[-1])
            runs[mode].append(got)
            print(f"  {mode}: {got}", file=sys.stderr, flush=True)
    on = statistics.median(r["us_per_op"] for r in runs["on"])
    off = statistics.median(r["us_per_op"] for r in runs["off"])
    # the fastest run of each: the least disturbed by other load (a CPU cost only adds)
    on_min = min(r["us_per_op"] for r in runs["on"])
    off_min = min(r["us_per_op"] for r in runs["off"])
    hook = statistics.median(r["us_per_op"] for r in runs["hook"])
    hook_min = min(r["us_per_op"] for r in runs["hook"])
    return {
        "us_per_op_fastest_hook": round(hook_min, 2),
        "hook_cost_us_fastest": round(hook_min - off_min, 2),
        "hook_cost_us": round(hook - off, 2),
        "hook_ask_answered_ms": round(statistics.median(r["dump_ms"] for r in runs["hook"]), 2),
        "us_per_op_fastest_on": round(on_min, 2),
        "us_per_op_fastest_off": round(off_min, 2),
        "recorder_cost_us_fastest": round(on_min - off_min, 2),
        "ops": args.overhead,
        "world": args.world,
        "rounds": args.rounds,
        "us_per_op_recorder_on": round(on, 2),
        "us_per_op_recorder_off": round(off, 2),
        "recorder_cost_us": round(on - off, 2),
        "recorder_cost_share": round((on - off) / off, 4),
        "ask_answered_ms": round(statistics.median(r["dump_ms"] for r in runs["on"]), 2),
        "entries_dumped": runs["on"][0]["entries"],
        "load": os.getloadavg()[0],
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--trials", type=int, default=1)
    p.add_argument("--kinds", default=",".join(KINDS), help=f"of {','.join(KINDS)}")
    p.add_argument(
        "--launchers",
        default="elasticd,torchrun",
        help="of elasticd,elasticd-hb,elasticd-noprobe,elasticd-before,torchrun",
    )
    p.add_argument(
        "--before", type=Path, help="elasticd-before's checkout (the code before a change)"
    )
    p.add_argument("--nproc", type=int, default=3, help="workers of the one-node kinds (default 3)")
    p.add_argument("--bound", type=float, default=15.0, help="a fault not seen by then: not within")
    p.add_argument("--hb", type=float, default=2.0, help="elasticd-hb's --heartbeat-timeout")
    p.add_argument(
        "--warmup",
        type=float,
        default=4.0,
        help="seconds of training before a fault (elasticd learns its deadline in 50 steps)",
    )
    p.add_argument("--start-timeout", type=float, default=120.0)
    p.add_argument("--all", action="store_true", help="try what is not measured here too")
    p.add_argument("--json", action="store_true", help="also one JSON line of every trial")
    p.add_argument(
        "--false-alarms",
        type=int,
        default=0,
        metavar="STEPS",
        help="instead: run STEPS steps with --jitter at the defaults, count the hangs declared",
    )
    p.add_argument(
        "--jitter", default="0.01,1.0", help="MEDIAN,SIGMA (s) of each step's log-normal sleep"
    )
    p.add_argument(
        "--overhead",
        type=int,
        default=0,
        metavar="OPS",
        help="instead: time OPS all_reduces with torch's Flight Recorder on and off",
    )
    p.add_argument("--rounds", type=int, default=5, help="--overhead's runs of each")
    p.add_argument("--world", type=int, default=1, help="--overhead's gloo ranks")
    args = p.parse_args()
    if args.overhead:
        print(json.dumps(overhead(args)))
        return
    if args.false_alarms:
        got = false_alarms(args)
        print(json.dumps(got))
        return
    args.kinds = [k for k in KINDS if k in args.kinds.split(",")]
    args.launchers = args.launchers.split(",")
    t0 = time.monotonic()
    results = run(args)
    load = os.getloadavg()
    print(
        f"detection: fault -> the launcher's record of it; {os.cpu_count()} cores, torch CPU/gloo; "
        f"{args.nproc} workers on one node, 1 per node on two; {args.trials} trial(s) each, bound "
        f"{args.bound:g} s; load average {load[0]:.1f} / {load[1]:.1f} / {load[2]:.1f}; "
        f"{time.monotonic() - t0:.0f} s"
    )
    print(table(results, args))
    for line in against_p99(results):
        print(line)
    if args.json:
        print(
            json.dumps(
                {
                    f: {c: [vars(t) for t in ts] for c, ts in cols.items()}
                    for f, cols in results.items()
                }
            )
        )


if __name__ == "__main__":
    main()
