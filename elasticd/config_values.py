"""Every setting's value judged: each alone, in one place whatever its layer (`check_value`:
finite numbers in range, safe ids and signal names, no NUL), and the whole Config where settings
span each other (`validate`, torchrun's static-rendezvous flags in `check_static`, and `resolve`,
with which config.build ends). The CLI's `stop --timeout` and the control socket's stop `timeout`
reuse `check_value`.

The ranges are `_RANGES`, the name rules `_NAME_RULES`. `resolve` also demands a secret across
nodes (or `--insecure-no-secret`) and gives a single-node job its private store.
"""

from __future__ import annotations

import dataclasses
import os
import re
import signal
import uuid
from typing import Any

from elasticd.config import (
    FIELDS,
    IN_PLACE,
    LOG_FORMATS,
    MAX_NPROC,
    MAX_RESTARTS,
    MAX_SECONDS,
    STRAGGLER_ACTIONS,
    Config,
    ConfigError,
    parse_endpoint,
    parse_nnodes,
    parse_std,
)

# Numeric settings: (least, most, whether `least` itself is allowed). monitor_interval paces the
# loop that feeds systemd's watchdog and answers stops: not a busy loop, not asleep for long.
_RANGES: dict[str, tuple[float, float, bool]] = {
    "nproc_per_node": (1, max(MAX_NPROC, os.cpu_count() or 1), True),
    "max_restarts": (0, MAX_RESTARTS, True),
    "deterministic_retries": (0, MAX_RESTARTS, True),
    "monitor_interval": (0.01, 10.0, True),
    **{
        k: (0.0, MAX_SECONDS, False)
        for k in (
            "heartbeat_timeout",
            "startup_timeout",
            "join_timeout",
            "exit_barrier_timeout",
            "peer_timeout",
            "kill_timeout",
        )
    },
    **{
        k: (0.0, MAX_SECONDS, True)
        for k in (
            "stop_grace",
            "restart_grace",
            "crash_grace",
            "restart_backoff",
            "restart_backoff_max",
            "last_call_timeout",
            "health_check_interval",
            "replay_timeout",
        )
    },
    "health_check_timeout": (0.0, MAX_SECONDS, False),
    "quarantine_after": (0, 1000, True),  # 0: never
    "quarantine_window": (0.0, MAX_SECONDS, False),
    "straggler_threshold": (0.0, 100.0, True),  # 0: off; 0.2: 20% above the median
    "straggler_window": (1.0, MAX_SECONDS, True),
}

# Signals a worker may dump its stacks on (faulthandler registers them; a worker that has not yet
# registered the handler is ended, as by SIGTERM). Not: signals that stop workers (SIGTERM,
# SIGINT), cannot be caught (SIGKILL, SIGSTOP), are faults faulthandler reserves (SIGSEGV, SIGBUS,
# SIGFPE, SIGILL, SIGABRT), or arrive in ordinary operation (SIGCHLD, SIGCONT, SIGPIPE, SIGALRM,
# SIGPROF...).
STACK_SIGNALS = tuple(
    n for n in ("SIGUSR1", "SIGUSR2", "SIGHUP", "SIGQUIT", "SIGPWR") if hasattr(signal, n)
)
# Signals that may stop the daemon gracefully: the asynchronous ones a user, scheduler or batch
# system sends (SLURM's --signal, LSF's SIGXCPU warning...), not faults, job control or SIGCHLD.
STOP_SIGNALS = tuple(
    n
    for n in (
        "SIGTERM",
        "SIGINT",
        "SIGHUP",
        "SIGQUIT",
        "SIGUSR1",
        "SIGUSR2",
        "SIGALRM",
        "SIGPWR",
        "SIGXCPU",
        "SIGVTALRM",
        "SIGPROF",
    )
    if hasattr(signal, n)
)
# A job id lands in directory names (<log dir>/<id>-..., checkpoints/<id>) and socket names.
RDZV_ID = re.compile(r"[A-Za-z0-9_-][A-Za-z0-9._-]{0,127}")


def _limits(key: str) -> str:
    least, most, closed = _RANGES[key]
    unit = (
        " seconds" + (" (30 days)" if most == MAX_SECONDS else "")
        if isinstance(least, float)
        else ""
    )
    return f"{'at least' if closed else 'greater than'} {least:g} and at most {most:.10g}{unit}"


def check_value(key: str, value: Any, where: str) -> Any:
    """`value` if it is a sane `key` (a number in range, a safe name), else ConfigError naming
    `where` it came from. The one place every setting's value is judged, whatever its layer."""
    strings = value if isinstance(value, tuple) else (value,)
    if any(isinstance(v, str) and "\0" in v for v in strings):
        raise ConfigError(f"{where}: {value!r} contains a NUL character; remove it")
    if key in _RANGES:
        least, most, closed = _RANGES[key]
        if not (least <= value <= most) or (value == least and not closed):
            raise ConfigError(f"{where}: {value!r} is out of range; use a number {_limits(key)}")
    problem = _NAME_RULES[key](value) if key in _NAME_RULES else None
    if problem:
        raise ConfigError(f"{where}: {value!r} is not allowed; {problem}")
    return value


def _rdzv_id_problem(v: str) -> str | None:
    if not RDZV_ID.fullmatch(v) or ".." in v:
        return (
            "use 1-128 letters, digits, '.', '_' or '-', not starting with '.' and without '..' "
            "(e.g. job42, a UUID or $SLURM_JOB_ID)"
        )
    return None


def _group_problem(v: str) -> str | None:
    if v.isascii() and v.isdigit():
        return None if int(v) < 2**32 - 1 else "a group id must be below 4294967295"
    if v and (not v.isprintable() or ":" in v or len(v) > 256):
        return "use a group name (printable, without ':') or a numeric group id"
    return None


def _signal_problem(name: str, allowed: tuple[str, ...], refusal: str) -> str | None:
    if name in allowed:
        return None
    if name.startswith("SIG_") or not isinstance(getattr(signal, name, None), signal.Signals):
        return f"{name!r} is not a signal name such as {allowed[0]}"
    return f"{name} {refusal}; use one of {', '.join(allowed)}"


def parse_metrics_address(text: str) -> tuple[str, int]:
    """--metrics-address HOST:PORT (IPv6 as [addr]:PORT): a host and a fixed port, both required."""
    problem, host, port = _metrics_address(str(text))
    if problem:
        raise ConfigError(f"--metrics-address {text!r}: {problem}")
    return host, port


def _metrics_address(text: str) -> tuple[str | None, str, int]:
    """(what is wrong or None, host, port)."""
    host, sep, port_text = text.rpartition(":")
    if not sep or not host or "]" in port_text:
        return "use HOST:PORT (e.g. 127.0.0.1:9400 or [::1]:9400)", "", 0
    if host.startswith("[") != host.endswith("]") or (":" in host and not host.startswith("[")):
        return "write an IPv6 address in brackets, e.g. [::1]:9400", "", 0
    host = host[1:-1] if host.startswith("[") else host
    if not port_text.isascii() or not port_text.isdigit() or not 1 <= int(port_text) <= 65535:
        return (
            "the port must be a number from 1 to 65535 (a fixed port Prometheus can be pointed at)",
            "",
            0,
        )
    if not host or len(host) > 255 or not all(c.isalnum() or c in ".-:_%" for c in host):
        return f"{host!r} is not an IP address or host name", "", 0
    return None, host, int(port_text)


ALL_INTERFACES = ("0.0.0.0", "::", "0:0:0:0:0:0:0:0")


_NAME_RULES = {
    "metrics_address": lambda v: _metrics_address(v)[0] if v else None,
    "straggler_action": lambda v: (
        None
        if v in STRAGGLER_ACTIONS
        else f"use {' or '.join(STRAGGLER_ACTIONS)} "
        "(restart and exclude-node are not implemented yet)"
    ),
    "in_place": lambda v: None if v in IN_PLACE else f"use {' or '.join(IN_PLACE)}",
    "health_check": lambda v: (
        None
        if v.isprintable() and len(v) <= 4096
        else "use a printable command line of at most 4096 characters"
    ),
    "metrics_textfile": lambda v: (
        None
        if not v or (v.isprintable() and not v.endswith("/"))
        else "use a printable file path, e.g. /var/lib/node_exporter/textfile/elasticd.prom"
    ),
    "rdzv_id": _rdzv_id_problem,
    "role": lambda v: (
        None
        if v and v.isprintable() and len(v) <= 128
        else "use a printable name of 1-128 characters"
    ),
    "stack_signal": lambda v: _signal_problem(v, STACK_SIGNALS, "cannot be a stack-dump signal"),
    "signals_to_handle": lambda vs: next(
        filter(
            None,
            (_signal_problem(v, STOP_SIGNALS, "cannot stop the daemon gracefully") for v in vs),
        ),
        None,
    ),
    "operators_group": _group_problem,
    "rdzv_backend": lambda v: None if v in RDZV_BACKENDS else f"use {', '.join(RDZV_BACKENDS)}",
    "local_addr": lambda v: (
        None
        if len(v) <= 255 and all(c.isprintable() and not c.isspace() for c in v)
        else "use an IP address or host name"
    ),
    "preload": lambda vs: next(
        (
            f"{v!r} is not a module name such as torch.nn"
            for v in vs
            if not all(p.isidentifier() for p in v.split("."))
        ),
        None,
    ),
    "fatal_exit_codes": lambda vs: (
        None
        if all(-64 <= v <= 255 for v in vs)
        else "exit codes are 0-255 (or -N for a worker killed by signal N)"
    ),
    "local_ranks_filter": lambda vs: (
        None
        if all(0 <= v < _RANGES["nproc_per_node"][1] for v in vs)
        else f"local ranks are 0 to {_RANGES['nproc_per_node'][1] - 1}"
    ),
}


RDZV_BACKENDS = (
    "c10d",
    "etcd",
    "etcd-v2",
    "static",
)  # torchrun's names; etcd-v2 is our etcd (its v3 API)


def check_static(static: list[tuple[str, str]], cfg: Config) -> None:
    """torchrun's static rendezvous (--node-rank, --master-addr/--master-port, --rdzv-backend
    static; its default): on one node there is nothing to rank or meet, and with
    --rdzv-endpoint torchrun itself ignores them; across nodes without one, say what to give."""
    if cfg.rdzv_backend == "static" and cfg.max_nodes > 1:
        raise ConfigError(
            f"--rdzv-backend static across {cfg.nnodes} nodes: elasticd ranks nodes as they "
            "join; give every node the same --rdzv-endpoint HOST:PORT and drop the flag"
        )
    for flag, value in static:
        value = str(value).strip()
        if cfg.max_nodes == 1:
            if flag == "--node-rank" and value != "0":
                raise ConfigError(
                    f"--node-rank {value} on a single node (--nnodes {cfg.nnodes}): the only node "
                    "is rank 0; drop --node-rank"
                )
        elif not cfg.rdzv_endpoint:
            if flag == "--node-rank":
                raise ConfigError(
                    f"--node-rank {value}: nodes are ranked at rendezvous: drop it and give every "
                    "node the same --rdzv-endpoint HOST:PORT and --nnodes"
                )
            raise ConfigError(
                f"{flag} {value}: give every node --rdzv-endpoint MASTER_ADDR:MASTER_PORT instead "
                "(the node that owns that address hosts the store)"
            )


def validate(cfg: Config) -> None:
    """The whole Config: each value (check_value, as every layer's are) and what spans several."""
    parse_nnodes(cfg.nnodes)
    if cfg.etcd:
        if not cfg.rdzv_endpoint:
            raise ConfigError(
                f"--rdzv-backend {cfg.rdzv_backend} needs --rdzv-endpoint with the etcd members, "
                "e.g. h1:2379,h2:2379,h3:2379"
            )
        for member in cfg.rdzv_endpoint.split(","):
            parse_endpoint(member.strip().split("://", 1)[-1])
    else:
        parse_endpoint(cfg.rdzv_endpoint)
        if "," in cfg.rdzv_endpoint:
            raise ConfigError(
                f"--rdzv-endpoint {cfg.rdzv_endpoint!r} lists several stores: c10d has one "
                "(HOST:PORT); for an etcd cluster give --rdzv-backend etcd"
            )
    if (cfg.etcd_user == "") != (cfg.etcd_password_file == ""):
        raise ConfigError("--etcd-user and --etcd-password-file go together: give both, or neither")
    for name in FIELDS:
        check_value(name, getattr(cfg, name), "--" + name.replace("_", "-"))
    plain = _plain_etcd_member(cfg) if cfg.etcd and cfg.etcd_user else None
    if plain and not cfg.etcd_allow_plain_password:
        raise ConfigError(
            f"--etcd-user over plain http would send the password (and the token it buys) in clear "
            f"to {plain}: serve etcd over TLS (https:// endpoints, --etcd-cacert), or on a network "
            "you trust add --etcd-allow-plain-password"
        )
    if cfg.log_format not in LOG_FORMATS:
        raise ConfigError(f"--log-format {cfg.log_format!r}: use auto, json or console")
    parse_std(cfg.redirects, "redirects")
    parse_std(cfg.tee_streams, "tee_streams")
    if cfg.metrics_address:
        host, port = parse_metrics_address(cfg.metrics_address)
        if host in ALL_INTERFACES and not cfg.metrics_all_interfaces:
            raise ConfigError(
                f"--metrics-address {cfg.metrics_address} would serve metrics on every interface: "
                f"give one address (e.g. 127.0.0.1:{port} or this node's own), or add "
                "--metrics-all-interfaces"
            )
    if cfg.health_check:
        import shlex

        try:
            if not shlex.split(cfg.health_check):
                raise ValueError("empty")
        except ValueError as e:
            raise ConfigError(
                f"--health-check {cfg.health_check!r} is not a command line ({e}): give an "
                "executable and its arguments, quoted as in a shell"
            ) from None
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if (
        cfg.virtual_local_rank
        and visible is not None
        and len(visible.split(",")) < cfg.nproc_per_node
    ):
        raise ConfigError(
            f"--virtual-local-rank with {cfg.nproc_per_node} workers per node, but "
            f"CUDA_VISIBLE_DEVICES={visible} lists fewer GPUs: list one per worker or lower "
            "--nproc-per-node"
        )


def _plain_etcd_member(cfg: Config) -> str | None:
    """The first etcd member reached over plain http, as etcd.parse_endpoints reads the list (a
    TLS option makes https the default, an explicit http:// overrides it); None if all use TLS."""
    tls = bool(cfg.etcd_cacert or cfg.etcd_cert or cfg.etcd_key)
    for member in filter(None, (m.strip() for m in cfg.rdzv_endpoint.split(","))):
        scheme = member.split("://", 1)[0] if "://" in member else ("https" if tls else "http")
        if scheme != "https":
            return member
    return None


def resolve(cfg: Config, static: list[tuple[str, str]]) -> Config:
    """The merged Config judged as a whole (`validate`, `check_static`, a secret across nodes),
    with what follows from it filled in: a single-node job's private store, and no warm spares
    for an executable that is not Python."""
    validate(cfg)
    check_static(static, cfg)
    if not cfg.etcd and (cfg.standalone or not cfg.rdzv_endpoint or cfg.rdzv_port == 0):
        if cfg.max_nodes > 1:
            raise ConfigError(
                f"--nnodes {cfg.nnodes} needs --rdzv-endpoint HOST:PORT shared by all nodes"
                + (" (a fixed port: peers cannot find port 0)" if cfg.rdzv_endpoint else "")
            )
        # A private store: a job of its own, which must not resume another's checkpoints.
        cfg = dataclasses.replace(
            cfg,
            rdzv_endpoint="" if cfg.standalone else cfg.rdzv_endpoint,
            rdzv_id=cfg.rdzv_id if cfg.rdzv_id != "none" else uuid.uuid4().hex[:12],
        )
    if cfg.max_nodes > 1 and not cfg.rdzv_secret_file and not cfg.insecure_no_secret:
        raise ConfigError(
            f"--nnodes {cfg.nnodes} without --rdzv-secret-file: anyone who reaches the store could "
            "restart, stop or redirect the job; give every node the same secret file (head -c 32 "
            "/dev/urandom | base64 > FILE && chmod 600 FILE), or --insecure-no-secret on a network "
            "only the job's nodes reach"
        )
    if cfg.no_python:  # nothing to warm: the worker becomes the executable
        cfg = dataclasses.replace(cfg, warm_spawn=False)
    return cfg
