"""torchrun's command line, as a whole, runs under `elasticd run`: every flag of torch's own
torchrun parser either does what it does under torchrun or gets one line saying what to give
instead; PET_* variables and ${local_rank} in the script's arguments work as torchrun reads them."""

from __future__ import annotations

import pytest

from elasticd import config
from elasticd.config import ConfigError
from elasticd.ops import cli

# A value torchrun's parser would take for each flag that takes one (what our parser is fed).
SAMPLE = {
    "nnodes": "1",
    "nproc_per_node": "2",
    "rdzv_backend": "c10d",
    "rdzv_endpoint": "localhost:0",
    "rdzv_id": "job",
    "rdzv_conf": "join_timeout=30",
    "max_restarts": "1",
    "monitor_interval": "0.1",
    "start_method": "spawn",
    "event_log_handler": "null",
    "role": "trainer",
    "log_dir": "/tmp/x",
    "log_line_prefix_template": "${hostname}:${rank}: ",
    "print_completion": "bash",
    "redirects": "3",
    "tee": "3",
    "local_ranks_filter": "0",
    "node_rank": "0",
    "master_addr": "127.0.0.1",
    "master_port": "29500",
    "local_addr": "127.0.0.1",
    "signals_to_handle": "SIGTERM,SIGUSR1",
    "shutdown_timeout": "5",
}


REFUSED = {"logs_specs", "numa_binding", "duplicate_stdout_filters", "duplicate_stderr_filters"}


def torchrun_flags() -> list[tuple[str, str, int | str | None]]:
    """(option string, dest, nargs) of every optional argument torchrun takes."""
    from torch.distributed.run import get_args_parser

    return [
        (opt, a.dest, a.nargs)
        for a in get_args_parser()._actions
        for opt in a.option_strings
        if a.dest != "help"
    ]


@pytest.mark.parametrize(
    "opt, dest, nargs", torchrun_flags(), ids=lambda v: v if isinstance(v, str) else ""
)
def test_every_torchrun_flag_is_known(opt, dest, nargs, capsys):
    """A torch upgrade that adds a flag fails here until elasticd knows it."""
    argv = ["run", opt] + ([] if nargs == 0 else [SAMPLE.get(dest, "x")]) + ["train.py"]
    try:
        args = cli.build_parser().parse_args(argv)
    except SystemExit as e:
        err = capsys.readouterr().err
        assert "unrecognized" not in err and "invalid choice" not in err, err
        assert dest in REFUSED, f"{opt} refused: {err}"
        assert e.code == 2 and err.count("\n") == 1 and "drop the flag" in err, err
        return
    assert dest not in REFUSED, opt
    assert args.entrypoint == "train.py" and args.args == []


def test_pet_variables_are_read_below_elasticd_ones():
    env = {
        "PET_NPROC_PER_NODE": "3",
        "PET_MAX_RESTARTS": "9",
        "PET_ROLE": "r",
        "PET_RDZV_CONF": "join_timeout=42",
        "PET_SHUTDOWN_TIMEOUT": "7",
        "PET_LOCAL_RANKS_FILTER": "0,2",
        "PET_STANDALONE": "1",
    }
    cfg = config.build({"entrypoint": "x.py"}, None, environ=env)
    assert (cfg.nproc_per_node, cfg.max_restarts, cfg.role, cfg.join_timeout, cfg.stop_grace) == (
        3,
        9,
        "r",
        42.0,
        7.0,
    )
    assert cfg.local_ranks_filter == (0, 2) and cfg.standalone
    cfg = config.build(
        {"entrypoint": "x.py", "max_restarts": 1},
        None,
        environ={**env, "ELASTICD_NPROC_PER_NODE": "4"},
    )
    assert (cfg.nproc_per_node, cfg.max_restarts) == (4, 1)
    with pytest.raises(
        ConfigError, match="max_restarts in environment variable PET_MAX_RESTARTS: 'x'"
    ):
        config.build({"entrypoint": "x.py"}, None, environ={"PET_MAX_RESTARTS": "x"})


def test_rdzv_conf_maps_to_our_settings_and_explicit_ones_win(tmp_path):
    cfg = config.build(
        {
            "entrypoint": "x.py",
            "rdzv_conf": "join_timeout=30, last_call_timeout=2,read_timeout=9,"
            "keep_alive_interval=2,keep_alive_max_attempt=4",
        },
        None,
        environ={},
    )
    assert (cfg.join_timeout, cfg.last_call_timeout, cfg.peer_timeout) == (30.0, 2.0, 8.0)
    cfg = config.build(
        {"entrypoint": "x.py", "rdzv_conf": "keep_alive_max_attempt=2", "join_timeout": 5},
        None,
        environ={},
    )
    assert (cfg.join_timeout, cfg.peer_timeout) == (5.0, 10.0)  # torch's 5 s keep-alive interval
    with pytest.raises(ConfigError, match="'join_timeout' is not KEY=VALUE"):
        config.build({"entrypoint": "x.py", "rdzv_conf": "join_timeout"}, None, environ={})


@pytest.mark.parametrize(
    "flags, static, message",
    [
        (
            {"rdzv_backend": "static"},
            [("--node-rank", "0"), ("--master-addr", "10.0.0.1"), ("--master-port", "29500")],
            None,
        ),  # one node: nothing to rank or meet
        (
            {"nnodes": "2", "rdzv_endpoint": "h:1", "insecure_no_secret": True},
            [("--node-rank", "1"), ("--master-addr", "x")],
            None,
        ),  # c10d: ignored
        ({}, [("--node-rank", "1")], "--node-rank 1 on a single node"),
        ({"nnodes": "2"}, [("--node-rank", "1")], "nodes are ranked at rendezvous"),
        (
            {"nnodes": "2"},
            [("--master-addr", "10.0.0.1")],
            "--rdzv-endpoint MASTER_ADDR:MASTER_PORT",
        ),
        (
            {"nnodes": "2", "rdzv_endpoint": "h:1", "rdzv_backend": "static"},
            [],
            "ranks nodes as they join",
        ),
        ({"rdzv_backend": "zookeeper"}, [], "use c10d, etcd, etcd-v2, static"),
        ({"rdzv_backend": "etcd-v2"}, [], "needs --rdzv-endpoint with the etcd members"),
        (
            {"rdzv_backend": "c10d", "rdzv_endpoint": "h:1,h:2", "nnodes": "2"},
            [],
            "give --rdzv-backend etcd",
        ),
    ],
)
def test_static_rendezvous_flags(flags, static, message):
    pet = {
        "PET_" + f[2:].replace("-", "_").upper(): v for f, v in static
    }  # the same from torchrun's variables
    for environ, given in (({}, static), (pet, [])):
        if message is None:
            config.build({"entrypoint": "x.py", **flags}, None, environ=environ, static=given)
        else:
            with pytest.raises(ConfigError, match=message):
                config.build({"entrypoint": "x.py", **flags}, None, environ=environ, static=given)


def test_port_zero_endpoint_is_a_job_of_its_own():
    ids = {
        config.build(
            {"entrypoint": "x.py", "rdzv_endpoint": "localhost:0"}, None, environ={}
        ).rdzv_id
        for _ in range(2)
    }
    assert len(ids) == 2 and "none" not in ids


def test_print_completion_prints_elasticds_own_and_exits(capsys):
    """torch 2.14's --print-completion: a completion script for the `elasticd` command (shtab,
    as torchrun's), every subcommand in it; nothing is run."""
    assert cli.main(["run", "--print-completion", "bash", "train.py"]) == 0
    script = capsys.readouterr().out
    assert "elasticd" in script and all(c in script for c in ("run", "status", "stop"))
