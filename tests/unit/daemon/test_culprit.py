"""The hang's culprit (culprit.judge_hang) as a table: stack dumps in, verdict out."""

from __future__ import annotations

import dataclasses
import json

import pytest

from elasticd.daemon.culprit import Where, judge_hang, parse_summary, summary, where

SITE = "/usr/lib/python3.11/site-packages/torch"
BOOT = '  File "/opt/elasticd/elasticd/worker/bootstrap.py", line 198 in _run_as_main\n'


def dump(*frames: tuple[str, int, str], extra_thread: bool = False) -> str:
    """A faulthandler dump of all threads: a helper thread first, then the training thread."""
    text = "\n=== elasticd stack dump, rank 0, pid 1, now ===\n"
    if extra_thread:
        text += (
            "Thread 0x00007f0000000001 (most recent call first):\n"
            '  File "/usr/lib/python3.11/threading.py", line 320 in wait\n'
            '  File "/usr/lib/python3.11/threading.py", line 1002 in _bootstrap\n\n'
        )
    text += "Current thread 0x00007f0000000002 (most recent call first):\n"
    text += "".join(f'  File "{f}", line {n} in {fn}\n' for f, n, fn in frames) + BOOT
    return text


ALL_REDUCE = dump(
    (f"{SITE}/distributed/distributed_c10d.py", 3252, "all_reduce"),
    (f"{SITE}/distributed/c10d_logger.py", 83, "wrapper"),
    ("/srv/train.py", 56, "main"),
)
BACKWARD = dump(
    (f"{SITE}/autograd/graph.py", 829, "_engine_run_backward"),
    (f"{SITE}/autograd/__init__.py", 353, "backward"),
    ("/srv/train.py", 50, "main"),
)
SLEEP = dump(("/srv/train.py", 18, "read_batch"), ("/srv/train.py", 51, "main"))
LOCK = dump(
    ("/usr/lib/python3.11/threading.py", 327, "wait"),
    ("/srv/data.py", 9, "next_item"),
    ("/srv/train.py", 51, "main"),
)
RECV = dump(
    (f"{SITE}/distributed/distributed_c10d.py", 2700, "recv"),
    ("/srv/train.py", 54, "main"),
)
FSDP = dump(
    (f"{SITE}/distributed/fsdp/_runtime.py", 90, "_wait_for_the_others"),
    ("/srv/train.py", 50, "main"),
)
BARRIER = dump(
    (f"{SITE}/distributed/distributed_c10d.py", 4800, "barrier"),
    ("/srv/train.py", 60, "main"),
)
EXACT_WAIT = dump(  # exact mode's ordered sum, waiting on its isend/irecv (a Work's wait: C++)
    ("/srv/venv/lib/python3.11/site-packages/elasticd/exact.py", 243, "_wait"),
    ("/srv/venv/lib/python3.11/site-packages/elasticd/exact.py", 228, "_ordered"),
    ("/srv/train.py", 50, "main"),
)

# name, dumps by rank, culprits, collective waited in, words the text must hold
CASES = [
    ("one sleeper, one waiter", {0: ALL_REDUCE, 1: SLEEP}, (1,), "all_reduce", ["`read_batch`"]),
    (
        "one of 16 in a data read",
        {r: (SLEEP if r == 7 else ALL_REDUCE) for r in range(16)},
        (7,),
        "all_reduce",
        ["rank 7 was in `read_batch` (train.py:18) while 15 ranks waited in all_reduce"],
    ),
    (
        "a lock: the caller of threading's wait is named",
        {0: ALL_REDUCE, 1: ALL_REDUCE, 2: LOCK},
        (2,),
        "all_reduce",
        ["`next_item` (data.py:9)"],
    ),
    (
        "a different collective: a desync, the odd rank named",
        {0: ALL_REDUCE, 1: ALL_REDUCE, 2: RECV},
        (2,),
        "all_reduce",
        ["desync: rank 2 waited in recv while 2 ranks waited in all_reduce"],
    ),
    (
        "a rank in a data read named before one waiting in another collective (on it)",
        {0: ALL_REDUCE, 1: ALL_REDUCE, 2: RECV, 3: SLEEP},
        (3, 2),
        "all_reduce",
        ["rank 3 was in `read_batch` (train.py:18); rank 2 waited in recv while 2 ranks"],
    ),
    (
        "exact mode: a rank waiting on its messages waits with those in recv",
        {0: RECV, 1: EXACT_WAIT, 2: RECV, 3: SLEEP},
        (3,),
        "recv",
        ["rank 3 was in `read_batch` (train.py:18) while 3 ranks waited in recv"],
    ),
    (
        "DDP: the others wait in backward",
        {0: BACKWARD, 1: BACKWARD, 2: SLEEP},
        (2,),
        "backward",
        ["while 2 ranks waited in backward"],
    ),
    (
        "every rank in the same collective: no culprit",
        {0: ALL_REDUCE, 1: ALL_REDUCE},
        (),
        "all_reduce",
        ["every rank waited in all_reduce"],
    ),
    (
        "one in each of two collectives: a desync, no odd one",
        {0: RECV, 1: BARRIER},
        (),
        None,
        ["desync: ranks waited in different collectives, none is the odd one: 1 rank waited in"],
    ),
    (
        "two collectives tied, a rank elsewhere: it is the culprit",
        {0: RECV, 1: BARRIER, 2: SLEEP},
        (2,),
        "barrier",
        ["rank 2 was in `read_batch`"],
    ),
    (
        "nobody in a collective: the places, by how many ranks",
        {0: SLEEP, 1: LOCK, 2: SLEEP},
        (),
        None,
        ["no rank waited in a collective: 2 ranks in `read_batch` (train.py:18) (0, 2); 1 rank"],
    ),
    (
        "inside torch.distributed's own code: a wait on the others",
        {0: FSDP, 1: FSDP, 2: SLEEP},
        (2,),
        "torch.distributed's `_wait_for_the_others`",
        ["rank 2 was in `read_batch`"],
    ),
    (
        "a rank without a dump is left out and said",
        {0: ALL_REDUCE, 1: SLEEP, 2: None},
        (1,),
        "all_reduce",
        ["no stack from rank(s) 2"],
    ),
    (
        "a dump with no frame counts as none",
        {0: ALL_REDUCE, 1: SLEEP, 2: "\n=== elasticd stack dump ===\n"},
        (1,),
        "all_reduce",
        ["no stack from rank(s) 2"],
    ),
    ("no stacks at all", {}, (), None, ["no stacks to compare"]),
    (
        "many culprits: the first four named",
        {**{r: SLEEP for r in range(6)}, **{r: ALL_REDUCE for r in range(6, 20)}},
        (0, 1, 2, 3, 4, 5),
        "all_reduce",
        ["and 2 more while 14 ranks waited in all_reduce"],
    ),
]


@pytest.mark.parametrize(
    "dumps, culprits, waited_in, words", [c[1:] for c in CASES], ids=[c[0] for c in CASES]
)
def test_judge_hang(dumps, culprits, waited_in, words):
    verdict = judge_hang(dumps)
    assert verdict.culprits == culprits, verdict.text
    assert verdict.waited_in == waited_in, verdict.text
    for w in words:
        assert w in verdict.text, verdict.text


@pytest.mark.parametrize(
    "dumps, desync",
    [
        ({0: ALL_REDUCE, 1: ALL_REDUCE, 2: RECV}, True),
        ({0: RECV, 1: BARRIER}, True),
        ({0: ALL_REDUCE, 1: BARRIER, 2: ALL_REDUCE, 3: BARRIER, 4: BARRIER}, True),
        ({0: ALL_REDUCE, 1: SLEEP}, False),  # a rank elsewhere: a straggler, not a desync
        ({0: ALL_REDUCE, 1: RECV, 2: ALL_REDUCE, 3: SLEEP}, False),  # one culprit elsewhere
        ({0: ALL_REDUCE, 1: ALL_REDUCE}, False),
        ({0: SLEEP, 1: LOCK}, False),
    ],
)
def test_a_desync_is_named_as_one(dumps, desync):
    verdict = judge_hang(dumps)
    assert verdict.desync is desync, verdict.text
    assert verdict.text.startswith("desync: ") is desync, verdict.text


def test_the_training_thread_is_read_whatever_thread_got_the_signal():
    """The signal may land on a helper thread: the thread that runs the entrypoint (bootstrap's
    frames below it) is the one judged."""
    text = dump(("/srv/train.py", 18, "read_batch"), extra_thread=True).replace(
        "Current thread", "Thread"
    )
    text = text.replace("Thread 0x00007f0000000001", "Current thread 0x00007f0000000001")
    assert where(text).func == "read_batch"


def test_nodes_and_stack_files_are_named():
    ranks = {
        0: where(ALL_REDUCE, node="a-1-x", stacks="/l/rank0.stacks.txt"),
        1: where(SLEEP, node="b-2-y", stacks="/l/rank1.stacks.txt"),
    }
    text = judge_hang(ranks).text
    assert text.startswith("rank 1 (node b-2-y) was in `read_batch` (train.py:18)"), text
    assert "[stacks /l/rank1.stacks.txt]" in text


def test_summary_round_trip_and_hostile_forms():
    ranks = {3: where(SLEEP, node="n", stacks="/s"), 4: where(ALL_REDUCE, node="n", stacks="/t")}
    assert parse_summary(summary(ranks)) == ranks
    # each rank's idleness travels (True, False, or not known), and an older daemon's rows read
    told = {
        3: dataclasses.replace(ranks[3], idle=True),
        4: dataclasses.replace(ranks[4], idle=False),
    }
    told[5] = where(SLEEP, node="n")
    back = parse_summary(summary(told))
    assert [back[r].idle for r in (3, 4, 5)] == [True, False, None], back
    assert parse_summary('[[1, "", "f", "s", "n", "p", ""]]')[1].idle is None
    for bad in (
        "{}",
        "[[1]]",
        '[["1", "", "f", "s", "n", "p"]]',
        '[[true, "", "f", "s", "n", "p"]]',
        '[[-1, "", "f", "s", "n", "p"]]',
        json.dumps([[1, "", "f" * 400, "s", "n", "p"]]),
        json.dumps([[i, "", "f", "s", "n", "p"] for i in range(300)]),
        '[[1, "", "f", "s", "n", "p", "", "asleep"]]',
        '[[1, "", "f", "s", "n", "p", "", true]]',
    ):
        assert parse_summary(bad) is None, bad
    assert Where(None, "f", "s").label == "`f` (s)"
