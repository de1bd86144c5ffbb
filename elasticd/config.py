"""One frozen Config: defaults <- TOML file <- torchrun's PET_* environment <- ELASTICD_* environment
<- flags, validated with clear messages.

Every problem raises ConfigError with one line that names the setting and the fix; the CLI turns
it into exit code 2 before anything starts.
"""

from __future__ import annotations

import dataclasses
import errno
import os
import re
import shutil
import signal
import socket
import tomllib
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any, get_args, get_origin, get_type_hints

from elasticd import names

DEFAULT_ENTRYPOINT = "entrypoints.train"
DEFAULT_RDZV_PORT = 29400


# Upper bounds: far above any real job, low enough for every API a value reaches (select and
# threading take at most about 292 years, timedelta 2.7 million years, systemd's
# EXTEND_TIMEOUT_USEC a uint64 of microseconds) and for the machine itself.
MAX_SECONDS = 30 * 86400.0  # 30 days
MAX_NPROC = 1024  # workers per node (more when a machine has more CPUs: nproc_per_node = "cpu")
MAX_NODES = 100_000
MAX_RESTARTS = 1_000_000

# Numeric settings: (least, most, whether `least` itself is allowed). monitor_interval paces the
# loop that feeds systemd's watchdog and answers stops: not a busy loop, not asleep for long.
_RANGES: dict[str, tuple[float, float, bool]] = {
    "nproc_per_node": (1, max(MAX_NPROC, os.cpu_count() or 1), True),
    "max_restarts": (0, MAX_RESTARTS, True),
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
            "restart_backoff",
            "restart_backoff_max",
            "last_call_timeout",
            "health_check_interval",
        )
    },
    "health_check_timeout": (0.0, MAX_SECONDS, False),
    "straggler_threshold": (0.0, 100.0, True),  # 0: off; 0.2: 20% above the median
    "straggler_window": (1.0, MAX_SECONDS, True),
}
STRAGGLER_ACTIONS = (
    "report",
)  # "restart" and "exclude-node" may come: stragglers.Straggler carries what they need

# Signals a worker may dump its stacks on (faulthandler registers them; a worker that has not yet
# registered the handler is ended, as by SIGTERM). Not: signals that stop workers (SIGTERM, SIGINT),
# cannot be caught (SIGKILL, SIGSTOP), are faults faulthandler reserves (SIGSEGV, SIGBUS, SIGFPE,
# SIGILL, SIGABRT), or arrive in ordinary operation (SIGCHLD, SIGCONT, SIGPIPE, SIGALRM, SIGPROF...).
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


class ConfigError(Exception):
    """A bad setting: the message is one line naming the problem and the fix."""


LOG_FORMATS = ("auto", "json", "console")


def _setting(default: Any, doc: str, *flags: str, torchrun: bool = False, **parse: Any) -> Any:
    """A Config field with its documentation, which `elasticd run --help` is made of (cli).

    `doc`: the help text, where {default} is the default (a list as a,b,c). `flags`: the options
    that set it, when not --NAME-WITH-DASHES (--no-NAME for a setting that is on by default).
    `torchrun`: one of torchrun's flags, listed among them and also taken in its --name_with_underscores
    spelling. `parse`: argparse's metavar, choices or type, where the field's type is not how the
    flag reads (a float or int field's flag reads a float or int)."""
    return dataclasses.field(
        default=default,
        metadata={"help": doc, "flags": flags, "torchrun": torchrun, "parse": parse},
    )


@dataclass(frozen=True)
class Config:
    """Every setting of a run, each with its default and help text (the flags' too: see _setting)."""

    # --- what to run (the CLI's ENTRYPOINT and ARGS) ---
    entrypoint: str = _setting(
        DEFAULT_ENTRYPOINT,
        "module (run as python -m), module:function, or "
        "path/to/script.py (default: the bundled example {default})",
    )
    args: tuple[str, ...] = _setting(
        (), "everything after the entrypoint goes to it, as with torchrun"
    )

    # --- torchrun's own flags ---
    nnodes: str = _setting("1", "N or MIN:MAX nodes (default {default})", torchrun=True)
    nproc_per_node: int = _setting(
        1,
        "workers on this node: a number, gpu, cpu or auto (default {default}; the "
        "bundled example: one per GPU, else 2)",
        torchrun=True,
        type=str,
    )  # a word or a number: nproc_from_word reads it
    max_restarts: int = _setting(
        3, "failure restarts of the job before it fails (default {default})", torchrun=True
    )
    rdzv_backend: str = _setting(
        "c10d",
        "c10d (default: a TCPStore at --rdzv-endpoint, hosted by the node that "
        "owns its address) or etcd (an etcd cluster, --rdzv-endpoint H1:2379,H2:2379,...: "
        "no node is special); torchrun's etcd-v2 and static are accepted",
        torchrun=True,
    )
    rdzv_endpoint: str = _setting(
        "",
        "HOST:PORT of the rendezvous store, the same on every node (etcd: the "
        "members, comma-separated)",
        torchrun=True,
    )
    rdzv_id: str = _setting("none", "job id shared by all nodes", torchrun=True)
    standalone: bool = _setting(
        False, "single node with a private store on a free loopback port", torchrun=True
    )
    monitor_interval: float = _setting(
        0.1, "seconds between worker checks (default {default:g})", torchrun=True
    )
    log_dir: str = _setting(
        "",
        "where per-rank logs, error files and stack dumps go (default ./elasticd-runs)",
        torchrun=True,
    )
    local_addr: str = _setting(
        "",
        "address peers reach this node at (default: the one routing to the endpoint)",
        torchrun=True,
    )
    role: str = _setting("default", "the workers' ROLE_NAME (default {default!r})", torchrun=True)
    redirects: str = _setting(
        "0",
        "as torchrun: 0-3 (none, stdout, stderr, both) or LOCAL_RANK:N,...; every "
        "rank's output is always in its log file, and a rank with both streams redirected "
        "(and not teed) is not echoed to the console",
        "-r",
        "--redirects",
        torchrun=True,
    )
    tee_streams: str = _setting(
        "0",
        "as torchrun: streams also echoed to the console (echoing is elasticd's default)",
        "-t",
        "--tee",
        torchrun=True,
    )
    local_ranks_filter: tuple[int, ...] = _setting(
        (),
        "comma-separated local ranks whose output is echoed to the console (default all)",
        torchrun=True,
    )
    signals_to_handle: tuple[str, ...] = _setting(
        ("SIGTERM", "SIGINT", "SIGHUP", "SIGQUIT"),
        "comma-separated signals that stop the job gracefully, as "
        "SIGTERM does (default {default}; e.g. add SIGUSR1 for SLURM's "
        "--signal)",
        torchrun=True,
    )
    virtual_local_rank: bool = _setting(
        False, "LOCAL_RANK=0 for every worker, and CUDA_VISIBLE_DEVICES its own GPU", torchrun=True
    )
    no_python: bool = _setting(
        False,
        "ENTRYPOINT is an executable run with ARGS in place of python (no warm "
        "spares, heartbeat or stack dumps: it is not Python)",
        torchrun=True,
    )

    # --- elasticd's own ---
    rdzv_secret_file: str = _setting(
        "",
        "the job's secret (the same file on every node, mode 600): what the "
        "daemons write to the store is signed with it, so no one without it can steer "
        "the job (single-node jobs make their own)",
        metavar="FILE",
    )
    insecure_no_secret: bool = _setting(
        False,
        "let a multi-node job run without --rdzv-secret-file: anyone who "
        "reaches the store can then restart, stop or redirect it (only on a network "
        "no one else reaches)",
    )
    checkpoint_dir: str = _setting(
        "",
        "where workers keep checkpoints (ELASTICD_CHECKPOINT_DIR; default <log dir>/"
        "checkpoints/<rdzv id>, so a job started again with the same --rdzv-id resumes)",
    )
    log_format: str = _setting(
        "auto", "daemon log format (default: console on a terminal, else JSON)", choices=LOG_FORMATS
    )
    tee: bool = _setting(True, "do not echo worker output to the daemon's stdout")
    heartbeat_timeout: float = _setting(
        300.0, "a rank silent this long after a beat is hung (default {default:g} s)"
    )
    startup_timeout: float = _setting(
        900.0, "time allowed before the first beat (default {default:g} s)"
    )
    require_heartbeat: bool = _setting(
        False, "judge workers that never beat by --startup-timeout too"
    )
    stop_grace: float = _setting(30.0, "SIGTERM-to-SIGKILL grace on stop (default {default:g} s)")
    restart_grace: float = _setting(
        3.0, "SIGTERM-to-SIGKILL grace when restarting after a failure (default {default:g} s)"
    )
    kill_timeout: float = _setting(
        5.0, "how long to wait for SIGKILLed processes to be reaped (default {default:g} s)"
    )
    restart_backoff: float = _setting(
        0.05,
        "first wait before a restart (plus up to as much jitter), doubling with "
        "each attempt in a row that failed before every rank stepped "
        "(default {default:g} s)",
    )
    restart_backoff_max: float = _setting(
        30.0, "longest wait between restarts (default {default:g} s)"
    )
    stack_signal: str = _setting(
        "SIGUSR1", "signal workers dump their stacks on (default {default})"
    )
    exit_barrier_timeout: float = _setting(
        300.0, "how long a finished node waits for the others (default {default:g} s)"
    )
    join_timeout: float = _setting(
        600.0, "how long to wait for enough nodes (default {default:g} s)"
    )
    last_call_timeout: float = _setting(
        1.0, "extra wait for more nodes once MIN have joined (default {default:g} s)"
    )
    peer_timeout: float = _setting(
        10.0, "a node silent this long is treated as lost (default {default:g} s)"
    )
    fatal_exit_codes: tuple[int, ...] = _setting(
        (), "comma-separated worker exit codes that fail the job without restart"
    )
    warm_spawn: bool = _setting(
        True, "start every worker as a fresh interpreter instead of a warm spare"
    )
    memory_state: bool = _setting(
        True,
        "do not offer workers a shared-memory directory for in-memory state "
        "(ELASTICD_MEMORY_DIR); they resume from disk checkpoints only",
    )
    # torch._dynamo too: DDP imports it on first construction (about 1.3 s on a small CPU), which
    # would otherwise be most of a warm restart.
    preload: tuple[str, ...] = _setting(
        ("torch", "torch.distributed", "torch.nn.parallel", "torch.optim", "torch._dynamo"),
        "comma-separated modules warm spares import ahead "
        "(default torch and its distributed, DDP and optim modules)",
    )
    etcd_cacert: str = _setting(
        "", "etcd: CA certificate file that verifies the members (turns on TLS)"
    )
    etcd_cert: str = _setting("", "etcd: client certificate file (TLS client authentication)")
    etcd_key: str = _setting("", "etcd: the client certificate's key file")
    etcd_user: str = _setting(
        "", "etcd: user name (etcd authentication; with --etcd-password-file)"
    )
    etcd_password_file: str = _setting("", "etcd: file holding the user's password (mode 600)")
    etcd_allow_plain_password: bool = _setting(
        False,
        "etcd: allow --etcd-user over plain http, where the password "
        "and the token it buys cross the network in clear",
    )
    socket: str = _setting("", "control socket path")
    operators_group: str = _setting("", "group whose members may use status/stop")

    # --- operability: metrics, stragglers, node health ---
    metrics_address: str = _setting(
        "",
        "HOST:PORT to serve Prometheus metrics on (off by default); one address, "
        "never all interfaces unless --metrics-all-interfaces",
        metavar="HOST:PORT",
    )
    metrics_all_interfaces: bool = _setting(
        False, "allow --metrics-address 0.0.0.0:PORT or [::]:PORT (every interface)"
    )
    metrics_textfile: str = _setting(
        "",
        "also write the metrics to this file (e.g. node_exporter's textfile "
        "collector directory/elasticd.prom), replaced atomically every few seconds",
        metavar="FILE",
    )
    straggler_threshold: float = _setting(
        0.2,
        "a rank whose own work per step stays this share above the node's "
        "median for --straggler-window is reported (default {default:g}, 20 "
        "percent; 0: off)",
    )
    straggler_window: float = _setting(
        30.0, "how long a rank must stay slow to be a straggler (default {default:g} s)"
    )
    straggler_action: str = _setting(
        "report",
        "what to do about a straggler: report (an event, a metric and a "
        "status field; nothing is restarted)",
        choices=STRAGGLER_ACTIONS,
    )
    health_check: str = _setting(
        "",
        "an executable (with arguments) run before every start and restart and every "
        "--health-check-interval; failing it, this node does not start, or stops its workers "
        "and leaves the job, with exit code 5",
        metavar="CMD",
    )
    health_check_interval: float = _setting(
        60.0,
        "seconds between health checks while training (default {default:g}; 0: only before starts)",
    )
    health_check_timeout: float = _setting(
        60.0, "a health check running longer fails (default {default:g} s)"
    )

    @property
    def min_nodes(self) -> int:
        return parse_nnodes(self.nnodes)[0]

    @property
    def max_nodes(self) -> int:
        return parse_nnodes(self.nnodes)[1]

    @property
    def rdzv_host(self) -> str:
        return parse_endpoint(self._first_endpoint)[0]

    @property
    def rdzv_port(self) -> int:
        return parse_endpoint(self._first_endpoint)[1]

    @property
    def etcd(self) -> bool:
        return self.rdzv_backend in ("etcd", "etcd-v2")

    @property
    def _first_endpoint(self) -> str:
        """etcd's endpoint is a list of members: the first stands for it where one address is
        needed (the address of ours that routes to it)."""
        first = self.rdzv_endpoint.split(",")[0].strip()
        return first.split("://", 1)[-1] if self.etcd else first

    def echoed(self, local_rank: int) -> bool:
        """Whether this local rank's output goes to the daemon's stdout besides its log file (every
        rank's output is always there), torchrun's way: not where its stdout and stderr are both
        redirected (-r) and neither teed (-t), nor where a non-empty local_ranks_filter leaves it out."""
        if not self.tee or (self.local_ranks_filter and local_rank not in self.local_ranks_filter):
            return False
        both_redirected = _std(self.redirects, "redirects", local_rank) == 3
        return not both_redirected or _std(self.tee_streams, "tee_streams", local_rank) != 0


FIELDS = {f.name: f for f in dataclasses.fields(Config)}
# Keys whose TOML / env values are lists, and the type of their elements.
_TUPLE_FIELDS = {
    k: get_args(t)[0] for k, t in get_type_hints(Config).items() if get_origin(t) is tuple
}

# torchrun reads every flag it was not given from PET_<FLAG> (what Kubeflow's PyTorchJob sets):
# the variable -> our key for the flags elasticd shares. Those of static rendezvous are checked
# as the flags are (check_static).
PET_SETTINGS = {
    "PET_NNODES": "nnodes",
    "PET_NPROC_PER_NODE": "nproc_per_node",
    "PET_MAX_RESTARTS": "max_restarts",
    "PET_RDZV_ENDPOINT": "rdzv_endpoint",
    "PET_RDZV_ID": "rdzv_id",
    "PET_RDZV_BACKEND": "rdzv_backend",
    "PET_RDZV_CONF": "rdzv_conf",
    "PET_STANDALONE": "standalone",
    "PET_MONITOR_INTERVAL": "monitor_interval",
    "PET_ROLE": "role",
    "PET_LOG_DIR": "log_dir",
    "PET_REDIRECTS": "redirects",
    "PET_TEE": "tee_streams",
    "PET_LOCAL_RANKS_FILTER": "local_ranks_filter",
    "PET_LOCAL_ADDR": "local_addr",
    "PET_SIGNALS_TO_HANDLE": "signals_to_handle",
    "PET_SHUTDOWN_TIMEOUT": "stop_grace",
    "PET_VIRTUAL_LOCAL_RANK": "virtual_local_rank",
    "PET_NO_PYTHON": "no_python",
}
PET_STATIC = {
    "PET_NODE_RANK": "--node-rank",
    "PET_MASTER_ADDR": "--master-addr",
    "PET_MASTER_PORT": "--master-port",
}

# torchrun's --rdzv-conf keys (c10d backend) -> what elasticd does with them.
_RDZV_CONF_KEYS = {"join_timeout": "join_timeout", "last_call_timeout": "last_call_timeout"}
# Keys whose job elasticd does another way (store calls bounded by --join-timeout, the node that
# owns the endpoint's address hosts the store): accepted, no effect.
_RDZV_CONF_ACCEPTED = {"read_timeout", "close_timeout", "is_host", "use_libuv"}
_KEEP_ALIVE = {"keep_alive_interval": 5.0, "keep_alive_max_attempt": 3.0}  # torch's defaults


def parse_nnodes(text: str) -> tuple[int, int]:
    """'N' or 'MIN:MAX' as torchrun takes it."""
    parts = str(text).split(":")
    try:
        if len(parts) == 1:
            lo = hi = int(parts[0])
        elif len(parts) == 2:
            lo, hi = int(parts[0]), int(parts[1])
        else:
            raise ValueError
    except ValueError:
        raise ConfigError(f"--nnodes {text!r} is not N or MIN:MAX (e.g. 2 or 1:4)") from None
    if lo < 1:
        raise ConfigError(f"--nnodes {text!r}: the minimum node count must be at least 1")
    if hi > MAX_NODES:
        raise ConfigError(f"--nnodes {text!r}: at most {MAX_NODES} nodes")
    if hi < lo:
        raise ConfigError(
            f"--nnodes {text!r}: MAX is smaller than MIN; write MIN:MAX, e.g. {hi}:{lo}"
        )
    return lo, hi


def parse_endpoint(text: str) -> tuple[str, int]:
    """'host[:port]' (IPv6 as [addr]:port); empty means standalone on loopback."""
    if not text:
        return "127.0.0.1", 0
    host, sep, port_text = text.rpartition(":")
    if not sep or "]" in port_text:
        host, port_text = text, str(DEFAULT_RDZV_PORT)
    host = host.strip("[]")
    try:
        port = int(port_text)
    except ValueError:
        raise ConfigError(
            f"--rdzv-endpoint {text!r}: port {port_text!r} is not a number (use HOST:PORT)"
        ) from None
    if not host or not 0 <= port <= 65535:
        raise ConfigError(f"--rdzv-endpoint {text!r} is not HOST:PORT with a port in 0..65535")
    return host, port


def parse_std(text: str, key: str) -> int | dict[int, int]:
    """torchrun's redirect/tee value: "N" for every local rank, or "LOCAL_RANK:N,..." (0 none,
    1 stdout, 2 stderr, 3 both), which is N for the ranks named and 0 for the others."""
    text = str(text).strip()
    try:
        if ":" not in text:
            every = int(text)
            if every not in range(4):
                raise ValueError
            return every
        out: dict[int, int] = {}
        for item in text.split(","):
            rank, _, value = item.partition(":")
            out[int(rank)] = int(value)
            if out[int(rank)] not in range(4) or int(rank) < 0:
                raise ValueError
        return out
    except ValueError:
        flag = {"redirects": "-r/--redirects", "tee_streams": "-t/--tee"}.get(key, key)
        raise ConfigError(
            f"{flag} {text!r}: use 0 (none), 1 (stdout), 2 (stderr) or 3 (both), for every "
            "local rank or per rank as LOCAL_RANK:N,... (e.g. 0:3,1:1)"
        ) from None


def _std(text: str, key: str, local_rank: int) -> int:
    parsed = parse_std(text, key)
    return parsed if isinstance(parsed, int) else parsed.get(local_rank, 0)


def rdzv_conf_settings(text: str, source: str) -> dict[str, Any]:
    """torchrun's --rdzv-conf "key=value,...": the settings it stands for here. torch's dead-node
    rule (a keep-alive every keep_alive_interval, lost after keep_alive_max_attempt misses) is
    --peer-timeout."""
    out: dict[str, Any] = {}
    keep_alive: dict[str, float] = {}
    for item in filter(None, (i.strip() for i in str(text).split(","))):
        key, sep, value = item.partition("=")
        key = key.strip()
        if not sep:
            raise ConfigError(f"{source} {item!r} is not KEY=VALUE (e.g. join_timeout=900)")
        if key in _RDZV_CONF_KEYS:
            out[_RDZV_CONF_KEYS[key]] = value.strip()
        elif key in _KEEP_ALIVE:
            try:
                keep_alive[key] = float(value)
            except ValueError:
                raise ConfigError(f"{source} {key}={value!r}: not a number") from None
        elif key not in _RDZV_CONF_ACCEPTED:
            known = ", ".join(sorted([*_RDZV_CONF_KEYS, *_KEEP_ALIVE, *_RDZV_CONF_ACCEPTED]))
            raise ConfigError(
                f"{source} key {key!r} is not one of torchrun's c10d keys elasticd takes ({known})"
            )
    if keep_alive:
        both = {**_KEEP_ALIVE, **keep_alive}
        out["peer_timeout"] = both["keep_alive_interval"] * both["keep_alive_max_attempt"]
    return out


def _expand(layer: dict[str, Any], source: str) -> dict[str, Any]:
    """A layer's rdzv_conf becomes the settings it stands for; the layer's own keys win."""
    if "rdzv_conf" not in layer:
        return layer
    layer = dict(layer)
    return {**rdzv_conf_settings(layer.pop("rdzv_conf"), f"rdzv_conf in {source}"), **layer}


def load_toml(path: str) -> dict[str, Any]:
    try:
        with open(path, "rb") as f:
            data = tomllib.load(f)
    except FileNotFoundError:
        raise ConfigError(
            f"config file {path} does not exist: create it or drop --config"
        ) from None
    except PermissionError:
        raise ConfigError(
            f"config file {path} is not readable by this user: fix its permissions"
        ) from None
    except IsADirectoryError:
        raise ConfigError(
            f"config file {path} is a directory: give the path of a TOML file"
        ) from None
    except UnicodeDecodeError as e:
        raise ConfigError(
            f"config file {path} is not UTF-8 text (byte {e.start}): save it as UTF-8"
        ) from None
    except ValueError as e:  # tomllib.TOMLDecodeError, or a number too long to read
        raise ConfigError(f"config file {path} is not valid TOML: {e}") from None
    except OSError as e:
        raise ConfigError(
            f"config file {path} cannot be read ({e.strerror or e}): give a readable TOML file"
        ) from None
    data = data.get("elasticd", data)
    if not isinstance(data, dict):
        raise ConfigError(
            f"config file {path}: elasticd is {type(data).__name__}, not a table; "
            "write the settings under [elasticd] or at the top level"
        )
    return {k.replace("-", "_"): v for k, v in data.items()}


def env_settings(environ: dict[str, str]) -> dict[str, Any]:
    """ELASTICD_<KEY> variables (ELASTICD_NPROC_PER_NODE=2). ELASTICD_SOCKET is the socket key."""
    out: dict[str, Any] = {}
    for name in FIELDS:
        value = environ.get(names.SETTING_PREFIX + name.upper())
        if value is None or value == "":
            continue
        out[name] = value.split() if name in _TUPLE_FIELDS else value
    return out


def pet_settings(environ: dict[str, str]) -> tuple[dict[str, Any], list[tuple[str, str]]]:
    """torchrun's PET_* variables: our settings, and the static-rendezvous ones as (flag, value)."""
    out = {key: environ[name] for name, key in PET_SETTINGS.items() if environ.get(name, "") != ""}
    static = [
        (flag, environ[name]) for name, flag in PET_STATIC.items() if environ.get(name, "") != ""
    ]
    return out, static


def nproc_from_word(value: Any, source: str) -> Any:
    """torchrun's words for the workers per node: `gpu` (one per visible CUDA device), `cpu` (one
    per CPU) or `auto` (gpu where there is one, else cpu). Anything else is left to _coerce."""
    word = value.strip().lower() if isinstance(value, str) else None
    if word not in ("auto", "gpu", "cpu"):
        if word is not None and not word.isdigit():
            raise ConfigError(f"{source}: {value!r} is not a number of workers, auto, gpu or cpu")
        return value
    gpus = cuda_devices() if word != "cpu" else 0
    if word == "gpu" and not gpus:
        raise ConfigError(
            f"{source}: gpu means one worker per CUDA device, and none is visible here; "
            "give a number of workers, or auto"
        )
    return gpus or os.cpu_count() or 1


def _coerce(key: str, value: Any, source: str) -> Any:
    """Turn a TOML/env/flag value into the field's type, or say which form it needs."""
    if key == "nproc_per_node":
        value = nproc_from_word(value, f"{key} in {source}")
    if key not in FIELDS:
        known = ", ".join(sorted(FIELDS))
        raise ConfigError(f"unknown setting {key!r} in {source}; known settings: {known}")
    default = FIELDS[key].default
    where = f"{key} in {source}"
    try:
        if key in _TUPLE_FIELDS:
            if isinstance(value, str):
                value = value.replace(",", " ").split()
            if not isinstance(value, (list, tuple)):
                raise TypeError
            return check_value(key, tuple(_element(_TUPLE_FIELDS[key], v) for v in value), where)
        if isinstance(default, bool):
            if isinstance(value, bool):
                return value
            text = str(value).strip().lower()
            if text in ("1", "true", "yes", "on"):
                return True
            if text in ("0", "false", "no", "off"):
                return False
            raise ValueError
        if isinstance(default, (int, float)):
            return check_value(key, _element(type(default), value), where)
        if isinstance(value, (dict, list)):
            raise TypeError
        return check_value(key, str(value), where)
    except (TypeError, ValueError, OverflowError):
        kind = {
            tuple: "a list",
            bool: "true or false",
            int: "a whole number",
            float: "a number",
            str: "a string",
        }
        element = {int: "whole numbers", str: "strings"}.get(_TUPLE_FIELDS.get(key))
        expected = f"a list of {element}" if element else kind[type(default)]
        raise ConfigError(f"{where}: {value!r} is not {expected}") from None


def _element(kind: type, value: Any) -> Any:
    """A scalar as `kind` (str, int or float), refusing what would change meaning on the way:
    booleans, tables, lists, and fractions or non-finite numbers as whole numbers."""
    if isinstance(value, (bool, dict, list, tuple)):
        raise TypeError
    if kind is int and isinstance(value, float) and not value.is_integer():
        raise ValueError
    return kind(value)


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
        else f"use {' or '.join(STRAGGLER_ACTIONS)} (restart and exclude-node are not implemented yet)"
    ),
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


def build(
    flags: dict[str, Any],
    config_file: str | None = None,
    environ: dict[str, str] | None = None,
    static: list[tuple[str, str]] = (),
) -> Config:
    """Merge the layers (later wins) and validate. `flags` holds only flags the user gave;
    `static`, torchrun's static-rendezvous flags given, as (flag, value)."""
    environ = dict(os.environ if environ is None else environ)
    pet, pet_static = pet_settings(environ)
    layers = [
        (load_toml(config_file) if config_file else {}, lambda k: f"config file {config_file}"),
        (pet, lambda k: f"environment variable {_pet_name(k)}"),
        (
            env_settings(environ),
            lambda k: f"environment variable {names.SETTING_PREFIX}{k.upper()}",
        ),
        (flags, lambda k: "--" + k.replace("_", "-")),
    ]
    merged: dict[str, Any] = {}
    for layer, where in layers:
        for k, v in _expand(layer, where("rdzv_conf")).items():
            merged[k] = _coerce(k, v, where(k))
    if (
        "nproc_per_node" not in merged
        and merged.get("entrypoint", DEFAULT_ENTRYPOINT) == DEFAULT_ENTRYPOINT
    ):
        merged["nproc_per_node"] = default_example_nproc()
    cfg = Config(**merged)
    validate(cfg)
    check_static([*pet_static, *static], cfg)
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


def _pet_name(key: str) -> str:
    return next((name for name, k in PET_SETTINGS.items() if k == key), "PET_" + key.upper())


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


def default_example_nproc() -> int:
    """The bundled example trains on every GPU, or on 2 CPU workers without one."""
    return cuda_devices() or 2


def cuda_devices() -> int:
    """CUDA devices visible to this process (0 without CUDA or without torch)."""
    try:
        import torch

        if torch.cuda.is_available():
            return torch.cuda.device_count()
    except Exception:  # noqa: BLE001 - a broken torch or driver: no GPU to count, as without torch
        pass
    return 0


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


def check_log_dir(path: Path, flag: str = "--log-dir") -> Path:
    """The directory, created if missing (new levels 0750) and resolved, once it is proven safe
    and writable, so a bad one fails before any worker starts.

    The daemon may run as root, and writes there by name: a directory that another user owns, or
    can add entries to (group/world-writable without the sticky bit), anywhere on the path, would
    let them plant symlinks that make it write to any file, so it is refused (root is trusted; a
    sticky directory like /tmp is fine, as the run directory below is always created fresh). The
    path returned has no symlink left that anyone could swap later."""
    import tempfile

    try:
        _make_dirs(path.absolute(), path, flag)
        resolved = _check_tree(path, path, flag)
        with tempfile.TemporaryFile(dir=resolved):
            pass
    except OSError as e:
        reason = os.strerror(e.errno) if e.errno else str(e)
        raise ConfigError(
            f"{flag} {path} is not writable ({reason}): choose a directory this user can write"
        ) from None
    return resolved


def _check_tree(path: Path, shown: Path, flag: str) -> Path:
    """`path` resolved, once neither it nor a directory above it is unsafe (_unsafe_dir)."""
    resolved = Path(os.path.realpath(path))
    for d in (resolved, *resolved.parents):
        why = _unsafe_dir(d, os.lstat(d))
        if why:
            raise ConfigError(f"{flag} {shown}: {why}, or choose another {flag}")
    return resolved


def _make_dirs(path: Path, shown: Path, flag: str) -> None:
    """mkdir -p, each new level 0750 whatever the umask (os.makedirs gives the parents 0777 less
    the umask), and only once the deepest level that exists is checked: nothing is created in an
    unsafe directory."""
    missing = []
    while not os.path.lexists(path) and path != path.parent:
        missing.append(path)
        path = path.parent
    if missing:
        _check_tree(path, shown, flag)
    for d in reversed(missing):
        try:
            os.mkdir(d, 0o750)
        except FileExistsError:
            pass


def _unsafe_dir(d: Path, st: os.stat_result) -> str | None:
    """Why someone other than this user or root could change what `d` holds, or None."""
    import pwd
    import stat

    me = os.geteuid()
    if stat.S_ISLNK(st.st_mode):  # realpath resolved them all: one appeared since
        return f"{d} was just replaced by a symlink"
    if st.st_uid not in (0, me):
        try:
            who = f"uid {st.st_uid} ({pwd.getpwuid(st.st_uid).pw_name})"
        except KeyError:
            who = f"uid {st.st_uid}"
        mine = "root" if me == 0 else "this user or root"
        return (
            f"{d} belongs to {who}, who could plant symlinks there that make elasticd write to any "
            f"file: use a directory owned by {mine}"
        )
    if st.st_mode & 0o022 and not st.st_mode & stat.S_ISVTX:
        who = "other users" if st.st_mode & 0o002 else "its group"
        return (
            f"{d} is writable by {who} without the sticky bit, so they could plant symlinks there that "
            f"make elasticd write to any file: chmod go-w {d}"
        )
    return None


def make_run_dir(base: Path, name: str) -> Path:
    """This run's directory, created fresh (0750) in a checked base: its name is predictable, and
    one that exists (someone may have planted it, with links inside) is never reused; a random
    suffix is tried instead."""
    import secrets

    from elasticd import safeio

    for suffix in ("", *(f"-{secrets.token_hex(4)}" for _ in range(3))):
        path = base / f"{name}{suffix}"
        try:
            safeio.mkdir(path)
        except FileExistsError:
            continue
        except OSError as e:
            raise ConfigError(
                f"--log-dir {base} is not writable ({e.strerror}): choose a directory this user "
                "can write"
            ) from None
        return path
    raise ConfigError(
        f"--log-dir {base}: a run directory of that name already exists, again and again: "
        "choose a --log-dir only this user can write"
    )


def check_port_free(host: str, port: int) -> None:
    """Fail early with a clear line when the rendezvous port is taken by someone else."""
    if port == 0:
        return
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
        try:
            s.bind((host, port))
        except OSError as e:
            if e.errno == errno.EADDRINUSE:
                raise ConfigError(
                    f"--rdzv-endpoint port {port} on {host} is in use by another process: pick a free port"
                ) from None
            raise ConfigError(
                f"--rdzv-endpoint {host}:{port} cannot be bound here ({e.strerror})"
            ) from None


def check_health_check(command: str) -> None:
    """--health-check's program exists and may be run (its arguments are its own)."""
    import shlex

    program = shlex.split(command)[0]
    if shutil.which(program, path=os.environ.get("PATH", os.defpath)) is None:
        raise ConfigError(
            f"--health-check {command!r}: {program!r} is not an executable file on PATH or at that "
            "path: give a program with its x bit set (e.g. deploy/healthcheck/gpu-check)"
        )


def check_entrypoint(entrypoint: str, cwd: str | None = None, no_python: bool = False) -> None:
    """Resolve the entrypoint the way the worker will, without running the user's code."""
    import ast
    import importlib.util
    import sys

    if no_python:
        if shutil.which(entrypoint, path=os.environ.get("PATH", os.defpath)) is None:
            raise ConfigError(
                f"--no-python: entrypoint {entrypoint!r} is not an executable file on PATH or at "
                "that path: give a program (e.g. /usr/bin/env or ./run.sh with its x bit set)"
            )
        return
    if entrypoint.endswith(".py") or os.sep in entrypoint:
        if not os.path.isfile(entrypoint):
            raise ConfigError(
                f"entrypoint script {entrypoint} does not exist: give a path to a .py file, "
                "a module name, or module:function"
            )
        return
    module, _, func = entrypoint.partition(":")
    if not module or (":" in entrypoint and not func):
        raise ConfigError(f"entrypoint {entrypoint!r} is not MODULE, MODULE:FUNCTION or PATH.py")
    sys.path.insert(0, cwd or os.getcwd())  # the worker runs with its working directory on sys.path
    try:
        spec = importlib.util.find_spec(module)
    except (ImportError, ValueError) as e:
        spec, why = None, f" ({e})"
    else:
        why = ""
    finally:
        sys.path.pop(0)
    if spec is None:
        raise ConfigError(
            f"entrypoint module {module!r} cannot be found{why}: check the name, "
            "the working directory, or install its package"
        )
    if spec.submodule_search_locations is not None and not func:
        main = importlib.util.find_spec(module + ".__main__") if spec.origin else None
        if main is None:
            raise ConfigError(
                f"entrypoint {module!r} is a package without __main__: name a module in it"
            )
    if func:
        origin = spec.origin or ""
        if origin.endswith(".py"):
            with open(origin, encoding="utf-8") as f:
                tree = ast.parse(f.read(), origin)
            top = tree.body
            defined = {
                n.name
                for n in top
                if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
            }
            defined |= {
                t.id
                for n in top
                if isinstance(n, ast.Assign)
                for t in n.targets
                if isinstance(t, ast.Name)
            }
            defined |= {
                a.asname or a.name
                for n in top
                if isinstance(n, (ast.Import, ast.ImportFrom))
                for a in n.names
            }
            if func.split(".")[0] not in defined:
                raise ConfigError(
                    f"entrypoint {entrypoint!r}: module {module!r} ({origin}) has no function {func!r}"
                )
