"""`elasticd run / status / stop / stacks / node / ledger / replay`: argument parsing, and every
error turned into an exit code (the commands to a running daemon are in daemon_cli.py).

Exit codes:
  0  run: the job succeeded, or was stopped on request; status: the daemon is running; stop: done;
     stacks: dumped
  1  run: the job failed (restart budget spent, fatal exit code, rendezvous failed)
  2  bad input: flags, config file, entrypoint, ports, paths (nothing was started); stop/stacks:
     several daemons run here and no --socket or --rdzv-id says which; status/stop/stacks: no
     daemon here runs the job --rdzv-id names
  3  status/stacks: no daemon is running (LSB "program is not running")
  4  status/stop/stacks: the daemon refused or did not answer (permission, protocol, no workers)
  5  run: this node's health check failed: it did not start, or it left the job
  6  run: deterministic failure (the same failure at the same step in consecutive attempts): do
     not requeue
  7  run: this node is quarantined (too many health check or hardware failures): it did not
     start, or it left the job; node status: it is quarantined (`elasticd node clear` ends it)
replay: 0 the failure reproduced, 1 it did not (the step completed), 2 the bundle refused (damaged,
     another version's), 3 undecided (another error, the samples differ, the time ran out)
141  status/stop/stacks: the reader of the output went away (`elasticd status | head`): quiet, as
     git (128 + SIGPIPE, what a shell shows for a command a closed pipe ended)

`run`'s checks before the daemon starts are here (daemon/preflight.py's, and a quarantined node
refused before anything starts); a start that fails to bind leaves no run directory. `entry()`,
the command itself, leaves with `os._exit` once `main()` returns: a helper thread still inside a
torch store call would abort interpreter finalization.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time
from pathlib import Path

from elasticd import __version__, names
from elasticd.config import ConfigError
from elasticd.config_values import check_value
from elasticd.exit_codes import ExitCode
from elasticd.ops import flags

EPILOG = """exit codes: 0 success (status: running), 1 job failed, 2 bad input (nothing started),
3 no daemon running (status, stacks), 4 daemon refused or did not answer,
5 this node's health check failed (run: it did not start, or left the job),
6 deterministic failure: the same failure at the same step again (run; do not requeue),
7 this node is quarantined (run, node status; `elasticd node clear` ends it),
replay: 0 reproduced, 1 not reproduced, 2 bundle refused, 3 undecided,
141 the output's reader went away (status | head)"""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one line, exit 2
        sys.stderr.write(f"elasticd: error: {_one_line(message)} (see '{self.prog} --help')\n")
        sys.exit(ExitCode.USAGE)


# What str.splitlines() (and so many a log reader) takes for the end of a line, as escapes.
_LINE_BREAKS = {ord(c): repr(c)[1:-1] for c in "\n\r\v\f\x1c\x1d\x1e\x85\u2028\u2029"}


def _one_line(message: object) -> str:
    """An error as one line, whatever a value quoted in it held (a newline from an environment
    variable must not make a second line that looks like another message)."""
    return str(message).translate(_LINE_BREAKS)


def _grace(text: str) -> float:
    """`stop --timeout`: seconds of grace the daemon can honour (not nan, inf or negative)."""
    try:
        return check_value("stop_grace", float(text), "stop grace")
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
    except ConfigError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _seconds(text: str) -> float:
    """A positive, finite number of seconds (`replay --timeout`)."""
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive number of seconds")
    return value


_RDZV_ID_HELP = (
    "the job (its --rdzv-id) whose daemon is meant, where several run here (default: every "
    "daemon found, as `status` lists them)"
)


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(
        prog="elasticd",
        description="Keeps PyTorch distributed training alive.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--version", action="version", version=f"elasticd {__version__}")
    sub = p.add_subparsers(dest="command", parser_class=_Parser)
    run = sub.add_parser(
        "run",
        help="run a training job on this node",
        usage="elasticd run [flags] [ENTRYPOINT [ARGS...]] | [flags] -- ARGS...",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    flags.add_run_flags(run)
    st = sub.add_parser(
        names.STATUS,
        help="show the daemon's state",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    st.add_argument(
        "--json",
        action="store_true",
        help="print the status as one JSON document: the job's object, or, where several "
        "daemons run here and neither --socket nor --rdzv-id picks one, a list of them, "
        'each with its "socket"',
    )
    st.add_argument("--socket", default=None, help="control socket path")
    st.add_argument("--rdzv-id", default=None, help=_RDZV_ID_HELP)
    sp = sub.add_parser(
        names.STOP,
        help="stop the job gracefully",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sp.add_argument(
        "--timeout",
        type=_grace,
        default=None,
        metavar="SECONDS",
        help="grace before workers are killed (default: the daemon's stop_grace)",
    )
    sp.add_argument("--socket", default=None, help="control socket path")
    sp.add_argument("--rdzv-id", default=None, help=_RDZV_ID_HELP)
    sk = sub.add_parser(
        names.STACKS,
        help="print every thread's stack of each local worker, now",
        description="Each running worker of this node dumps all its threads' Python stacks "
        "(faulthandler), as before a hang restart; the job goes on. The dumps are "
        "also appended to the ranks' rankR.stacks.txt.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sk.add_argument("--json", action="store_true", help="print the reply as JSON")
    sk.add_argument("--socket", default=None, help="control socket path")
    sk.add_argument("--rdzv-id", default=None, help=_RDZV_ID_HELP)
    nd = sub.add_parser(
        "node",
        help="this node's record: quarantine and failures (read here, no daemon needed)",
        description="status: whether this node is quarantined (exit 7 if so) and its recent "
        "failures; clear: forget them, once the node is repaired, so that it may start again.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    nd.add_argument("action", choices=("status", "clear"))
    nd.add_argument("--state-dir", default=None, help="the daemon's --state-dir")
    nd.add_argument("--log-dir", default=None, help="the daemon's --log-dir (for its default)")
    nd.add_argument("--config", dest="config_file", default=None, help="the daemon's config")
    nd.add_argument("--json", action="store_true", help="print the record as JSON")
    lg = sub.add_parser(
        "ledger",
        help="check a run's per-sample ledger (--ledger) for exactly-once",
        description="check: every sample of each finished epoch trained exactly once, from the "
        "ledger files at or below the given log or run directories (every node's); exit 1 if "
        "not, 2 for input that is not a ledger, or that another user could have written (a "
        "file or directory on its path owned by another user than you or root, or writable by "
        "its group or others): the proof holds only for ledgers only the job's user can write.",
    )
    lg.add_argument("action", choices=("check",))
    lg.add_argument("paths", nargs="+", metavar="DIR", help="log or run directories, or files")
    rp = sub.add_parser(
        "replay",
        help="re-run a failed step from its repro bundle, in one process",
        description="A worker that died of an exception, in a script using CheckpointManager "
        "under `elasticd run --ledger`, leaves rankR.repro beside its error file: the certified "
        "state before the failed step, the ledger's samples since, its RNG, what ran. This runs "
        "that step again as a world of one and says whether the same error comes back (exit "
        "0), or not (1: the step completed, with its state's digest); a damaged bundle or "
        "another version's is refused in one line (2); 3: undecided (another error, samples "
        "that differ from the ledger's, the time ran out). See docs/replay.md.",
    )
    rp.add_argument("bundle", metavar="BUNDLE", help="a rankR.repro file")
    rp.add_argument(
        "--timeout",
        type=_seconds,
        default=600.0,
        metavar="SECONDS",
        help="give up on the replay after this long (default 600)",
    )
    return p


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    extra: list[str] = []
    if (
        "--" in argv
    ):  # before any entrypoint, `--` ends elasticd's flags: the rest is the default entrypoint's
        i = argv.index("--")
        head = build_parser().parse_args(argv[:i])
        if head.command != "run" or "entrypoint" not in vars(head):
            argv, extra = argv[:i], argv[i + 1 :]
    args = build_parser().parse_args(argv)
    if getattr(args, "print_completion", None):
        return _printed(lambda: _print_completion(args.print_completion))
    if args.command == "run":
        given = vars(args).pop("args", None) or []  # after the entrypoint, as torchrun takes them
        return _run(args, extra or (given[1:] if given[:1] == ["--"] else given))
    if extra:
        build_parser().error("arguments after -- are only for 'run'")
    if args.command == "node":
        return _node(args)
    if args.command == "ledger":
        from elasticd.ops import ledger_check

        return ledger_check.check(args.paths)
    if args.command == "replay":
        from elasticd.ops import replay

        return replay.run(args.bundle, args.timeout)
    from elasticd.ops import daemon_cli

    control_command = {
        names.STATUS: daemon_cli.status,
        names.STOP: daemon_cli.stop,
        names.STACKS: daemon_cli.stacks,
    }.get(args.command)
    if control_command:
        return _printed(lambda: control_command(args))
    build_parser().print_help()
    return ExitCode.USAGE


def _printed(command) -> int:
    """A command that prints: its exit code, or quietly ExitCode.PIPE once its reader left."""
    try:
        code = command()
        sys.stdout.flush()  # a closed pipe shows here, not at exit
    except BrokenPipeError:
        return _reader_gone()
    return code


def _print_completion(shell: str) -> int:
    """`run --print-completion SHELL`, torchrun's flag: the `elasticd` command's completion."""
    import shtab

    print(shtab.complete(build_parser(), shell=shell))
    return ExitCode.OK


def _reader_gone() -> int:
    """The reader of our output left (`elasticd status | head`): no traceback and no second try
    at exit, as git and systemctl do; what is left to print goes to /dev/null."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, sys.stdout.fileno())
    finally:
        os.close(devnull)
    return ExitCode.PIPE


def _run(args: argparse.Namespace, extra: list[str]) -> int:
    from elasticd import config, logs
    from elasticd.cluster import signing
    from elasticd.daemon import preflight, quarantine, systemd

    systemd.quiet_torch_cpp()  # before anything imports torch

    cli_only = ("command", "config_file", "module", "run_path", "static")
    flags = {k: v for k, v in vars(args).items() if k not in cli_only}
    if extra:
        flags["args"] = extra
    try:
        _entrypoint_kind(args, flags)
        cfg = config.build(flags, args.config_file, static=getattr(args, "static", []))
        preflight.check_entrypoint(cfg.entrypoint, no_python=cfg.no_python)
        if cfg.health_check:
            preflight.check_health_check(cfg.health_check)
        if cfg.metrics_textfile:
            cfg = _checked_textfile(cfg)
        if cfg.rdzv_secret_file:
            signing.load_secret(cfg.rdzv_secret_file)
        if cfg.etcd and cfg.etcd_password_file:
            signing.load_password(cfg.etcd_password_file)
        if (
            cfg.max_nodes == 1 and cfg.rdzv_endpoint and not cfg.etcd
        ):  # a single node hosts a c10d store
            preflight.check_port_free(cfg.rdzv_host, cfg.rdzv_port)
        base = preflight.check_log_dir(_log_base(cfg))
        state = quarantine.state_dir(cfg, base)  # the default one is made at the first failure
        if cfg.state_dir or state.exists():
            state = preflight.check_log_dir(state, "--state-dir")
        cfg = dataclasses.replace(cfg, state_dir=str(state.absolute()))
        record = quarantine.read(state)
        if record.quarantined:  # a scheduler drains the node on this exit code
            sys.stderr.write(quarantine.refusal(record, state) + "\n")
            return ExitCode.QUARANTINED
        checkpoints = (
            Path(cfg.checkpoint_dir) if cfg.checkpoint_dir else base / "checkpoints" / cfg.rdzv_id
        )
        cfg = dataclasses.replace(
            cfg, checkpoint_dir=str(preflight.check_log_dir(checkpoints, "--checkpoint-dir"))
        )
        run_dir = _run_dir(cfg, base)
    except ConfigError as e:
        sys.stderr.write(f"elasticd: error: {_one_line(e)}\n")
        return ExitCode.USAGE
    logs.setup(cfg.log_format)
    from elasticd.daemon.serve import serve

    try:
        return serve(cfg, run_dir)
    except ConfigError as e:  # found only when binding (a port in use, a live socket)
        _forget_run_dir(run_dir)
        sys.stderr.write(f"elasticd: error: {_one_line(e)}\n")
        return ExitCode.USAGE


def _entrypoint_kind(args: argparse.Namespace, flags: dict) -> None:
    """`--run-path` and `-m` as torchrun takes them (--run-path wins over -m and --no-python)."""
    entrypoint = flags.get("entrypoint")
    if getattr(args, "run_path", False):
        if not entrypoint:
            raise ConfigError("--run-path needs a script path as ENTRYPOINT")
        if not entrypoint.endswith(".py") and os.sep not in entrypoint:
            flags["entrypoint"] = os.path.join(os.curdir, entrypoint)
        flags.pop("no_python", None)
    elif getattr(args, "module", False):
        if not entrypoint or entrypoint.endswith(".py") or os.sep in entrypoint:
            raise ConfigError(
                f"-m takes a module name such as pkg.train, got {entrypoint or 'none'}; "
                "for a script path drop -m"
            )
        if flags.get("no_python"):
            raise ConfigError(
                "--no-python and -m cannot go together: -m runs a Python module; drop one"
            )


def _checked_textfile(cfg):
    """--metrics-textfile in a directory that exists and is safe to write in, made absolute."""
    from elasticd.daemon import preflight

    textfile = Path(cfg.metrics_textfile)
    parent = textfile.absolute().parent
    if not parent.is_dir():
        raise ConfigError(
            f"--metrics-textfile {textfile}: directory {parent} does not exist: create it "
            "(node_exporter's textfile directory, readable by node_exporter)"
        )
    directory = preflight.check_log_dir(parent, "--metrics-textfile's directory")
    return dataclasses.replace(cfg, metrics_textfile=str(directory / textfile.name))


def _forget_run_dir(run_dir: Path) -> None:
    """A start that failed leaves no run directory behind: nothing ran, and an empty directory
    per failed try (systemd retries every few seconds) would only bury the real runs. Removed
    only while empty (rmdir), so nothing anyone wrote there is lost."""
    try:
        os.rmdir(run_dir)
    except OSError:
        pass


def _log_base(cfg) -> Path:
    """--log-dir, else systemd's LogsDirectory ($LOGS_DIRECTORY), else the state directory a
    launcher's user expects (`default_log_base`): never the working directory, which is often
    the user's checkout."""
    return Path(
        cfg.log_dir or os.environ.get("LOGS_DIRECTORY", "").split(":")[0] or default_log_base()
    )


def default_log_base() -> Path:
    """Where runs go by default: $XDG_STATE_HOME/elasticd (the XDG base directories' home of
    logs and history); else /var/lib/elasticd for root (the service's StateDirectory), else
    ~/.local/state/elasticd (XDG's default); else, with no home, elasticd-runs-UID in the
    temporary directory (as torchrun's logs)."""
    import tempfile

    state = os.environ.get("XDG_STATE_HOME", "")
    if os.path.isabs(state):  # a relative one is to be ignored (the XDG specification)
        return Path(state) / "elasticd"
    if os.geteuid() == 0:
        return Path("/var/lib/elasticd")
    home = os.path.expanduser("~")
    if os.path.isabs(home) and home != "/":
        return Path(home) / ".local" / "state" / "elasticd"
    return Path(tempfile.gettempdir()) / f"elasticd-runs-{os.geteuid()}"


def _run_dir(cfg, base: Path) -> Path:
    """This run's directory under the checked base, created fresh (preflight.make_run_dir)."""
    from elasticd.daemon import preflight

    return preflight.make_run_dir(
        base, f"{cfg.rdzv_id}-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}"
    )


def _node(args: argparse.Namespace) -> int:
    """`elasticd node status / clear`: the record in the state directory `run` would use."""
    from elasticd import config
    from elasticd.daemon import quarantine

    given = {k: getattr(args, k) for k in ("state_dir", "log_dir") if getattr(args, k)}
    try:  # nproc 1: the default's device count would import torch, for nothing here
        cfg = config.build({"nproc_per_node": "1", **given}, args.config_file)
        directory = quarantine.state_dir(cfg, _log_base(cfg))
        return quarantine.node_command(args.action, directory, cfg, args.json)
    except (ConfigError, OSError) as e:
        sys.stderr.write(f"elasticd: error: {_one_line(e)}\n")
        return ExitCode.USAGE


def entry() -> None:
    """The `elasticd` command: main(), then leave at once, without the interpreter's finalization.
    By then the daemon has stopped its workers and said its last line; a helper thread may still
    be inside a blocking torch store call (a rendezvous left by a stop), and finalizing around it
    aborts the process (SIGABRT, "terminate called without an active exception")."""
    code = main()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(code if isinstance(code, int) else 1)


if __name__ == "__main__":
    entry()
