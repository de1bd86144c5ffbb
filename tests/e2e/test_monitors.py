"""What the tools and people around a job see of it (real daemons and workers, gloo on CPU): the
rank's environment in /proc/PID/environ whichever way a worker started, one JSON document from
`status --json` with two jobs on the node, steps lost said as unknown where elasticd cannot tell,
and the console as torchrun's."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import urllib.request
from pathlib import Path

from harness import FAST, ROOT, free_port, run_cli, script, wait_until

RANK_VARIABLES = (
    "RANK",
    "LOCAL_RANK",
    "GROUP_RANK",
    "WORLD_SIZE",
    "LOCAL_WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
    "TORCHELASTIC_RUN_ID",
    "TORCHELASTIC_RESTART_COUNT",
)


def environ(pid: int) -> dict[str, str]:
    """/proc/PID/environ as a monitor reads it, from outside the process."""
    with open(f"/proc/{pid}/environ", "rb") as f:
        entries = f.read().split(b"\0")
    return dict(e.decode(errors="replace").partition("=")[::2] for e in entries if b"=" in e)


def test_status_json_with_two_jobs(daemons, tmp_path):
    """Two daemons of two jobs found by the CLI at once: --json prints one document (a list,
    each job's object with its socket), --rdzv-id picks one, plain status names each job."""
    runtime = tmp_path / "runtime"
    runtime.mkdir(mode=0o700)
    sockets = [runtime / "control.sock", runtime / "control-jobB.sock"]
    jobs = [
        daemons(
            script("silent.py"),
            *FAST,
            "--rdzv-id",
            job,
            "--socket",
            str(sock),
            name=job,
            args=["60"],
        )
        for job, sock in zip(("jobA", "jobB"), sockets)
    ]
    for d, sock in zip(jobs, sockets):
        d.socket = sock  # the later --socket wins
        wait_until(lambda d=d: '"RUNNING"' in d.status("--json").stdout, 60, what="RUNNING")
    env = {"RUNTIME_DIRECTORY": str(runtime)}  # where find_daemons looks first
    r = run_cli("status", "--json", env=env, timeout=30)
    assert r.returncode == 0, r.stderr
    docs = json.loads(r.stdout)  # one document: json.loads fails on two
    assert isinstance(docs, list)
    mine = {d["socket"]: d["run_id"] for d in docs if d.get("socket") in map(str, sockets)}
    assert mine == {str(sockets[0]): "jobA", str(sockets[1]): "jobB"}, r.stdout[:2000]
    one = run_cli("status", "--json", "--rdzv-id", "jobB", env=env, timeout=30)
    assert one.returncode == 0, one.stderr
    assert json.loads(one.stdout)["run_id"] == "jobB"
    none = run_cli("status", "--rdzv-id", "jobC", env=env, timeout=30)
    assert none.returncode == 2 and "jobC" in none.stderr and "jobA" in none.stderr
    plain = run_cli("status", env=env, timeout=30).stdout
    sections = {part.split(" ==")[0]: part for part in plain.split("== job ")[1:]}
    assert {"jobA", "jobB"} <= set(sections), plain
    assert all(f"run {job} " in sections[job] for job in ("jobA", "jobB")), plain
    stop = run_cli("stop", "--rdzv-id", "jobA", env=env, timeout=60)
    assert stop.returncode == 0, stop.stderr
    assert jobs[0].wait(30) == 0
    assert jobs[1].proc.poll() is None  # the other job goes on
    jobs[1].kill(signal.SIGTERM)
    jobs[1].wait(30)


def _torch_mapped(pid: int) -> bool:
    """Whether torch's library is loaded in the process: silent.py never imports it, so only a
    worker that was a warm spare has it."""
    return "libtorch" in Path(f"/proc/{pid}/maps").read_text()


def test_environ_of_warm_and_cold_workers(daemons):
    """/proc/PID/environ read from outside, as psutil, exporters and operators read it: a worker
    handed its rank as a warm spare shows the rank's environment, exactly as a cold one does."""
    seen = {}
    for how, flags in (("warm", ()), ("cold", ("--no-warm-spawn",))):
        d = daemons(
            script("silent.py"),
            *FAST,
            *flags,
            "--nproc-per-node",
            "2",
            "--rdzv-id",
            f"env-{how}",
            name=how,
            args=["60"],
        )
        pids = wait_until(lambda d=d: len(d.worker_pids()) == 2 and d.worker_pids(), 60, what="2")
        wait_until(lambda: all(_rank_shown(p) for p in pids.values()), 10, what="environ")
        seen[how] = {rank: (environ(pid), _torch_mapped(pid)) for rank, pid in pids.items()}
        d.kill(signal.SIGTERM)
        assert d.wait(30) == 0
        # the kernel let the spares move their environment: no line says it would not
        assert not [e for e in d.events() if e.get("event") == "worker_environ_hidden"]
    for how, ranks in seen.items():
        for rank, (env, torch_loaded) in ranks.items():
            assert torch_loaded == (how == "warm"), (how, rank)
            assert env.get("RANK") == str(rank) and env.get("LOCAL_RANK") == str(rank), env
            assert env.get("WORLD_SIZE") == "2" and env.get("LOCAL_WORLD_SIZE") == "2"
            assert env.get("TORCHELASTIC_RUN_ID") == f"env-{how}"
            assert all(env.get(k) for k in RANK_VARIABLES), (how, rank, env)
            assert "ELASTICD_WARM_PRELOAD" not in env  # the spare's own variable is gone
    for rank in (0, 1):  # the same variables, whichever way the worker started
        assert set(seen["warm"][rank][0]) == set(seen["cold"][rank][0])


def _rank_shown(pid: int) -> bool:
    try:
        return "RANK" in environ(pid)
    except OSError:
        return False


def test_steps_lost_unknown_for_a_plain_script(daemons):
    """A torchrun script that keeps no checkpoint elasticd can see starts again from step 0
    after a kill -9: steps lost and goodput are unknown in status, and absent from /metrics
    (not 0, not a ratio that counts the steps done again as productive)."""
    port = free_port()
    d = daemons(
        script("ddp_tutorial.py"),
        *FAST,
        "--nproc-per-node",
        "2",
        "--metrics-address",
        f"127.0.0.1:{port}",
        args=["--steps", "100000", "--step-time", "0.05"],  # no --snapshot: nothing kept
    )
    d.wait_for_step(1, 15, timeout=90)
    os.kill(d.worker_pids()[1], signal.SIGKILL)
    wait_until(lambda: any(e.get("event") == "recovered" for e in d.events()), 60, what="recovery")
    s = json.loads(d.status("--json").stdout)
    assert s["steps_lost"] == {"total": None, "last": None, "unknown": 1}, s["steps_lost"]
    assert s["goodput"]["ratio"] is None and s["goodput"]["productive_seconds"] is None
    assert s["goodput"]["lost_seconds"] is None and s["goodput"]["wall_seconds"] > 0
    plain = d.status().stdout
    assert "goodput unknown" in plain and "steps lost unknown" in plain, plain
    assert "steps lost 0" not in plain
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        metrics = r.read().decode()
    samples = {m.group(1) for m in re.finditer(r"^(elasticd_\w+?)(?:\{|\s)", metrics, re.M)}
    assert "elasticd_steps_lost_unknown_total" in samples and "elasticd_restarts_total" in samples
    for absent in ("elasticd_steps_lost_total", "elasticd_goodput_ratio", "elasticd_lost_seconds"):
        assert absent not in samples, absent
    d.kill(signal.SIGTERM)
    assert d.wait(60) == 0


def test_runs_go_to_the_state_directory_not_the_checkout(tmp_path):
    """`elasticd run` in a user's checkout without --log-dir: the run is written under the XDG
    state directory and the daemon says where at its start; the checkout stays as it was."""
    checkout, state = tmp_path / "checkout", tmp_path / "state"
    (checkout / ".git").mkdir(parents=True)
    (checkout / "train.py").write_text("print('trained', flush=True)\n")
    before = sorted(os.listdir(checkout))
    env = dict(os.environ, XDG_STATE_HOME=str(state), PYTHONPATH=str(ROOT))
    env.pop("LOGS_DIRECTORY", None)
    r = subprocess.run(
        [sys.executable, "-m", "elasticd", "run", "--socket", str(tmp_path / "c.sock")]
        + ["--log-format", "json", "--rdzv-id", "xdg", "train.py"],
        cwd=checkout,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    assert "[rank0]: trained" in r.stdout
    assert sorted(os.listdir(checkout)) == before  # no elasticd-runs/ in the checkout
    started = [json.loads(ln) for ln in r.stderr.splitlines() if '"daemon_started"' in ln]
    run_dir = Path(started[0]["run_dir"])
    assert run_dir.parent == (state / "elasticd").resolve() and run_dir.name.startswith("xdg-")
    assert "trained" in (run_dir / "attempt1" / "rank0.log").read_text()


def test_console_streams_and_prefixes_as_torchrun(daemons):
    """Workers' stdout on the daemon's stdout and their stderr (warnings, tracebacks) on its
    stderr, so `2>/dev/null` hides them as under torchrun; a traceback torch's excepthook already
    prefixed with `[rank1]: ` is not prefixed twice; every echoed line is one rank's, whole."""
    d = daemons(script("console_parity.py"), *FAST, "--nproc-per-node", "2", "--max-restarts", "0")
    assert d.wait(120) == 1, d.stderr()[-3000:]
    out = d.stdout().splitlines()
    err = [ln for ln in d.stderr(workers=True).splitlines() if ln.startswith("[rank")]
    assert "[rank0]: out of rank 0" in out and "[rank1]: out of rank 1" in out, out
    assert not [ln for ln in out if "careful" in ln or "Traceback" in ln], out
    assert all(re.match(r"\[rank[01]\]: ", ln) for ln in out), out
    assert any("UserWarning: careful, rank 0" in ln for ln in err), err
    assert "[rank1]: Traceback (most recent call last):" in err, err
    assert "[rank1]: RuntimeError: injected on rank 1 of 2" in err, err
    assert not [ln for ln in err if "]: [rank" in ln], err  # never "[rank1]: [rank1]: "
    assert not [ln for ln in out + err if "out of rank" in ln and "careful" in ln]  # unglued
    attempt = d.attempt_dirs()[-1]
    assert "RuntimeError" in (attempt / "rank1.stderr.log").read_text()
    assert "RuntimeError" not in (attempt / "rank1.log").read_text()
