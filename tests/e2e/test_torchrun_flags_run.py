"""torchrun's command line, as a whole, runs under `elasticd run`: every flag of torch's own
torchrun parser either does what it does under torchrun or gets one line saying what to give
instead; PET_* variables and ${local_rank} in the script's arguments work as torchrun reads them."""

from __future__ import annotations

import json
import os
import signal
import socket
import stat
import subprocess
import sys

import pytest

from elasticd.daemon import spawn
from harness import ROOT, assert_one_error, run_cli, script, wait_until


def test_torchtitan_launch_line_runs_as_is(daemons, tmp_path):
    """torchtitan's run_train.sh: --rdzv_endpoint localhost:0, --local-ranks-filter, --role, --tee,
    plus --rdzv-conf, --start-method and torchrun's ${local_rank} macro in the script's
    arguments."""
    out = tmp_path / "env.json"
    d = daemons(
        None,
        "--nproc_per_node=2",
        "--rdzv_backend",
        "c10d",
        "--rdzv_endpoint=localhost:0",
        "--local-ranks-filter",
        "1",
        "--role",
        "rank",
        "--tee",
        "3",
        "--start-method",
        "spawn",
        "--rdzv-conf",
        "join_timeout=30,keep_alive_interval=2",
        "-m",
        "tests.scripts.dump_env",
        str(out),
        "--local-rank=${local_rank}",
        "$$HOME",
    )
    assert d.wait(60) == 0, d.stderr()[-3000:]
    envs = sorted(
        (json.loads(line) for line in out.read_text().splitlines()), key=lambda e: int(e["RANK"])
    )
    assert [e["ROLE_NAME"] for e in envs] == ["rank", "rank"]
    assert [e["argv"][2:] for e in envs] == [
        ["--local-rank=0", "$HOME"],
        ["--local-rank=1", "$HOME"],
    ]
    assert envs[0]["TORCHELASTIC_RUN_ID"] not in (
        "none",
        "",
    )  # a job of its own: never another's checkpoints
    stdout = d.stdout()
    assert (
        "[rank1]: dumped rank 1" in stdout and "dumped rank 0" not in stdout
    )  # the filter: console only
    assert "dumped rank 0" in d.log_text(0) and "dumped rank 1" in d.log_text(1)


def test_redirected_ranks_stay_off_the_console(daemons, tmp_path):
    """-r/-t as torchrun takes them, and its --log-line-prefix-template for the lines."""
    out = tmp_path / "env.json"
    d = daemons(
        "tests.scripts.dump_env",
        "--nproc-per-node",
        "3",
        "-r",
        "3",
        "-t",
        "0:3,1:2",
        "--role",
        "r",
        "--log-line-prefix-template",
        "<${role_name}:${rank}:${local_rank}:${hostname}>",
        args=[str(out)],
    )
    assert d.wait(60) == 0, d.stderr()[-3000:]
    stdout = d.stdout()
    assert f"<r:0:0:{socket.gethostname()}>dumped rank 0" in stdout  # teed
    assert "dumped rank 1" not in stdout and "dumped rank 1" in d.log_text(1)  # stderr teed only
    assert "dumped rank 2" not in stdout and "dumped rank 2" in d.log_text(2)


def _program(tmp_path, body: str):
    path = tmp_path / "worker.sh"
    path.write_text("#!/bin/sh\n" + body)
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return path


def test_no_python_runs_an_executable_and_restarts_it(daemons, tmp_path):
    """--no-python: the worker becomes the program (same pid, environment, log); a failure restarts
    the group as for Python workers; the daemon's death still takes it (parent-death signal)."""
    out = tmp_path / "seen.txt"
    prog = _program(
        tmp_path,
        f'echo "$RANK $LOCAL_RANK $TORCHELASTIC_RESTART_COUNT $$ $PPID $*" >> {out}\n'
        'echo "ran rank $RANK"\n'
        '[ "$TORCHELASTIC_RESTART_COUNT" = 0 ] && [ "$RANK" = 1 ] && exit 5\n'
        "exit 0\n",
    )
    d = daemons(
        str(prog), "--no-python", "--nproc-per-node", "2", "--restart-grace", "1", args=["a b", "c"]
    )
    assert d.wait(60) == 0, d.stderr()[-3000:]
    rows = [line.split(" ", 5) for line in out.read_text().splitlines()]
    assert sorted((r[0], r[2]) for r in rows if r[2] == "1") == [
        ("0", "1"),
        ("1", "1"),
    ]  # restarted once
    assert all(r[4] == str(d.pid) and r[5] == "a b c" for r in rows), rows  # the daemon's own child
    causes = [
        e["cause"] for e in d.events() if e.get("event") == "state" and e.get("new") == "RESTARTING"
    ]
    assert len(causes) == 1 and "rank 1" in causes[0] and "exit code 5" in causes[0], causes
    assert "[rank1]: ran rank 1" in d.stdout()


def test_no_python_worker_dies_with_the_daemon(daemons, tmp_path):
    started = tmp_path / "started"
    prog = _program(tmp_path, f"echo $$ >> {started}\nexec sleep 600\n")
    d = daemons(str(prog), "--no-python", "--nproc-per-node", "1")
    pid = int(
        wait_until(
            lambda: started.exists() and started.read_text().strip(), 30, what="program started"
        )
    )
    d.kill(signal.SIGKILL)
    d.proc.wait(10)
    wait_until(
        lambda: (
            not os.path.exists(f"/proc/{pid}") or open(f"/proc/{pid}/stat").read().split()[2] == "Z"
        ),
        10,
        what="the program gone with its daemon",
    )


def test_virtual_local_rank_gives_each_worker_its_own_device(daemons, tmp_path):
    out = tmp_path / "env.json"
    d = daemons(
        "tests.scripts.dump_env",
        "--nproc-per-node",
        "2",
        "--virtual-local-rank",
        args=[str(out)],
        env={"CUDA_VISIBLE_DEVICES": "5,7"},
    )
    assert d.wait(60) == 0, d.stderr()[-3000:]
    envs = {e["RANK"]: e for e in map(json.loads, out.read_text().splitlines())}
    assert [(envs[r]["LOCAL_RANK"], envs[r]["CUDA_VISIBLE_DEVICES"]) for r in ("0", "1")] == [
        ("0", "5"),
        ("0", "7"),
    ]
    # each still has its own in-memory slots (named by the real local rank)
    assert [envs[r]["ELASTICD_LOCAL_RANK"] for r in ("0", "1")] == ["0", "1"]


@pytest.mark.parametrize(
    "sig, flags",
    [(signal.SIGQUIT, ()), (signal.SIGUSR2, ("--signals-to-handle", "SIGTERM,SIGUSR2"))],
    ids=["SIGQUIT-default", "SIGUSR2-given"],
)
def test_handled_signals_stop_the_job_gracefully(daemons, sig, flags):
    d = daemons(
        script("faulty.py"),
        "--nproc-per-node",
        "2",
        "--stop-grace",
        "5",
        *flags,
        args=["--steps", "100000", "--step-time", "0.05"],
    )
    d.wait_for_step(1, 2, timeout=60)
    d.kill(sig)
    assert d.wait(60) == 0, d.stderr()[-3000:]
    stops = [e for e in d.events() if e.get("event") == "stop_requested"]
    assert stops and stops[0]["why"] == f"signal {signal.Signals(sig).name}"
    assert [e["new"] for e in d.events() if e.get("event") == "state"][-1] == "STOPPED"


@pytest.mark.parametrize(
    "args, needles",
    [
        (["--start-method", "thread"], ["--start-method thread", "spawn, fork or forkserver"]),
        (["--numa-binding", "node"], ["--numa-binding node", "does not bind", "numactl"]),
        (["--logs-specs", "mine"], ["--logs-specs mine", "rankR.log"]),
        (["--rdzv-conf", "timeout=5"], ["rdzv_conf in --rdzv-conf key 'timeout'", "join_timeout"]),
        (["--redirects", "4"], ["-r/--redirects '4'", "0 (none)"]),
        (["--tee", "0:x"], ["-t/--tee '0:x'"]),
        (["--signals-to-handle", "SIGKILL"], ["SIGKILL cannot stop the daemon gracefully"]),
        (["--signals-to-handle", "SIGFOO"], ["'SIGFOO' is not a signal name"]),
        (["--no-python"], ["--no-python: entrypoint 'entrypoints.train' is not an executable"]),
        (
            ["--no-python", "-m", "tests.scripts.dump_env"],
            ["--no-python and -m cannot go together"],
        ),
        (["--nnodes", "2", "--rdzv-endpoint", "localhost:0"], ["a fixed port"]),
    ],
)
def test_torchrun_flags_bad_input(args, needles, tmp_path):
    assert_one_error(
        run_cli("run", "--log-dir", str(tmp_path), "--socket", str(tmp_path / "s"), *args), *needles
    )


def test_virtual_local_rank_needs_a_gpu_per_worker(tmp_path):
    r = run_cli(
        "run",
        "--log-dir",
        str(tmp_path),
        "--nproc-per-node",
        "2",
        "--virtual-local-rank",
        script("faulty.py"),
        env={"CUDA_VISIBLE_DEVICES": "3"},
    )
    assert_one_error(r, "--virtual-local-rank with 2 workers", "CUDA_VISIBLE_DEVICES=3")


def test_run_path_takes_a_script_without_py(tmp_path):
    (tmp_path / "train").write_text(
        "import os, sys\nopen(sys.argv[1], 'a').write(os.environ['RANK'] + '\\n')\n"
    )
    # run from tmp_path (where "train" is), yet with this checkout's elasticd: the interpreter's
    # current directory no longer finds it first, an installed one elsewhere would be run instead
    here = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    r = run_cli(
        "run",
        "--log-dir",
        str(tmp_path / "logs"),
        "--socket",
        str(tmp_path / "s"),
        "--run-path",
        "--nproc-per-node",
        "2",
        "train",
        str(tmp_path / "ranks"),
        cwd=tmp_path,
        env={"PYTHONPATH": here},
    )
    assert r.returncode == 0, r.stderr[-3000:]
    assert sorted((tmp_path / "ranks").read_text().split()) == ["0", "1"]


# What a worker sees that differs from torchrun's, each for a reason docs/running.md ("What the
# workers see") gives; everything else must be equal, variable by variable.
DIFFERENT_VALUE = {
    "MASTER_PORT": "a free port each, chosen at run time",
    "TORCHELASTIC_RUN_ID": "a random id each (no --rdzv-id)",
    "TORCHELASTIC_ERROR_FILE": "under each launcher's own log directory",
}
# What elasticd adds that torchrun does not give, with its value (docs/running.md too)
ADDED = {"THP_MEM_ALLOC_ENABLE": "1"}  # torch's CPU allocator on huge pages (worker_defaults)


def _observed(launchers: dict[str, list[str]], tmp_path) -> dict[str, dict[str, dict]]:
    """tests/scripts/parity.py's records by launcher, then by rank, each launcher running it with
    2 workers, the environment without PYTHONUNBUFFERED (this machine's tests set it). The runs
    are independent (each its own output and log directory): they go side by side."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}
    runs = {}
    for how, launcher in launchers.items():
        cmd = [*launcher, "--nproc-per-node", "2", "--max-restarts", "2"]
        cmd += [script("parity.py"), str(tmp_path / f"{how}.json"), "2"]
        with open(tmp_path / f"{how}.out", "w") as out, open(tmp_path / f"{how}.err", "w") as err:
            runs[how] = (cmd, subprocess.Popen(cmd, stdout=out, stderr=err, cwd=ROOT, env=env))
    try:
        for how, (cmd, proc) in runs.items():
            code = proc.wait(120)
            assert code == 0, (cmd, (tmp_path / f"{how}.err").read_text()[-3000:])
    finally:
        for _cmd, proc in runs.values():
            proc.kill()
            proc.wait()
    return {
        how: {e["env"]["RANK"]: e for e in map(json.loads, (tmp_path / f"{how}.json").open())}
        for how in launchers
    }


def _compare_env(how: str, ours: dict, theirs: dict) -> None:
    loopback = spawn.master_name("127.0.0.1") != "127.0.0.1"
    for key in sorted(set(theirs) | set(ours)):
        if key.startswith("ELASTICD_") and key not in theirs:
            continue  # our own features' variables
        if key in ADDED and key not in theirs:
            assert ours.get(key) == ADDED[key], (how, key, ours.get(key))
            continue
        if key == "MASTER_ADDR" and not loopback:  # this host's name leads elsewhere: documented
            assert ours[key] == "127.0.0.1", ours[key]
        elif key in DIFFERENT_VALUE:
            assert key in ours and key in theirs, (how, key)
        else:
            assert ours.get(key) == theirs.get(key), (how, key, ours.get(key), theirs.get(key))


def test_workers_observe_what_torchrun_gives(tmp_path):
    """The same script under real torchrun (--standalone), elasticd's warm spares and
    --no-warm-spawn: every variable torchrun gives with its value (but an allowlist of documented
    differences) and nothing more but ELASTICD_* and ADDED's, so no PYTHONUNBUFFERED for the
    script's own children; argv, sys.orig_argv, sys.flags (but -P's safe_path), -u's unbuffered
    stdout; and torch's threads from OMP_NUM_THREADS set before `import torch` (issue 31: a warm
    spare had imported torch already), and not from one set after it; torch's unseeded generator
    different in every worker."""
    elasticd = [sys.executable, "-m", "elasticd", "run", "--log-dir"]
    runs = _observed(
        {
            "torchrun": [sys.executable, "-m", "torch.distributed.run", "--standalone"],
            "warm": [*elasticd, str(tmp_path / "w")],
            "cold": [*elasticd, str(tmp_path / "c"), "--no-warm-spawn"],
        },
        tmp_path,
    )
    path = script("parity.py")
    for rank, theirs in runs["torchrun"].items():
        if len(os.sched_getaffinity(0)) >= 2:  # the premise: torch takes what was set before
            assert theirs["threads"][:2] == ([2, 2] if rank == "0" else [1, 1])
        for how in ("warm", "cold"):
            ours = runs[how][rank]
            _compare_env(how, ours["env"], theirs["env"])
            assert "PYTHONUNBUFFERED" not in ours["env"]
            assert (
                ours["orig_argv"][:-2] == [sys.executable, "-u", path] == theirs["orig_argv"][:-2]
            )
            assert ours["argv"][0] == path == theirs["argv"][0]
            for fact in ("stdout_write_through", "path0", "name", "threads"):
                assert ours[fact] == theirs[fact], (how, rank, fact, ours[fact], theirs[fact])
            # sys.flags as torchrun's but -P's, which keeps the working directory off the path
            # of elasticd's imports (worker/proctitle.py)
            safe = type(sys.flags).__match_args__.index("safe_path")
            assert ours["flags"][safe] == 1 and theirs["flags"][safe] == 0
            ours["flags"][safe] = 0
            assert ours["flags"] == theirs["flags"], (how, rank, ours["flags"], theirs["flags"])
    # torch's unseeded generator draws differently in every worker, as in fresh processes (a spare
    # forked from the fork server reseeds it); str hashing too, but in the spares of one server
    for how, ranks in runs.items():
        seeds = [ranks[r]["seeds"] for r in ("0", "1")]
        assert seeds[0][:2] != seeds[1][:2] and seeds[0][0] != seeds[1][0], (how, seeds)
        assert (seeds[0][2] == seeds[1][2]) == (how == "warm"), (how, seeds)
