"""The one process `elasticd replay BUNDLE` starts (ops/replay.py): the bundle's entrypoint run
again as a world of one, in the environment the CLI made (names.REPLAY and the rest), and what
became of it left in the result file for the CLI to judge.

The script's CheckpointManager does the replay's work (elasticd.checkpoint.bundle): its
`load_latest()` returns the bundle's certified state, and its `maybe_save()` past the failed step
writes the result (the step completed, with the state's digest) and ends the script. Here: an
exception the script leaves uncaught is the result "error", with its text and traceback; an exit
or return before the failed step is "ended". Torch is the script's to import.

Usage: python -m elasticd.worker.replay BUNDLE RESULT
"""

from __future__ import annotations

import json
import os
import sys
import traceback
from typing import NoReturn

from elasticd import repro
from elasticd.worker import bootstrap


def _leave(result: str, data: dict) -> None:
    if not os.path.exists(result):  # the manager's boundary wrote it already
        with open(result, "w") as f:
            json.dump(data, f)


def main(argv: list[str]) -> int:
    path, result = argv
    try:
        head, _ = repro.read_header(path)
    except repro.BundleError as e:
        _leave(result, {"outcome": "refused", "why": str(e)})
        return 2
    if os.path.isdir(head.get("cwd", "")):
        os.chdir(head["cwd"])
    try:
        bootstrap.run_entrypoint(head["entrypoint"], list(head["args"]))
        _leave(result, {"outcome": "ended", "code": 0})
    except SystemExit as stop:
        _leave(result, {"outcome": "ended", "code": stop.code})
    except BaseException as exc:  # noqa: BLE001 - the replay's outcome
        exc.__traceback__ = bootstrap.script_traceback(exc.__traceback__)
        _leave(
            result,
            {
                "outcome": "error",
                "exception": f"{type(exc).__name__}: {exc}",
                "callstack": "".join(traceback.format_exception(exc)),
            },
        )
        traceback.print_exception(exc)
    return 0


def run(argv: list[str]) -> NoReturn:
    """main, then out at once: a thread or process group the script left must not hold the
    verdict. A warm spare handed a replay (the referee's, daemon/referee.py) comes here too."""
    code = main(argv)
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    os._exit(code)


if __name__ == "__main__":
    run(sys.argv[1:])
