"""Preflight finds a module entrypoint where the workers will (the working directory first) without
running any of its code in the daemon: a package's __init__ planted in the working directory
(someone else's to write) must not run as the daemon's user (root, for a service)."""

from __future__ import annotations

import sys

import pytest

from elasticd.config import ConfigError
from elasticd.daemon import preflight

PKG = "planted_pkg_preflight"


@pytest.fixture
def planted(tmp_path):
    """A package in a working directory whose every __init__ would leave a marker if run."""
    marker = tmp_path / "ran"
    run = f"open({str(marker)!r}, 'a').write(__name__ + '\\n')\n"
    files = {
        f"{PKG}/__init__.py": run,
        f"{PKG}/mod.py": run + "def main():\n    return 0\n",
        f"{PKG}/sub/__init__.py": run,
        f"{PKG}/sub/__main__.py": run,
        f"{PKG}/nomain/__init__.py": run,
    }
    for rel, text in files.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)
    yield tmp_path, marker
    for name in [m for m in sys.modules if m.split(".")[0] == PKG]:
        del sys.modules[name]


def test_a_module_entrypoint_is_found_without_running_its_package(planted):
    cwd, marker = planted
    preflight.check_entrypoint(f"{PKG}.mod", cwd=str(cwd))
    preflight.check_entrypoint(f"{PKG}.mod:main", cwd=str(cwd))  # the function read, not run
    preflight.check_entrypoint(f"{PKG}.sub", cwd=str(cwd))  # a package with __main__
    spec = preflight.find_module(f"{PKG}.sub.__main__", str(cwd))
    assert spec is not None and spec.origin == str(cwd / PKG / "sub" / "__main__.py")
    assert not marker.exists()
    assert PKG not in sys.modules
    assert str(cwd) not in sys.path  # the daemon's own path is left as it was


@pytest.mark.parametrize(
    "entrypoint, needle",
    [
        (f"{PKG}.missing", "cannot be found"),
        (f"{PKG}.mod.deeper", "cannot be found"),  # a module is not a package
        (f"{PKG}.nomain", "package without __main__"),
        (f"{PKG}.mod:nope", "has no function"),
    ],
)
def test_what_the_worker_could_not_run_is_still_refused(planted, entrypoint, needle):
    cwd, marker = planted
    with pytest.raises(ConfigError, match=needle):
        preflight.check_entrypoint(entrypoint, cwd=str(cwd))
    assert not marker.exists()


def test_installed_and_builtin_modules_are_found_as_before(tmp_path):
    assert preflight.find_module("json.tool", str(tmp_path)).origin.endswith("json/tool.py")
    assert preflight.find_module("sys", str(tmp_path)).origin == "built-in"
    assert preflight.find_module("json.nothing_here", str(tmp_path)) is None
