"""The settings of a run: one frozen Config, each field declared with its default, help text and
flags, and `build`, which merges the layers (defaults <- TOML file <- torchrun's PET_* environment
<- ELASTICD_* environment <- flags, read by config_layers.py) and judges the result
(config_values.py).

`_setting` declares a field; `ConfigError` is every refusal; `parse_nnodes`, `parse_endpoint` and
`parse_std` read the value forms the Config's properties need.

Every problem raises ConfigError with one line that names the setting and the fix; the CLI turns
it into exit code 2 before anything starts. What the host must offer (directories, ports, the
entrypoint) is checked later, by the daemon (daemon/preflight.py).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, get_args, get_origin, get_type_hints

DEFAULT_ENTRYPOINT = "entrypoints.train"
DEFAULT_RDZV_PORT = 29400
# What warm spares always import (Config.preloaded): what a torchrun DDP script imports, so a
# restart skips it. torch._dynamo too: DDP imports it on first construction (about 1.3 s on a small
# CPU), which would otherwise be most of a warm restart.
DEFAULT_PRELOAD = (
    "torch",
    "torch.distributed",
    "torch.nn.parallel",
    "torch.optim",
    "torch._dynamo",
)

# Upper bounds: far above any real job, low enough for every API a value reaches (select and
# threading take at most about 292 years, timedelta 2.7 million years, systemd's
# EXTEND_TIMEOUT_USEC a uint64 of microseconds) and for the machine itself.
MAX_SECONDS = 30 * 86400.0  # 30 days
MAX_NPROC = 1024  # workers per node (more when a machine has more CPUs: nproc_per_node = "cpu")
MAX_NODES = 100_000
MAX_RESTARTS = 1_000_000


class ConfigError(Exception):
    """A bad setting: the message is one line naming the problem and the fix."""


LOG_FORMATS = ("auto", "json", "console")
# "restart" and "exclude-node" may come: stragglers.Straggler carries what they need
STRAGGLER_ACTIONS = ("report",)
# how a failed rank's group recovers: auto (in place, where torch and the job allow it: the
# daemon's recovery_path line says which and why), off (the whole group restarts)
IN_PLACE = ("auto", "off")


def _setting(default: Any, doc: str, *flags: str, torchrun: bool = False, **parse: Any) -> Any:
    """A Config field with its documentation, which `elasticd run --help` is made of (cli).

    `doc`: the help text, where {default} is the default (a list as a,b,c). `flags`: the options
    that set it, when not --NAME-WITH-DASHES (--no-NAME for a setting that is on by default).
    `torchrun`: one of torchrun's flags, listed among them and also taken in its
    --name_with_underscores spelling. `parse`: argparse's metavar, choices or type, where the
    field's type is not how the flag reads (a float or int field's flag reads a float or int)."""
    return dataclasses.field(
        default=default,
        metadata={"help": doc, "flags": flags, "torchrun": torchrun, "parse": parse},
    )


@dataclass(frozen=True)
class Config:
    """Every setting of a run, each with its default and help text (the flags' too: see
    _setting)."""

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
        3,
        "failures the job survives before it fails, restarts and recoveries in place "
        "alike (default {default})",
        torchrun=True,
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
        "where per-rank logs, error files and stack dumps go, a directory per run; said at "
        "start (daemon_started's run_dir). Default: $LOGS_DIRECTORY (systemd), else "
        "$XDG_STATE_HOME/elasticd, else /var/lib/elasticd as root and "
        "~/.local/state/elasticd otherwise; never the working directory",
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
    log_line_prefix_template: str = _setting(
        "",
        "as torchrun: what each echoed line starts with, from ${{role_name}}, ${{rank}}, "
        "${{local_rank}} and ${{hostname}} (e.g. '${{hostname}}:${{rank}}: '; default '[rankR]: ', "
        "or torchrun's TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE where it is set)",
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
    tee: bool = _setting(
        True, "do not echo worker output to the daemon's stdout and stderr (it stays in the logs)"
    )
    heartbeat_timeout: float = _setting(
        300.0,
        "the ceiling: a rank silent this long after a beat is hung; below it the deadline is "
        "learned from the job's step gaps, with evidence (default {default:g} s)",
    )
    startup_timeout: float = _setting(
        900.0, "time allowed before the first beat (default {default:g} s)"
    )
    require_heartbeat: bool = _setting(
        False, "judge workers that never beat by --startup-timeout too"
    )
    stop_grace: float = _setting(30.0, "SIGTERM-to-SIGKILL grace on stop (default {default:g} s)")
    restart_grace: float = _setting(
        3.0,
        "SIGTERM-to-SIGKILL grace when the workers are stopped for a restart while their group is "
        "sound (a node joining) or this node leaves (default {default:g} s)",
    )
    crash_grace: float = _setting(
        0.0,
        "SIGTERM-to-SIGKILL grace for the survivors of a failure (a crash, hang or lost node), "
        "whose group is broken; 0 (the default) SIGKILLs them at once",
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
    deterministic_retries: int = _setting(
        1,
        "restarts a failure gets while it repeats identically (the same exception, numbers and "
        "ids masked, and innermost frame of user code, or the same exit code or signal, at the "
        "same step) before the job stops as deterministic with exit code 6 (default {default}; 0: "
        "never)",
    )
    replay_timeout: float = _setting(
        120.0,
        "after a worker's exception, how long its repro bundle's replay (elasticd replay, one "
        "process, on this node) may take to decide: reproduced ends the job as deterministic "
        "(exit code 6) after one failure, not reproduced restarts it; also the referee's replay "
        "of a step two replicas disagree on (silent data corruption at two ranks) (default "
        "{default:g} s; 0: no replay, the repeat rule and an undecided verdict alone)",
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
    ledger: bool = _setting(
        False,
        "workers write a per-sample ledger (which sample went into which optimizer step, on which "
        "rank, in which attempt) beside their logs, for `elasticd ledger check`",
    )
    preload: tuple[str, ...] = _setting(
        (),
        "comma-separated modules warm spares import ahead, besides the defaults they always "
        "import (torch and its distributed, DDP, optim and _dynamo modules)",
    )
    learn_preload: bool = _setting(
        True,
        "do not have warm spares import what this job's workers imported (the fork server "
        "learns it at their first step, leaving out what reads the rank's environment)",
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
    in_place: str = _setting(
        "auto",
        "in-place recovery: auto (default {default}: where this torch can re-form a group in "
        "place, a rank's failure replaces that rank only, the others staying in their "
        "processes; elsewhere the whole group restarts) or off (every failure restarts the "
        "whole group)",
        choices=IN_PLACE,
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
    quarantine_after: int = _setting(
        3,
        "failed health checks (before a start, at a restart after a worker's failure, or while "
        "training; a worker's error text never counts) within --quarantine-window after which "
        "this node is quarantined: it leaves the job and refuses to start, exit code 7, until "
        "`elasticd node clear` (default {default}; 0: never)",
    )
    quarantine_window: float = _setting(
        86400.0, "seconds over which --quarantine-after counts failures (default {default:g})"
    )
    state_dir: str = _setting(
        "",
        "this node's record, kept across runs and jobs: its failures and quarantine (default "
        "$STATE_DIRECTORY, else <log dir>/state)",
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
    def preloaded(self) -> tuple[str, ...]:
        """What warm spares import: the defaults, then --preload's additions (each once)."""
        return tuple(dict.fromkeys((*DEFAULT_PRELOAD, *self.preload)))

    @property
    def etcd(self) -> bool:
        return self.rdzv_backend in ("etcd", "etcd-v2")

    @property
    def _first_endpoint(self) -> str:
        """etcd's endpoint is a list of members: the first stands for it where one address is
        needed (the address of ours that routes to it)."""
        first = self.rdzv_endpoint.split(",")[0].strip()
        return first.split("://", 1)[-1] if self.etcd else first

    def echoed(self, local_rank: int, streams: int = 3) -> bool:
        """Whether this local rank's stdout (`streams` 1), stderr (2) or either (3) is echoed to
        the daemon's own besides its log file (every rank's output is always there), torchrun's
        way: not a stream redirected (-r) and not teed (-t), nor a rank a non-empty
        local_ranks_filter leaves out."""
        if not self.tee or (self.local_ranks_filter and local_rank not in self.local_ranks_filter):
            return False
        redirected = _std(self.redirects, "redirects", local_rank)
        teed = _std(self.tee_streams, "tee_streams", local_rank)
        return any(s & streams and (not redirected & s or teed & s) for s in (1, 2))


FIELDS = {f.name: f for f in dataclasses.fields(Config)}
# Keys whose TOML / env values are lists, and the type of their elements.
_TUPLE_FIELDS = {
    k: get_args(t)[0] for k, t in get_type_hints(Config).items() if get_origin(t) is tuple
}


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


def build(
    flags: dict[str, Any],
    config_file: str | None = None,
    environ: dict[str, str] | None = None,
    static: list[tuple[str, str]] = (),
) -> Config:
    """Merge the layers (later wins) and validate. `flags` holds only flags the user gave;
    `static`, torchrun's static-rendezvous flags given, as (flag, value)."""
    from elasticd import config_layers, config_values  # imported here: they import Config

    merged, pet_static = config_layers.merge(flags, config_file, environ)
    return config_values.resolve(Config(**merged), [*pet_static, *static])
