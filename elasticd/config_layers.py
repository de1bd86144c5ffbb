"""Where settings come from, read into Config's field types: the TOML file, torchrun's PET_*
variables and --rdzv-conf, the ELASTICD_* environment, and the words `--nproc-per-node` takes
(gpu, cpu, auto); `merge` (which config.build calls) layers them, later layers winning: defaults
<- TOML file <- `PET_*` (and `--rdzv-conf`) <- `ELASTICD_*` <- flags.
"""

from __future__ import annotations

import os
import tomllib
from typing import Any

from elasticd import names
from elasticd.config import _TUPLE_FIELDS, DEFAULT_ENTRYPOINT, FIELDS, ConfigError
from elasticd.config_values import check_value

# torchrun reads every flag it was not given from PET_<FLAG> (what Kubeflow's PyTorchJob sets):
# the variable -> our key for the flags elasticd shares. Those of static rendezvous are checked
# as the flags are (config_values.check_static).
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
    "PET_LOG_LINE_PREFIX_TEMPLATE": "log_line_prefix_template",
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


def _pet_name(key: str) -> str:
    return next((name for name, k in PET_SETTINGS.items() if k == key), "PET_" + key.upper())


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


def merge(
    flags: dict[str, Any], config_file: str | None, environ: dict[str, str] | None
) -> tuple[dict[str, Any], list[tuple[str, str]]]:
    """Every layer's settings in the fields' types, later layers winning (config.build), and the
    static-rendezvous flags torchrun's PET_* variables give, as (flag, value)."""
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
    return merged, pet_static
