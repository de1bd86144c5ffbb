"""A warm spare bound to a rank ahead of need: it imports the modules that read a rank variable at
import (worker/preload.py leaves them out of the fork server: Lightning's and torchmetrics'
`rank_zero_only.rank` from RANK) with the environment its rank is expected to have, before any
crash, so a restart does not pay for them (Lightning: about 0.3 s on 2 cores).

The daemon binds a spare to the environment a local rank has in the running attempt (a restart at
an unchanged world gives it again) and hands it only a rank whose environment has the same values
in the variables those imports read (daemon/spares.py). The spare checks again what its imports
actually read against the rank it is given: where a value differs after all, what the modules
computed from it would be wrong, so it becomes a cold worker instead (exec), slower but exactly
what the script would see under torchrun. `bind` imports them and records the values read;
`cold_start` is the exec."""

from __future__ import annotations

import importlib
import os
import sys

from elasticd import names
from elasticd.worker import preload, proctitle


def bind(message: dict) -> dict[str, str | None]:
    """Import `message["modules"]` with os.environ as `message["env"]` (the rank's expected
    environment), each only from its file in `message["origins"]` (preload.Origins); the rank
    variables read meanwhile, with the values seen (None: unset)."""
    saved = dict(os.environ)
    os.environ.clear()
    os.environ.update(message["env"])
    try:
        with preload.Origins(message.get("origins")), preload.Audit() as audit:
            for name in message["modules"]:
                try:
                    importlib.import_module(name)
                except Exception:  # noqa: BLE001 - the script meets the same error, cold
                    continue
    finally:
        os.environ.clear()
        os.environ.update(saved)
    return audit.values


def holds(seen: dict[str, str | None], env: dict[str, str]) -> bool:
    """Whether every variable the bound imports read has the same value in `env`."""
    return all(env.get(key) == value for key, value in seen.items())


def cold_start(args: list[str]) -> None:
    """Become a cold worker of the rank already in os.environ (and on stdout/stderr): the
    bootstrap started afresh, as spawn.spawn starts one, in this process."""
    shown = proctitle.title(os.environ[names.ENTRYPOINT], args)
    command = proctitle.command("elasticd.worker.bootstrap", shown, args)
    sys.stdout.flush()
    sys.stderr.flush()
    os.execv(sys.executable, command)
