"""Fuzzing the config loader (issue 18): random TOML documents, random bytes as the file, random
PET_*/ELASTICD_* environments and random flag values, through the code the CLI runs.

Whatever comes in, the outcome is a sane Config (every number in range, names in their form) or
one error line and exit code 2, never a traceback. The CLI runs are given an entrypoint that does
not exist, so a config that passes stops at the entrypoint check (exit 2 too) and no daemon starts.
Derandomized with a fixed number of examples, so CI sees the same inputs on every run.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from elasticd import config, config_layers
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


# The environment torchrun's launchers set (PET_*) and ours (ELASTICD_*), plus names that mean nothing.
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


def assert_one_line(code: int, stderr: str) -> str:
    assert code == 2, (code, stderr)
    assert "Traceback" not in stderr, stderr
    lines = stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("elasticd: error: "), stderr
    return lines[0]


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
