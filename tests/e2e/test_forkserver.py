"""Warm spares forked from the fork server: a refill costs a fork, not an interpreter importing
torch; where forking is unsafe the daemon falls back to fresh-interpreter spares."""

from __future__ import annotations

import json
import os
import re
import signal
import sys

import psutil
import pytest

from harness import FAST_STOP5 as FAST
from harness import RESTART, script, wait_until


def _forked_spares(daemon_pid: int, workers: set[int]) -> set[int]:
    """Children of the daemon forked from the fork server (torch mapped, next to no CPU of their
    own: a fresh interpreter spends a second or more of CPU importing torch) that are no worker."""
    found = set()
    for p in psutil.Process(daemon_pid).children():
        try:
            if p.pid in workers or "elasticd.worker.forkserver" not in " ".join(p.cmdline()):
                continue
            cpu = p.cpu_times()
            torch_mapped = any("libtorch" in m.path for m in p.memory_maps())
        except psutil.Error:
            continue
        if torch_mapped and cpu.user + cpu.system < 0.5:
            found.add(p.pid)
    return found


def _training_with_spares(daemons, tmp_path):
    """A 2-worker job training, its workers (rank -> pid) and its two forked spares."""
    d = daemons(
        script("ddp_tutorial.py"),
        *RESTART,  # the restart's spares
        "--nproc-per-node",
        "2",
        "--max-restarts",
        "2",
        *FAST,
        args=["--steps", "100000", "--step-time", "0.02", "--snapshot", str(tmp_path / "snap.pt")],
    )
    d.wait_for_step(1, 3, timeout=60)
    first = d.worker_pids()
    # the fork server learns the workers' imports, then replaces the spares forked before
    learned = wait_until(
        lambda: [e for e in d.events() if e.get("event") == "preload_learned"],
        60,
        what="the imports learned",
    )
    replaced = set(learned[0]["replaced"])
    spares = wait_until(
        lambda: s if len(s := _forked_spares(d.pid, set(first.values())) - replaced) == 2 else None,
        15,
        what="two forked spares after the imports were learned",
    )
    return d, first, spares


def test_restart_takes_forked_spares_and_refills_with_forks(daemons, tmp_path):
    d, first, spares = _training_with_spares(daemons, tmp_path)
    os.kill(first[1], signal.SIGKILL)
    wait_until(lambda: len(d.attempt_dirs()) == 2, 30, what="the restart")
    for rank in (0, 1):
        wait_until(
            lambda: re.search(r"^step \d+", d.log_text(rank, 2), re.M),
            60,
            what=f"rank {rank} training after the restart",
        )
    second = d.worker_pids()
    assert set(second.values()) == spares  # the ranks went to the waiting spares
    for pid in second.values():
        assert psutil.Process(pid).ppid() == d.pid
    # the refill is two more forks, ready within seconds, while the workers train
    wait_until(
        lambda: len(_forked_spares(d.pid, set(second.values())) - spares) == 2,
        15,
        what="two new forked spares after the restart",
    )
    assert not [e for e in d.events() if e.get("event") == "fork_server_off"]
    d.kill(signal.SIGTERM)
    assert d.wait(60) == 0, d.stderr()[-3000:]


def test_fork_server_with_threads_falls_back_to_fresh_spares(daemons, tmp_path):
    # A preloaded module that starts a thread: no fork from there.
    out = tmp_path / "env.json"
    d = daemons(
        "tests.scripts.dump_env",
        "--nproc-per-node",
        "2",
        "--preload",
        "torch,thread_at_import",
        args=[str(out)],
        env={"PYTHONPATH": os.path.dirname(script("thread_at_import.py"))},
    )
    assert d.wait(90) == 0, d.stderr()[-3000:]
    off = [e for e in d.events() if e.get("event") == "fork_server_off"]
    assert len(off) == 1 and "started 1 thread(s)" in off[0]["reason"], off
    envs = [json.loads(line) for line in out.read_text().splitlines()]
    assert sorted(int(e["RANK"]) for e in envs) == [0, 1]
    assert all(e["facts"]["ppid"] == d.pid for e in envs)
    shown = "\0".join([sys.executable, "-u", "-m", "tests.scripts.dump_env", str(out)]) + "\0"
    assert all(e["facts"]["cmdline"] == shown for e in envs)  # fresh spares show the script too


def test_fork_server_killed_falls_back_and_restarts_still_work(daemons, tmp_path):
    d, first, spares = _training_with_spares(daemons, tmp_path)
    server = [
        p
        for p in psutil.Process(d.pid).children()
        if "elasticd.worker.forkserver" in " ".join(p.cmdline())
        and p.pid not in spares
        and p.pid not in first.values()
    ]
    assert len(server) == 1
    server[0].kill()
    wait_until(
        lambda: [e for e in d.events() if e.get("event") == "fork_server_died"],
        15,
        what="the daemon noticing the fork server is gone",
    )
    os.kill(first[0], signal.SIGKILL)
    wait_until(lambda: len(d.attempt_dirs()) == 2, 30, what="the restart")
    for rank in (0, 1):
        wait_until(
            lambda: re.search(r"^step \d+", d.log_text(rank, 2), re.M),
            90,
            what=f"rank {rank} training after the restart",
        )
    d.kill(signal.SIGTERM)
    assert d.wait(60) == 0, d.stderr()[-3000:]


@pytest.mark.parametrize(
    "nproc, omp", [("1", None), ("2", "2")], ids=["one worker, OMP unset", "OMP_NUM_THREADS=2"]
)
def test_spares_forked_despite_openblas_pool_size_threads_as_cold_workers(
    daemons, tmp_path, monkeypatch, nproc, omp
):
    """One worker per node leaves OMP_NUM_THREADS unset (as torchrun does), and then numpy's
    OpenBLAS starts a pool of threads when the fork server imports torch: the server still forks
    (it ends that idle pool), and its workers size their thread pools exactly as cold ones do."""
    for var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
        monkeypatch.delenv(var, raising=False)
    got = {}
    for mode, flags in (("warm", ()), ("cold", ("--no-warm-spawn",))):
        out = tmp_path / f"{mode}.json"
        d = daemons(
            script("thread_settings.py"),
            "--nproc-per-node",
            nproc,
            *flags,
            name=mode,
            args=[str(out)],
            env={"OMP_NUM_THREADS": omp} if omp else {},
        )
        assert d.wait(90) == 0, d.stderr()[-3000:]
        assert not [e for e in d.events() if e.get("event") == "fork_server_off"], d.stderr()[
            -3000:
        ]
        got[mode] = sorted(
            (json.loads(line) for line in out.read_text().splitlines()), key=lambda r: r["rank"]
        )
    assert got["warm"] == got["cold"]
    assert [r["omp"] for r in got["warm"]] == [omp] * int(nproc)
    if (os.cpu_count() or 1) > 1:
        assert all(r["openblas"] and r["openblas"][0] > 1 for r in got["warm"]), (
            got
        )  # a pool the server had to end
