"""The triage rules, pure (elasticd/lifecycle/triage.py): a failure's signature, its class and the
repeat rule that calls it deterministic; and the OOM counters' files (daemon/oom.py)."""

import dataclasses
import json
import signal

import pytest

from elasticd.cluster import values
from elasticd.daemon import oom
from elasticd.lifecycle import triage
from elasticd.lifecycle.states import Failure, RestartCause, first_elsewhere, restart_request
from elasticd.lifecycle.triage import FailureClass as C

STACK = """Traceback (most recent call last):
  File "/usr/lib/python3.12/runpy.py", line 88, in _run_code
  File "/work/repo/elasticd/worker/bootstrap.py", line 300, in main
  File "/home/u/train.py", line 40, in main
    loss = step(batch)
  File "/home/u/model.py", line 12, in step
    raise ValueError("bad batch 17")
  File "/usr/lib/python3/dist-packages/torch/nn/modules/module.py", line 1, in _call_impl
ValueError: bad batch 17
"""


@pytest.mark.parametrize(
    "text, expect",
    [
        ("at step 17", "at step N"),
        ("tensor 0x7f3a2c00 on port 29500", "tensor N on port N"),
        ("no numbers", "no numbers"),
        ("", ""),
    ],
)
def test_numbers_are_masked(text, expect):
    assert triage.mask_numbers(text) == expect


@pytest.mark.parametrize(
    "text, expect",
    [
        ("loss -0.2718", "loss N"),
        ("3.2e-05 vs 0.00041 vs 1E+3 vs .5", "N vs N vs N vs N"),
        ("x=-3 (+4.5) a-1", "x=N (N) a-N"),  # a sign only where one can stand
        ("<Foo object at 0x7f3a2c00e1d0>", "<Foo object at N>"),
        ("from [127.0.0.1]:57368", "from [N]:N"),
        ("torch 2.13.0 at 2026-11-28 07:51:45", "torch N at N-N-N N:N:N"),
        ("run 123e4567-e89b-12d3-a456-426614174000 sha a3f9c2e1b4d5", "run ID sha ID"),
        ("/tmp/tmpk3j_x9ab/torchelastic_q8x_2lm0/x", "/tmp/tmpID/torchelastic_ID/x"),
        ("shard_00017.pt ran for 600011ms", "shard_N.pt ran for Nms"),
        ("float32 conv2d layer3.weight cuda:0 v1.2", "float32 conv2d layer3.weight cuda:N v1.2"),
        ("deadbeef", "deadbeef"),  # a word, not an id: no digit
        ("(32x784 and 512x10)", "(NxN and NxN)"),
    ],
)
def test_numbers_are_masked_as_numbers(text, expect):
    assert triage.mask_numbers(text) == expect


def _traceback(exception: str, line: int = 12) -> str:
    return STACK.replace("line 12", f"line {line}").replace("ValueError: bad batch 17", exception)


# two failures' error-file texts, and whether they are the same failure (their signatures equal)
SAME, OTHER = True, False
MESSAGES = [
    ("ValueError: loss 0.3123 is too high", "ValueError: loss -0.2718 is too high", SAME),
    ("AssertionError: grad 3.2e-05 < 1e-4", "AssertionError: grad 0.00041 < 1e-4", SAME),
    ("ValueError: loss nan at step 30", "ValueError: loss inf at step 30", OTHER),
    (
        "RuntimeError: Expected all tensors to be on the same device, but found at least two "
        "devices, cuda:0 and cpu!",
        "RuntimeError: Expected all tensors to be on the same device, but found at least two "
        "devices, cuda:3 and cpu!",
        SAME,
    ),
    (
        "RuntimeError: mat1 and mat2 shapes cannot be multiplied (32x784 and 512x10)",
        "RuntimeError: mat1 and mat2 shapes cannot be multiplied (64x784 and 512x10)",
        SAME,  # a shape's sizes are numbers too (the last batch is short)
    ),
    (
        "IndexError: index 17 is out of bounds for dimension 0 with size 16",
        "IndexError: index 40 is out of bounds for dimension 0 with size 16",
        SAME,
    ),
    (
        "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 20.00 MiB. GPU 0 has a "
        "total capacity of 79.15 GiB of which 6.62 MiB is free. Process 3301 has 79.14 GiB",
        "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 20.00 MiB. GPU 5 has a "
        "total capacity of 79.15 GiB of which 11.5 MiB is free. Process 88120 has 79.13 GiB",
        SAME,
    ),
    (
        "RuntimeError: CUDA error: an illegal memory access was encountered",
        "RuntimeError: CUDA error: device-side assert triggered",
        OTHER,
    ),
    (
        "RuntimeError: [../third_party/gloo/gloo/transport/tcp/pair.cc:534] Read error "
        "[10.0.0.2]:57368: Connection reset by peer",
        "RuntimeError: [../third_party/gloo/gloo/transport/tcp/pair.cc:534] Read error "
        "[10.0.0.17]:41002: Connection reset by peer",
        SAME,
    ),
    (
        "RuntimeError: [../third_party/gloo/gloo/transport/tcp/pair.cc:534] Read error "
        "[10.0.0.2]:57368: Connection reset by peer",
        "RuntimeError: [../third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:81] Timed out "
        "waiting 1800000ms for recv operation to complete",
        OTHER,
    ),
    (
        "torch.distributed.DistBackendError: [Rank 0] Watchdog caught collective operation "
        "timeout: WorkNCCL(SeqNum=118, OpType=ALLREDUCE, NumelIn=1, NumelOut=1, "
        "Timeout(ms)=600000) ran for 600011 milliseconds before timing out.",
        "torch.distributed.DistBackendError: [Rank 3] Watchdog caught collective operation "
        "timeout: WorkNCCL(SeqNum=9021, OpType=ALLREDUCE, NumelIn=1, NumelOut=1, "
        "Timeout(ms)=600000) ran for 600347 milliseconds before timing out.",
        SAME,
    ),
    (
        "WorkNCCL(SeqNum=118, OpType=ALLREDUCE, NumelIn=1, NumelOut=1, Timeout(ms)=600000)",
        "WorkNCCL(SeqNum=118, OpType=ALLGATHER, NumelIn=1, NumelOut=4, Timeout(ms)=600000)",
        OTHER,
    ),
    (
        "KeyError: 'layer3.weight'",
        "KeyError: 'layer4.weight'",
        OTHER,  # another name
    ),
    (
        "FileNotFoundError: [Errno 2] No such file or directory: '/tmp/tmpk3j_x9ab/shard_00017.pt'",
        "FileNotFoundError: [Errno 2] No such file or directory: '/tmp/tmp0qz_81mc/shard_00023.pt'",
        SAME,
    ),
    (
        "TypeError: unsupported operand type(s) for +: 'Tensor' and 'NoneType' "
        "(<Batch object at 0x7f3a2c00e1d0>)",
        "TypeError: unsupported operand type(s) for +: 'Tensor' and 'NoneType' "
        "(<Batch object at 0x7fa0113b9e50>)",
        SAME,
    ),
    (
        "RuntimeError: run 123e4567-e89b-12d3-a456-426614174000 has no checkpoint",
        "RuntimeError: run 9b2f0c4e-1d7a-4e55-8f0b-2c9d3e1a7b60 has no checkpoint",
        SAME,
    ),
    ("ValueError: bad batch 3", "KeyError: bad batch 3", OTHER),
]


@pytest.mark.parametrize("first, second, same", MESSAGES)
def test_the_same_failure_whatever_its_numbers(first, second, same):
    """Real messages (Python, torch, CUDA, NCCL, gloo) compared as the repeat rule compares two
    failures: their signatures, the traceback's user frame included."""
    a = triage.signature(1, first, _traceback(first))
    b = triage.signature(1, second, _traceback(second))
    assert (a == b) is same, (a, b)
    assert a != triage.signature(1, first, _traceback(first, line=13))  # another line of code


@pytest.mark.parametrize(
    "stack, expect",
    [
        (STACK, "model.py:12 in step"),  # innermost user frame, library frames after it skipped
        ('  File "/x/site-packages/torch/a.py", line 3, in f\n', ""),  # no user frame at all
        ('  File "<frozen runpy>", line 3, in f\n  File "/a/b.py", line 9, in g\n', "b.py:9 in g"),
        (None, ""),
        ("not a traceback", ""),
    ],
)
def test_innermost_user_frame(stack, expect):
    assert triage.user_frame(stack) == expect


@pytest.mark.parametrize(
    "exit_code, exception, stack, expect",
    [
        (1, "ValueError: bad batch 17", STACK, "ValueError: bad batch N at model.py:12 in step"),
        (1, "ValueError: bad batch 3", STACK, "ValueError: bad batch N at model.py:12 in step"),
        (1, "ValueError: bad batch 3", None, "ValueError: bad batch N"),
        (3, None, None, "exit code 3"),
        (-signal.SIGSEGV, None, None, "signal SIGSEGV"),
        (-99, None, None, "signal 99"),
        (None, None, None, ""),
    ],
)
def test_signature(exit_code, exception, stack, expect):
    assert triage.signature(exit_code, exception, stack) == expect


def test_signature_differs_where_the_failure_does():
    other_frame = STACK.replace('model.py", line 12', 'model.py", line 13')
    a = triage.signature(1, "ValueError: bad batch 1", STACK)
    assert a != triage.signature(1, "KeyError: bad batch 1", STACK)
    assert a != triage.signature(1, "ValueError: bad batch 1", other_frame)
    assert a != triage.signature(1, "ValueError: bad input 1", STACK)


@pytest.mark.parametrize(
    "step, expect", [(0, "step 0"), (12, "step 12"), (-1, "before the first step"), (None, None)]
)
def test_at_step(step, expect):
    assert triage.at_step(step) == (expect or "before the first step")


@pytest.mark.parametrize(
    "exit_code, exception, oom_killed, expect",
    [
        (1, "ValueError: x", False, C.USER),
        (3, None, False, C.USER),
        (-signal.SIGSEGV, None, False, C.USER),  # a crash of its own
        (-signal.SIGKILL, None, False, C.KILLED),  # someone's kill -9
        (-signal.SIGTERM, None, False, C.KILLED),
        (-signal.SIGKILL, None, True, C.OOM),  # the OOM counters went up with it
        (128 + signal.SIGKILL, None, True, C.OOM),  # through a shell
        (137, None, False, C.KILLED),  # a shell whose child was killed -9
        (-signal.SIGTERM, None, True, C.KILLED),  # the OOM killer sends SIGKILL only
        (1, "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate", False, C.OOM),
        (1, "MemoryError", False, C.OOM),
        # a GPU fault named in the error file is the job's text: never the node's hardware
        # (the health check, which reads the driver's counters, decides that)
        (1, "RuntimeError: CUDA error: uncorrectable ECC error encountered", False, C.USER),
        (
            1,
            "RuntimeError: NCCL error: unhandled cuda error (run with NCCL_DEBUG=INFO)",
            False,
            C.USER,
        ),
        (1, "RuntimeError: NCCL Error 2: unhandled system error", False, C.USER),
        (1, "RuntimeError: GPU has fallen off the bus (Xid 79)", False, C.USER),
        (1, "RuntimeError: bad record: Xid 79 ECC error", False, C.USER),
        (1, "KeyError: 'xid'", False, C.USER),
        (-signal.SIGKILL, "RuntimeError: uncorrectable ECC error", True, C.OOM),
        (1, "ValueError: expected 3 channels", False, C.USER),
        # its DataLoader worker killed -9: someone's kill, or the OOM killer's (counters up)
        (
            1,
            "RuntimeError: DataLoader worker (pid 6352) is killed by signal: Killed. ",
            False,
            C.KILLED,
        ),
        (
            1,
            "RuntimeError: DataLoader worker (pid 6352) is killed by signal: Killed. ",
            True,
            C.OOM,
        ),
        (1, "RuntimeError: DataLoader worker (pid(s) 5438, 5439) exited unexpectedly", True, C.OOM),
        # no signal named, no OOM: as any error of the rank's
        (1, "RuntimeError: DataLoader worker (pid(s) 5438) exited unexpectedly", False, C.USER),
        # with the bootstrap's note of its exit status (worker/loader_exits.py), as the daemon
        # reads the error file's message: its line breaks escaped
        (
            1,
            "RuntimeError: DataLoader worker (pid(s) 5438) exited unexpectedly\\nDataLoader "
            "worker (pid 5438) is killed by signal: Killed. (elasticd: its exit status)",
            False,
            C.KILLED,
        ),
        (
            1,
            "RuntimeError: DataLoader worker (pid(s) 5438) exited unexpectedly\\nDataLoader "
            "worker (pid 5438) exited with code 3. (elasticd: its exit status)",
            False,
            C.USER,
        ),
        # a loader's own crash (a decoder's segfault, /dev/shm too small) is the code's
        (
            1,
            "RuntimeError: DataLoader worker (pid 12) is killed by signal: Segmentation fault.",
            False,
            C.USER,
        ),
        (
            1,
            "RuntimeError: DataLoader worker (pid 12) is killed by signal: Bus error. ",
            True,
            C.USER,
        ),
        (1, "ValueError: DataLoader worker (pid 12) is killed by signal: Killedx", False, C.USER),
    ],
)
def test_worker_failure_class(exit_code, exception, oom_killed, expect):
    assert triage.classify(exit_code, exception, oom_killed) is expect


def test_hung_is_hang_whatever_else():
    assert triage.classify(None, "ValueError: x", True, hung=True) is C.HANG


@pytest.mark.parametrize(
    "klass, judged",
    [(C.USER, True), (C.OOM, True), (C.HARDWARE, True), (C.HANG, False), (C.KILLED, False)],
)
def test_which_classes_the_repeat_rule_judges(klass, judged):
    assert triage.judged(klass) is judged


SIG = "ValueError: x at a.py:1 in f (step 5)"


@pytest.mark.parametrize(
    "previous, current, retries, expect",
    [
        (None, SIG, 1, (1, False)),  # a first failure
        ((SIG, 1), SIG, 1, (2, True)),  # its second occurrence: stop (the default)
        ((SIG, 1), SIG, 2, (2, False)),  # two identical retries allowed
        ((SIG, 2), SIG, 2, (3, True)),
        ((SIG, 1), SIG.replace("step 5", "step 6"), 1, (1, False)),  # another step: a new chain
        (("other", 4), SIG, 1, (1, False)),
        ((SIG, 7), SIG, 0, (8, False)),  # 0: never deterministic
        ((SIG, 1), "", 1, (0, False)),  # not judged (a hang, a node lost): the chain ends
        (None, None, 1, (0, False)),
    ],
)
def test_repeat_rule(previous, current, retries, expect):
    assert triage.repeats(previous, current, retries) == expect


@pytest.mark.parametrize(
    "previous, current, retries, expect",
    [
        (None, SIG, 1, (1, True)),  # its replay reproduced it: deterministic the first time
        (None, SIG, 3, (1, True)),  # whatever the retries allowed
        (None, SIG, 0, (1, False)),  # 0: never deterministic, the replay's verdict neither
        (None, "", 1, (0, False)),  # not judged: no verdict carries it
    ],
)
def test_a_reproduced_failure_is_deterministic_at_once(previous, current, retries, expect):
    assert triage.repeats(previous, current, retries, reproduced=True) == expect


def test_the_replays_verdict_travels_in_the_restart_request():
    why = Failure(RestartCause.CRASH, "exit 1", rank=1, signature=SIG, replayed="reproduced")
    reason = restart_request(why, "n1")
    assert reason["replayed"] == "reproduced"
    assert values.reason(__import__("json").dumps(reason)) == reason
    assert "replayed" not in restart_request(Failure(RestartCause.CRASH, "exit 1"), "n1")
    forged = __import__("json").dumps({**reason, "replayed": "yes"})
    assert values.reason(forged) is None  # only the verdicts elasticd writes


def test_every_cause_has_a_class_and_a_failure_keeps_the_one_given():
    for cause in RestartCause:
        assert Failure(cause, "x").failure_class in {c.value for c in C}
    assert Failure(RestartCause.CRASH, "x").failure_class == "user"
    assert Failure(RestartCause.HEALTH, "x").failure_class == "hardware"
    assert Failure(RestartCause.SIGNAL, "x", failure_class="oom").failure_class == "oom"


def test_the_class_and_signature_travel_in_the_restart_request():
    why = Failure(RestartCause.CRASH, "exit 1", rank=1, failure_class="oom", signature=SIG)
    reason = restart_request(why, "n1")
    assert (reason["class"], reason["sig"], reason["spends"]) == ("oom", SIG, True)
    assert values.reason(__import__("json").dumps(reason)) == reason
    assert values.reason('{"summary": "s", "sig": 3}') is None  # a signature is text
    assert values.reason('{"summary": "s", "class": []}') is None


@pytest.mark.parametrize(
    "extra, ok",
    [
        ({}, True),
        ({"sig": SIG, "repeats": 2, "deterministic": True, "failed": "why"}, True),
        ({"sig": 1}, False),
        ({"repeats": -1}, False),
        ({"repeats": "2"}, False),
        ({"deterministic": "yes"}, False),
    ],
)
def test_the_round_keeps_the_repeat_record(extra, ok):
    text = __import__("json").dumps({"members": [["n1", 1, "127.0.0.1"]], "lost": [], **extra})
    found = values.members(text)
    assert (found is not None) is ok
    if ok:
        assert found["sig"] == extra.get("sig", "")
        assert found["repeats"] == extra.get("repeats", 0)
        assert found["deterministic"] is extra.get("deterministic", False)


def test_oom_counters_read_from_kernel_files(tmp_path, monkeypatch):
    vmstat = tmp_path / "vmstat"
    vmstat.write_text("pgfault 10\noom_kill 4\n")
    monkeypatch.setattr(oom, "VMSTAT", vmstat)
    counters = oom.Counters([])
    assert counters.host == 4 and not counters.killed(12345)
    vmstat.write_text("pgfault 11\noom_kill 5\n")
    assert counters.killed(12345)  # the host's counter went up: an OOM kill somewhere
    events = tmp_path / "memory.events"
    events.write_text("low 0\nhigh 0\nmax 3\noom 1\noom_kill 1\n")
    assert oom._count(events) == 1
    assert oom._count(tmp_path / "missing") is None
    vmstat.write_text("garbage")
    assert oom.Counters([]).host is None and not oom.Counters([]).killed(1)


def test_the_worker_memory_cgroup_counter_decides_alone(tmp_path, monkeypatch):
    """A cgroup whose oom_kill went up calls a SIGKILL an OOM kill even where the host's counter
    cannot be read; one that did not, and no host counter, does not."""
    monkeypatch.setattr(oom, "VMSTAT", tmp_path / "no-vmstat")
    control = tmp_path / "memory.oom_control"
    control.write_text("oom_kill_disable 0\nunder_oom 0\noom_kill 2\n")
    monkeypatch.setattr(oom, "cgroup_counter", lambda pid: control)
    counters = oom.Counters([7, 8])
    assert not counters.killed(7)
    control.write_text("oom_kill_disable 0\nunder_oom 0\noom_kill 3\n")
    assert counters.killed(7) and counters.killed(8) and not counters.killed(9)


@pytest.mark.parametrize(
    "membership, v2_only, expect",
    [
        ("4:memory:/job/a\n0::/\n", False, "memory/job/a/memory.oom_control"),  # v1
        ("5:cpu,memory:/b\n", False, "memory/b/memory.oom_control"),
        (
            "1:cpu:/\n0::/system.slice/x.service\n",
            False,
            "unified/system.slice/x.service/memory.events",
        ),
        ("0::/user.slice\n", True, "user.slice/memory.events"),  # a v2-only host
        ("1:cpu:/\n", False, None),
        ("garbage", False, None),
    ],
)
def test_the_memory_cgroup_counter_file(tmp_path, membership, v2_only, expect):
    if v2_only:
        (tmp_path / "cgroup.controllers").write_text("memory\n")
    found = oom.counter_file(membership, tmp_path)
    assert found == (tmp_path / expect if expect else None)


def test_the_closing_judges_the_repeat_from_the_previous_closings_record():
    """cluster/closing.py on a single node's store: the previous round's members value carries
    the signature and count; the next closing continues the chain or starts a new one."""
    import json

    from elasticd import names
    from elasticd.cluster import closing
    from elasticd.cluster.rendezvous import Rendezvous
    from elasticd.config import Config

    rz = Rendezvous(Config())
    key = rz.round_key(1, names.MEMBERS)

    def closed_with(**record):
        value = json.dumps({"members": [["n", 1, "a"]], "lost": [], **record})
        rz.kv.set(key, rz.seal(key, value))

    closed_with(sig=SIG, repeats=1)  # round 0's failure, as round 1's closing recorded it
    found = closing._repeats(rz, 2, {"sig": SIG, "summary": "rank 0; boom"})
    assert found["deterministic"] and found["repeats"] == 2
    assert found["failed"].startswith(
        f"deterministic failure: the same failure ({SIG}) in attempts 1 and 2"
    )
    assert found["failed"].endswith("not restarted: rank 0; boom")
    assert closing._repeats(rz, 2, {"sig": "other"}) == {
        "sig": "other",
        "repeats": 1,
        "deterministic": False,
    }
    closed_with()  # round 1 closed after a node was lost: no record, a new chain
    assert closing._repeats(rz, 2, {"sig": SIG})["repeats"] == 1
    closed_with(sig=SIG, repeats=1)
    assert closing._repeats(rz, 2, {"sig": ""}) == {"sig": "", "repeats": 0, "deterministic": False}


GLOO_RESET = (
    "RuntimeError: [../third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed by "
    "peer [127.0.0.1]:37290. This is typically caused by a remote worker crashing."
)


@pytest.mark.parametrize(
    "text, expect",
    [
        (GLOO_RESET, True),
        ("RuntimeError: [pair.cc:534] Read error [10.0.0.2]:57368: Connection reset by peer", True),
        ("torch.distributed.DistNetworkError: failed to recv, got 0 bytes", True),
        ("RuntimeError: NCCL communicator was aborted on rank 3.", True),
        ("BrokenPipeError: [Errno 32] Broken pipe", True),
        ("ValueError: bad batch 17", False),
        ("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 20.00 MiB", False),
        ("RuntimeError: CUDA error: an illegal memory access was encountered", False),
        (None, False),
    ],
)
def test_a_consequence_is_known_by_its_text(text, expect):
    assert triage.consequence(text) is expect


@pytest.mark.parametrize(
    "failures, expect",
    [
        ([], []),
        ([(10.0, False)], [0]),
        ([(10.5, False), (10.0, False)], [1, 0]),  # by when they happened, not by rank
        # rank 0 died of the reset 0.4 s before rank 1's error was seen: rank 1's is the cause
        ([(10.0, True), (10.4, False)], [1, 0]),
        ([(10.0, True), (10.0 + triage.CLOCK_SLACK, False)], [1, 0]),  # at the slack's edge
        ([(10.0, True), (12.0, False)], [0, 1]),  # long after: the reset came first
        ([(10.0, True), (10.1, True)], [0, 1]),  # only consequences: the earliest
        ([(10.2, True), (10.3, False), (10.1, True), (10.25, False)], [3, 2, 0, 1]),
        ([(10.0, False), (10.0, False)], [0, 1]),  # a tie: in the order given
    ],
)
def test_the_first_failure_wins(failures, expect):
    assert triage.first(failures) == expect


def test_the_cause_names_rank_node_exception_and_frame_first():
    why = Failure(
        RestartCause.CRASH,
        "exit code 1",
        rank=1,
        node="b-2",
        exception="ValueError: bad batch 3",
        frame="train.py:40 in step",
        log_path="/l/rank1.log",
        consequences=("rank 0: RuntimeError: Connection closed by peer (+0.41 s)",),
    )
    assert why.summary() == (
        "rank 1 (node b-2); ValueError: bad batch 3 (train.py:40 in step); exit code 1; "
        "log /l/rank1.log; then rank 0: RuntimeError: Connection closed by peer (+0.41 s)"
    )
    assert Failure(RestartCause.SIGNAL, "killed by SIGKILL", rank=2).summary() == (
        "rank 2; killed by SIGKILL"
    )


def _request(at, consequence=False, spends=True):
    return {"summary": "s", "spends": spends, "at": at, "consequence": consequence}


def _lost(at):
    return {"summary": "node n; lost", "lost": ["n"], "at": at, "node": "a"}


@pytest.mark.parametrize(
    "ours, theirs, expect",
    [
        (_request(10.0), _request(10.5), True),  # ours came first
        (_request(10.5), _request(10.0), False),
        (_request(10.3), _request(10.0, consequence=True), True),  # theirs died of ours
        (_request(10.0, consequence=True), _request(10.3), False),
        (_request(10.0), {"summary": "s", "spends": True}, False),  # an older elasticd's: stays
        (_request(10.0), {"summary": "s", "lost": ["n"]}, False),  # a node lost: stays
        (_request(10.0, spends=False), _request(10.5), False),
        # a node lost (quiet since 10.0) takes the place of a death of its going
        (_lost(10.0), _request(10.3, consequence=True), True),
        (_lost(10.9), _request(10.3, consequence=True), True),  # within CLOCK_SLACK: clocks
        (_lost(11.5), _request(10.3, consequence=True), False),  # it died before: not of this
        (_lost(10.0), _request(10.3), False),  # a rank's own failure stays
        ({"summary": "s", "lost": ["n"]}, _request(10.3, consequence=True), False),  # no time
    ],
)
def test_a_restart_request_for_the_first_failure_takes_the_place(ours, theirs, expect):
    assert triage.comes_first(ours, theirs) is expect


def test_the_restart_request_says_when_and_whether_a_consequence():
    why = Failure(RestartCause.CRASH, "exit 1", rank=0, exception=GLOO_RESET, at=12.5)
    request = restart_request(why, "a")
    assert (request["at"], request["rank"], request["consequence"]) == (12.5, 0, True)
    assert values.reason(json.dumps(request)) == request
    for bad in ({"at": "soon"}, {"at": float("inf")}, {"rank": "1"}, {"consequence": 1}):
        assert values.reason(json.dumps({**request, **bad})) is None, bad


def test_a_failure_elsewhere_that_came_first_becomes_this_nodes_last():
    """Node a's rank 0 died of the closed connection; node b's request for rank 1's ValueError,
    0.3 s earlier, took the request's place: a's status shows rank 1's failure, its own a
    consequence; its own request, or a later one, changes nothing."""
    mine = Failure(
        RestartCause.CRASH, "exit code 1", rank=0, node="a", exception=GLOO_RESET, at=10.3
    )
    theirs = Failure(
        RestartCause.CRASH,
        "raised, exiting",
        rank=1,
        node="b",
        exception="ValueError: bad batch 3",
        frame="train.py:40 in step",
        at=10.0,
        signature="ValueError: bad batch N at train.py:40 in step (step 3)",
    )
    first = first_elsewhere(restart_request(theirs, "b"), mine)
    assert (first.rank, first.node, first.at, first.signature) == (1, "b", 10.0, theirs.signature)
    assert first.summary().startswith(
        "rank 1 (node b); ValueError: bad batch 3 (train.py:40 in step); raised, exiting; then "
        "rank 0 (node a): RuntimeError: [../third_party/gloo"
    ), first.summary()
    assert first_elsewhere(restart_request(mine, "a"), mine) is None  # ours
    later = dataclasses.replace(theirs, exception="ValueError: x", at=11.5)
    assert first_elsewhere(restart_request(later, "b"), mine) is None
    assert first_elsewhere(None, mine) is None


def test_a_node_lost_that_came_first_becomes_this_nodes_last():
    """Node a's rank 0 died of a closed connection at 10.3; node c saw node b go quiet at 10.0
    and its request took the place of a's: a's status names node b lost (class node_lost), its
    own rank a consequence. Where no request named it, the next round's closing finding b gone
    says as much."""
    mine = Failure(
        RestartCause.CRASH, "exit code 1", rank=0, node="a", exception=GLOO_RESET, at=10.3
    )
    seen = Failure(
        RestartCause.NODE_LOST,
        "lost: group rank 1 (rank 1) went silent for 0.6s; seen by node c",
        node="b-77-abc",
        lost=("b-77-abc",),
        at=10.0,
    )
    request = restart_request(seen, "c")
    assert request["lost"] == ["b-77-abc"] and request["at"] == 10.0
    assert values.reason(json.dumps(request)) == request
    first = first_elsewhere(request, mine)
    assert (first.kind, first.node, first.rank, first.lost) == (
        RestartCause.NODE_LOST,
        "b-77-abc",
        None,
        ("b-77-abc",),
    )
    assert first.failure_class == "node_lost" and first.at == 10.0
    assert first.summary().startswith(
        "node b-77-abc; lost: group rank 1 (rank 1) went silent for 0.6s; seen by node c; then "
        "rank 0 (node a): RuntimeError: [../third_party/gloo"
    ), first.summary()
    # no request named it (a's own stood), but the closing found b gone
    gone = first_elsewhere(restart_request(mine, "a"), mine, ["b-77-abc"])
    assert gone.summary().startswith("node b-77-abc; lost: never came back"), gone.summary()
    assert gone.failure_class == "node_lost"
    # a rank's own failure is never put on a node lost
    own = dataclasses.replace(mine, exception="ValueError: bad batch 3")
    assert first_elsewhere(restart_request(own, "a"), own, ["b-77-abc"]) is None
