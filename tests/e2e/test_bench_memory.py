"""bench/memory.py end to end, one worker, a second after its first step: every process of each
launcher's tree is read and named (elasticd: daemon, death guard, fork server, warm spare,
worker; torchrun: agent, worker), with figures that make sense."""

from __future__ import annotations

import json

import pytest
import torch
import torch.distributed as dist

from harness import bench


def test_memory_bench_names_every_process_of_both_launchers():
    args = ("--nproc", "1", "--settle", "1", "--timeout", "60", "--json")
    r = bench("memory.py", *args, timeout=180)
    got = json.loads(r.stdout.splitlines()[-1])
    ours, theirs = got["elasticd"]["processes"], got["torchrun"]["processes"]
    assert set(ours) == {"launcher", "guard", "fork server", "spare", "worker"}, ours
    assert set(theirs) == {"launcher", "worker"}, theirs
    assert len(ours["worker"]) == len(theirs["worker"]) == 1
    for launcher in got.values():
        rows = [row for rows in launcher["processes"].values() for row in rows]
        assert all(0 < row["uss"] <= row["pss"] <= row["rss"] for row in rows), rows
        assert launcher["total"]["pss"] == sum(row["pss"] for row in rows)
    assert "ratio elasticd/torchrun" in r.stderr


@pytest.mark.skipif(
    not hasattr(dist, "_reconfigure"),
    reason=f"torch {torch.__version__} cannot re-form a group in place (needs torch>=2.14)",
)
def test_memory_bench_runs_the_in_place_path_beside_today_s_and_torchrun():
    """--in-place auto beside --in-place off and torchrun in one run: the daemon took the path
    each column names, and its tree is read and named like today's."""
    args = ("--nproc", "1", "--settle", "1", "--timeout", "60", "--json")
    args += ("--launchers", "elasticd,elasticd-in-place,torchrun")
    r = bench("memory.py", *args, timeout=240)
    got = json.loads(r.stdout.splitlines()[-1])
    assert (got["elasticd"]["path"], got["elasticd-in-place"]["path"]) == ("restart", "in_place")
    assert got["torchrun"]["path"] is None
    ours = got["elasticd-in-place"]["processes"]
    assert set(ours) == {"launcher", "guard", "fork server", "spare", "worker"}, ours
    assert "ratio elasticd-in-place/torchrun" in r.stderr
    assert "elasticd-in-place - elasticd, PSS" in r.stderr
