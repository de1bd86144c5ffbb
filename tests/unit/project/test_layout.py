"""The package layout's rules (docs/architecture.md, "Module map"): the folders say which process
a module runs in, and these checks keep it true.

- Worker side (elasticd/worker/, elasticd/checkpoint/, and the top-level modules user scripts
  import, WORKER_MODULES: the sampler, the global batch) runs in the user's training processes:
  nothing it imports, directly or through the shared top-level modules, reaches the daemon-side
  packages (daemon, cluster, control, ops). Read from the source with
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
import importlib.util
import json
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from harness import ROOT

PACKAGE = ROOT / "elasticd"
DAEMON_SIDE = (
    "elasticd.daemon",
    "elasticd.lifecycle",
    "elasticd.cluster",
    "elasticd.control",
    "elasticd.reporting",
    "elasticd.ops",
)
# The daemon process's packages in one direction: a package imports only packages of a lower
# rank (the shared top-level modules and the worker side are below them all): the vocabulary,
# then the line between nodes and the control socket, then the reporting the daemon fills in,
# then the daemon, then the operator's CLI that starts it and reads its reports.
RANKS = {
    "elasticd.lifecycle": 1,
    "elasticd.cluster": 2,
    "elasticd.control": 2,
    "elasticd.reporting": 3,
    "elasticd.daemon": 4,
    "elasticd.ops": 5,
}
DEPENDENCIES = {"torch", "psutil", "structlog", "tenacity", "prometheus_client", "elasticd"}


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


WORKER_PACKAGES = ("elasticd.worker", "elasticd.checkpoint", "elasticd.integrations")
WORKER_MODULES = (
    "elasticd.sampler",
    "elasticd.global_batch",
    "elasticd.batch_split",
    "elasticd.exact",
    "elasticd.ledger",
)  # top-level modules that user scripts import
# An integration is named after the framework it serves (elasticd.integrations.transformers): the
# public path a script imports. Absolute imports keep `import transformers` in it the framework's.
FRAMEWORKS = {"pytorch_lightning", "lightning", "transformers", "accelerate", "rich"}


def installed(name: str) -> bool:
    """Whether the framework an integration imports is installed (other modules: True)."""
    framework = {"lightning": "pytorch_lightning"}.get(
        name.rpartition(".")[2], name.rpartition(".")[2]
    )
    if not name.startswith("elasticd.integrations.") or framework not in FRAMEWORKS:
        return True
    return importlib.util.find_spec(framework) is not None


def worker_side(name: str) -> bool:
    return (
        name in WORKER_MODULES
        or name.startswith(tuple(p + "." for p in WORKER_PACKAGES))
        or name in WORKER_PACKAGES
    )


def daemon_side(name: str) -> bool:
    return any(name == p or name.startswith(p + ".") for p in DAEMON_SIDE)


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


def chain_to_daemon_side(start: str) -> list[str] | None:
    """The shortest import chain from `start` to a daemon-side module, as 'module:line' steps."""
    seen, queue = {start}, [[(start, 0)]]
    while queue:
        path = queue.pop(0)
        for target, line in imports(path[-1][0]):
            step = [*path[:-1], (path[-1][0], line), (target, 0)]
            if daemon_side(target):
                return [f"{m}:{n}" if n else m for m, n in step]
            if target not in seen:
                seen.add(target)
                queue.append(step)
    return None


def _package(name: str) -> str | None:
    return next((p for p in RANKS if name == p or name.startswith(p + ".")), None)


def test_the_daemons_packages_import_in_one_direction():
    """No daemon-side package imports one of a higher rank, nor another of its own rank: the
    failure vocabulary and the supervision sit below the rendezvous and the control socket that
    use them, the reporting below the daemon, the CLI above it."""
    upward = []
    for name in MODULES:
        here = _package(name)
        if here is None:
            continue
        for target, line in imports(name):
            there = _package(target)
            if there is None or there == here:
                continue
            if RANKS[there] >= RANKS[here]:
                upward.append(f"{MODULES[name].relative_to(ROOT)}:{line} imports {target}")
    assert upward == [], "\n".join(upward)


def test_the_layout_is_what_the_checks_assume():
    assert "elasticd.worker.bootstrap" in MODULES and "elasticd.checkpoint.disk.format" in MODULES
    assert "elasticd.sampler" in MODULES and "elasticd.daemon.agent" in MODULES
    assert [m for m in MODULES if worker_side(m) and daemon_side(m)] == []


@pytest.mark.parametrize("name", sorted(m for m in MODULES if worker_side(m)))
def test_worker_side_imports_nothing_daemon_side(name):
    chain = chain_to_daemon_side(name)
    assert chain is None, (
        f"{MODULES[name].relative_to(ROOT)} runs in the workers but reaches the daemon side: "
        + " -> ".join(chain)
        + "; move the shared part to a top-level module"
    )


def test_the_import_reader_sees_every_form(tmp_path, monkeypatch):
    """The static check is only as good as its reading of imports: each form here is one the
    worker side must not use to reach the daemon, in a module that is not really there."""
    forms = [
        "from elasticd.daemon import agent",
        "import elasticd.cluster.kv",
        "def f():\n    from elasticd import ops",
        "from ..control import server",
        "import importlib\nimportlib.import_module('elasticd.ops.cli')",
        "from elasticd import names  # fine\nfrom elasticd.worker import heartbeat  # fine\n"
        "from elasticd.lifecycle.states import State",
    ]
    for i, source in enumerate(forms):
        fake = tmp_path / f"fake{i}.py"
        fake.write_text(source + "\n")
        monkeypatch.setitem(MODULES, f"elasticd.checkpoint.fake{i}", fake)
        chain = chain_to_daemon_side(f"elasticd.checkpoint.fake{i}")
        assert chain is not None and daemon_side(chain[-1]), (source, chain)
    fine = tmp_path / "fine.py"
    fine.write_text(
        "import os\nfrom elasticd import names, safeio\n"
        "from elasticd.checkpoint.disk import format\n"
    )
    monkeypatch.setitem(MODULES, "elasticd.checkpoint.fine", fine)
    assert chain_to_daemon_side("elasticd.checkpoint.fine") is None


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


TORCH_FREE = [
    "elasticd.ops.cli",
    "elasticd.ops.daemon_cli",
    "elasticd.reporting.status_snapshot",
    "elasticd.cluster.kv",
    "elasticd.cluster.etcd",
    "elasticd.cluster.signing",
    "elasticd.cluster.values",
    "elasticd.cluster.rounds",
    "elasticd.cluster.errors",
    "elasticd.cluster.timing",
    "elasticd.cluster.silence",
    "elasticd.cluster.closing_rule",
    "elasticd.cluster.stores",
    "elasticd.cluster.joining",
    "elasticd.cluster.rendezvous",
    "elasticd.cluster.peers",
    "elasticd.cluster.etcd.client",
    "elasticd.cluster.etcd.connections",
    "elasticd.cluster.etcd.endpoints",
    "elasticd.cluster.etcd.errors",
    "elasticd.cluster.etcd.reply",
    "elasticd.cluster.etcd.watch",
    "elasticd.cluster.etcd.wire",
    "elasticd.checkpoint.disk.format",
    "elasticd.checkpoint",
    "elasticd.checkpoint.memory.directory",
    "elasticd.checkpoint.memory.slots",
    "elasticd.checkpoint.memory.cadence",
    "elasticd.names",
    "elasticd.config",
    "elasticd.control.client",
    "elasticd.control.paths",
]


def test_torch_free_modules_load_no_torch():
    """Worth keeping: the CLI answers `elasticd status` without torch's seconds of import; the
    daemon reads checkpoints (format), its in-memory state directory (memory.directory, the
    slots' headers) and etcd without it. Daemon code may import torch inside the functions that
    need it. One interpreter imports them in turn: the first whose import brings torch in is the
    one named (whatever it imports had been imported alone before it, torch-free)."""
    code = (
        "import json, sys\n"
        f"for m in {TORCH_FREE!r}:\n"
        "    __import__(m)\n"
        "    if 'torch' in sys.modules:\n"
        "        print(json.dumps(m)); break\n"
        "else:\n"
        "    print(json.dumps(None))\n"
    )
    r = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert r.returncode == 0, r.stderr[-3000:]
    module = json.loads(r.stdout.splitlines()[-1])
    assert module is None, (
        f"importing {module} imports torch; make the import that pulls it in lazy"
    )


def test_the_control_clients_side_loads_nothing_of_the_daemons():
    """The CLI's half of the control socket (client, paths, protocol) runs in the operator's
    shell: it loads neither the server's half nor the daemon's packages."""
    loaded = _imported("import elasticd.control.client, elasticd.control.paths")
    cli_side = {f"elasticd.control{m}" for m in ("", ".client", ".paths", ".protocol")}
    assert [m for m in loaded if daemon_side(m) and m not in cli_side] == []


def test_the_status_snapshot_imports_nothing_of_elasticd():
    """Its records are read in the operator's shell (cli) and built in the daemon (status.py):
    they hold data only, whatever either side imports."""
    assert imports("elasticd.reporting.status_snapshot") == []


def test_worker_side_loads_no_daemon_side_module():
    """The same rule, for real: the bootstrap, the fork server and the whole checkpoint library
    imported in one interpreter, as a worker does (with the integrations whose framework is
    installed)."""
    names = sorted(m for m in MODULES if worker_side(m) and installed(m))
    loaded = _imported("\n".join(f"import {m}" for m in names))
    assert "torch" in loaded  # the checkpoint library's modules did load
    assert [m for m in loaded if daemon_side(m)] == []


def test_python_dash_m_elasticd_is_the_cli():
    r = subprocess.run(
        [sys.executable, "-m", "elasticd", "--version"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 0 and r.stdout.strip() == "elasticd 0.1.0", (r.stdout, r.stderr)


def test_no_module_is_named_like_another_package():
    """`from elasticd.control import socket` would hide the standard library's socket in the
    importing module, and a script run from the folder would import ours instead."""
    clashes = sorted(
        f"{m} ({MODULES[m].relative_to(ROOT)})"
        for m in MODULES
        if m.rpartition(".")[2] in (set(sys.stdlib_module_names) | DEPENDENCIES | FRAMEWORKS)
        and m != "elasticd"
        and not (m.startswith("elasticd.integrations.") and m.rpartition(".")[2] in FRAMEWORKS)
    )
    assert clashes == [], f"named like a standard-library module or a dependency: {clashes}"


def test_every_package_is_installed():
    listed = set(
        tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]
    )
    packages = {module_name(p) for p in PACKAGE.rglob("__init__.py")}
    assert packages <= listed, (
        f"missing from pyproject's [tool.setuptools] packages: {sorted(packages - listed)}"
    )
    stray = sorted(
        str(d.relative_to(ROOT))
        for d in PACKAGE.rglob("*")
        if d.is_dir() and d.name != "__pycache__" and not (d / "__init__.py").exists()
    )
    assert stray == [], f"folders without __init__.py (not installed): {stray}"


IMPORTED = re.compile(
    r"\bfrom (elasticd(?:\.\w+)*) import (\w+(?: as \w+)?(?:, *\w+(?: as \w+)?)*)"
    r"|\bimport (elasticd(?:\.\w+)*)"
)
STARTED = re.compile(r'(?:"-m", |command\()"(elasticd(?:\.\w+)*)"')


def test_every_elasticd_import_resolves_in_this_checkout():
    """Read as text, so that code in strings (`python -c`, a worker's script) counts; run in an
    interpreter that finds modules through sys.path only (no editable-install finder), this
    checkout first."""
    statements, started = set(), set()
    for folder in ("elasticd", "tests", "bench", "entrypoints"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            if path.name == "test_layout.py":
                continue
            text = path.read_text()
            for m in IMPORTED.finditer(text):
                if m.group(1):
                    names = ", ".join(n.split(" as ")[0].strip() for n in m.group(2).split(","))
                    statements.add(f"from {m.group(1)} import {names}")
                else:
                    statements.add(f"import {m.group(3)}")
            started.update(STARTED.findall(text))
    assert len(statements) > 50 and "elasticd.worker.bootstrap" in started, (
        len(statements),
        started,
    )
    code = f"""
import importlib.machinery, importlib.util, json, sys
sys.meta_path[:] = [f for f in sys.meta_path if f in (importlib.machinery.BuiltinImporter,
                    importlib.machinery.FrozenImporter, importlib.machinery.PathFinder)]
sys.path.insert(0, {str(ROOT)!r})
failed = []
for statement in {sorted(statements)!r}:
    try:
        exec(statement, {{}})
    except Exception as e:
        failed.append(f"{{statement}}: {{type(e).__name__}}: {{e}}")
for module in {sorted(started)!r}:
    spec = importlib.util.find_spec(module)
    if spec is None or not (spec.origin or "").startswith({str(PACKAGE)!r}):
        failed.append(f"python -m {{module}}: not in this checkout")
print(json.dumps(failed))
"""
    r = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert r.returncode == 0, r.stderr[-3000:]
    assert json.loads(r.stdout.splitlines()[-1]) == []
