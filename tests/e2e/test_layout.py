"""The package layout's rules (docs/architecture.md, "Module map"): the folders say which process
a module runs in, and these checks keep it true.

- Worker side (elasticd/worker/, elasticd/checkpoint/, elasticd/sampler.py) runs in the user's
  training processes: nothing it imports, directly or through the shared top-level modules,
  reaches the daemon-side packages (daemon, cluster, control, ops). Read from the source with
  `ast`, every import counted, those inside functions too; then once for real in a subprocess.
- The CLI, the KV protocol and the etcd client, the checkpoint format and the daemon's side of
  the in-memory state import no torch, so `elasticd status` is quick and the daemon reads
  checkpoints without it (a subprocess each).
- No module or package is named like a standard-library module or one of our dependencies, and
  every package is one that pyproject installs.
- Every elasticd import the code, tests and benchmarks write (in code strings too) resolves in
  this checkout alone: an interpreter whose site-packages holds another elasticd (an editable
  install of another copy) would otherwise find a module that moved away there, and pass.
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


PACKAGE = ROOT / "elasticd"


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def imports(name: str) -> list[tuple[str, int]]:
    """(module, line) for every elasticd module `name` imports, anywhere in it: `import a.b`,
    `from a import b` (b itself when it is a module), relative imports, and import_module("a.b")
    with a literal name. Importing a.b.c also runs a and a.b (their __init__)."""
    path = MODULES[name]
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: list[tuple[str, int]] = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        targets: list[str] = []
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join([*anchor, base] if base else anchor)
            targets = [base] + [f"{base}.{a.name}" for a in node.names]
        elif (
            isinstance(node, ast.Call)
            and getattr(node.func, "attr", getattr(node.func, "id", "")) == "import_module"
            and node.args
            and isinstance(node.args[0], ast.Constant)
            and isinstance(node.args[0].value, str)
        ):
            targets = [node.args[0].value]
        for target in targets:
            parts = target.split(".")
            for i in range(1, len(parts) + 1):  # the packages on the way run too
                prefix = ".".join(parts[:i])
                if prefix in MODULES and prefix != name:
                    found.append((prefix, node.lineno))
    return found


def _imported(statement: str) -> dict:
    code = (
        f"import json, sys\n{statement}\n"
        "print(json.dumps(sorted(m for m in sys.modules "
        "if m == 'torch' or m.startswith('elasticd'))))"
    )
    r = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout)


@pytest.mark.parametrize(
    "module",
    [
        "elasticd.ops.cli",
        "elasticd.ops.snapshot",
        "elasticd.cluster.kv",
        "elasticd.cluster.etcd",
        "elasticd.cluster.signing",
        "elasticd.cluster.values",
        "elasticd.cluster.rounds",
        "elasticd.cluster.errors",
        "elasticd.cluster.timing",
        "elasticd.cluster.silence",
        "elasticd.cluster.closing_rule",
        "elasticd.cluster.etcd.client",
        "elasticd.cluster.etcd.connections",
        "elasticd.cluster.etcd.endpoints",
        "elasticd.cluster.etcd.errors",
        "elasticd.cluster.etcd.reply",
        "elasticd.cluster.etcd.watch",
        "elasticd.cluster.etcd.wire",
        "elasticd.checkpoint.format",
        "elasticd.checkpoint",
        "elasticd.checkpoint.memory.directory",
        "elasticd.checkpoint.memory.slots",
        "elasticd.checkpoint.memory.cadence",
        "elasticd.names",
        "elasticd.config",
        "elasticd.control.client",
        "elasticd.control.paths",
    ],
)
def test_torch_free_modules_load_no_torch(module):
    """Worth keeping: the CLI answers `elasticd status` without torch's seconds of import; the
    daemon reads checkpoints (format), its in-memory state directory (memory.directory, the
    slots' headers) and etcd without it. Daemon code may import torch inside the functions that
    need it."""
    loaded = _imported(f"import {module}")
    assert "torch" not in loaded, (
        f"importing {module} imports torch; make the import that pulls it in lazy"
    )


def test_python_dash_m_elasticd_is_the_cli():
    r = subprocess.run(
        [sys.executable, "-m", "elasticd", "--version"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 0 and r.stdout.strip() == "elasticd 0.1.0", (r.stdout, r.stderr)
