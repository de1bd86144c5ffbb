"""elasticd's own collective hook (where torch's Flight Recorder is off) counts a group's
collectives from 1 again once the group re-forms in place: a survivor counting on would be
judged against its replacement's count ("never arrived at seq 9" for a fault at seq 3)."""

from __future__ import annotations

import json
import multiprocessing
import os
from datetime import timedelta

_fork = multiprocessing.get_context("fork")


def _rank(store: str, out: str) -> None:
    code = 1
    try:
        import torch
        import torch.distributed as dist

        from elasticd.worker import collective_hook

        assert collective_hook.install()
        dist.init_process_group(
            "gloo", init_method=f"file://{store}", rank=0, world_size=1,
            timeout=timedelta(seconds=20),
        )  # fmt: skip
        t = torch.ones(3)
        for _ in range(3):
            dist.all_reduce(t)
        before = json.loads(collective_hook.dump())["pg_status"]
        collective_hook.reset()  # what Member.form does at each generation re-formed
        dist.all_reduce(t)
        after = json.loads(collective_hook.dump())["pg_status"]
        with open(out, "w") as f:
            json.dump({"before": before, "after": after}, f)
        code = 0
    finally:
        os._exit(code)


def test_a_group_re_formed_counts_its_collectives_from_one_again(tmp_path):
    out = tmp_path / "out.json"
    p = _fork.Process(target=_rank, args=(str(tmp_path / "store"), str(out)))
    p.start()
    p.join(60)
    assert p.exitcode == 0
    seen = json.loads(out.read_text())
    assert [g["last_enqueued_collective"] for g in seen["before"].values()] == [3]
    assert [g["last_enqueued_collective"] for g in seen["after"].values()] == [1]


def test_a_work_that_cannot_say_is_done_only_once_the_rank_went_on_past_it():
    """NCCL's Work on torch 2.11 unboxes to None (seen on an H200): the newest such op is one
    the rank may wait in, never one it finished (taken as done, a rank waiting in it read idle
    and the hang lost its culprit); one it went on past is done."""
    import torch

    from elasticd.worker import collective_hook

    collective_hook.reset()
    try:
        for _ in range(2):
            entry = collective_hook._note("all_reduce", torch.ones(1), None)  # no group: "0"
            entry["work"] = object()  # a Work that does not unbox
        status = json.loads(collective_hook.dump())["pg_status"]["0"]
        assert status == {"last_enqueued_collective": 2, "last_completed_collective": 1}, status
    finally:
        collective_hook.reset()
