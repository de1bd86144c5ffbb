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
from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import C10dRendezvousBackend
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import _NodeDesc, _RendezvousState

from elasticd import rendezvous, signing
from elasticd.config import ConfigError
from elasticd.signed_backend import SignedBackend, check_state
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


def _plant_pickle_and_budget(port: int, marker: str) -> str:
    """What the attacker of the issue did: find the job's keys, replace torch's rendezvous state
    with a pickle that runs a command, and spend the restart budget."""
    c = dist.TCPStore("127.0.0.1", port, None, False, td(5))
    state_key = next(k for k in c.list_keys() if re.fullmatch(r"torch\.rendezvous\.[^./]+", k))
    run = state_key.split(".", 2)[2]
    c.set(state_key, base64.b64encode(pickle.dumps(_Evil(marker))).decode())
    c.add(f"elasticd/{run}/restarts", 100)
    return run


def _store_port(d) -> int:
    ev = wait_until(lambda: [e for e in d.events() if e.get("event") == "rendezvous_store"], 60, what="the store")
    return int(ev[0]["endpoint"].rsplit(":", 1)[1])


@needs_root
def test_unprivileged_store_writer_runs_no_code_and_spends_no_budget(daemons, tmp_path):
    marker = tmp_path / "pwned"
    d = daemons(script("ddp_tutorial.py"), "--nproc-per-node", "2", "--max-restarts", "1", *FAST,
                args=["--steps", "60", "--step-time", "0.05", "--snapshot", str(tmp_path / "snap.pt")])
    port = _store_port(d)
    pids = wait_until(lambda: d.worker_pids() if len(d.worker_pids()) == 2 else None, 60, what="workers")
    d.wait_for_step(1, 3, timeout=60)
    os.chmod(tmp_path, 0o777)  # the attacker may name the marker; only the daemon could write it
    got = as_user(NOBODY, _plant_pickle_and_budget, port, str(marker), timeout=30)
    assert isinstance(got, str), got  # the run id it found
    rejected = lambda: any(e.get("event") == "rdzv_state_rejected" for e in d.events())  # noqa: E731
    wait_until(lambda: rejected() or marker.exists(), 15, what="the daemon to read the forged state")
    assert not marker.exists(), "the forged pickle ran in the daemon"
    os.kill(pids[1], signal.SIGKILL)  # a real failure: the budget (1) still has room for it
    assert d.wait(120) == 0, d.stderr()[-3000:]
    assert "done world_size=2 rank=0 restart=1" in d.stdout()
    assert not marker.exists() and rejected()


def _forge_restart(port: int) -> str:
    c = dist.TCPStore("127.0.0.1", port, None, False, td(5))
    alive = next(k for k in c.list_keys() if re.fullmatch(r"torch\.rendezvous\.job\.\d+/elasticd/alive/0", k))
    prefix = alive.split("/", 1)[0]
    c.set(f"{prefix}/elasticd/restart", json.dumps({"summary": "forged", "node": "nowhere"}))
    c.set(f"{prefix}/elasticd/master", f"127.0.0.1 {port}")
    for _ in range(20):  # values the daemons parse, for a second (< --peer-timeout): they must not crash them
        for key in ("alive/0", "alive/1", "done/0"):
            c.set(f"{prefix}/elasticd/{key}", "not a number \xff")
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
    wait_until(lambda: re.search(r"^step 3\b", nodes[1].log_text(1), re.M), 60, what="training")
    got = as_user(NOBODY, _forge_restart, port, timeout=30)
    assert isinstance(got, str), got
    for n in nodes:
        assert n.wait(120) == 0, n.stderr()[-3000:]
    out = nodes[0].stdout() + nodes[1].stdout()
    assert "done world_size=2 rank=0 restart=0" in out and "done world_size=2 rank=1 restart=0" in out
    assert not [e for n in nodes for e in n.events() if e.get("new") == "RESTARTING"]
    rejected = {e.get("key") for n in nodes for e in n.events() if e.get("event") == "store_value_rejected"}
    # each daemon reads its peer's liveness a few times a second: at least one saw the garbage
    assert "elasticd/restart" in rejected and rejected & {"elasticd/alive/0", "elasticd/alive/1"}, rejected


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


@pytest.fixture
def store():
    s = dist.TCPStore("127.0.0.1", 0, None, True, td(5), wait_for_workers=False)
    yield s


def _state(round_: int = 3) -> bytes:
    st = _RendezvousState()
    st.round = round_
    node = _NodeDesc("10.1.2.3", 42, 0)
    st.participants[node] = 0
    st.last_heartbeats[node] = datetime.datetime.now(datetime.UTC)
    return pickle.dumps(st)


def test_check_state_accepts_torchs_state_and_refuses_anything_else(tmp_path):
    assert check_state(_state()) is None
    marker = tmp_path / "ran"
    assert "not part of a rendezvous state" in check_state(pickle.dumps(_Evil(str(marker))))
    assert not marker.exists()
    bad = _RendezvousState()
    bad.round = "1"
    assert check_state(pickle.dumps(bad)) == "a rendezvous state with fields of the wrong type"
    assert check_state(pickle.dumps({"round": 1})) == "not a rendezvous state"
    assert check_state(b"\x80\x05garbage") is not None
    assert check_state(b"(" * 100000) is not None


def test_signed_backend_refuses_forged_replayed_and_foreign_states(store):
    signer = signing.Signer(b"k" * 32, "job")
    a = SignedBackend(C10dRendezvousBackend(store, "job"), signer)
    assert a.get_state() is None
    state, token, written = a.set_state(_state(1))
    assert written and pickle.loads(state).round == 1
    old_raw = store.get("torch.rendezvous.job")
    state, token, written = a.set_state(_state(2), token)
    assert written and pickle.loads(state).round == 2

    for forged in (base64.b64encode(_state(9)),  # unsigned
                   base64.b64encode(signing.Signer(b"x" * 32, "job").seal("rendezvous-state", b"9\n" + _state(9))),
                   old_raw):  # a replay of an earlier, validly signed state
        store.set("torch.rendezvous.job", forged)
        got, token = a.get_state()
        assert pickle.loads(got).round == 2, forged[:40]
        # the handler's next write (with the store's current token) puts a good state back
        state, token, written = a.set_state(got, token)
        assert written and pickle.loads(a.get_state()[0]).round == 2

    # another node of the same job (same secret) reads what the first wrote
    b = SignedBackend(C10dRendezvousBackend(store, "job"), signing.Signer(b"k" * 32, "job"))
    assert pickle.loads(b.get_state()[0]).round == 2


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
    assert rendezvous._nproc("0") is None and rendezvous._nproc("99999999") is None
    assert rendezvous._count("1e999") is None and rendezvous._count("٣") is None


def parsed(fn, text):
    """What Rendezvous._open makes of a payload: the parser's value, or None where it raises."""
    try:
        return fn(text)
    except (ValueError, RecursionError):
        return None
