"""One frozen Config: defaults <- TOML file <- environment <- flags, validated with clear messages.

Every problem raises ConfigError with one line that names the setting and the fix; the CLI turns
it into exit code 2 before anything starts.
"""

from __future__ import annotations

import dataclasses
import errno
import os
import socket
import tomllib
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

DEFAULT_ENTRYPOINT = "entrypoints.train"
DEFAULT_RDZV_PORT = 29400


class ConfigError(Exception):
    """A bad setting: the message is one line naming the problem and the fix."""


@dataclass(frozen=True)
class Config:
    entrypoint: str = DEFAULT_ENTRYPOINT
    args: tuple[str, ...] = ()
    nnodes: str = "1"
    nproc_per_node: int = 1
    max_restarts: int = 3
    rdzv_endpoint: str = ""
    rdzv_id: str = "none"
    standalone: bool = False
    monitor_interval: float = 0.1
    log_dir: str = ""
    checkpoint_dir: str = ""
    log_format: str = "auto"
    tee: bool = True
    heartbeat_timeout: float = 300.0
    startup_timeout: float = 900.0
    require_heartbeat: bool = False
    stop_grace: float = 30.0
    restart_grace: float = 3.0
    kill_timeout: float = 5.0
    exit_barrier_timeout: float = 300.0
    join_timeout: float = 600.0
    last_call_timeout: float = 1.0
    peer_timeout: float = 10.0
    restart_backoff: float = 0.05
    restart_backoff_max: float = 30.0
    socket: str = ""
    operators_group: str = ""
    fatal_exit_codes: tuple[int, ...] = ()
    local_addr: str = ""
    stack_signal: str = "SIGUSR1"
    warm_spawn: bool = True
    memory_state: bool = True  # workers keep the latest step's state in /dev/shm (elasticd.memory)
    # torch._dynamo too: DDP imports it on first construction (about 1.3 s on a small CPU), which
    # would otherwise be most of a warm restart.
    preload: tuple[str, ...] = ("torch", "torch.distributed", "torch.nn.parallel", "torch.optim", "torch._dynamo")

    @property
    def min_nodes(self) -> int:
        return parse_nnodes(self.nnodes)[0]

    @property
    def max_nodes(self) -> int:
        return parse_nnodes(self.nnodes)[1]

    @property
    def rdzv_host(self) -> str:
        return parse_endpoint(self.rdzv_endpoint)[0]

    @property
    def rdzv_port(self) -> int:
        return parse_endpoint(self.rdzv_endpoint)[1]


FIELDS = {f.name: f for f in dataclasses.fields(Config)}
# Keys whose TOML / env values are lists.
_TUPLE_FIELDS = {"args": str, "fatal_exit_codes": int, "preload": str}


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
    if hi < lo:
        raise ConfigError(f"--nnodes {text!r}: MAX is smaller than MIN; write MIN:MAX, e.g. {hi}:{lo}")
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
        raise ConfigError(f"--rdzv-endpoint {text!r}: port {port_text!r} is not a number (use HOST:PORT)") from None
    if not host or not 0 <= port <= 65535:
        raise ConfigError(f"--rdzv-endpoint {text!r} is not HOST:PORT with a port in 0..65535")
    return host, port


def load_toml(path: str) -> dict[str, Any]:
    try:
        with open(path, "rb") as f:
            data = tomllib.load(f)
    except FileNotFoundError:
        raise ConfigError(f"config file {path} does not exist: create it or drop --config") from None
    except PermissionError:
        raise ConfigError(f"config file {path} is not readable by this user: fix its permissions") from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"config file {path} is not valid TOML: {e}") from None
    data = dict(data.get("elasticd", data))
    return {k.replace("-", "_"): v for k, v in data.items()}


def env_settings(environ: dict[str, str]) -> dict[str, Any]:
    """ELASTICD_<KEY> variables (ELASTICD_NPROC_PER_NODE=2). ELASTICD_SOCKET is the socket key."""
    out: dict[str, Any] = {}
    for name in FIELDS:
        value = environ.get("ELASTICD_" + name.upper())
        if value is None or value == "":
            continue
        out[name] = value.split() if name in _TUPLE_FIELDS else value
    return out


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
        raise ConfigError(f"{source}: gpu means one worker per CUDA device, and none is visible here; "
                          "give a number of workers, or auto")
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
            return tuple(_TUPLE_FIELDS[key](v) for v in value)
        if isinstance(default, bool):
            if isinstance(value, bool):
                return value
            text = str(value).strip().lower()
            if text in ("1", "true", "yes", "on"):
                return True
            if text in ("0", "false", "no", "off"):
                return False
            raise ValueError
        if isinstance(default, int):
            if isinstance(value, bool) or (isinstance(value, float) and not value.is_integer()):
                raise ValueError
            return int(value)
        if isinstance(default, float):
            if isinstance(value, bool):
                raise ValueError
            return float(value)
        if isinstance(value, (dict, list)):
            raise TypeError
        return str(value)
    except (TypeError, ValueError):
        kind = {tuple: "a list", bool: "true or false", int: "a whole number", float: "a number", str: "a string"}
        expected = "a list" if key in _TUPLE_FIELDS else kind[type(default)]
        raise ConfigError(f"{where}: {value!r} is not {expected}") from None


def build(flags: dict[str, Any], config_file: str | None = None, environ: dict[str, str] | None = None) -> Config:
    """Merge the layers (later wins) and validate. `flags` holds only flags the user gave."""
    environ = dict(os.environ if environ is None else environ)
    merged: dict[str, Any] = {}
    if config_file:
        for k, v in load_toml(config_file).items():
            merged[k] = _coerce(k, v, f"config file {config_file}")
    for k, v in env_settings(environ).items():
        merged[k] = _coerce(k, v, f"environment variable ELASTICD_{k.upper()}")
    for k, v in flags.items():
        merged[k] = _coerce(k, v, "--" + k.replace("_", "-"))
    if "nproc_per_node" not in merged and merged.get("entrypoint", DEFAULT_ENTRYPOINT) == DEFAULT_ENTRYPOINT:
        merged["nproc_per_node"] = default_example_nproc()
    cfg = Config(**merged)
    validate(cfg)
    if cfg.standalone or not cfg.rdzv_endpoint:
        if cfg.max_nodes > 1:
            raise ConfigError(f"--nnodes {cfg.nnodes} needs --rdzv-endpoint HOST:PORT shared by all nodes")
        cfg = dataclasses.replace(cfg, rdzv_endpoint="", rdzv_id=cfg.rdzv_id if cfg.rdzv_id != "none" else uuid.uuid4().hex[:12])
    return cfg


def default_example_nproc() -> int:
    """The bundled example trains on every GPU, or on 2 CPU workers without one."""
    return cuda_devices() or 2


def cuda_devices() -> int:
    """CUDA devices visible to this process (0 without CUDA or without torch)."""
    try:
        import torch

        if torch.cuda.is_available():
            return torch.cuda.device_count()
    except Exception:
        pass
    return 0


def validate(cfg: Config) -> None:
    parse_nnodes(cfg.nnodes)
    parse_endpoint(cfg.rdzv_endpoint)
    if cfg.nproc_per_node < 1:
        raise ConfigError(f"--nproc-per-node {cfg.nproc_per_node}: at least 1 worker per node is needed")
    if cfg.max_restarts < 0:
        raise ConfigError(f"--max-restarts {cfg.max_restarts}: must be 0 or more")
    for name in ("monitor_interval", "heartbeat_timeout", "startup_timeout", "join_timeout",
                 "exit_barrier_timeout", "peer_timeout", "kill_timeout"):
        if getattr(cfg, name) <= 0:
            raise ConfigError(f"--{name.replace('_', '-')} {getattr(cfg, name)}: must be greater than 0")
    for name in ("stop_grace", "restart_grace", "restart_backoff", "restart_backoff_max", "last_call_timeout"):
        if getattr(cfg, name) < 0:
            raise ConfigError(f"--{name.replace('_', '-')} {getattr(cfg, name)}: must be 0 or more")
    if cfg.log_format not in ("auto", "json", "console"):
        raise ConfigError(f"--log-format {cfg.log_format!r}: use auto, json or console")
    if not cfg.rdzv_id or "/" in cfg.rdzv_id:
        raise ConfigError(f"--rdzv-id {cfg.rdzv_id!r}: use a non-empty name without '/'")
    import signal

    if not hasattr(signal, cfg.stack_signal) or not cfg.stack_signal.startswith("SIG"):
        raise ConfigError(f"stack_signal {cfg.stack_signal!r} is not a signal name such as SIGUSR1")


def check_log_dir(path: Path, flag: str = "--log-dir") -> None:
    """Create a directory now so an unwritable one fails before any worker starts."""
    try:
        path.mkdir(parents=True, exist_ok=True)
        probe = path / f".write-test-{os.getpid()}"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as e:
        reason = os.strerror(e.errno) if e.errno else str(e)
        raise ConfigError(f"{flag} {path} is not writable ({reason}): choose a directory this user can write") from None


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
            raise ConfigError(f"--rdzv-endpoint {host}:{port} cannot be bound here ({e.strerror})") from None


def check_entrypoint(entrypoint: str, cwd: str | None = None) -> None:
    """Resolve the entrypoint the way the worker will, without running the user's code."""
    import ast
    import importlib.util
    import sys

    if entrypoint.endswith(".py") or os.sep in entrypoint:
        if not os.path.isfile(entrypoint):
            raise ConfigError(f"entrypoint script {entrypoint} does not exist: give a path to a .py file, "
                              "a module name, or module:function")
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
        raise ConfigError(f"entrypoint module {module!r} cannot be found{why}: check the name, "
                          "the working directory, or install its package")
    if spec.submodule_search_locations is not None and not func:
        main = importlib.util.find_spec(module + ".__main__") if spec.origin else None
        if main is None:
            raise ConfigError(f"entrypoint {module!r} is a package without __main__: name a module in it")
    if func:
        origin = spec.origin or ""
        if origin.endswith(".py"):
            with open(origin, encoding="utf-8") as f:
                tree = ast.parse(f.read(), origin)
            names = {n.name for n in tree.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))}
            names |= {t.id for n in tree.body if isinstance(n, ast.Assign) for t in n.targets if isinstance(t, ast.Name)}
            names |= {a.asname or a.name for n in tree.body if isinstance(n, (ast.Import, ast.ImportFrom)) for a in n.names}
            if func.split(".")[0] not in names:
                raise ConfigError(f"entrypoint {entrypoint!r}: module {module!r} ({origin}) has no function {func!r}")
