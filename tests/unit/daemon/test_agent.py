"""The agent loop's decisions, driven through every edge of the state machine (states.TRANSITIONS)
with fake collaborators: a scripted store and rounds, peers, local group, spares and health check
(Agent's factories). No process is started and no store is reached; the loop, its waits, its
inbox, the restart bookkeeping and the status snapshot are the real ones.

Each scenario checks the exact path of states and the exit code; together they must take every
edge of TRANSITIONS at least once (test_every_edge_is_taken), so an edge whose handling breaks
either changes a scenario's path or goes missing from the set."""

from __future__ import annotations

import dataclasses
import hashlib
import os
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace

import pytest
import structlog.testing

from elasticd import config, names, repro
from elasticd.cluster.errors import BudgetSpent, Deterministic, RendezvousFailed, StoreLost
from elasticd.cluster.rounds import Member, Round
from elasticd.daemon import deadlines, preflight, quarantine
from elasticd.daemon.agent import Agent
from elasticd.daemon.healthcheck import HealthCheck
from elasticd.exit_codes import ExitCode
from elasticd.lifecycle.states import TRANSITIONS, Failure, RestartCause, State
from elasticd.worker import heartbeat

S = State
EDGES = {(old, new) for old, targets in TRANSITIONS.items() for new in targets}
TAKEN: set[tuple[State, State]] = set()  # the edges the scenarios took


def stop(agent: Agent) -> None:
    """What `elasticd stop` does: a command posted to the loop's inbox."""
    agent.post((names.STOP, 0.0))


def wait_for_stop(agent: Agent) -> None:
    """A blocking store call that lasts until the loop has taken the stop request."""
    deadline = time.monotonic() + 10
    while agent.stop_request is None and time.monotonic() < deadline:
        time.sleep(0.005)


@dataclass
class Script:
    """What the fakes do, per scenario. Rounds and group attempts are counted from 1."""

    members: int = 1  # nodes in every round (an exit barrier only with more than one)
    round_fails: dict[int, Exception] = field(default_factory=dict)  # round n raises this
    stop_in_round: int | None = None  # a stop arrives while round n is being joined
    stop_in_read: str = ""  # a stop arrives while this is read from the store ("restart": the
    # round's restart request; a replay key: the word another node leaves under it)
    sdc: heartbeat.Beat | None = None  # what the local rank's audit noted, the attempt ended
    failures: dict[int, Failure] = field(default_factory=dict)  # attempt n's group reports this
    finishes: set[int] = field(default_factory=set)  # attempt n's workers all exit 0
    stop_in_attempt: set[int] = field(default_factory=set)  # a stop while attempt n runs
    barrier_fails: bool = False  # the exit barrier raises (the store is gone)
    peers_fail: bool = False  # the peers' check raises (the store is gone)
    checks: list[bool] = field(default_factory=list)  # health checks' outcomes (on when given)
    # what the peers' check finds once asked about a local death of a closed connection
    behind: Failure | None = None
    attempt_dir: Path | None = None  # where the group's ranks leave their files (a repro bundle)
    # the verdict of the node the restart request names to replay the failed step too
    # (daemon/replay_elsewhere.py), None: no word from it
    elsewhere: dict | None = None
    peer_silent: bool = False  # the other nodes' beats stop (their daemons died)
    agent: Agent | None = None
    calls: list[tuple] = field(default_factory=list)  # what the fakes were asked, in order


class FakeRendezvous:
    def __init__(self, script: Script) -> None:
        self.s = script
        self.rounds = 0
        self.node_id, self.endpoint, self.is_host = "node-0", "fake:0", True
        self.addr = "127.0.0.1"  # this node's address, whose name lookup the agent times

    def next_round(self, nproc: int) -> Round:
        self.rounds += 1
        self.s.calls.append(("next_round", self.rounds))
        if self.s.stop_in_round == self.rounds:
            stop(self.s.agent)
            wait_for_stop(self.s.agent)
        if self.rounds in self.s.round_fails:
            raise self.s.round_fails[self.rounds]
        members = [Member(f"node-{i}", nproc, "127.0.0.1") for i in range(self.s.members)]
        return Round(self.rounds, 0, members, world_size=nproc * self.s.members)

    def restarts_used(self) -> int:
        return sum(1 for c in self.s.calls if c[0] == "request_restart" and c[1].get("spends"))

    kv = None
    carry = None  # daemon/grow.py: what a node carries into its next round (never, here)

    def read_restart(self, store, rnd: Round) -> dict | None:
        self.stop_in("restart")
        return None

    def stop_in(self, what: str) -> None:
        if self.s.stop_in_read == what:
            stop(self.s.agent)
            wait_for_stop(
                self.s.agent
            )  # the request this node wrote, or none: no other node's failure came first

    def request_restart(self, rnd: Round, reason: dict) -> None:
        self.s.calls.append(("request_restart", reason))

    def amend_restart(self, rnd: Round, ours: dict, amended: dict) -> bool:
        self.s.calls.append(("amend_restart", amended))
        return True

    def note_replay(self, rnd: Round, name: str, value: dict) -> None:
        self.s.calls.append(("note_replay", name, value))

    def replay_noted(self, rnd: Round, name: str, timeout: float) -> dict | None:
        self.stop_in(name)
        word = self.s.elsewhere if name == names.REPLAYED_ELSEWHERE else None
        if word is None:
            time.sleep(min(timeout, 5.0))  # waited for in vain
        return word

    def read_beats(self, store, node_ids: list[str]) -> dict[str, int | None]:
        self.beats = getattr(self, "beats", 0) + (not self.s.peer_silent)
        return {n: self.beats for n in node_ids}

    def exit_barrier(self, rnd: Round, timeout: float) -> bool:
        self.s.calls.append(("exit_barrier",))
        if self.s.barrier_fails:
            raise StoreLost("the store's host is gone")
        return True

    def close(self, job_finished: bool, why: str) -> None:
        self.s.calls.append(("close", job_finished))


class FakePeers:
    def __init__(self, script: Script) -> None:
        self.s = script
        # no other node asks about a hang (cluster/hang_inquiry.py)
        self.inquiries = SimpleNamespace(next=0, asked=None, verdict=None)

    def new_round(self, rnd: Round) -> None:
        pass

    def silences(self, now: float) -> dict[int, float]:
        return {}

    def check(self, rnd: Round, now: float, beats, died_at=None, died_of=None) -> Failure | None:
        if self.s.peers_fail:
            raise StoreLost("the store's host is gone")
        if died_at is not None:
            self.s.calls.append(("looked_behind", died_at))
            return self.s.behind
        return None

    def close(self) -> None:
        pass


class FakeGroup:
    """This node's workers: none run; each attempt reports what the script says."""

    def __init__(self, script: Script) -> None:
        self.s = script
        self.tee = None
        self.in_place = False  # the restart path (serve.py sets it from inplace.announce)
        self.workers: list = []
        self.attempt = 0
        self.deadline = deadlines.Deadline(300.0, False)
        dirs = script.attempt_dir
        self.spec = SimpleNamespace(attempt_dir=dirs) if dirs is not None else None

    def start(self, rnd: Round, restart_count: int, memory_dir, spares, joining=None) -> None:
        self.attempt += 1
        self.s.calls.append(("start", self.attempt, restart_count))
        self.workers = [
            SimpleNamespace(local_rank=0, global_rank=0, pid=1000 + self.attempt, env={})
        ]

    def check(self) -> Failure | None:
        if self.attempt in self.s.stop_in_attempt:
            self.s.stop_in_attempt.discard(self.attempt)
            stop(self.s.agent)
        return self.s.failures.get(self.attempt)

    def failed_now(self) -> Failure | None:
        return None  # told by a peer to restart, nothing failed here

    def raised(self) -> Failure | None:
        return None  # no error file written by a worker still exiting

    @property
    def finished(self) -> bool:
        return self.attempt in self.s.finishes

    def beats(self) -> list:
        return [self.s.sdc for _ in self.workers]  # None: not beaten yet

    def rows(self, now: float) -> list[dict]:
        return []

    def stacks(self, state: str) -> dict:
        return {}

    def stop(self, grace, abandon=False, keep=frozenset(), cut_short=None, spared=frozenset()):
        self.s.calls.append(("teardown", self.attempt, abandon))
        self.workers = []


class FakeSpares:
    spares: list = []
    pending = 0
    refill_due = None

    def start(self, reaper: bool) -> None:
        pass

    def waitables(self) -> list:
        return []

    def collect(self) -> None:
        pass

    def after_spawn(self, envs: list) -> None:
        pass

    def refill_if_due(self, stepped: bool, now: float) -> None:
        pass

    def learn(self, workers: list) -> None:
        pass

    def keep(self) -> frozenset[int]:
        return frozenset()

    def take(self) -> None:
        return None  # no warm spare: a replay runs as `elasticd replay`, in a fresh interpreter

    def ready_or_none_coming(self) -> bool:
        return True

    def missing(self) -> str:
        return "none in this test"

    def close(self) -> None:
        pass


class FakeHealthCheck(HealthCheck):
    """The real health check's bookkeeping on its real thread, with each check's outcome taken
    from the script instead of a command run."""

    outcomes: list[bool] = []

    def _run(self) -> None:
        ok = self.outcomes.pop(0) if self.outcomes else True
        self._finish(ok, "passed" if ok else "exit code 1: GPU 3 is gone", "", time.monotonic())


def run(tmp_path, script: Script, **settings) -> tuple[int, list[State], Agent]:
    """Run an agent to its end on the script; its exit code and the states it went through."""
    flags = {
        "entrypoint": "train.py",
        "nproc_per_node": 1,
        "monitor_interval": 0.01,
        "restart_backoff": 0.0,
        "max_restarts": 3,
        "tee": False,
        "warm_spawn": False,
        "memory_state": False,
        "health_check": "true" if script.checks else "",
        "health_check_interval": 0.02,
        **settings,
    }
    cfg = config.build(flags, environ={})
    tmp_path.mkdir(parents=True, exist_ok=True)
    FakeHealthCheck.outcomes = list(script.checks)
    agent = Agent(
        cfg,
        preflight.make_run_dir(tmp_path, "run"),
        rendezvous=lambda cfg: FakeRendezvous(script),
        peers=lambda *args, **kwargs: FakePeers(script),
        group=lambda *args: FakeGroup(script),
        spares=lambda *args: FakeSpares(),
        health_check=FakeHealthCheck,
        subreaper=lambda: False,
    )
    script.agent = agent
    path = [agent.state]
    set_state = agent.set_state

    def recorded(state: State, **fields) -> None:
        TAKEN.add((agent.state, state))
        set_state(state, **fields)
        path.append(state)

    agent.set_state = recorded
    box: dict = {}
    thread = threading.Thread(target=lambda: box.update(code=agent.run()), daemon=True)
    thread.start()
    thread.join(30)
    assert not thread.is_alive(), f"the loop did not end; it went through {path}"
    return box["code"], path, agent


def crash(code: int = 1) -> Failure:
    return Failure(RestartCause.CRASH, f"exit code {code}", rank=0, exit_code=code)


def test_a_job_that_finishes_passes_the_exit_barrier(tmp_path):
    s = Script(members=2, finishes={1})
    code, path, _ = run(tmp_path, s)
    assert (code, path) == (
        ExitCode.OK,
        [S.INIT, S.RENDEZVOUS, S.RUNNING, S.EXIT_BARRIER, S.SUCCEEDED],
    )
    assert ("exit_barrier",) in s.calls and s.calls[-1] == ("close", True)


def test_a_crash_restarts_the_group_and_spends_the_budget(tmp_path):
    s = Script(failures={1: crash()}, finishes={2})
    code, path, agent = run(tmp_path, s)
    assert code == ExitCode.OK
    assert path == [
        *[S.INIT, S.RENDEZVOUS, S.RUNNING, S.RESTARTING],
        *[S.RENDEZVOUS, S.RUNNING, S.EXIT_BARRIER, S.SUCCEEDED],
    ]
    asked = [c[1] for c in s.calls if c[0] == "request_restart"]
    assert len(asked) == 1 and asked[0]["spends"] is True
    assert ("teardown", 1, True) in s.calls and ("start", 2, 1) in s.calls  # restart count 1
    assert agent.first_failure is not None and agent.first_failure.exit_code == 1


def _bundle(tmp_path: Path, raises: str) -> tuple[Path, Failure]:
    """An attempt directory whose rank 0 left a repro bundle of a script that raises `raises`
    (no torch: the replay runs the script, which fails before any state is asked for)."""
    attempt, bug = tmp_path / "attempt", tmp_path / "bug.py"
    attempt.mkdir(parents=True)
    bug.write_text(f"raise ValueError({raises!r})\n")
    head = {
        **{"rank": 0, "world": 1, "certified_step": 1, "failed_step": 2, "samples": {}},
        **{"entrypoint": str(bug), "args": [], "cwd": str(tmp_path)},
        "env": {"PYTHONPATH": os.environ.get("PYTHONPATH", "")},
        "error": {
            "exception": "ValueError: bad sample 3",
            "callstack": f'Traceback:\n  File "{bug}", line 1, in <module>\n',
        },
    }
    repro.write(attempt / "rank0.repro", head, b"")
    why = Failure(
        RestartCause.CRASH, "exit code 1", rank=0, exit_code=1, exception=head["error"]["exception"]
    )
    return attempt, why


@pytest.mark.parametrize("raises, verdict", [("bad sample 7", "reproduced"), ("another thing", "")])
def test_a_failure_with_a_bundle_is_replayed_and_its_verdict_amends_the_request(
    tmp_path, raises, verdict
):
    attempt, why = _bundle(tmp_path, raises)
    s = Script(failures={1: why}, finishes={2}, attempt_dir=attempt)
    code, _, agent = run(tmp_path / "agent", s)
    assert code == ExitCode.OK  # the fakes' rounds judge nothing: the closing's part, e2e
    amended = [c[1] for c in s.calls if c[0] == "amend_restart"]
    assert [a["replayed"] for a in amended] == ([verdict] if verdict else [])
    assert agent.last_failure.replayed == verdict
    said = (attempt / "rank0.replay.log").read_text()
    assert ("elasticd replay: reproduced" in said) == bool(verdict), said


@pytest.mark.parametrize(
    "there, verdict",
    [(1, "hardware"), (0, "reproduced"), (3, "reproduced"), (None, "reproduced"), ("gone", "")],
    ids=["completed-there", "reproduced-there", "undecided-there", "no-word", "gone-silent"],
)
def test_a_replay_reproduced_here_is_replayed_on_another_node_too(tmp_path, there, verdict):
    """Where the failure's own replay reproduced, the node after this one replays the bundle too
    (daemon/replay_elsewhere.py): completed there, the failure is this node's hardware, which
    leaves the job quarantined from RESTARTING (exit 7); reproduced there, undecided there or no
    word: reproduced, the job's end in the closing's hands as before. The node named gone
    (silent for --peer-timeout): reproduced, without waiting out --replay-timeout."""
    attempt, why = _bundle(tmp_path, "bad sample 7")
    said = "elasticd replay: did not reproduce" if there == 1 else "elasticd replay: ..."
    word = there in (None, "gone")
    answer = None if word else {"node": "other", "code": there, "said": said}
    s = Script(members=2, failures={1: why}, finishes={2}, attempt_dir=attempt, elsewhere=answer,
               peer_silent=there == "gone")  # fmt: skip
    ckpt, state = tmp_path / "ckpt", tmp_path / "state"
    t0 = time.monotonic()
    with structlog.testing.capture_logs() as said:
        code, path, agent = run(
            tmp_path / "agent", s, checkpoint_dir=str(ckpt), state_dir=str(state),
            replay_timeout=20 if there == "gone" else 2, peer_timeout=0.5,
        )  # fmt: skip
    took = time.monotonic() - t0
    if there == "gone":
        verdict = "reproduced"
        assert took < 10, took  # the node named silent 0.5 s: not the 20 s of --replay-timeout
        (judged,) = [e for e in said if e.get("event") == "replay_verdict"]
        assert "silent for" in judged["elsewhere"] and "gone" in judged["elsewhere"], judged
    elif there is None:
        assert took >= 2, took  # the node named still beats: its word waited for to the end
    (asked,) = [c[1] for c in s.calls if c[0] == "request_restart"][:1]
    assert asked["replay_on"] == "node-1", asked  # the next member in group order
    (noted,) = [c for c in s.calls if c[0] == "note_replay"]
    copy = Path(noted[2]["path"])
    assert noted[1] == names.REPLAY_ASK and copy.parent == ckpt / "repro", noted
    assert copy.read_bytes() == (attempt / "rank0.repro").read_bytes()
    assert noted[2]["sha256"] == hashlib.sha256(copy.read_bytes()).hexdigest()
    (amended,) = [c[1] for c in s.calls if c[0] == "amend_restart"]
    assert amended["replayed"] == verdict == agent.last_failure.replayed
    if verdict == "hardware":
        assert code == ExitCode.QUARANTINED and path[-2:] == [S.RESTARTING, S.LEFT], path
        assert amended["lost"] == ["node-0"] and amended["class"] == "hardware", amended
        assert quarantine.read(state).quarantined is not None
    else:
        assert code == ExitCode.OK and "lost" not in amended, (code, amended)
        assert S.LEFT not in path


@pytest.mark.parametrize("off", ["timeout 0", "a death of another's going"])
def test_no_replay_when_it_is_off_or_the_failure_is_a_consequence(tmp_path, off):
    attempt, why = _bundle(tmp_path, "bad sample 7")
    if off != "timeout 0":
        why = dataclasses.replace(why, exception=GLOO_CLOSED)
    s = Script(failures={1: why}, finishes={2}, attempt_dir=attempt)
    run(tmp_path / "agent", s, replay_timeout=0 if off == "timeout 0" else 120)
    assert not [c for c in s.calls if c[0] == "amend_restart"]
    assert not (attempt / "rank0.replay.log").exists()


def test_a_fatal_exit_code_fails_the_job_without_a_round(tmp_path):
    s = Script(failures={1: crash(3)})
    code, path, agent = run(tmp_path, s, fatal_exit_codes=[3])
    assert code == ExitCode.FAILED
    assert path == [S.INIT, S.RENDEZVOUS, S.RUNNING, S.RESTARTING, S.FAILED]
    assert [c for c in s.calls if c[0] == "next_round"] == [("next_round", 1)]
    assert s.calls[-1] == ("close", True) and agent.first_failure.exit_code == 3


def test_a_round_that_finds_the_budget_spent_fails_the_job(tmp_path):
    s = Script(failures={1: crash()}, round_fails={2: BudgetSpent("restart budget spent")})
    code, path, agent = run(tmp_path, s)
    assert code == ExitCode.FAILED
    assert path == [S.INIT, S.RENDEZVOUS, S.RUNNING, S.RESTARTING, S.RENDEZVOUS, S.FAILED]
    assert agent.first_failure.kind is RestartCause.CRASH  # the first failure, not the verdict
    assert agent.last_failure.kind is RestartCause.RENDEZVOUS


def test_a_round_that_finds_the_failure_deterministic_ends_the_job_with_exit_6(tmp_path):
    """The verdict of the round after the failure (cluster/closing.py): exit 6, its line (naming
    both attempts) the first failure, the class of the failure that led to it."""
    oom = Failure(RestartCause.SIGNAL, "signal 9", rank=0, exit_code=-9, failure_class="oom")
    verdict = Deterministic("deterministic failure: ... in attempts 1 and 2")
    s = Script(failures={1: oom}, round_fails={2: verdict})
    code, path, agent = run(tmp_path, s)
    assert code == ExitCode.DETERMINISTIC == 6
    assert path == [S.INIT, S.RENDEZVOUS, S.RUNNING, S.RESTARTING, S.RENDEZVOUS, S.FAILED]
    assert agent.first_failure is agent.last_failure
    assert "in attempts 1 and 2" in agent.first_failure.reported()
    assert agent.first_failure.failure_class == "oom"
    assert agent.status.figures.failures == {"oom": 1}


def test_a_failed_rendezvous_fails_the_job(tmp_path):
    s = Script(round_fails={1: RendezvousFailed("join timeout")})
    code, path, agent = run(tmp_path, s)
    assert (code, path) == (ExitCode.FAILED, [S.INIT, S.RENDEZVOUS, S.FAILED])
    assert agent.first_failure.reason == "join timeout"


def test_a_stop_while_running_stops_the_workers(tmp_path):
    s = Script(stop_in_attempt={1})
    code, path, _ = run(tmp_path, s)
    assert (code, path) == (ExitCode.OK, [S.INIT, S.RENDEZVOUS, S.RUNNING, S.STOPPING, S.STOPPED])
    assert ("teardown", 1, False) in s.calls  # a stop's teardown gives the grace: not abandoned
    assert ("exit_barrier",) not in s.calls  # alone in the job: no barrier


def test_a_stop_while_joining_leaves_the_rendezvous(tmp_path):
    s = Script(stop_in_round=1)
    code, path, _ = run(tmp_path, s)
    assert (code, path) == (ExitCode.OK, [S.INIT, S.RENDEZVOUS, S.STOPPED])
    assert not [c for c in s.calls if c[0] == "start"]


def test_a_stop_during_a_restart_is_acted_on_before_the_next_round(tmp_path):
    s = Script(failures={1: crash()}, stop_in_attempt={1})
    code, path, _ = run(tmp_path, s)
    assert code == ExitCode.OK
    assert path == [
        *[S.INIT, S.RENDEZVOUS, S.RUNNING, S.RESTARTING],
        *[S.RENDEZVOUS, S.STOPPING, S.STOPPED],
    ]
    assert [c for c in s.calls if c[0] == "next_round"] == [("next_round", 1)]


def test_a_stop_while_a_restart_waits_on_the_store_ends_there(tmp_path):
    """A restart for another node's failure reads whether that node asks this one to replay its
    step (daemon/replay_elsewhere.py): a stop (SIGTERM) in that read ends the daemon there, its
    workers already down, exit 0, as a stop while joining does."""
    s = Script(members=2, failures={1: NOT_OURS[0]}, stop_in_read="restart")
    code, path, _ = run(tmp_path, s, checkpoint_dir=str(tmp_path / "ckpt"))
    assert (code, path) == (ExitCode.OK, [S.INIT, S.RENDEZVOUS, S.RUNNING, S.RESTARTING, S.STOPPED])
    assert [c for c in s.calls if c[0] == "next_round"] == [("next_round", 1)]


def test_a_stop_while_the_referee_waits_for_the_other_node_stops_as_any_stop(tmp_path):
    """Two replicas on two nodes disagreed: rank 0's node waits, still RUNNING, for rank 1's
    bundle (replay_elsewhere.referee_across). A stop in that wait is a stop while running: its
    workers get the grace, the exit barrier, exit 0."""
    attempt = tmp_path / "attempt"
    attempt.mkdir(parents=True)
    (attempt / f"rank0{repro.SDC_SUFFIX}").write_bytes(b"rank 0's step")
    found = Failure(RestartCause.CRASH, "sdc", rank=0, exit_code=names.SDC_EXIT,
                    failure_class="sdc")  # fmt: skip
    sdc = heartbeat.Beat(10, 7, 1.0, 0.5, figures=tuple(
        {"sdc_found": 1.0, "sdc_step": 5.0}.get(f, 0.0) for f in heartbeat.FIGURES))  # fmt: skip
    s = Script(members=2, failures={1: found}, stop_in_read=names.REFEREE_ASK, sdc=sdc,
               attempt_dir=attempt)  # fmt: skip
    code, path, _ = run(tmp_path / "agent", s, checkpoint_dir=str(tmp_path / "ckpt"))
    assert (code, path) == (ExitCode.OK, [S.INIT, S.RENDEZVOUS, S.RUNNING, S.STOPPING, S.STOPPED])
    assert ("teardown", 1, False) in s.calls and ("exit_barrier",) in s.calls


def test_a_store_lost_in_a_stops_exit_barrier_fails_the_job(tmp_path):
    s = Script(members=2, stop_in_attempt={1}, barrier_fails=True)
    code, path, _ = run(tmp_path, s)
    assert code == ExitCode.FAILED
    assert path == [S.INIT, S.RENDEZVOUS, S.RUNNING, S.STOPPING, S.FAILED]


def test_a_store_lost_in_the_exit_barrier_fails_the_job(tmp_path):
    s = Script(members=2, finishes={1}, barrier_fails=True)
    code, path, _ = run(tmp_path, s)
    assert code == ExitCode.FAILED
    assert path == [S.INIT, S.RENDEZVOUS, S.RUNNING, S.EXIT_BARRIER, S.FAILED]


def test_a_store_lost_while_running_fails_the_job(tmp_path):
    s = Script(peers_fail=True)
    code, path, agent = run(tmp_path, s)
    assert (code, path) == (ExitCode.FAILED, [S.INIT, S.RENDEZVOUS, S.RUNNING, S.FAILED])
    assert agent.first_failure.kind is RestartCause.RENDEZVOUS


def test_a_node_whose_health_check_fails_before_starting_never_joins(tmp_path):
    s = Script(checks=[False])
    code, path, agent = run(tmp_path, s)
    assert (code, path) == (ExitCode.UNHEALTHY, [S.INIT, S.RENDEZVOUS, S.LEFT])
    assert not [c for c in s.calls if c[0] == "next_round"]
    assert agent.left_line.startswith("elasticd: not starting")


def test_a_node_whose_health_check_fails_while_running_leaves_the_job(tmp_path):
    s = Script(members=2, checks=[True, False])
    code, path, agent = run(tmp_path, s)
    assert (code, path) == (ExitCode.UNHEALTHY, [S.INIT, S.RENDEZVOUS, S.RUNNING, S.LEFT])
    asked = [c[1] for c in s.calls if c[0] == "request_restart"]
    assert len(asked) == 1 and asked[0]["lost"] == ["node-0"]  # the others go on without it
    assert agent.left_line.startswith("elasticd: this node left the job")


GLOO_CLOSED = "RuntimeError: [pair.cc:553] Connection closed by peer [10.0.0.2]:17828"


def test_a_death_of_a_closed_connection_is_put_on_the_node_lost(tmp_path):
    """Rank 0 dies of a closed connection in a job of two nodes: the loop looks behind it, finds
    node-1 lost, and that is the restart's cause (its first words), status's last failure and the
    request (a node lost: nothing spent); rank 0's death a consequence."""
    died = Failure(RestartCause.CRASH, "exit code 1", rank=0, exit_code=1, exception=GLOO_CLOSED)
    lost = Failure(
        RestartCause.NODE_LOST,
        "lost: group rank 1 (rank 1) went silent for 0.6s, and our worker died of a closed "
        "connection; seen by node node-0",
        node="node-1",
        lost=("node-1",),
        at=died.at - 0.2,
    )
    s = Script(members=2, failures={1: died}, finishes={2}, behind=lost)
    code, path, agent = run(tmp_path, s)
    assert code == ExitCode.OK and path.count(S.RESTARTING) == 1
    assert [c for c in s.calls if c[0] == "looked_behind"]
    why = agent.last_failure
    assert (why.kind, why.node, why.lost, why.failure_class) == (
        RestartCause.NODE_LOST,
        "node-1",
        ("node-1",),
        "node_lost",
    )
    assert why.summary().startswith("node node-1; lost: group rank 1 (rank 1) went silent")
    assert why.consequences[0].startswith("rank 0 (node ") and "closed by peer" in why.summary()
    (asked,) = [c[1] for c in s.calls if c[0] == "request_restart"]
    assert asked["lost"] == ["node-1"] and not asked.get("spends"), asked
    assert agent.first_failure is None  # nothing of the job's budget


def test_a_death_of_a_closed_connection_with_nobody_behind_it_is_ours_after_a_while(tmp_path):
    """Nobody found lost, no other node's request within LOST_SILENCE: rank 0's own failure is the
    cause, as before (and it spends the budget)."""
    died = Failure(RestartCause.CRASH, "exit code 1", rank=0, exit_code=1, exception=GLOO_CLOSED)
    s = Script(members=2, failures={1: died}, finishes={2})
    t0 = time.monotonic()
    code, path, agent = run(tmp_path, s)
    assert code == ExitCode.OK and path.count(S.RESTARTING) == 1
    assert time.monotonic() - t0 >= 1.25
    assert agent.last_failure is died and agent.first_failure is died
    (asked,) = [c[1] for c in s.calls if c[0] == "request_restart"]
    assert asked["spends"] and asked["consequence"], asked


NOT_OURS = [
    Failure(RestartCause.PEER, "node-1 asked", node="node-1"),
    Failure(RestartCause.NODE_LOST, "node-1 silent", node="node-1", lost=("node-1",)),
    Failure(RestartCause.STORE_UNREACHABLE, "no answer", node="node-0"),
]


@pytest.mark.parametrize("why", NOT_OURS, ids=lambda why: why.kind.name)
def test_a_restart_that_is_not_this_nodes_failure_spends_nothing(tmp_path, why):
    s = Script(members=2, failures={1: why}, finishes={2})
    code, path, agent = run(tmp_path, s)
    assert code == ExitCode.OK and path.count(S.RESTARTING) == 1
    asked = [c[1] for c in s.calls if c[0] == "request_restart"]
    if why.kind is RestartCause.NODE_LOST:
        assert asked == [
            {
                "summary": why.summary(),
                "node": agent.node,
                "class": "node_lost",
                "lost": ["node-1"],
                "at": why.at,
            }
        ]
    else:  # another node asked already, or the store cannot be reached
        assert asked == []
    assert agent.first_failure is None


def test_every_edge_is_taken(tmp_path):
    """The scenarios above, together, take every edge of the table (run again here, so that this
    test stands alone whatever runs beside it)."""
    TAKEN.clear()
    for i, scenario in enumerate(SCENARIOS):
        scenario(tmp_path / str(i))
    for i, why in enumerate(NOT_OURS):
        test_a_restart_that_is_not_this_nodes_failure_spends_nothing(tmp_path / f"n{i}", why)
    assert TAKEN - EDGES == set(), "a transition outside the table (set_state would raise)"
    missing = sorted(f"{a.value} -> {b.value}" for a, b in EDGES - TAKEN)
    assert missing == [], f"edges of TRANSITIONS no scenario took: {missing}"


SCENARIOS = [
    test_a_job_that_finishes_passes_the_exit_barrier,
    test_a_crash_restarts_the_group_and_spends_the_budget,
    test_a_fatal_exit_code_fails_the_job_without_a_round,
    test_a_round_that_finds_the_budget_spent_fails_the_job,
    test_a_failed_rendezvous_fails_the_job,
    test_a_stop_while_running_stops_the_workers,
    test_a_stop_while_joining_leaves_the_rendezvous,
    test_a_stop_during_a_restart_is_acted_on_before_the_next_round,
    test_a_stop_while_a_restart_waits_on_the_store_ends_there,
    test_a_stop_while_the_referee_waits_for_the_other_node_stops_as_any_stop,
    test_a_store_lost_in_a_stops_exit_barrier_fails_the_job,
    test_a_store_lost_in_the_exit_barrier_fails_the_job,
    test_a_store_lost_while_running_fails_the_job,
    test_a_node_whose_health_check_fails_before_starting_never_joins,
    test_a_node_whose_health_check_fails_while_running_leaves_the_job,
    lambda tmp: test_a_replay_reproduced_here_is_replayed_on_another_node_too(tmp, 1, "hardware"),
]
