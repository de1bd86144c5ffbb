"""Bad input: one clear error line, exit code 2, nothing started or left running."""

from __future__ import annotations

import os
import socket
import subprocess
import sys

import pytest

from harness import ROOT, script


def run_cli(*args: str, timeout: float = 60, cwd=ROOT, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "elasticd.cli", *args], capture_output=True, text=True,
                          timeout=timeout, cwd=cwd, env=dict(os.environ, **(env or {})))


def assert_one_error(r: subprocess.CompletedProcess, *needles: str) -> None:
    assert r.returncode == 2, (r.returncode, r.stdout, r.stderr)
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1, r.stderr
    assert lines[0].startswith("elasticd: error: ")
    for n in needles:
        assert n in lines[0], lines[0]


@pytest.mark.parametrize("args, needles", [
    (["no_such_module_xyz"], ["entrypoint module 'no_such_module_xyz' cannot be found"]),
    (["missing/train.py"], ["entrypoint script missing/train.py does not exist"]),
    (["entrypoints.train:nope"], ["has no function 'nope'"]),
    (["--nnodes", "3:2", script("faulty.py")], ["--nnodes '3:2'", "MAX is smaller than MIN"]),
    (["--nnodes", "0", script("faulty.py")], ["--nnodes '0'", "at least 1"]),
    (["--nnodes", "x", script("faulty.py")], ["--nnodes 'x' is not N or MIN:MAX"]),
    (["--nproc-per-node", "0", script("faulty.py")], ["--nproc-per-node: 0 is out of range", "at least 1"]),
    (["--nproc-per-node", "two", script("faulty.py")], ["--nproc-per-node", "'two' is not a number of workers"]),
    (["-m", script("faulty.py")], ["-m takes a module name", "drop -m"]),
    # torchrun's static rendezvous flags across nodes: what to give instead
    (["--nnodes", "2", "--node-rank", "0", script("faulty.py")], ["--node-rank 0", "ranked at rendezvous",
                                                                  "--rdzv-endpoint"]),
    (["--nnodes", "2", "--master_addr=10.0.0.1", script("faulty.py")], ["--master-addr 10.0.0.1",
                                                                         "--rdzv-endpoint MASTER_ADDR"]),
    (["--rdzv-backend", "etcd", script("faulty.py")], ["--rdzv-backend etcd", "c10d only"]),
    (["--max-restarts", "-1", script("faulty.py")], ["--max-restarts: -1 is out of range", "at least 0"]),
    (["--nnodes", "2", script("faulty.py")], ["needs --rdzv-endpoint"]),
    (["--rdzv-endpoint", "localhost:http", script("faulty.py")], ["port 'http' is not a number"]),
    (["--log-format", "xml", script("faulty.py")], ["--log-format", "invalid choice"]),
    (["--bogus-flag"], ["unrecognized arguments: --bogus-flag"]),
])
def test_bad_input_exits_2_with_one_line(args, needles, tmp_path):
    assert_one_error(run_cli("run", "--log-dir", str(tmp_path), "--socket", str(tmp_path / "s"), *args), *needles)


def test_port_in_use(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        r = run_cli("run", "--log-dir", str(tmp_path), "--socket", str(tmp_path / "s"),
                    "--rdzv-endpoint", f"127.0.0.1:{port}", script("faulty.py"))
    assert_one_error(r, f"port {port}", "in use")


def test_unwritable_log_dir(tmp_path):
    ro = tmp_path / "ro"
    ro.mkdir()
    (ro / "file").write_text("x")
    r = run_cli("run", "--log-dir", str(ro / "file" / "sub"), "--socket", str(tmp_path / "s"), script("faulty.py"))
    assert_one_error(r, "--log-dir", "not writable")


def test_bad_config_file(tmp_path):
    cfg = tmp_path / "c.toml"
    cfg.write_text('nproc_per_node = "many"\n')
    r = run_cli("run", "--config", str(cfg), "--log-dir", str(tmp_path), script("faulty.py"))
    assert_one_error(r, "nproc_per_node", "'many' is not a number of workers, auto, gpu or cpu")
    cfg.write_text('nprocs = 2\n')
    r = run_cli("run", "--config", str(cfg), "--log-dir", str(tmp_path), script("faulty.py"))
    assert_one_error(r, "unknown setting 'nprocs'")
    cfg.write_text('nproc_per_node = \n')
    r = run_cli("run", "--config", str(cfg), "--log-dir", str(tmp_path), script("faulty.py"))
    assert_one_error(r, "is not valid TOML")
    r = run_cli("run", "--config", str(tmp_path / "missing.toml"), script("faulty.py"))
    assert_one_error(r, "does not exist")


def test_help_documents_exit_codes():
    r = run_cli("run", "--help")
    assert r.returncode == 0
    assert "exit codes" in r.stdout and "2 bad input" in r.stdout
