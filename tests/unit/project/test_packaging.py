"""What `pip install .` installs: a wheel built from a clean copy of this checkout holds every
module of elasticd, `python -m elasticd`'s __main__ included (issue 31: a venv user once got
`No module named elasticd.__main__`)."""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile

from harness import ROOT


def test_the_wheel_holds_every_module(tmp_path):
    src = tmp_path / "src"  # a copy: building in the checkout would leave build/ behind
    junk = shutil.ignore_patterns(
        ".git",
        "build",
        "dist",
        "*.egg-info",
        "__pycache__",
        ".pytest_cache",
        ".venv",
        "elasticd-runs",
    )
    shutil.copytree(ROOT, src, ignore=junk, symlinks=True)
    r = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation"]
        + ["-w", str(tmp_path / "dist"), str(src)],
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    (wheel,) = (tmp_path / "dist").glob("elasticd-*.whl")
    packed = set(zipfile.ZipFile(wheel).namelist())
    modules = {str(p.relative_to(src)) for p in (src / "elasticd").rglob("*.py")}
    assert "elasticd/__main__.py" in modules and modules <= packed, sorted(modules - packed)
