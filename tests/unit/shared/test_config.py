"""Config layers (defaults <- TOML file <- environment <- flags) and their error messages."""

from __future__ import annotations

import os

import pytest

from elasticd import config, config_layers, config_values
from elasticd.config import ConfigError
from harness import ROOT


def write(tmp_path, text):
    p = tmp_path / "elasticd.toml"
    p.write_text(text)
    return str(p)


def test_precedence_flags_over_env_over_file(tmp_path):
    path = write(
        tmp_path,
        'nproc_per_node = 3\nmax_restarts = 7\nheartbeat_timeout = 60\nentrypoint = "x.py"\n'
        'args = ["--a", "1"]\nfatal_exit_codes = [3, 4]\n',
    )
    cfg = config.build({}, path, environ={})
    assert (cfg.nproc_per_node, cfg.max_restarts, cfg.heartbeat_timeout) == (3, 7, 60.0)
    assert cfg.args == ("--a", "1") and cfg.fatal_exit_codes == (3, 4)
    cfg = config.build(
        {}, path, environ={"ELASTICD_MAX_RESTARTS": "9", "ELASTICD_NPROC_PER_NODE": "5"}
    )
    assert (cfg.nproc_per_node, cfg.max_restarts) == (5, 9)
    cfg = config.build({"nproc_per_node": 2}, path, environ={"ELASTICD_NPROC_PER_NODE": "5"})
    assert (cfg.nproc_per_node, cfg.max_restarts) == (2, 7)


def test_nproc_per_node_takes_torchruns_words(tmp_path):
    """gpu: one worker per visible CUDA device; cpu: one per CPU; auto: gpu where there is one."""
    gpus = config_layers.cuda_devices()
    path = write(tmp_path, 'nproc_per_node = "auto"\nentrypoint = "x.py"\n')
    assert config.build({}, path, environ={}).nproc_per_node == (gpus or os.cpu_count())
    assert (
        config.build({"nproc_per_node": "CPU"}, path, environ={}).nproc_per_node == os.cpu_count()
    )
    assert config.build({}, path, environ={"ELASTICD_NPROC_PER_NODE": "3"}).nproc_per_node == 3
    if gpus:
        assert config.build({"nproc_per_node": "gpu"}, path, environ={}).nproc_per_node == gpus
    else:
        with pytest.raises(
            ConfigError,
            match="nproc_per_node in --nproc-per-node: gpu means one worker per CUDA "
            "device, and none is visible",
        ):
            config.build({"nproc_per_node": "gpu"}, path, environ={})
    with pytest.raises(
        ConfigError,
        match="nproc_per_node in environment variable ELASTICD_NPROC_PER_NODE: '4x' is "
        "not a number of workers",
    ):
        config.build({}, path, environ={"ELASTICD_NPROC_PER_NODE": "4x"})


def test_defaults():
    cfg = config.build({}, None, environ={})
    assert cfg.entrypoint == config.DEFAULT_ENTRYPOINT and cfg.nproc_per_node >= 1
    assert cfg.monitor_interval == 0.1 and cfg.max_restarts == 3 and cfg.warm_spawn
    assert cfg.min_nodes == cfg.max_nodes == 1
    assert (
        config.build({"entrypoint": "m"}, None, environ={}).nproc_per_node == 1
    )  # torchrun's default


def test_preload_adds_to_the_defaults(tmp_path):
    """--preload, its TOML key and ELASTICD_PRELOAD add to what spares always import: replacing
    the list made a `--preload transformers` spare lose torch._dynamo (issue 31)."""
    assert config.build({}, None, environ={}).preloaded == config.DEFAULT_PRELOAD
    path = write(tmp_path, 'preload = ["yaml", "torch"]\n')
    extra = ("yaml",)  # torch, already a default, is imported once
    assert config.build({}, path, environ={}).preloaded == config.DEFAULT_PRELOAD + extra
    env = {"ELASTICD_PRELOAD": "json yaml"}
    got = config.build({}, None, environ=env).preloaded
    assert got == (*config.DEFAULT_PRELOAD, "json", "yaml")
    cfg = config.build({"preload": ("pytorch_lightning",)}, path, environ=env)
    assert cfg.preloaded == (*config.DEFAULT_PRELOAD, "pytorch_lightning")  # flags win, as ever


@pytest.mark.parametrize(
    "text, message",
    [
        ("nproc_per_node = 1.5\n", "nproc_per_node in config file"),
        ("require_heartbeat = 3\n", "is not true or false"),
        ('heartbeat_timeout = "soon"\n', "is not a number"),
        ("args = 5\n", "is not a list"),
        ('fatal_exit_codes = ["x"]\n', "is not a list of whole numbers"),
        (
            "monitor_interval = 0\n",
            "monitor_interval in config file .*: 0.0 is out of range; use a number at least 0.01",
        ),
        ('nnodes = "4:2"\n', "MAX is smaller than MIN"),
        ('log_format = "xml"\n', "--log-format 'xml'"),
        ('stack_signal = "SIGNOPE"\n', "not a signal name such as SIGUSR1"),
        ("colour = true\n", "unknown setting 'colour'"),
    ],
)
def test_bad_values_name_the_key(tmp_path, text, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace("[", r"\[")):
        config.build({}, write(tmp_path, text), environ={})


def test_bad_environment_value_names_the_variable():
    with pytest.raises(ConfigError, match="ELASTICD_MAX_RESTARTS"):
        config.build({}, None, environ={"ELASTICD_MAX_RESTARTS": "lots"})


def test_elasticd_section_is_accepted(tmp_path):
    cfg = config.build({}, write(tmp_path, "[elasticd]\nmax_restarts = 1\n"), environ={})
    assert cfg.max_restarts == 1


@pytest.mark.parametrize("text, expect", [("2", (2, 2)), ("1:4", (1, 4))])
def test_nnodes(text, expect):
    assert config.parse_nnodes(text) == expect


@pytest.mark.parametrize(
    "text, expect",
    [
        ("h:29500", ("h", 29500)),
        ("h", ("h", 29400)),
        ("[::1]:7", ("::1", 7)),
        ("", ("127.0.0.1", 0)),
    ],
)
def test_endpoint(text, expect):
    assert config.parse_endpoint(text) == expect


def test_example_config_parses():

    example = ROOT / "systemd" / "elasticd.toml.example"
    uncommented = "\n".join(
        line[2:]
        for line in example.read_text().splitlines()
        if line.startswith("# ") and " = " in line.split("#")[1]
    )
    import tomllib

    keys = set(tomllib.loads(uncommented))
    assert keys <= set(config.FIELDS), keys - set(config.FIELDS)
    assert set(config.FIELDS) == keys, set(config.FIELDS) - keys


# --- issue 18: every numeric and name-like setting judged once, whatever layer it came from -------


@pytest.mark.parametrize(
    "flags, environ, text, message",
    [
        (
            {},
            {},
            "stop_grace = nan\n",
            (
                "stop_grace in config file .*: nan is out of range; use a number at least 0 "
                "and at most 2592000 seconds"
            ),
        ),
        (
            {},
            {},
            "join_timeout = inf\n",
            ("join_timeout in config file .*: inf is out of range; use a number greater than 0"),
        ),
        (
            {},
            {},
            "monitor_interval = nan\n",
            "monitor_interval in config file .*: nan is out of range",
        ),
        (
            {},
            {},
            "exit_barrier_timeout = -inf\n",
            "exit_barrier_timeout in config file .*: -inf is out of range",
        ),
        (
            {},
            {},
            "max_restarts = 1e7\n",
            (
                "max_restarts in config file .*: 10000000 is out of range; use a number at "
                "least 0 and at most 1000000$"
            ),
        ),
        (
            {"nproc_per_node": "100000"},
            {},
            "",
            "nproc_per_node in --nproc-per-node: 100000 is out of range",
        ),
        (
            {"rdzv_conf": "join_timeout=inf"},
            {},
            "",
            "join_timeout in --join-timeout: inf is out of range",
        ),
        (
            {},
            {"PET_MONITOR_INTERVAL": "nan"},
            "",
            "environment variable PET_MONITOR_INTERVAL: nan is out of range",
        ),
        (
            {},
            {"ELASTICD_STOP_GRACE": "1e999"},
            "",
            "environment variable ELASTICD_STOP_GRACE: inf is out of range",
        ),
        (
            {},
            {},
            'stack_signal = "SIGKILL"\n',
            "SIGKILL cannot be a stack-dump signal; use one of SIGUSR1",
        ),
        ({}, {}, 'stack_signal = "SIGSTOP"\n', "SIGSTOP cannot be a stack-dump signal"),
        ({}, {}, 'stack_signal = "SIG_IGN"\n', "'SIG_IGN' is not a signal name"),
        (
            {},
            {},
            'signals_to_handle = ["SIGTERM", "SIGCONT"]\n',
            "SIGCONT cannot stop the daemon gracefully",
        ),
        (
            {},
            {},
            'rdzv_id = ".."\n',
            "rdzv_id in config file .*: '..' is not allowed; use 1-128 letters",
        ),
        ({}, {"ELASTICD_RDZV_ID": "../../etc"}, "", "ELASTICD_RDZV_ID: '../../etc' is not allowed"),
        (
            {},
            {},
            'log_dir = "/tmp/a\\u0000b"\n',
            "log_dir in config file .*: '/tmp/a\\\\x00b' contains a NUL",
        ),
        ({}, {}, 'operators_group = "a\\u0000"\n', "operators_group in config file .*NUL"),
        ({}, {}, "local_ranks_filter = [0, 5000]\n", "local ranks are 0 to"),
        ({}, {}, "args = [true]\n", "args in config file .*: \\[True\\] is not a list of strings"),
    ],
)
def test_issue18_values_are_refused_with_their_source(tmp_path, flags, environ, text, message):
    with pytest.raises(ConfigError, match=message):
        config.build(
            {"entrypoint": "x.py", **flags},
            write(tmp_path, text) if text else None,
            environ=environ,
        )


def test_config_path_that_is_a_directory_is_a_config_error(tmp_path):
    with pytest.raises(ConfigError, match=f"config file {tmp_path} is a directory"):
        config_layers.load_toml(str(tmp_path))


def test_limits_fit_what_the_values_reach():
    """The largest accepted timeout fits systemd's EXTEND_TIMEOUT_USEC (a uint64 of
    microseconds, three of them added at stop), threading and timedelta."""
    import datetime
    import threading

    assert 3 * config.MAX_SECONDS * 1e6 < 2**64 and config.MAX_SECONDS < threading.TIMEOUT_MAX
    datetime.timedelta(seconds=config.MAX_SECONDS)
    ok = config.build(
        {
            "entrypoint": "x.py",
            "stop_grace": str(config.MAX_SECONDS),
            "join_timeout": "2592000",
            "rdzv_id": "torchtitan-llama3_8b.v2",
            "nproc_per_node": "1024",
            "stack_signal": "SIGUSR2",
        },
        None,
        environ={},
    )
    assert ok.stop_grace == config.MAX_SECONDS and ok.rdzv_id == "torchtitan-llama3_8b.v2"
    for good in ("job42", "none", "123456", "3f2b1c9e-8d7a-4e6b-9c1d-2a3b4c5d6e7f", "a" * 128):
        config_values.check_value("rdzv_id", good, "--rdzv-id")
