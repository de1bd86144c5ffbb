"""Issue 23's parts one by one, without a job: the heartbeat's running figures, the figures
(steps lost, goodput), the straggler rule, the metrics' names and exposition, the settings, the
deploy/ files and the example GPU check."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys

import pytest
from prometheus_client.parser import text_string_to_metric_families

from elasticd import config, config_values
from elasticd.config import ConfigError
from elasticd.lifecycle.states import Failure, RestartCause
from elasticd.reporting import metrics
from elasticd.reporting.figures import Figures
from elasticd.reporting.stragglers import Stragglers
from elasticd.worker import heartbeat
from harness import ROOT

DEPLOY = ROOT / "deploy"


def beat(step=10, beats=10, first=1.0, last=2.0, loaded=1.0, **figures) -> heartbeat.Beat:
    values = tuple(float(figures.get(name, 0.0)) for name in heartbeat.FIGURES)
    return heartbeat.Beat(beats, step, last, first, state_loaded=loaded, figures=values)


def test_heartbeat_figures_round_trip(tmp_path):
    """What the worker side writes (a beat, its own work around backward(), the checkpoint
    library's figures) is what the daemon reads, and the header keeps its old offsets."""
    path = str(tmp_path / "hb")
    heartbeat.create(path)
    w = heartbeat.Writer(path)
    w.backward_in, w.backward_out = 10.0, 10.5
    w.optimizer_stepped()  # no earlier sync: no work measured yet
    w.backward_in = 10.8  # 0.3 s of own work after the sync at 10.5
    w.backward_out = 11.0
    w.optimizer_stepped()
    w.name_step(42)
    w.add("saves", 1)
    w.add("save_stall_total", 0.25)
    w.note("refresh_every", 3)
    w.note("resumed", 40)
    b = heartbeat.read(path)
    assert (b.beats, b.step) == (2, 42)
    assert b.figure("work_steps") == 1 and b.figure("work_total") == pytest.approx(0.3)
    assert (
        b.figure("saves"),
        b.figure("save_stall_total"),
        b.figure("refresh_every"),
        b.figure("resumed"),
    ) == (1, 0.25, 3, 40)
    heartbeat.mark(path, "state_loaded")
    assert heartbeat.read(path).state_loaded > 0 and os.path.getsize(path) == heartbeat.SIZE


def test_steps_lost_and_goodput():
    f = Figures(started=0.0)
    f.observe(
        1,
        [0, 1],
        [beat(step=0, beats=1, first=10, last=10), beat(step=0, beats=1, first=10, last=10)],
        now=10,
    )
    f.observe(
        1,
        [0, 1],
        [beat(step=57, beats=51, first=10, last=60), beat(step=57, beats=51, first=10.5, last=60)],
        now=60,
    )
    f.on_restart(
        Failure(RestartCause.SIGNAL, "killed by SIGKILL", rank=1),
        [beat(step=57), beat(step=57)],
        now=60.05,
    )
    f.observe(
        1, [0, 1], [beat(step=57, beats=51, first=10.5, last=60)] * 2, now=60.1
    )  # the RESTARTING snapshot
    assert f.steps_lost_last is None  # the old attempt's beats tell nothing of the resume
    f.observe(2, [], [], now=61)  # torn down
    resumed = beat(step=50, beats=1, first=70, last=70, loaded=69, resumed=50)
    f.observe(2, [0, 1], [resumed] * 2, now=70)
    assert (f.steps_lost_last, f.steps_lost_total) == (7, 7)
    later = beat(step=100, beats=50, first=70, last=100, loaded=69, resumed=50)
    f.observe(2, [0, 1], [later] * 2, now=100)
    r = f.report(100)
    assert r["restarts_by_cause"]["signal"] == 1 and sum(r["restarts_by_cause"].values()) == 1
    step_time = 1.0  # 50 steps over 50 s in the first attempt
    productive = (60 - 10.5) + (100 - 70) - 7 * step_time
    assert r["goodput"]["productive_seconds"] == pytest.approx(productive, abs=0.01)
    assert r["goodput"]["ratio"] == pytest.approx(productive / 100, abs=1e-3)
    f.on_recovered({"torn_down": 0.1, "first_step": 0.4})
    rec = f.report(100)["recoveries"]
    assert rec["count"] == 1 and rec["sum"] == 0.4 and dict(map(tuple, rec["buckets"]))[0.5] == 1


def test_a_recovery_in_place_is_counted_apart_and_its_steps_lost_told():
    """The survivors keep their processes (the attempt does not change): the steps lost are told
    once every rank has loaded its state again after the recovery (a survivor's run again too),
    and the recovery counts in place, not as a restart."""
    f = Figures(started=0.0)
    f.observe(1, [0, 1], [beat(step=40, beats=40, first=10, last=50, loaded=9)] * 2, now=50)
    f.on_restart(
        Failure(RestartCause.SIGNAL, "killed by SIGKILL", rank=1),
        [beat(step=40, loaded=9)] * 2,
        in_place=True,
        now=50.1,
    )
    # rank 0 re-entered but has not loaded yet; rank 1's replacement has
    joined = beat(step=38, beats=1, first=51, last=51, loaded=50.8, resumed=38)
    f.observe(1, [0, 1], [beat(step=40, loaded=9), joined], now=51)
    assert f.steps_lost_last is None
    again = beat(step=38, beats=41, first=10, last=51, loaded=50.9, resumed=38)
    f.observe(1, [0, 1], [again, again], now=51.2)
    assert (f.steps_lost_last, f.steps_lost_total) == (2, 2)
    r = f.report(52)
    assert r["in_place_by_cause"]["signal"] == 1 and sum(r["restarts_by_cause"].values()) == 0
    assert r["failures_by_class"] and r["steps_lost"]["unknown"] == 0


def test_steps_lost_unknown_without_the_checkpoint_library():
    f = Figures(started=0.0)
    f.observe(1, [0], [beat(loaded=0.0)], now=5)
    f.on_restart(Failure(RestartCause.CRASH, "exit 1", rank=0), [beat(loaded=0.0)])
    assert f.report(6)["steps_lost"] == {"total": None, "last": None, "unknown": 1}
    assert f.report(6)["goodput"]["ratio"] is None  # what the restart lost is not known
    assert Figures(started=0.0).report(5)["goodput"]["ratio"] is None  # nothing ever stepped


def test_straggler_rule_needs_the_whole_window_and_reports_once():
    events = []
    cfg = config.build({"entrypoint": "x.py", "straggler_window": "3"}, environ={})
    s = Stragglers(cfg, "n1", lambda name, **kw: events.append((name, kw)), clock=lambda: 1000.0)
    ranks = [(4, 0), (5, 1), (6, 2)]
    work = [0.0, 0.0, 0.0]
    for t in range(12):
        slow = 0.5 if t >= 2 else 0.1  # rank 6 works 5x the others from t=2 on
        for i, per_step in enumerate((0.1, 0.1, slow)):
            work[i] += 10 * per_step
        beats = [beat(beats=10 * (t + 1), work_steps=10 * (t + 1), work_total=w) for w in work]
        s.observe(1, ranks, beats, now=float(t))
        reported = [kw for name, kw in events if name == "straggler"]
        if t < 5:
            assert not reported, (
                t,
                events,
            )  # slow since t=2 (first seen at t=3): not yet a whole window
    assert len(reported) == 1 and reported[0]["rank"] == 6 and reported[0]["node"] == "n1"
    assert reported[0]["ratio"] > 1.2 and s.report()[0]["rank"] == 6 and s.reports == 1
    rows = [{"local_rank": i} for i in range(3)]
    s.annotate(rows)
    assert rows[2]["straggler"] and rows[2]["straggler_ratio"] > 1.2 and not rows[0]["straggler"]
    # a new attempt starts afresh; a threshold of 0 turns the rule off
    s.observe(2, ranks, beats, now=20.0)
    assert not s.report()
    off = Stragglers(
        config.build({"entrypoint": "x.py", "straggler_threshold": "0"}, environ={}),
        "n1",
        lambda *a, **k: None,
        clock=lambda: 0.0,
    )
    assert not off.on


SNAPSHOT = {
    "state": "RUNNING",
    "run_id": "job42",
    "node": "n1",
    "group_rank": 0,
    "group_world_size": 2,
    "world_size": 4,
    "round": 2,
    "restarts": 1,
    "budget_left": 2,
    "uptime": 100.0,
    "hang_inquiries": {"hang": 0, "cleared": 3, "none": 0},
    "restarts_by_cause": {
        "crash": 1,
        "signal": 0,
        "hang": 0,
        "peer": 0,
        "node_lost": 0,
        "scale": 0,
    },
    "last_failure": {"at": 1.7e9},
    "last_recovery": {"torn_down": 0.02, "first_step": 0.3},
    "recoveries": {"count": 1, "sum": 0.3, "buckets": [[0.1, 0], [0.5, 1], ["+Inf", 0]]},
    "steps_lost": {"total": 3, "last": 3, "unknown": 0},
    "goodput": {
        "ratio": 0.95,
        "productive_seconds": 95.0,
        "wall_seconds": 100.0,
        "lost_seconds": 0.1,
    },
    "step": 500,
    "step_time": 0.02,
    "work_time": 0.015,
    "checkpoint_costs": {
        "saves": 5,
        "stall_seconds_total": 0.1,
        "write_seconds_total": 0.5,
        "last_stall_seconds": 0.02,
        "last_write_seconds": 0.1,
    },
    "checkpoint": {"step": 500, "age": 3.0},
    "memory_step": 499,
    "memory_refresh": {"refreshes": 250, "seconds_total": 0.07, "last_seconds": 0.0003, "every": 2},
    "workers": [
        {
            "rank": r,
            "local_rank": r,
            "heartbeat_age": 0.01,
            "rss_bytes": 2**28,
            "step": 500,
            "step_time": 0.02,
            "work_time": 0.015,
            "straggler_ratio": 1.0,
        }
        for r in (0, 1)
    ],
    "stragglers": [],
    "straggler_reports": 0,
    "peers": {"1": 0.4},
    "health": {
        "check": "/bin/true",
        "runs": 3,
        "failures": 0,
        "peers_left": [],
        "last": {"ok": True, "seconds": 0.01, "at": 1.7e9},
        "quarantine_after": 3,
        "strikes": 1,
    },
}


def test_every_metric_is_named_by_convention_documented_and_exposed():
    names = [m[0] for m in metrics.METRICS]
    reference = (ROOT / "docs" / "metrics-reference.md").read_text()
    for name, kind, doc, _labels in metrics.METRICS:
        assert re.fullmatch(r"elasticd_[a-z_]+", name) and doc, name
        assert name.endswith("_total") == (kind == "counter"), name
        assert not re.search(
            r"_(ms|milliseconds|minutes|hours|kilobytes|megabytes|percent)(_|$)", name
        ), name
        assert f"`{name}`" in reference, (
            f"docs/metrics-reference.md lacks {name}: run python3 -m elasticd.ops.docs"
        )
    text = metrics.generate_latest(_registry(SNAPSHOT)).decode()
    exposed = {f.name for f in text_string_to_metric_families(text)}
    assert {n.removesuffix("_total") for n in names} <= exposed
    assert 'elasticd_restarts_total{cause="crash",node="n1",run_id="job42"} 1.0' in text
    assert 'elasticd_rank_rss_bytes{local_rank="1",node="n1",rank="1",run_id="job42"}' in text
    assert 'elasticd_recovery_seconds_bucket{le="0.5",node="n1",run_id="job42"} 1.0' in text
    assert 'elasticd_node_quarantined{node="n1",run_id="job42"} 0.0' in text
    assert 'elasticd_hang_inquiries_total{node="n1",run_id="job42",verdict="cleared"} 3.0' in text
    assert 'elasticd_node_failures{node="n1",run_id="job42"} 1.0' in text
    for line in text.splitlines():
        if line.startswith("# HELP "):
            assert len(line.split(" ", 3)) == 4, line  # every metric has a help text
    if shutil.which("promtool"):  # Prometheus' own linter of names, units and help
        r = subprocess.run(
            ["promtool", "check", "metrics"], input=text, capture_output=True, text=True, timeout=30
        )
        assert r.returncode == 0, r.stdout + r.stderr


def _registry(snapshot):
    from prometheus_client import CollectorRegistry

    registry = CollectorRegistry(auto_describe=False)
    registry.register(metrics.SnapshotCollector(lambda: snapshot))
    return registry


@pytest.mark.parametrize(
    "flags, message",
    [
        (
            {"metrics_address": "0.0.0.0:9400"},
            "would serve metrics on every interface: give one address",
        ),
        ({"metrics_address": "[::]:9400"}, "would serve metrics on every interface"),
        ({"metrics_address": "127.0.0.1"}, "use HOST:PORT"),
        ({"metrics_address": "127.0.0.1:0"}, "the port must be a number from 1 to 65535"),
        ({"metrics_address": "::1:9400"}, "write an IPv6 address in brackets"),
        (
            {"straggler_action": "restart"},
            "use report (restart and exclude-node are not implemented yet)",
        ),
        (
            {"straggler_threshold": "-1"},
            "straggler_threshold in --straggler-threshold: -1.0 is out of range",
        ),
        ({"health_check": "'unclosed"}, "is not a command line"),
    ],
)
def test_operability_settings_are_judged(flags, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        config.build({"entrypoint": "x.py", **flags}, environ={})


def test_metrics_on_every_interface_needs_the_flag():
    cfg = config.build(
        {"entrypoint": "x.py", "metrics_address": "0.0.0.0:9400", "metrics_all_interfaces": True},
        environ={},
    )
    assert config_values.parse_metrics_address(cfg.metrics_address) == ("0.0.0.0", 9400)
    assert config_values.parse_metrics_address("[::1]:9400") == ("::1", 9400)


def _cli(*args, env=None):
    return subprocess.run(
        [sys.executable, "-m", "elasticd", *args],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
        env=dict(os.environ, **(env or {})),
    )


def test_bad_metrics_and_health_flags_exit_2_with_one_line(tmp_path, open_dir):
    import socket

    os.chmod(open_dir, 0o777)
    common = ("run", "--log-dir", str(tmp_path / "logs"), "--socket", str(tmp_path / "s"))
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        cases = [
            (["--metrics-address", "0.0.0.0:9400"], "--metrics-all-interfaces"),
            (
                ["--health-check", "/no/such/check --now"],
                "'/no/such/check' is not an executable file",
            ),
            (
                ["--metrics-address", f"127.0.0.1:{port}"],
                f"--metrics-address 127.0.0.1:{port} cannot be bound here",
            ),
            (
                ["--metrics-textfile", str(tmp_path / "none" / "m.prom")],
                "directory " + str(tmp_path / "none") + " does not exist",
            ),
            (
                ["--metrics-textfile", str(open_dir / "m.prom")],
                "is writable by other users without the sticky bit",
            ),
        ]
        for flags, needle in cases:
            r = _cli(*common, *flags, "tests/scripts/faulty.py")
            lines = [ln for ln in r.stderr.splitlines() if ln.strip() and not ln.startswith("{")]
            assert r.returncode == 2 and len(lines) == 1 and needle in lines[0], (
                flags,
                r.returncode,
                r.stderr,
            )


def test_deploy_rules_config_and_dashboard():
    """The alert rules and example config load in Prometheus' own checker, and the dashboard
    uses only metrics elasticd exports."""
    names = {m[0] for m in metrics.METRICS}
    dashboard = json.loads((DEPLOY / "grafana" / "elasticd-dashboard.json").read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p["targets"]]
    rules = (DEPLOY / "prometheus" / "elasticd-alerts.yml").read_text()
    used = set(re.findall(r"elasticd_[a-z_]+", " ".join(exprs) + rules))
    used = {n.removesuffix("_bucket") for n in used}
    assert used and used <= names, used - names
    for alert in (
        "ElasticdCrashLoop",
        "ElasticdGoodputLow",
        "ElasticdRankStraggling",
        "ElasticdNodeStraggling",
        "ElasticdNodeUnhealthy",
        "ElasticdStallsJudgedNoHang",
    ):
        assert f"alert: {alert}" in rules
    if not shutil.which("promtool"):
        pytest.skip("promtool is not installed (Debian's prometheus package; .ci/run installs it)")
    for args in (
        ["check", "rules", str(DEPLOY / "prometheus" / "elasticd-alerts.yml")],
        ["check", "config", str(DEPLOY / "prometheus" / "prometheus.yml")],
        ["test", "rules", str(DEPLOY / "prometheus" / "elasticd-alerts.test.yml")],
    ):
        r = subprocess.run(["promtool", *args], capture_output=True, text=True, timeout=60)
        assert r.returncode == 0, r.stdout + r.stderr


def test_gpu_check_passes_without_a_gpu_and_fails_on_a_sick_one(tmp_path):
    check = str(DEPLOY / "healthcheck" / "gpu-check")
    bare = str(tmp_path / "bare")
    os.mkdir(bare)
    for tool in ("sh", "ls", "grep", "head", "tr", "tail"):
        os.symlink(shutil.which(tool), os.path.join(bare, tool))
    r = subprocess.run([check], capture_output=True, text=True, timeout=30, env={"PATH": bare})
    assert r.returncode == 0 and r.stdout.strip().splitlines()[-1].startswith("no GPU"), r
    fake = tmp_path / "nvidia-smi"
    fake.write_text(
        '#!/bin/sh\necho "0, 00000000:01:00.0, 0, No, No, 41"\n'
        'echo "1, 00000000:41:00.0, 2, No, [N/A], 50"\n'
    )
    fake.chmod(0o755)
    os.symlink(fake, os.path.join(bare, "nvidia-smi"))
    r = subprocess.run([check], capture_output=True, text=True, timeout=30, env={"PATH": bare})
    assert r.returncode == 1 and "GPU 1 (00000000:41:00.0): 2 uncorrected ECC errors" in r.stdout, r
    fake.write_text('#!/bin/sh\necho "0, 00000000:01:00.0, 0, No, No, 41"\n')
    r = subprocess.run(
        [check],
        capture_output=True,
        text=True,
        timeout=30,
        env={"PATH": bare, "ELASTICD_EXPECTED_GPUS": "1"},
    )
    assert r.returncode == 0 and r.stdout.strip() == "1 GPU(s) healthy", r


def test_health_check_results(tmp_path):
    """Pass, fail with its last line, a timeout (its whole session killed), a program that cannot
    run."""
    import time

    from elasticd.daemon.healthcheck import HealthCheck

    def run(command: str, timeout: str = "10"):
        cfg = config.build(
            {"entrypoint": "x.py", "health_check": command, "health_check_timeout": timeout},
            environ={},
        )
        events = []
        check = HealthCheck(cfg, "token", lambda name, **kw: events.append(name), wake=lambda: None)
        check.begin()
        wait = time.monotonic() + 20
        while check.running and time.monotonic() < wait:
            time.sleep(0.02)
        return check.take(), check, events

    ok, check, events = run("sh -c 'echo checking; echo fine'")
    assert (
        ok.ok
        and ok.output == "fine"
        and events == ["health_check_passed"]
        and check.report()["state"] == "passing"
    )
    bad, check, events = run("sh -c 'echo checking; printf \"GPU 2: \\033[31mhot\\n\"; exit 4'")
    assert not bad.ok and bad.reason.endswith("exited 4: GPU 2: \\x1b[31mhot"), bad  # escaped
    assert (
        events == ["health_check_failed"]
        and check.report()["state"] == "failing"
        and check.failures == 1
    )
    marker = tmp_path / "grandchild"
    slow, _, _ = run(f"sh -c 'sleep 30 & echo $! > {marker}; wait'", timeout="0.5")
    assert not slow.ok and "timed out after 0.5s" in slow.reason
    pid = int(marker.read_text())
    deadline = time.monotonic() + 5
    while os.path.exists(f"/proc/{pid}") and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not os.path.exists(f"/proc/{pid}") or open(f"/proc/{pid}/stat").read().split()[2] == "Z"
    missing, _, _ = run(str(tmp_path / "nope"))
    assert not missing.ok and "cannot run" in missing.reason
