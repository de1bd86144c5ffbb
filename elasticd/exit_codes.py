"""The exit-code contract of the `elasticd` command, in one type: what `elasticd run`, `status`,
`stop`, `stacks` and `node` return, which systemd's unit keeps from restarting (`NO_RESTART`, the
unit's RestartPreventExitStatus) and which docs/running.md's table lists (tests/unit/
test_exit_codes.py checks both). Imports nothing: the daemon, the CLI and the tests read it alike.
"""

from __future__ import annotations

import enum
import signal


class ExitCode(enum.IntEnum):
    """One code, one meaning, whichever subcommand returns it."""

    OK = 0
    """`run`: the job succeeded, or stopped on request; `status`: a daemon runs; `stop`: stopped
    (or none was running)."""
    FAILED = 1
    """`run`: the job failed (restart budget spent, fatal exit code, rendezvous failed)."""
    USAGE = 2
    """Bad input (flags, config, entrypoint, ports, paths): nothing started; several daemons
    found where one is meant (`--socket` picks)."""
    NOT_RUNNING = 3
    """No daemon runs (LSB's "not running" for `status`)."""
    CONTROL = 4
    """The daemon refused the command or did not answer."""
    UNHEALTHY = 5
    """`run`: this node's health check failed: it did not start, or it left the job."""
    DETERMINISTIC = 6
    """`run`: the same failure at the same step in consecutive attempts: requeueing will not
    help."""
    QUARANTINED = 7
    """`run`: this node is quarantined (it did not start, or it left the job); `node status`: it
    is quarantined."""
    PIPE = 128 + signal.SIGPIPE
    """The reader of the output went away (`elasticd status | head`): quiet, as git is."""


# what a restart of the service cannot fix: the unit's RestartPreventExitStatus
NO_RESTART = frozenset({ExitCode.USAGE, ExitCode.DETERMINISTIC, ExitCode.QUARANTINED})
