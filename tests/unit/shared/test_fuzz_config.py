"""Fuzzing the config loader (issue 18): random TOML documents, random bytes as the file, random
PET_*/ELASTICD_* environments and random flag values, through the code the CLI runs.

Whatever comes in, the outcome is a sane Config (every number in range, names in their form) or
one error line and exit code 2, never a traceback. The CLI runs are given an entrypoint that does
not exist, so a config that passes stops at the entrypoint check (exit 2 too) and no daemon starts.
Derandomized with a fixed number of examples, so CI sees the same inputs on every run.
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import io
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from elasticd import config, config_layers, config_values
from elasticd.config import ConfigError
from elasticd.ops import cli
from harness import ROOT

MISSING = "/nonexistent/elasticd-fuzz/train.py"
SETTINGS = {
    "deadline": None,
    "derandomize": True,
    "database": None,
    "suppress_health_check": [HealthCheck.too_slow, HealthCheck.filter_too_much],
}

# Values that sit on the edges the checks draw, and names that once got through.
EDGES = [
    "inf",
    "-inf",
    "nan",
    "NaN",
    "1e999",
    "-1",
    "0",
    "1",
    "0.001",
    "2592000",
    "2592001",
    "1024",
    "1025",
    "100000",
    "SIGKILL",
    "SIGSTOP",
    "SIGSEGV",
    "SIGUSR1",
    "SIGUSR2",
    "SIG_IGN",
    "SIGTERM,SIGKILL",
    "9",
    "..",
    ".",
    "../x",
    "a/b",
    "none",
    "job42",
    "auto",
    "gpu",
    "cpu",
    "1:4",
    "4:2",
    "0:3,1:1",
    "x\0y",
    "a\nb",
    "torch,os",
    "torch.nn",
    "1,2,300",
    "localhost:29400",
    "[::1]:0",
    "host:http",
    "true",
    "yes",
    "",
    " ",
]
KEYS = sorted(config.FIELDS) + ["rdzv_conf"]

scalars = st.one_of(
    st.integers(),
    st.integers(min_value=-5, max_value=1100),
    st.floats(),
    st.floats(min_value=0, max_value=3e6),
    st.booleans(),
    st.text(max_size=20),
    st.sampled_from(EDGES),
)
values = st.recursive(
    scalars,
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=3)
    ),
    max_leaves=8,
)
keys = st.one_of(
    st.sampled_from(KEYS),
    st.sampled_from(KEYS),
    st.sampled_from([k.replace("_", "-") for k in KEYS]),
    st.text(min_size=0, max_size=12),
)
documents = st.tuples(st.dictionaries(keys, values, max_size=6), st.booleans())


def toml_value(v) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int):
        return str(v)
    if isinstance(v, float):
        return (
            "nan" if math.isnan(v) else ("inf" if v > 0 else "-inf") if math.isinf(v) else repr(v)
        )
    if isinstance(v, str):  # a TOML basic string: JSON's escapes are TOML's, \u0000 included
        return json.dumps(v, ensure_ascii=False).replace("\x7f", "\\u007f")
    if isinstance(v, list):
        return "[" + ", ".join(map(toml_value, v)) + "]"
    return "{" + ", ".join(f"{toml_value(str(k))} = {toml_value(x)}" for k, x in v.items()) + "}"


def toml_document(doc: tuple[dict, bool]) -> bytes:
    settings_, in_table = doc
    lines = [f"{toml_value(k)} = {toml_value(v)}" for k, v in settings_.items()]
    return (("[elasticd]\n" if in_table else "") + "\n".join(lines) + "\n").encode()


# The environment torchrun's launchers set (PET_*) and ours (ELASTICD_*), plus names that mean
# nothing.
ENV_NAMES = sorted(
    {
        *config_layers.PET_SETTINGS,
        *config_layers.PET_STATIC,
        *("ELASTICD_" + k.upper() for k in config.FIELDS),
        "ELASTICD_BOGUS",
        "PET_BOGUS",
    }
)
env_values = st.one_of(
    st.sampled_from(EDGES), st.text(max_size=20), st.integers().map(str), st.floats().map(repr)
).map(lambda s: s.replace("\0", ""))
environments = st.dictionaries(st.sampled_from(ENV_NAMES), env_values, max_size=5)


def _value_flags() -> list[str]:
    """Every `elasticd run` option that takes a value, from the parser itself."""
    run = next(
        a for a in cli.build_parser()._actions if isinstance(a, argparse._SubParsersAction)
    ).choices["run"]
    return sorted(
        opt
        for a in run._actions
        for opt in a.option_strings
        if a.nargs is None and not isinstance(a, argparse._HelpAction) and opt != "--config"
    )


VALUE_FLAGS = _value_flags()
flag_lists = st.lists(st.tuples(st.sampled_from(VALUE_FLAGS), env_values), max_size=4)


def assert_sane(cfg: config.Config) -> None:
    """What a Config that passed must hold, whatever it was built from."""
    for key, (least, most, closed) in config_values._RANGES.items():
        value = getattr(cfg, key)
        assert least <= value <= most and (closed or value > least), (key, value)
    assert config_values.RDZV_ID.fullmatch(cfg.rdzv_id) and ".." not in cfg.rdzv_id, cfg.rdzv_id
    assert cfg.stack_signal in config_values.STACK_SIGNALS
    assert set(cfg.signals_to_handle) <= set(config_values.STOP_SIGNALS)
    assert 1 <= cfg.min_nodes <= cfg.max_nodes <= config.MAX_NODES
    strings = [
        v
        for f in config.FIELDS
        for v in (getattr(cfg, f) if isinstance(getattr(cfg, f), tuple) else (getattr(cfg, f),))
        if isinstance(v, str)
    ]
    assert not any("\0" in s for s in strings)


def build_or_error(flags: dict, path: str | None, environ: dict) -> str | None:
    """None for a sane Config, else the ConfigError's message; anything else raised fails."""
    try:
        cfg = config.build(flags, path, environ=environ)
    except ConfigError as e:
        return str(e)
    assert_sane(cfg)
    return None


@contextlib.contextmanager
def environment(env: dict[str, str]):
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def run_main(argv: list[str]) -> tuple[int, str]:
    """`elasticd ARGV` in this process: (exit code, stderr)."""
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        try:
            code = cli.main(argv)
        except SystemExit as e:
            code = e.code
    return code, err.getvalue()


def assert_one_line(code: int, stderr: str) -> str:
    assert code == 2, (code, stderr)
    assert "Traceback" not in stderr, stderr
    lines = stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("elasticd: error: "), stderr
    return lines[0]


SCRATCH = Path(tempfile.mkdtemp(prefix="elasticd-fuzz-"))  # one file, rewritten per example
atexit.register(shutil.rmtree, SCRATCH, True)  # the session leaves no file behind


def config_file(content: bytes) -> str:
    path = SCRATCH / "c.toml"
    path.write_bytes(content)
    return str(path)


@settings(max_examples=250, **SETTINGS)
@given(doc=documents)
def test_random_toml_documents(doc):
    build_or_error({"entrypoint": "x.py"}, config_file(toml_document(doc)), {})


@settings(max_examples=120, **SETTINGS)
@given(
    data=st.one_of(
        st.binary(max_size=200),
        documents.map(toml_document).flatmap(
            lambda b: st.integers(0, max(len(b) - 1, 0)).map(
                lambda i: b[:i] + b'\x00\xff"[=\n'[i % 6 :][:1] + b[i + 1 :]
            )
        ),
    )
)
def test_random_bytes_as_the_config_file(data):
    build_or_error({"entrypoint": "x.py"}, config_file(data), {})


@settings(max_examples=120, **SETTINGS)
@given(env=environments, flags=st.dictionaries(st.sampled_from(KEYS), env_values, max_size=4))
def test_random_environment_and_flag_values(env, flags):
    build_or_error(flags, None, env)


@settings(max_examples=180, **SETTINGS)
@given(doc=documents, env=environments, flags=flag_lists)
def test_cli_in_process(doc, env, flags):
    """The CLI's own path (argparse, layers, validation, entrypoint check): exit 2, one line."""
    argv = [
        "run",
        "--config",
        config_file(toml_document(doc)),
        *(f"{opt}={value}" for opt, value in flags),
        MISSING,
    ]
    with environment(env):
        code, stderr = run_main(argv)
    assert_one_line(code, stderr)


@settings(max_examples=120, **SETTINGS)
@given(value=env_values)
def test_stop_timeout_flag(value):
    """`elasticd stop --timeout X` with no daemon to ask: a bad X is one line and exit 2 before
    any request; a good one finds nobody to stop (exit 0)."""
    code, stderr = run_main(
        ["stop", "--socket", "/nonexistent/elasticd-fuzz.sock", f"--timeout={value}"]
    )
    try:
        ok = 0 <= float(value) <= config.MAX_SECONDS
    except ValueError:
        ok = False
    if ok:
        assert code == 0 and stderr == "", (value, code, stderr)
    else:
        assert "--timeout" in assert_one_line(code, stderr)


@settings(max_examples=6, **SETTINGS)
@given(
    content=st.one_of(documents.map(toml_document), st.binary(max_size=64)),
    env=environments,
    flags=flag_lists,
)
def test_real_cli_process(content, env, flags):
    """A few through a real `python -m elasticd run`, as an operator would."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "c.toml"
        path.write_bytes(content)
        argv = [
            "run",
            "--config",
            str(path),
            "--log-dir",
            str(Path(tmp) / "logs"),
            *(f"{opt}={value}" for opt, value in flags),
            MISSING,
        ]
        r = subprocess.run(
            [sys.executable, "-m", "elasticd", *argv],
            capture_output=True,
            text=True,
            timeout=60,
            cwd=ROOT,
            env={**os.environ, **env},
            check=False,
        )
        assert_one_line(r.returncode, r.stderr)
        assert not (Path(tmp) / "logs").exists()
