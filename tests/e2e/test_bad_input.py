"""Bad input: one clear error line, exit code 2, nothing started or left running."""

from __future__ import annotations

import json
import socket
import time

import pytest

from harness import assert_one_error, run_cli, script, wait_until


@pytest.mark.parametrize(
    "args, needles",
    [
        (["no_such_module_xyz"], ["entrypoint module 'no_such_module_xyz' cannot be found"]),
        (["missing/train.py"], ["entrypoint script missing/train.py does not exist"]),
        (["entrypoints.train:nope"], ["has no function 'nope'"]),
        (["--nnodes", "3:2", script("faulty.py")], ["--nnodes '3:2'", "MAX is smaller than MIN"]),
        (["--nnodes", "0", script("faulty.py")], ["--nnodes '0'", "at least 1"]),
        (["--nnodes", "x", script("faulty.py")], ["--nnodes 'x' is not N or MIN:MAX"]),
        (
            ["--nproc-per-node", "0", script("faulty.py")],
            ["--nproc-per-node: 0 is out of range", "at least 1"],
        ),
        (
            ["--nproc-per-node", "two", script("faulty.py")],
            ["--nproc-per-node", "'two' is not a number of workers"],
        ),
        (["-m", script("faulty.py")], ["-m takes a module name", "drop -m"]),
        # torchrun's static rendezvous flags across nodes: what to give instead
        (
            ["--nnodes", "2", "--node-rank", "0", script("faulty.py")],
            ["--node-rank 0", "ranked at rendezvous", "--rdzv-endpoint"],
        ),
        (
            ["--nnodes", "2", "--master_addr=10.0.0.1", script("faulty.py")],
            ["--master-addr 10.0.0.1", "--rdzv-endpoint MASTER_ADDR"],
        ),
        (
            ["--rdzv-backend", "etcd", script("faulty.py")],
            ["--rdzv-backend etcd needs --rdzv-endpoint", "h1:2379"],
        ),
        (
            ["--rdzv-backend", "zk", script("faulty.py")],
            ["--rdzv-backend: 'zk' is not allowed", "use c10d, etcd"],
        ),
        (
            [
                "--rdzv-backend",
                "etcd",
                "--rdzv-endpoint",
                "h1:2379",
                "--etcd-user",
                "u",
                script("faulty.py"),
            ],
            ["--etcd-user and --etcd-password-file go together"],
        ),
        (
            ["--max-restarts", "-1", script("faulty.py")],
            ["--max-restarts: -1 is out of range", "at least 0"],
        ),
        (["--nnodes", "2", script("faulty.py")], ["needs --rdzv-endpoint"]),
        (
            ["--rdzv-endpoint", "localhost:http", script("faulty.py")],
            ["port 'http' is not a number"],
        ),
        (["--log-format", "xml", script("faulty.py")], ["--log-format", "invalid choice"]),
        (["--bogus-flag"], ["unrecognized arguments: --bogus-flag"]),
    ],
)
def test_bad_input_exits_2_with_one_line(args, needles, tmp_path):
    assert_one_error(
        run_cli("run", "--log-dir", str(tmp_path), "--socket", str(tmp_path / "s"), *args), *needles
    )


def test_port_in_use(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        r = run_cli(
            "run",
            "--log-dir",
            str(tmp_path),
            "--socket",
            str(tmp_path / "s"),
            "--rdzv-endpoint",
            f"127.0.0.1:{port}",
            script("faulty.py"),
        )
    assert_one_error(r, f"port {port}", "in use")


def test_unwritable_log_dir(tmp_path):
    ro = tmp_path / "ro"
    ro.mkdir()
    (ro / "file").write_text("x")
    r = run_cli(
        "run",
        "--log-dir",
        str(ro / "file" / "sub"),
        "--socket",
        str(tmp_path / "s"),
        script("faulty.py"),
    )
    assert_one_error(r, "--log-dir", "not writable")


def test_bad_config_file(tmp_path):
    cfg = tmp_path / "c.toml"
    cfg.write_text('nproc_per_node = "many"\n')
    r = run_cli("run", "--config", str(cfg), "--log-dir", str(tmp_path), script("faulty.py"))
    assert_one_error(r, "nproc_per_node", "'many' is not a number of workers, auto, gpu or cpu")
    cfg.write_text("nprocs = 2\n")
    r = run_cli("run", "--config", str(cfg), "--log-dir", str(tmp_path), script("faulty.py"))
    assert_one_error(r, "unknown setting 'nprocs'")
    cfg.write_text("nproc_per_node = \n")
    r = run_cli("run", "--config", str(cfg), "--log-dir", str(tmp_path), script("faulty.py"))
    assert_one_error(r, "is not valid TOML")
    r = run_cli("run", "--config", str(tmp_path / "missing.toml"), script("faulty.py"))
    assert_one_error(r, "does not exist")


def test_help_documents_exit_codes():
    r = run_cli("run", "--help")
    assert r.returncode == 0
    assert "exit codes" in r.stdout and "2 bad input" in r.stdout


# --- issue 18: values that used to pass validation and then crash, hang or misplace data ---------


@pytest.mark.parametrize(
    "args, env, needles",
    [
        # inf/nan/absurd numbers, from flags, --rdzv-conf, torchrun's PET_* and our ELASTICD_*
        # variables
        (
            ["--join-timeout", "inf"],
            {},
            ["join_timeout in --join-timeout: inf is out of range", "30 days"],
        ),
        (["--stop-grace", "nan"], {}, ["stop_grace in --stop-grace: nan is out of range"]),
        (
            ["--monitor-interval", "nan"],
            {},
            ["monitor_interval in --monitor-interval: nan is out of range"],
        ),
        (["--monitor-interval", "1e-9"], {}, ["at least 0.01"]),
        (
            ["--heartbeat-timeout", "-1"],
            {},
            ["heartbeat_timeout in --heartbeat-timeout: -1.0 is out of range"],
        ),
        (["--rdzv-conf", "join_timeout=1e999"], {}, ["join_timeout", "inf is out of range"]),
        (
            ["--rdzv-conf", "keep_alive_interval=1e308,keep_alive_max_attempt=10"],
            {},
            ["peer_timeout", "inf"],
        ),
        (
            [],
            {"PET_SHUTDOWN_TIMEOUT": "inf"},
            ["environment variable PET_SHUTDOWN_TIMEOUT: inf is out of range"],
        ),
        (
            [],
            {"ELASTICD_KILL_TIMEOUT": "1e999"},
            ["environment variable ELASTICD_KILL_TIMEOUT: inf"],
        ),
        (
            ["--nproc-per-node", "100000"],
            {},
            ["--nproc-per-node: 100000 is out of range", "at most 1024"],
        ),
        (["--max-restarts", "10000000000"], {}, ["--max-restarts: 10000000000 is out of range"]),
        (["--nnodes", "1:100000000"], {}, ["--nnodes '1:100000000': at most 100000 nodes"]),
        # signals a worker cannot dump its stacks on (every worker would die) or names that are not
        # signals
        (["--stack-signal", "SIGKILL"], {}, ["SIGKILL cannot be a stack-dump signal", "SIGUSR1"]),
        (["--stack-signal", "SIGSEGV"], {}, ["SIGSEGV cannot be a stack-dump signal"]),
        (["--stack-signal", "SIG_IGN"], {}, ["'SIG_IGN' is not a signal name"]),
        (["--stack-signal", "SIGTERM"], {}, ["SIGTERM cannot be a stack-dump signal"]),
        (
            ["--signals-to-handle", "SIGTERM,SIGSEGV"],
            {},
            ["SIGSEGV cannot stop the daemon gracefully"],
        ),
        # ids and names that end up in paths, sockets, group lookups
        (["--rdzv-id", ".."], {}, ["rdzv_id in --rdzv-id: '..' is not allowed", "letters, digits"]),
        (["--rdzv-id", "a/../../b"], {}, ["'a/../../b' is not allowed"]),
        (["--rdzv-id", ".hidden"], {}, ["not starting with '.'"]),
        (["--rdzv-id", "x" * 129], {}, ["1-128 letters"]),
        (
            [],
            {"PET_RDZV_ID": "job 1"},
            ["environment variable PET_RDZV_ID: 'job 1' is not allowed"],
        ),
        (
            ["--operators-group", "99999999999999999999"],
            {},
            ["a group id must be below 4294967295"],
        ),
        (["--role", "a\x1b[2Jb"], {}, ["role in --role", "printable"]),
        (["--preload", "torch,os;import"], {}, ["'os;import' is not a module name"]),
        (["--fatal-exit-codes", "3,999"], {}, ["exit codes are 0-255"]),
    ],
)
def test_issue18_values_exit_2_with_one_line(args, env, needles, tmp_path):
    r = run_cli(
        "run",
        "--log-dir",
        str(tmp_path),
        "--socket",
        str(tmp_path / "s"),
        *args,
        script("faulty.py"),
        "--steps",
        "1",
        env=env,
        timeout=30,
    )
    assert_one_error(r, *needles)
    assert not any(tmp_path.iterdir()), "nothing may be created for a refused config"


def _config_file(tmp_path, content: bytes):
    path = tmp_path / "c.toml"
    path.write_bytes(content)
    return str(path)


@pytest.mark.parametrize(
    "make, needles",
    [
        (lambda tmp: str(tmp), ["is a directory", "give the path of a TOML file"]),
        (lambda tmp: "/tmp", ["config file /tmp is a directory"]),
        (
            lambda tmp: _config_file(tmp, b'log_dir = "/tmp/a\\u0000b"\n'),
            ["log_dir in config file", "NUL"],
        ),
        (
            lambda tmp: _config_file(tmp, b'entrypoint = "x\\u0000.py"\n'),
            ["entrypoint in config file", "NUL"],
        ),
        (
            lambda tmp: _config_file(tmp, b'args = ["ok", "a\\u0000"]\n'),
            ["args in config file", "NUL"],
        ),
        (
            lambda tmp: _config_file(tmp, b'role = "caf\xe9"\n'),
            ["is not UTF-8 text", "save it as UTF-8"],
        ),
        (lambda tmp: _config_file(tmp, b"\x89PNG\r\n\x1a\n\x00\x00"), ["is not UTF-8 text"]),
        (lambda tmp: _config_file(tmp, b"elasticd = 3\n"), ["elasticd is int, not a table"]),
        (
            lambda tmp: _config_file(tmp, b"stop_grace = nan\n"),
            ["stop_grace in config file", "nan is out of range"],
        ),
        (
            lambda tmp: _config_file(tmp, b"join_timeout = inf\n"),
            ["join_timeout in config file", "inf"],
        ),
        (
            lambda tmp: _config_file(tmp, b"max_restarts = " + b"9" * 5000 + b"\n"),
            ["is not valid TOML"],
        ),
        (
            lambda tmp: _config_file(tmp, b"args = [1, {a = 2}]\n"),
            ["args in config file", "is not a list of strings"],
        ),
        (
            lambda tmp: _config_file(tmp, b"fatal_exit_codes = [1.5]\n"),
            ["is not a list of whole numbers"],
        ),
        (
            lambda tmp: _config_file(tmp, b"fatal_exit_codes = [true]\n"),
            ["is not a list of whole numbers"],
        ),
    ],
)
def test_bad_config_files_exit_2_with_one_line(make, needles, tmp_path):
    cfg = make(tmp_path)
    r = run_cli(
        "run",
        "--config",
        cfg,
        "--log-dir",
        str(tmp_path / "logs"),
        "--socket",
        str(tmp_path / "s"),
        script("faulty.py"),
        "--steps",
        "1",
        timeout=30,
    )
    assert_one_error(r, *needles)
    assert not (tmp_path / "logs").exists()


def test_error_line_stays_one_line_whatever_the_value_holds(tmp_path):
    """A newline in an environment variable quoted in a message must not split it in two."""
    r = run_cli(
        "run",
        "--log-dir",
        str(tmp_path),
        "--nproc-per-node",
        "2",
        "--virtual-local-rank",
        script("faulty.py"),
        env={"CUDA_VISIBLE_DEVICES": "3\nelasticd: error: forged\x1eand\u2028more"},
    )
    assert_one_error(
        r, "--virtual-local-rank with 2 workers", "3\\nelasticd: error: forged\\x1eand\\u2028more"
    )


def test_stop_timeout_inf_is_refused_and_the_daemon_keeps_running(daemons):
    """`elasticd stop --timeout inf` (and a raw request with 1e999, NaN, a string or a negative)
    used to be accepted, then the daemon died in systemd.extend_timeout with OverflowError:
    workers SIGKILLed, nothing saved. Now the CLI and the daemon refuse it, and a sane stop after
    that still stops the job gracefully."""
    d = daemons(
        script("faulty.py"),
        "--nproc-per-node",
        "1",
        "--stop-grace",
        "2",
        args=["--steps", "100000", "--step-time", "0.05"],
    )
    d.wait_for_step(0, 2, timeout=60)
    wait_until(lambda: d.status().returncode == 0, 30, what="status to answer")
    for bad in ("inf", "nan", "-1", "1e999", "soon"):
        r = run_cli("stop", "--socket", str(d.socket), "--timeout", bad, timeout=30)
        assert_one_error(r, "--timeout")
    for raw in (
        b'{"version": 1, "command": "stop", "timeout": 1e999}',
        b'{"version": 1, "command": "stop", "timeout": NaN}',
        b'{"version": 1, "command": "stop", "timeout": -Infinity}',
        b'{"version": 1, "command": "stop", "timeout": 1' + b"0" * 400 + b"}",
        b'{"version": 1, "command": "stop", "timeout": "30"}',
    ):
        with socket.socket(socket.AF_UNIX) as s:
            s.settimeout(10)
            s.connect(str(d.socket))
            s.sendall(raw + b"\n")
            reply = json.loads(s.makefile("rb").readline())
        assert reply["ok"] is False and "timeout" in reply["error"], (raw[:80], reply)
    time.sleep(0.5)  # a stop taken, or a crash, would show by now
    assert d.proc.poll() is None, d.stderr()[-3000:]
    assert json.loads(d.status("--json").stdout)["state"] == "RUNNING"
    r = run_cli("stop", "--socket", str(d.socket), "--timeout", "2", timeout=60)
    assert r.returncode == 0, r.stderr
    assert d.wait(30) == 0
    assert "Traceback" not in d.stderr()
    assert [e["new"] for e in d.events() if e.get("event") == "state"][-1] == "STOPPED"
