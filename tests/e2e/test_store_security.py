"""The rendezvous store is open to anyone who reaches its port: nothing read from it may run code
in the daemon or steer the job without the job's secret. Attacks run as a real unprivileged
process (forked from the test and switched to uid 65534) against real daemons."""

from __future__ import annotations

import base64
import datetime
import json
import os
import pickle
import re
import signal
import socket
import subprocess
import sys
import time

import psutil
import pytest
import torch.distributed as dist

from elasticd.cluster import signing, values
from elasticd.config import ConfigError
from harness import FAST_NODES as FAST
from harness import RESTART, ROOT, as_user, end_soon, free_port, node_flags, script, wait_until

NOBODY = 65534
needs_root = pytest.mark.skipif(
    os.geteuid() != 0, reason="switching to an unprivileged uid needs root"
)


def td(s: float) -> datetime.timedelta:
    return datetime.timedelta(seconds=s)


class _Evil:
    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def _store_port(d) -> int:
    ev = wait_until(
        lambda: [e for e in d.events() if e.get("event") == "rendezvous_store"],
        60,
        what="the store",
    )
    return int(ev[0]["endpoint"].rsplit(":", 1)[1])


def _listening(pid: int) -> set[int]:
    return {
        c.laddr.port
        for c in psutil.Process(pid).net_connections("inet")
        if c.status == psutil.CONN_LISTEN
    }


def test_a_single_node_job_listens_on_no_store_of_its_own(daemons, tmp_path):
    """Its control plane is a dict in the daemon: the only port it opens is the round's worker
    store, which torch's init_process_group needs (as under torchrun)."""
    d = daemons(
        script("ddp_tutorial.py"),
        *RESTART,
        "--nproc-per-node",
        "2",
        "--max-restarts",
        "1",
        *FAST,
        args=["--steps", "60", "--step-time", "0.05", "--snapshot", str(tmp_path / "snap.pt")],
    )
    store = wait_until(
        lambda: [e for e in d.events() if e.get("event") == "rendezvous_store"],
        60,
        what="the store",
    )
    assert store[0]["endpoint"] == "in-process" and store[0]["hosted_here"] is False, store
    pids = wait_until(
        lambda: d.worker_pids() if len(d.worker_pids()) == 2 else None, 60, what="workers"
    )
    d.wait_for_step(1, 3, timeout=60)
    running = [e for e in d.events() if e.get("event") == "state" and e.get("new") == "RUNNING"][-1]
    assert _listening(d.pid) == {int(running["master"].rsplit(":", 1)[1])}
    os.kill(pids[1], signal.SIGKILL)  # a restart goes through the in-process store too
    assert d.wait(120) == 0, d.stderr()[-3000:]
    assert "done world_size=2 rank=0 restart=1" in d.stdout()


BIG = 8 << 20


def _break_the_next_restart(port: int, marker: str) -> dict:
    """An attacker without the secret, as the issue found it: a pickle that runs a command under
    every key of the job, the budget far past --max-restarts, an empty value under the round key,
    garbage under the next round's members, the round's arrival counter raised (15 numbers with
    8 MiB values under them, then a billion more), the exit barrier's counter not a number."""
    c = dist.TCPStore("127.0.0.1", port, None, False, td(10))
    keys = [k for k in c.list_keys() if k.startswith("elasticd/")]
    scope = next(k for k in keys if re.fullmatch(r"elasticd/job/[0-9a-f]{16}/round", k)).rsplit(
        "/", 1
    )[0]
    number = max(
        int(m.group(1)) for k in keys if (m := re.fullmatch(rf"{scope}/r(\d+)/members", k))
    )
    for k in keys:
        if "/arrived/" not in k:
            c.set(k, base64.b64encode(pickle.dumps(_Evil(marker))))
    c.set(f"{scope}/restarts", "100 99")
    c.set(f"{scope}/round", b"")
    c.set(f"{scope}/r{number + 1}/members", b"\xff not json")
    for n in (number, number + 1):  # the barrier the job ends with, whichever round it is in
        c.set(f"{scope}/r{n}/done_count", "not a number")
    counter = next(k for k in keys if "/arrived/" in k)
    tag = counter.rsplit("/", 1)[1]
    first = c.add(counter, 15) - 14
    for i in range(first, first + 15):
        c.set(f"{scope}/r{number}/node/{tag}/{i}", b"x" * BIG)
    time.sleep(3)  # the daemons read those once: then the counter past any real number
    c.add(counter, 10**9)
    return {"scope": scope, "round": number}


@needs_root
def test_unprivileged_store_writer_cannot_fail_crash_or_slow_a_restart(daemons, tmp_path):
    """Each write above broke the next restart (a round that never closed, a traceback) or
    made every daemon read 120 MiB a second: now the restart forms at once, nothing runs, the
    budget is untouched, and the daemons' CPU is back to idle once each bad value was read."""

    marker = tmp_path / "pwned"
    port = free_port()
    stop = tmp_path / "stop"
    args = ["--steps", "400", "--step-time", "0.05", "--snapshot", str(tmp_path / "snap.pt")]
    args += ["--stop-file", str(stop)]
    # elastic (2:3), so each node looks for nodes waiting to join every second; both in the first
    # round
    nodes = [
        daemons(
            script("ddp_tutorial.py"),
            *RESTART,  # a restart's round, which the writer would slow
            "--nproc-per-node",
            "1",
            "--max-restarts",
            "1",
            *node_flags(port, "2:3"),
            name=f"n{i}",
            args=args,
        )
        for i in range(2)
    ]
    wait_until(lambda: all(len(n.worker_pids()) == 1 for n in nodes), 60, what="both nodes running")
    wait_until(lambda: re.search(r"^step 3\b", nodes[1].all_logs(), re.M), 60, what="training")
    os.chmod(tmp_path, 0o777)  # the attacker may name the marker; only the daemon could write it
    got = as_user(NOBODY, _break_the_next_restart, port, str(marker), timeout=60)
    assert isinstance(got, dict) and "scope" in got, got
    time.sleep(1.5)  # the liveness threads meet the raised counter
    cpu = [psutil.Process(n.pid) for n in nodes]
    before = [sum(p.cpu_times()[:2]) for p in cpu]
    time.sleep(4)
    used = [sum(p.cpu_times()[:2]) - b for p, b in zip(cpu, before)]
    assert all(u < 0.4 for u in used), (
        f"daemon CPU over 4 s after the attack: {used}"
    )  # was 1.5 s/s
    os.kill(
        next(iter(nodes[0].worker_pids().values())), signal.SIGKILL
    )  # a real failure: within budget
    wait_until(
        lambda: all(sum(e.get("new") == "RUNNING" for e in n.events()) == 2 for n in nodes),
        60,
        what="both nodes restarted",
    )
    end_soon(stop, *nodes)
    for n in nodes:
        assert n.wait(120) == 0, n.stderr()[-3000:]
    out = nodes[0].stdout() + nodes[1].stdout()
    assert "restart=1" in out and "Traceback" not in nodes[0].stderr() + nodes[1].stderr()
    stopped = [e for e in nodes[1].events() if e.get("new") == "RESTARTING"]
    resumed = [e for e in nodes[1].events() if e.get("new") == "RUNNING"]
    assert len(stopped) == 1 and len(resumed) == 2, (stopped, resumed)
    took = _ts(resumed[1]) - _ts(stopped[0])
    assert took < 15, f"the restart's round took {took:.1f}s to form"
    rejected = {
        e.get("key") for n in nodes for e in n.events() if e.get("event") == "store_value_rejected"
    }
    # the forged values were read and refused; the line for the restarts counter itself may be
    # one the overall cap held back (REJECTED_LOGS a window: the forger writes many keys), and
    # the budget's being untouched shows above (--max-restarts 1: the real failure restarted)
    assert rejected - {None} and not marker.exists(), rejected


def _ts(event: dict) -> float:
    return datetime.datetime.fromisoformat(event["timestamp"].replace("Z", "+00:00")).timestamp()


def _forge_restart(port: int) -> str:
    c = dist.TCPStore("127.0.0.1", port, None, False, td(5))
    keys = c.list_keys()
    found = [
        m for k in keys if (m := re.fullmatch(r"(elasticd/job/[0-9a-f]{16})/r(\d+)/members", k))
    ]
    number = max(int(m.group(2)) for m in found)
    prefix = f"{found[0].group(1)}/r{number}"
    c.set(f"{prefix}/restart", json.dumps({"summary": "forged", "node": "nowhere"}))
    c.set(f"{prefix}/master", f"127.0.0.1 {port}")
    alive = [k for k in keys if "/alive/" in k]
    for _ in range(
        20
    ):  # values the daemons parse, for a second (< --peer-timeout): they must not crash them
        for key in (*alive, f"{prefix}/done/0"):
            c.set(key, "not a number \xff")
        time.sleep(0.05)
    return prefix


def _record(port: int) -> dict:
    """Every value of the job, as it stands while the job trains."""
    c = dist.TCPStore("127.0.0.1", port, None, False, td(10))
    return {
        k: base64.b64encode(c.get(k)).decode() for k in c.list_keys() if k.startswith("elasticd/")
    }


def _replay(port: int, recorded: dict, seconds: float, started: str) -> dict:
    """Run A's values into run B's store from the moment B's run is there, under A's keys and
    under B's (its run id put in), over and over while B's nodes meet; a listener on A's
    worker-store port, where a replayed master would send B's workers."""
    scope_a = next(k for k in recorded if k.endswith("/round")).rsplit("/", 1)[0]
    master = base64.b64decode(recorded[f"{scope_a}/r0/master"]).split(b" ")[-1]
    trap = socket.socket()
    trap.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    trap.bind(("127.0.0.1", int(master)))
    trap.listen()
    trap.setblocking(False)
    c, scope_b, deadline = None, None, time.monotonic() + 60
    while scope_b is None and time.monotonic() < deadline:
        try:
            c = c or dist.TCPStore("127.0.0.1", port, None, False, td(2))
            run = (
                c.get("elasticd/rep/run").split(b" ")[1].decode()
            )  # "<mac> <run> <time>": plain text
            scope_b = f"elasticd/rep/{run}"
        except Exception:  # noqa: BLE001 - B's store is not up yet
            c = None
            time.sleep(0.01)
    values = [(k, base64.b64decode(v)) for k, v in recorded.items() if not k.endswith("/run")]
    caught, deadline = 0, time.monotonic() + seconds
    while time.monotonic() < deadline:
        for k, v in values:
            c.set(k, v)
            c.set(k.replace(scope_a, scope_b), v)
        if not os.path.exists(started):
            open(started, "w").close()  # the test starts B's second node now
        try:
            trap.accept()[0].close()
            caught += 1
        except BlockingIOError:
            pass
        time.sleep(0.05)
    return {"a": scope_a, "b": scope_b, "caught": caught, "replayed": len(values)}


@needs_root
def test_values_of_an_earlier_run_of_the_job_replayed_into_the_next_steer_nothing(
    daemons, tmp_path
):
    """Run A of --rdzv-id rep is recorded by an unprivileged user; run B (same id, same secret,
    same port: a job started again) gets every value back, under A's keys and B's. Before runs
    were told apart, a replayed `closed` made every node of B exit 1 and a replayed master sent
    a worker to the attacker's port."""
    import threading

    port = free_port()
    a = [
        daemons(
            script("ddp_tutorial.py"),
            "--nproc-per-node",
            "1",
            *node_flags(port, "2", job="rep"),
            name=f"a{i}",
            args=["--steps", "60", "--step-time", "0.05"],
        )
        for i in range(2)
    ]
    wait_until(lambda: all(len(n.worker_pids()) == 1 for n in a), 60, what="run A training")
    recorded = [as_user(NOBODY, _record, port, timeout=30)]
    for n in a:
        assert n.wait(120) == 0, n.stderr()[-3000:]
    assert any(k.endswith("/r0/master") for k in recorded[0]), recorded
    replayed: list = []
    import tempfile
    from pathlib import Path

    signals = Path(
        tempfile.mkdtemp(prefix="elasticd-attack-")
    )  # not under tmp_path: its parents are root's, 0700
    signals.chmod(0o777)
    started = signals / "started"
    attacker = threading.Thread(
        target=lambda: replayed.append(
            as_user(NOBODY, _replay, port, recorded[0], 6, str(started), timeout=90)
        )
    )
    attacker.start()
    b = [
        daemons(
            script("ddp_tutorial.py"),
            "--nproc-per-node",
            "1",
            *node_flags(port, "2", job="rep"),
            name="b0",
            args=["--steps", "60", "--step-time", "0.05"],
        )
    ]
    wait_until(
        started.exists, 60, what="the replay under way"
    )  # B's host is up, its round not formed
    b.append(
        daemons(
            script("ddp_tutorial.py"),
            "--nproc-per-node",
            "1",
            *node_flags(port, "2", job="rep"),
            name="b1",
            args=["--steps", "60", "--step-time", "0.05"],
        )
    )
    attacker.join(100)
    started.unlink(missing_ok=True)
    signals.rmdir()
    got = replayed[0] if replayed else None
    assert isinstance(got, dict) and got.get("replayed"), got
    for n in b:
        assert n.wait(120) == 0, n.stderr()[-3000:]
    assert got["a"] != got["b"] and got["caught"] == 0, got
    out = b[0].stdout() + b[1].stdout()
    assert (
        "done world_size=2 rank=0 restart=0" in out and "done world_size=2 rank=1 restart=0" in out
    )
    assert not [e for n in b for e in n.events() if e.get("new") == "RESTARTING"]
    rejected = {
        e.get("key") for n in b for e in n.events() if e.get("event") == "store_value_rejected"
    }
    assert any(k.startswith(got["b"]) for k in rejected), rejected


def secret_file(path, content: bytes = b"0123456789abcdef0123456789abcdef") -> str:
    path.write_bytes(content)
    path.chmod(0o600)
    return str(path)


@needs_root
def test_forged_restart_request_is_ignored_across_nodes(daemons, tmp_path):

    port, secret = free_port(), secret_file(tmp_path / "secret")
    args = ["--steps", "80", "--step-time", "0.05"]
    nodes = [
        daemons(
            script("ddp_tutorial.py"),
            "--nproc-per-node",
            "1",
            "--rdzv-secret-file",
            secret,
            *node_flags(port, "2"),
            name=f"n{i}",
            args=args,
        )
        for i in range(2)
    ]
    wait_until(lambda: all(len(n.worker_pids()) == 1 for n in nodes), 60, what="both nodes running")
    wait_until(lambda: re.search(r"^step 3\b", nodes[1].all_logs(), re.M), 60, what="training")
    got = as_user(NOBODY, _forge_restart, port, timeout=30)
    assert isinstance(got, str), got
    for n in nodes:
        assert n.wait(120) == 0, n.stderr()[-3000:]
    out = nodes[0].stdout() + nodes[1].stdout()
    assert (
        "done world_size=2 rank=0 restart=0" in out and "done world_size=2 rank=1 restart=0" in out
    )
    assert not [e for n in nodes for e in n.events() if e.get("new") == "RESTARTING"]
    rejected = {
        e.get("key") for n in nodes for e in n.events() if e.get("event") == "store_value_rejected"
    }
    # each daemon reads its peer's liveness a few times a second: at least one saw the garbage
    assert any(k.endswith("/restart") for k in rejected), rejected
    assert any("/alive/" in k for k in rejected), rejected


def test_nodes_with_different_secrets_fail_with_a_line_naming_the_secret(daemons, tmp_path):

    port = free_port()
    files = [secret_file(tmp_path / f"s{i}", bytes([65 + i]) * 32) for i in range(2)]
    nodes = [
        daemons(
            script("ddp_tutorial.py"),
            "--nproc-per-node",
            "1",
            "--rdzv-secret-file",
            files[i],
            "--join-timeout",
            "6",
            *node_flags(port, "2", secret=False),
            name=f"n{i}",
            args=["--steps", "5"],
        )
        for i in range(2)
    ]
    for n in nodes:
        assert n.wait(60) == 1, n.stderr()[-3000:]
    assert any("same --rdzv-secret-file" in n.stderr() for n in nodes), [
        n.stderr()[-2000:] for n in nodes
    ]
    assert "Traceback" not in nodes[0].stderr() + nodes[1].stderr()


# --- the pieces, in-process over a real TCPStore ---


def test_load_secret_refuses_unsafe_files(tmp_path):
    good = secret_file(tmp_path / "good")
    assert signing.load_secret(good) == b"0123456789abcdef0123456789abcdef"
    cases = {"does not exist": str(tmp_path / "missing")}
    loose = secret_file(tmp_path / "loose")
    os.chmod(loose, 0o644)
    cases["chmod 600"] = loose
    short = secret_file(tmp_path / "short", b"abc\n")
    cases["fewer than 16"] = short
    link = tmp_path / "link"
    link.symlink_to(good)
    cases["not a symbolic link"] = str(link)
    cases["not a regular file"] = str(tmp_path)
    if os.geteuid() == 0:
        foreign = secret_file(tmp_path / "foreign")
        os.chown(foreign, NOBODY, NOBODY)
        cases["owned by uid 65534"] = foreign
    for needle, path in cases.items():
        with pytest.raises(ConfigError, match=re.escape(needle)) as e:
            signing.load_secret(path)
        assert "\n" not in str(e.value)


def test_cli_refuses_a_world_readable_secret_in_one_line(tmp_path):
    loose = secret_file(tmp_path / "loose")
    os.chmod(loose, 0o644)
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "elasticd",
            "run",
            "--rdzv-secret-file",
            loose,
            "--log-dir",
            str(tmp_path / "logs"),
        ],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
    )
    assert r.returncode == 2, r.stderr
    assert r.stderr.count("\n") == 1 and "chmod 600" in r.stderr, r.stderr


def test_our_values_verify_only_for_their_round_and_key_and_form():
    signer = signing.Signer(b"s" * 32, "job")
    sealed = signer.seal("3/elasticd/restart", '{"summary": "x", "node": "n"}')
    assert signer.open("3/elasticd/restart", sealed) is not None
    assert signer.open("4/elasticd/restart", sealed) is None  # another round: a replay
    assert signer.open("3/elasticd/master", sealed) is None  # another key
    assert signer.open("3/elasticd/restart", sealed[:-1] + b"y") is None
    assert parsed(values.reason, '{"summary": "x", "node": "n"}') == {
        "summary": "x",
        "node": "n",
    }
    for text in (
        "[" * 50000,
        "[]",
        '{"summary": 1}',
        '{"summary": "x", "scale": "yes"}',
        "x" * 9000,
        "1e999",
    ):
        assert parsed(values.reason, text) is None, text[:20]
    assert values.master("10.0.0.1 29500") == ("10.0.0.1", 29500, None)
    for text in ("10.0.0.1 0", "10.0.0.1 70000", "a;b 1", "host", " 1", "h 1e3", "h -1"):
        assert values.master(text) is None, text
    record = {"id": "n-1-ab", "nproc": 2, "addr": "10.0.0.1", "prev": -1, "link": 29501}
    assert parsed(values.record, json.dumps(record)) == record
    no_link = {k: v for k, v in record.items() if k != "link"}  # a daemon without links
    assert parsed(values.record, json.dumps(no_link)) == {**no_link, "link": 0}
    for bad in (
        {"nproc": 0},
        {"nproc": 99999999},
        {"nproc": True},
        {"id": "a b"},
        {"addr": "x;y"},
        {"prev": -2},
        {"link": 65536},
        {"link": -1},
        {"link": True},
        {"link": "29501"},
    ):
        assert parsed(values.record, json.dumps({**record, **bad})) is None, bad
    members = {"members": [["a", 1, "10.0.0.1"], ["b", 2, "10.0.0.2"]], "lost": ["c"]}
    assert [m.nproc for m in parsed(values.members, json.dumps(members))["members"]] == [1, 2]
    for bad in (
        {"members": []},
        {"members": [["a", 1, "h"], ["a", 1, "h"]]},
        {"lost": [1]},
        {"failed": 3},
        {"members": [["a", 0, "h"]]},
    ):
        assert parsed(values.members, json.dumps({**members, **bad})) is None, bad
    assert values.budget("3 7") == (3, 7) and values.budget("3") is None
    assert values.count("1e999") is None and values.count("٣") is None


def parsed(fn, text):
    """What Rendezvous._open makes of a payload: the parser's value, or None where it raises."""
    try:
        return fn(text)
    except (ValueError, RecursionError):
        return None
