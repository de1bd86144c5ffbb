"""The DDP tutorial job (ddp_tutorial.py) after importing a library module named first on the
command line (`early_crash.py MODULE ARGS...`): something the workers import that the spares do
not hold yet, so the fork server has it to learn when the job first steps."""

import importlib
import sys

importlib.import_module(sys.argv.pop(1))

import ddp_tutorial  # noqa: E402 - after the library, as a framework's job imports it first

ddp_tutorial.main()
