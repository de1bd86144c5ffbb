"""What the tools and people around a job see of it (real daemons and workers, gloo on CPU): the
rank's environment in /proc/PID/environ whichever way a worker started, one JSON document from
`status --json` with two jobs on the node, steps lost said as unknown where elasticd cannot tell,
and the console as torchrun's."""

from __future__ import annotations

import json
import signal

from harness import FAST, run_cli, script, wait_until

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
