"""Bad nodes remembered: a node whose health check fails three times is quarantined and refuses
to start (exit 7, one line) until `elasticd node clear`; in an elastic job a node whose health
check fails after its worker's GPU error is quarantined, leaves, and the other goes on at the
smaller size; a worker's failure while the GPU driver's own counters rose strikes the node; a
worker's error text alone ("Xid 79" in a data record) never quarantines."""

from __future__ import annotations

import os
import re

import pytest

from e2e.test_operability import check_script, non_json
from elasticd.exit_codes import ExitCode
from harness import FAST, free_port, node_flags, run_cli, script, wait_until

QUARANTINED = re.compile(
    r"^elasticd: (not starting: this node|this node left the job: it) is quarantined since "
)


def said(stderr: str) -> list[str]:
    """The daemon's own lines for people (the workers' stderr, echoed with their rank, aside)."""
    return [ln for ln in non_json(stderr) if ln.startswith("elasticd:")]


def test_three_failed_health_checks_quarantine_the_node_until_cleared(tmp_path):
    healthy = tmp_path / "healthy"
    check = check_script(
        tmp_path, f'[ -e {healthy} ] && exit 0\necho "GPU 0: Xid 79, fell off the bus"\nexit 1\n'
    )
    logs = tmp_path / "logs"
    run = (
        "run",
        "--log-dir",
        str(logs),
        "--socket",
        str(tmp_path / "control.sock"),
        "--nproc-per-node",
        "1",
        "--health-check",
        str(check),
        script("faulty.py"),
        "--steps",
        "2",
        "--step-time",
        "0.01",
    )
    codes = []
    for _ in range(3):
        r = run_cli(*run, timeout=60)
        codes.append(r.returncode)
    assert codes == [ExitCode.UNHEALTHY, ExitCode.UNHEALTHY, ExitCode.QUARANTINED], r.stderr[-2000:]
    assert QUARANTINED.match(said(r.stderr)[0]), r.stderr[-2000:]
    runs = sorted(p for p in logs.iterdir() if p.name != "state")
    healthy.touch()  # repaired, but not cleared: still refused, before anything starts
    r = run_cli(*run, timeout=60)
    assert r.returncode == ExitCode.QUARANTINED, r.stderr[-2000:]
    (line,) = said(r.stderr)
    assert line.startswith("elasticd: not starting: this node is quarantined since "), line
    assert "3 failure(s) within 24 h, the last: " in line and "Xid 79" in line, line
    assert f"`elasticd node clear --state-dir {logs / 'state'}`" in line, line
    assert sorted(p for p in logs.iterdir() if p.name != "state") == runs  # no run directory
    st = run_cli("node", "status", "--log-dir", str(logs), timeout=30)
    assert st.returncode == ExitCode.QUARANTINED and "quarantined since" in st.stdout, st
    assert st.stdout.count("health check failed") >= 3, st.stdout
    cleared = run_cli("node", "clear", "--log-dir", str(logs), timeout=30)
    assert cleared.returncode == 0 and "may start again" in cleared.stdout, cleared
    assert run_cli("node", "status", "--log-dir", str(logs), timeout=30).returncode == 0
    r = run_cli(*run, timeout=60)
    assert r.returncode == 0, r.stderr[-2000:]


def test_elastic_job_goes_on_without_a_node_quarantined_by_a_hardware_failure(daemons, tmp_path):
    """Node b's worker dies of an uncorrectable ECC error and b's health check, run before the
    restart, confirms it (it passed before the start): with --quarantine-after 1, b is quarantined
    and leaves (exit 7); a goes on alone and finishes; b started again is refused."""
    port = free_port()
    flags = ("--nproc-per-node", "1", *node_flags(port, "1:2", "quarantine"))
    flags += ("--quarantine-after", "1")
    checked = tmp_path / "checked"
    fault = "GPU 0: 2 uncorrectable ECC errors (driver counter)"
    check = check_script(
        tmp_path, f'[ -e {checked} ] && {{ echo "{fault}"; exit 1; }}\ntouch {checked}\n'
    )
    ecc = "CUDA error: uncorrectable ECC error encountered"
    args = ["--steps", "40", "--step-time", "0.05", "--raise-at", "5", "--error", ecc]
    # a starts alone (1:2) and must not finish before b, whose start may take seconds on a loaded
    # machine, joins: its first attempt lasts until b's arrival re-forms the group
    alone = [*args, "--first-attempt-steps", "100000"]
    a = daemons(script("faulty.py"), *flags, name="a", args=alone)
    wait_until(
        lambda: any(e.get("event") == "rendezvous_store" for e in a.events()), 60, what="the store"
    )
    on_b = ("--health-check", str(check), "--health-check-interval", "0")
    b = daemons(script("faulty.py"), *flags, *on_b, name="b", args=args)
    assert b.wait(90) == ExitCode.QUARANTINED, b.stderr()[-3000:]
    (line,) = said(b.stderr())
    assert QUARANTINED.match(line) and fault in line, line
    assert a.wait(90) == 0, a.stderr()[-3000:]
    causes = [e["cause"] for e in a.events() if e.get("new") == "RESTARTING"]
    assert any("left the job: quarantined: 1 failure(s)" in c for c in causes), causes
    assert [e for e in a.events() if e.get("new") == "RUNNING" and e.get("world_size") == 1]
    assert "done" in a.log_text(0)
    again = daemons(script("faulty.py"), *flags, *on_b, name="b", args=args)
    assert again.wait(60) == ExitCode.QUARANTINED, again.stderr()[-3000:]
    assert said(again.stderr())[0].startswith("elasticd: not starting: this node is quar")


# nvidia-smi as the daemon finds it on its PATH: the uncorrected ECC count of GPU 0 is 0 at the
# attempt's start, 2 once asked again (after the worker's failure); no row remapping (an older
# driver refuses that query)
FAKE_SMI = """#!/bin/sh
case "$1" in
  *ecc.errors*) if [ -e {mark} ]; then echo "0, 2, 0"; else touch {mark}; echo "0, 0, 0"; fi ;;
  *retired_pages.pending*) echo "0, No" ;;
  *) exit 2 ;;
esac
"""


@pytest.mark.parametrize("fault", ["raises", "hangs"])
def test_a_failure_while_the_gpu_drivers_counters_rose_quarantines_the_node(tmp_path, fault):
    """The worker raises at step 2, or hangs at step 3 (a GPU off the bus hangs collectives),
    while NVML's uncorrected ECC count rose (nvidia-smi, a stand-in on the daemon's PATH): class
    hardware, the driver's words in the strike; with --quarantine-after 1 the node is
    quarantined at once (exit 7, one line naming them)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    smi = bin_dir / "nvidia-smi"
    smi.write_text(FAKE_SMI.format(mark=tmp_path / "asked"))
    smi.chmod(0o755)
    state = tmp_path / "state"
    run = ("run", "--log-dir", str(tmp_path / "logs"), "--socket", str(tmp_path / "ctl.sock"))
    run += ("--state-dir", str(state), "--quarantine-after", "1", *FAST, "--nproc-per-node", "1")
    if fault == "raises":
        job = (script("faulty.py"), "--rank", "0", "--steps", "6", "--step-time", "0.01")
        job += ("--raise-at", "2", "--error", "RuntimeError: CUDA error")
    else:
        run += ("--heartbeat-timeout", "2")
        job = (script("hang.py"), "--rank", "0", "--steps", "10", "--mode", "loop", "--at", "3")
    path = {"PATH": f"{bin_dir}:{os.environ['PATH']}"}
    r = run_cli(*run, *job, env=path, timeout=120)
    assert r.returncode == ExitCode.QUARANTINED, r.stderr[-3000:]
    (line,) = said(r.stderr)
    assert QUARANTINED.match(line), line
    evidence = "the GPU driver reported gpu 0 ecc.errors.uncorrected.volatile.total 0 -> 2"
    assert evidence in line and ("hung" in line) == (fault == "hangs"), line
    st = run_cli("node", "status", "--state-dir", str(state), timeout=30)
    assert st.returncode == ExitCode.QUARANTINED and evidence in st.stdout, st.stdout


@pytest.mark.parametrize("error", ["bad record: Xid 79 ECC error", "KeyError: 'xid'"])
def test_a_workers_error_text_never_quarantines_the_node(tmp_path, error):
    """The same exception naming Xid and ECC at the same step, twice, under --quarantine-after 2:
    the job's own text, so a deterministic failure (exit 6), no strike; the node runs the next
    job. (Before: each retry was a hardware strike, quarantine in one ~8 s run.)"""
    state = tmp_path / "state"
    base = ("run", "--log-dir", str(tmp_path / "logs"), "--socket", str(tmp_path / "ctl.sock"))
    base += ("--state-dir", str(state), "--quarantine-after", "2", "--max-restarts", "5", *FAST)
    job = (script("faulty.py"), "--rank", "0", "--steps", "6", "--step-time", "0.01")
    r = run_cli(*base, "--nproc-per-node", "1", *job, "--raise-at", "2", "--error", error)
    assert r.returncode == ExitCode.DETERMINISTIC, r.stderr[-3000:]
    (line,) = said(r.stderr)
    assert "deterministic failure" in line and "[class user]" in line and error in line, line
    st = run_cli("node", "status", "--state-dir", str(state), timeout=30)
    assert st.returncode == 0 and "not quarantined" in st.stdout, st.stdout
    assert "failures within 24 h: 0 " in st.stdout, st.stdout
    r = run_cli(*base, "--nproc-per-node", "1", *job, timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]


def test_node_status_names_the_threshold_the_node_was_quarantined_at(tmp_path):
    """A node quarantined at --quarantine-after 2: `elasticd node status`, given only the state
    directory, says "quarantine at 2" (before: the default's 3)."""
    state = tmp_path / "state"
    check = check_script(tmp_path, 'echo "GPU 0: Xid 79, fell off the bus"\nexit 1\n')
    run = ("run", "--log-dir", str(tmp_path / "logs"), "--socket", str(tmp_path / "ctl.sock"))
    run += ("--state-dir", str(state), "--quarantine-after", "2", "--health-check", str(check))
    run += ("--nproc-per-node", "1", script("faulty.py"), "--steps", "2", "--step-time", "0.01")
    codes = [run_cli(*run, timeout=60).returncode for _ in range(2)]
    assert codes == [ExitCode.UNHEALTHY, ExitCode.QUARANTINED], codes
    st = run_cli("node", "status", "--state-dir", str(state), timeout=30)
    assert st.returncode == ExitCode.QUARANTINED, st
    assert "failures within 24 h: 2 (quarantine at 2)" in st.stdout, st.stdout
    assert "2 failure(s) within 24 h" in st.stdout, st.stdout
