"""The exit-code contract has one source, `elasticd.exit_codes.ExitCode`: the unit file's
RestartPreventExitStatus, docs/running.md's table and the package's code all follow it."""

from __future__ import annotations

import re

from elasticd.exit_codes import NO_RESTART, ExitCode
from harness import ROOT


def test_the_unit_file_keeps_exactly_what_a_restart_cannot_fix():
    unit = (ROOT / "systemd" / "elasticd.service").read_text()
    found = re.findall(r"^RestartPreventExitStatus=(.*)$", unit, re.M)
    assert len(found) == 1, found
    assert {int(c) for c in found[0].split()} == {int(c) for c in NO_RESTART}


def test_the_docs_table_lists_every_code_and_no_other():
    page = (ROOT / "docs" / "running.md").read_text()
    table = page.split("## Exit codes", 1)[1].split("\n## ", 1)[0]
    rows = {int(m) for m in re.findall(r"^\| (\d+) \|", table, re.M)}
    assert rows == {int(c) for c in ExitCode}


def test_no_module_spells_an_exit_code_of_its_own():
    """An `EXIT_X = <number>` anywhere in the package is a second source of the contract."""
    spelled = []
    for path in (ROOT / "elasticd").rglob("*.py"):
        for n, line in enumerate(path.read_text().splitlines(), 1):
            if re.match(
                r"\s*EXIT_[A-Z_]+[\s,A-Z_]*=\s*(\d+(\s*,\s*\d+)*|128\s*\+.*)\s*(#.*)?$", line
            ):
                spelled.append(f"{path.relative_to(ROOT)}:{n}: {line.strip()}")
    assert not spelled, "use elasticd.exit_codes.ExitCode:\n" + "\n".join(spelled)
