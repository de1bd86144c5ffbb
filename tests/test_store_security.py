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
import subprocess
import sys
import time

import pytest
import torch.distributed as dist

from elasticd import rendezvous, signing
from elasticd.config import ConfigError
from harness import ROOT, as_user, script, wait_until

NOBODY = 65534
FAST = ("--restart-grace", "1", "--stop-grace", "3", "--peer-timeout", "3", "--last-call-timeout", "0.5")
needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="switching to an unprivileged uid needs root")


def td(s: float) -> datetime.timedelta:
    return datetime.timedelta(seconds=s)


class _Evil:
    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def _plant_pickles_and_budget(port: int, marker: str) -> list[str]:
    """An attacker without the secret: a pickle that runs a command under every key of the job it
    finds, the restart budget set far past --max-restarts, the arrival counters bumped."""
    c = dist.TCPStore("127.0.0.1", port, None, False, td(5))
    keys = [k for k in c.list_keys() if k.startswith("elasticd/")]
    for k in keys:
        if not k.endswith(("arrived", "done_count")):
            c.set(k, base64.b64encode(pickle.dumps(_Evil(marker))))
    c.set("elasticd/job/restarts", "100 99")
    for k in keys:
        if k.endswith("arrived"):
            c.add(k, 3)
    return keys


def _store_port(d) -> int:
    ev = wait_until(lambda: [e for e in d.events() if e.get("event") == "rendezvous_store"], 60, what="the store")
    return int(ev[0]["endpoint"].rsplit(":", 1)[1])


@needs_root
def test_unprivileged_store_writer_runs_no_code_and_spends_no_budget(daemons, tmp_path):
    marker = tmp_path / "pwned"
    d = daemons(script("ddp_tutorial.py"), "--nproc-per-node", "2", "--max-restarts", "1", "--rdzv-id", "job",
                *FAST, args=["--steps", "60", "--step-time", "0.05", "--snapshot", str(tmp_path / "snap.pt")])
    port = _store_port(d)
    pids = wait_until(lambda: d.worker_pids() if len(d.worker_pids()) == 2 else None, 60, what="workers")
    d.wait_for_step(1, 3, timeout=60)
    os.chmod(tmp_path, 0o777)  # the attacker may name the marker; only the daemon could write it
    got = as_user(NOBODY, _plant_pickles_and_budget, port, str(marker), timeout=30)
    assert isinstance(got, list) and "elasticd/job/round" in got, got
    os.kill(pids[1], signal.SIGKILL)  # a real failure: the budget (1) still has room for it
    assert d.wait(120) == 0, d.stderr()[-3000:]
    assert "done world_size=2 rank=0 restart=1" in d.stdout()
    rejected = {e.get("key") for e in d.events() if e.get("event") == "store_value_rejected"}
    assert "elasticd/job/restarts" in rejected and not marker.exists(), rejected


def _forge_restart(port: int) -> str:
    c = dist.TCPStore("127.0.0.1", port, None, False, td(5))
    keys = c.list_keys()
    number = max(int(m.group(1)) for k in keys if (m := re.fullmatch(r"elasticd/job/r(\d+)/members", k)))
    prefix = f"elasticd/job/r{number}"
    c.set(f"{prefix}/restart", json.dumps({"summary": "forged", "node": "nowhere"}))
    c.set(f"{prefix}/master", f"127.0.0.1 {port}")
    alive = [k for k in keys if k.startswith("elasticd/job/alive/")]
    for _ in range(20):  # values the daemons parse, for a second (< --peer-timeout): they must not crash them
        for key in (*alive, f"{prefix}/done/0"):
            c.set(key, "not a number \xff")
        time.sleep(0.05)
    return prefix


def secret_file(path, content: bytes = b"0123456789abcdef0123456789abcdef") -> str:
    path.write_bytes(content)
    path.chmod(0o600)
    return str(path)


@needs_root
def test_forged_restart_request_is_ignored_across_nodes(daemons, tmp_path):
    from test_multinode import free_port, node_flags

    port, secret = free_port(), secret_file(tmp_path / "secret")
    args = ["--steps", "80", "--step-time", "0.05"]
    nodes = [daemons(script("ddp_tutorial.py"), "--nproc-per-node", "1", "--rdzv-secret-file", secret,
                     *node_flags(port, "2"), name=f"n{i}", args=args) for i in range(2)]
    wait_until(lambda: all(len(n.worker_pids()) == 1 for n in nodes), 60, what="both nodes running")
    wait_until(lambda: re.search(r"^step 3\b", nodes[1].all_logs(), re.M), 60, what="training")
    got = as_user(NOBODY, _forge_restart, port, timeout=30)
    assert isinstance(got, str), got
    for n in nodes:
        assert n.wait(120) == 0, n.stderr()[-3000:]
    out = nodes[0].stdout() + nodes[1].stdout()
    assert "done world_size=2 rank=0 restart=0" in out and "done world_size=2 rank=1 restart=0" in out
    assert not [e for n in nodes for e in n.events() if e.get("new") == "RESTARTING"]
    rejected = {e.get("key") for n in nodes for e in n.events() if e.get("event") == "store_value_rejected"}
    # each daemon reads its peer's liveness a few times a second: at least one saw the garbage
    assert any(k.endswith("/restart") for k in rejected), rejected
    assert any(k.startswith("elasticd/job/alive/") for k in rejected), rejected


def test_nodes_with_different_secrets_fail_with_a_line_naming_the_secret(daemons, tmp_path):
    from test_multinode import free_port, node_flags

    port = free_port()
    files = [secret_file(tmp_path / f"s{i}", bytes([65 + i]) * 32) for i in range(2)]
    nodes = [daemons(script("ddp_tutorial.py"), "--nproc-per-node", "1", "--rdzv-secret-file", files[i],
                     "--join-timeout", "6", *node_flags(port, "2"), name=f"n{i}", args=["--steps", "5"])
             for i in range(2)]
    for n in nodes:
        assert n.wait(60) == 1, n.stderr()[-3000:]
    assert any("same --rdzv-secret-file" in n.stderr() for n in nodes), [n.stderr()[-2000:] for n in nodes]
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
    r = subprocess.run([sys.executable, "-m", "elasticd.cli", "run", "--rdzv-secret-file", loose,
                        "--log-dir", str(tmp_path / "logs")], capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert r.returncode == 2, r.stderr
    assert r.stderr.count("\n") == 1 and "chmod 600" in r.stderr, r.stderr


def test_our_values_verify_only_for_their_round_and_key_and_form():
    signer = signing.Signer(b"s" * 32, "job")
    sealed = signer.seal("3/elasticd/restart", '{"summary": "x", "node": "n"}')
    assert signer.open("3/elasticd/restart", sealed) is not None
    assert signer.open("4/elasticd/restart", sealed) is None  # another round: a replay
    assert signer.open("3/elasticd/master", sealed) is None  # another key
    assert signer.open("3/elasticd/restart", sealed[:-1] + b"y") is None
    assert parsed(rendezvous._reason, '{"summary": "x", "node": "n"}') == {"summary": "x", "node": "n"}
    for text in ("[" * 50000, "[]", '{"summary": 1}', '{"summary": "x", "scale": "yes"}', "x" * 9000, "1e999"):
        assert parsed(rendezvous._reason, text) is None, text[:20]
    assert rendezvous._master("10.0.0.1 29500") == ("10.0.0.1", 29500)
    for text in ("10.0.0.1 0", "10.0.0.1 70000", "a;b 1", "host", " 1", "h 1e3", "h -1"):
        assert rendezvous._master(text) is None, text
    record = {"id": "n-1-ab", "nproc": 2, "addr": "10.0.0.1", "prev": -1}
    assert parsed(rendezvous._record, json.dumps(record)) == record
    for bad in ({"nproc": 0}, {"nproc": 99999999}, {"nproc": True}, {"id": "a b"}, {"addr": "x;y"}, {"prev": -2}):
        assert parsed(rendezvous._record, json.dumps({**record, **bad})) is None, bad
    members = {"members": [["a", 1, "10.0.0.1"], ["b", 2, "10.0.0.2"]], "lost": ["c"]}
    assert [m.nproc for m in parsed(rendezvous._members, json.dumps(members))["members"]] == [1, 2]
    for bad in ({"members": []}, {"members": [["a", 1, "h"], ["a", 1, "h"]]}, {"lost": [1]}, {"failed": 3},
                {"members": [["a", 0, "h"]]}):
        assert parsed(rendezvous._members, json.dumps({**members, **bad})) is None, bad
    assert rendezvous._budget("3 7") == (3, 7) and rendezvous._budget("3") is None
    assert rendezvous._count("1e999") is None and rendezvous._count("٣") is None


def parsed(fn, text):
    """What Rendezvous._open makes of a payload: the parser's value, or None where it raises."""
    try:
        return fn(text)
    except (ValueError, RecursionError):
        return None
