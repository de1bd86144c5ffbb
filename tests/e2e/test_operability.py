"""Issue 23 with real daemons and workers: a real Prometheus scraping a job through a kill -9,
a straggling rank reported, and node health checks refusing a start or taking a node out of an
elastic job (gloo on CPU)."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import urllib.parse
import urllib.request

import pytest

from harness import FAST_NODES as NODE
from harness import FAST_STOP5 as FAST
from harness import RESTART, ROOT, free_port, script, secret_flags, wait_until


def get(url: str, timeout: float = 5.0) -> str:
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return r.read().decode()


def scrape(port: int) -> str:
    return get(f"http://127.0.0.1:{port}/metrics")


def value(text: str, pattern: str) -> float | None:
    """The value of the first exposed sample whose line matches `pattern` (a regex)."""
    m = re.search(rf"^{pattern}\S* (\S+)$", text, re.M)
    return float(m.group(1)) if m else None


def status_json(d) -> dict:
    r = d.status("--json")
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def non_json(text: str) -> list[str]:
    return [ln for ln in text.splitlines() if ln.strip() and not ln.startswith("{")]


def check_script(tmp_path, body: str):
    path = tmp_path / "check.sh"
    path.write_text("#!/bin/sh\n" + body)
    path.chmod(0o755)
    return path


@pytest.fixture
def prometheus(tmp_path):
    """A real Prometheus (Debian's package) scraping the given target every 0.5 s, with the
    project's alert rules loaded; yields a query function."""
    binary = shutil.which("prometheus")
    if not binary:
        pytest.skip(
            "the prometheus binary is not installed "
            "(Debian's prometheus package; .ci/run installs it)"
        )
    started = []

    def start(target: str):
        port = free_port()
        d = tmp_path / "prometheus"
        d.mkdir()
        shutil.copy(
            ROOT / "deploy" / "prometheus" / "elasticd-alerts.yml", d / "elasticd-alerts.yml"
        )
        (d / "prometheus.yml").write_text(
            "global: {scrape_interval: 500ms, evaluation_interval: 1s}\n"
            "rule_files: [elasticd-alerts.yml]\n"
            "scrape_configs:\n  - job_name: elasticd\n"
            f"    static_configs: [{{targets: ['{target}']}}]\n"
        )
        log = open(d / "prometheus.log", "wb")
        proc = subprocess.Popen(
            [
                binary,
                f"--config.file={d / 'prometheus.yml'}",
                f"--storage.tsdb.path={d / 'data'}",
                f"--web.listen-address=127.0.0.1:{port}",
            ],
            stdout=log,
            stderr=log,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
        started.append((proc, log))
        base = f"http://127.0.0.1:{port}"

        def ready():
            try:
                return get(base + "/-/ready", 1).strip() != ""
            except OSError:
                return False

        wait_until(ready, 30, interval=0.2, what="Prometheus to be ready")

        def query(expr: str) -> list[dict]:
            reply = json.loads(
                get(f"{base}/api/v1/query?" + urllib.parse.urlencode({"query": expr}))
            )
            assert reply["status"] == "success", reply
            return reply["data"]["result"]

        query.base = base
        return query

    yield start
    for proc, log in started:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)
        log.close()


def test_prometheus_scrapes_a_job_through_a_kill_9(daemons, tmp_path, prometheus):
    port = free_port()
    textdir = tmp_path / "textfile"
    textdir.mkdir(mode=0o755)
    check = check_script(tmp_path, "echo all good\n")
    d = daemons(
        script("ops_train.py"),
        *RESTART,
        "--nproc-per-node",
        "2",
        *FAST,
        "--metrics-address",
        f"127.0.0.1:{port}",
        "--metrics-textfile",
        str(textdir / "elasticd.prom"),
        "--health-check",
        str(check),
        "--health-check-interval",
        "2",
        args=[
            "--steps",
            "100000",
            "--step-time",
            "0.02",
            "--checkpoint-every",
            "10",
            "--memory-every",
            "0",
        ],
    )
    query = prometheus(f"127.0.0.1:{port}")
    d.wait_for_step(1, 25, timeout=60)
    wait_until(
        lambda: query('elasticd_state{state="RUNNING"} == 1'),
        15,
        what="Prometheus to scrape the job",
    )
    os.kill(d.worker_pids()[1], signal.SIGKILL)
    wait_until(
        lambda: any(e.get("event") == "recovered" for e in d.events()), 60, what="the recovery"
    )

    def restarts():
        found = query('elasticd_restarts_total{cause="signal"}')
        recovered = query("elasticd_recovery_seconds_count")
        return (
            found
            if found and float(found[0]["value"][1]) == 1 and float(recovered[0]["value"][1]) == 1
            else None
        )

    found = wait_until(
        restarts, 20, interval=0.25, what="Prometheus to see the restart and the recovery"
    )
    assert (
        found[0]["metric"]["node"] == socket.gethostname()
        and found[0]["metric"]["job"] == "elasticd"
    )
    # steps lost: the last step before the kill less the step the restart resumed from
    s = status_json(d)
    reached = max(int(n) for n in re.findall(r"^step (\d+)", d.log_text(0, 1), re.M))
    resumed = int(re.search(r"^resumed at step (\d+)", d.log_text(0, 2), re.M).group(1))
    assert s["steps_lost"]["last"] in (reached - resumed, reached - resumed - 1), (
        s["steps_lost"],
        reached,
        resumed,
    )
    # (a kill right after a save loses none; one while its write is in flight, up to two intervals)
    assert 0 <= s["steps_lost"]["last"] <= 20 and resumed % 10 == 0
    assert s["restarts_by_cause"]["signal"] == 1 and s["budget_left"] == 2
    assert 0 < s["goodput"]["ratio"] < 1, json.dumps(s)
    assert (s["goodput"]["lost_seconds"] > 0) == (s["steps_lost"]["last"] > 0), json.dumps(s)
    assert s["checkpoint_costs"]["saves"] >= 2 and s["step"] >= resumed
    assert all(w["step_time"] and w["work_time"] for w in s["workers"])
    assert (
        s["health"]["state"] == "passing" and s["health"]["runs"] >= 2
    )  # first start, restart (and periodic)
    text = scrape(port)
    assert value(text, r"elasticd_steps_lost_total\{") == s["steps_lost"]["total"]
    assert value(text, r"elasticd_health_check_up\{") == 1
    # the same figures in the textfile, for node_exporter
    wait_until(
        lambda: 'elasticd_restarts_total{cause="signal"' in (textdir / "elasticd.prom").read_text(),
        10,
        what="the textfile to show the restart",
    )
    assert oct((textdir / "elasticd.prom").stat().st_mode & 0o777) == "0o644"
    # the alert rules load and evaluate against the job's series
    rules = json.loads(get(query.base + "/api/v1/rules"))["data"]["groups"][0]["rules"]
    assert rules and all(r["health"] == "ok" for r in rules), rules
    human = d.status().stdout
    assert (
        "goodput " in human
        and "restarts by cause: signal 1" in human
        and "health check passing" in human
    )
    d.kill(signal.SIGTERM)
    assert d.wait(60) == 0, d.stderr()[-3000:]
    assert "elasticd_state{node=" in (textdir / "elasticd.prom").read_text()
    assert value((textdir / "elasticd.prom").read_text(), r'elasticd_state\{.*state="STOPPED"') == 1


def test_straggling_rank_is_reported_and_nothing_restarts(daemons):
    port = free_port()
    d = daemons(
        script("ops_train.py"),
        "--nproc-per-node",
        "3",
        *FAST,
        "--straggler-window",
        "3",
        "--metrics-address",
        f"127.0.0.1:{port}",
        args=["--steps", "100000", "--step-time", "0.01", "--slow-rank", "2", "--slow", "0.06"],
    )
    event = wait_until(
        lambda: next((e for e in d.events() if e.get("event") == "straggler"), None),
        60,
        what="a straggler event",
    )
    assert event["rank"] == 2 and event["node"] == socket.gethostname() and event["ratio"] > 1.2, (
        event
    )
    s = wait_until(
        lambda: (lambda j: j if j["stragglers"] else None)(status_json(d)), 10, what="status"
    )
    (st,) = s["stragglers"]
    assert (st["rank"], st["local_rank"], st["node"]) == (2, 2, socket.gethostname()) and st[
        "ratio"
    ] > 1.2
    assert [w["straggler"] for w in s["workers"]] == [False, False, True]
    # in DDP the steps take as long on every rank; the own work tells the slow one
    times = [w["step_time"] for w in s["workers"]]
    assert max(times) < 1.2 * min(times), times
    assert "straggler: rank 2 (local 2) on node" in d.status().stdout
    # the in-memory state is on by default here: its refreshes' cost and cadence come through
    assert s["memory_refresh"]["refreshes"] > 0 and s["memory_refresh"]["every"] >= 1, s[
        "memory_refresh"
    ]
    text = scrape(port)
    assert value(text, r"elasticd_stragglers\{") == 1
    assert value(text, r'elasticd_rank_straggler_ratio\{local_rank="2"') > 1.2
    assert not [e for e in d.events() if e.get("event") == "state" and e.get("new") == "RESTARTING"]
    d.kill(signal.SIGTERM)
    assert d.wait(60) == 0, d.stderr()[-3000:]


def test_failing_health_check_refuses_a_fixed_size_start(daemons, tmp_path):
    check = check_script(
        tmp_path, 'echo "checking GPU 0"\necho "GPU 0: XID 79, fell off the bus"\nexit 3\n'
    )
    d = daemons(
        script("faulty.py"),
        "--nproc-per-node",
        "1",
        "--health-check",
        f"{check} --quick",
        args=["--steps", "5"],
    )
    assert d.wait(60) == 5, d.stderr()[-3000:]
    assert non_json(d.stderr()) == [
        f"elasticd: not starting: this node's health check failed: `{check} --quick` "
        "exited 3: GPU 0: XID 79, fell off the bus"
    ]
    assert not d.attempt_dirs()  # no worker ever started
    left = [e for e in d.events() if e.get("event") == "state" and e.get("new") == "LEFT"]
    assert left and left[0]["exit_code"] == 5


def test_failing_health_check_takes_a_node_out_of_an_elastic_job(daemons, tmp_path):
    port = free_port()
    sick = tmp_path / "sick"
    check = check_script(
        tmp_path,
        f'if [ -e {sick} ]; then echo "GPU 3: 2 uncorrected ECC errors"; exit 1; fi\necho ok\n',
    )
    flags = (
        "--nproc-per-node",
        "1",
        "--nnodes",
        "1:2",
        "--rdzv-endpoint",
        f"127.0.0.1:{port}",
        "--rdzv-id",
        "hc",
        *NODE,
        *secret_flags(),
    )
    args = ["--steps", "400", "--step-time", "0.03", "--checkpoint-every", "10"]
    a = daemons(script("ops_train.py"), *flags, name="a", args=args)
    wait_until(
        lambda: any(e.get("event") == "rendezvous_store" for e in a.events()), 60, what="the store"
    )
    b = daemons(
        script("ops_train.py"),
        *flags,
        "--health-check",
        str(check),
        "--health-check-interval",
        "1",
        name="b",
        args=args,
    )
    wait_until(lambda: re.search(r"^step \d+", b.log_text(1), re.M), 90, what="both nodes training")
    sick.touch()
    assert b.wait(30) == 5, b.stderr()[-3000:]
    reason = f"health check failed: `{check}` exited 1: GPU 3: 2 uncorrected ECC errors"
    assert non_json(b.stderr()) == [f"elasticd: this node left the job: {reason}"]
    # the other node restarts with the reason, shows it, and goes on alone
    restart = wait_until(
        lambda: [
            e
            for e in a.events()
            if e.get("new") == "RESTARTING" and "left the job" in e.get("cause", "")
        ],
        10,
        what="a's restart",
    )
    assert (
        restart[0]["cause"] == f"node {socket.gethostname()}; peer asked for restart: node "
        f"{socket.gethostname()} left the job: {reason}"
    ), restart
    s = status_json(a)
    assert s["health"]["peers_left"][0]["reason"].endswith("GPU 3: 2 uncorrected ECC errors"), s[
        "health"
    ]
    assert "left the job: health check failed" in a.status().stdout
    wait_until(
        lambda: [e for e in a.events() if e.get("new") == "RUNNING" and e.get("world_size") == 1],
        60,
        what="a running alone",
    )
    a.kill(signal.SIGTERM)
    assert a.wait(60) == 0, a.stderr()[-3000:]
