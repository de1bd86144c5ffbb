"""`elasticd run / status / stop`: argument parsing, and every error turned into an exit code.

Exit codes:
  0  run: the job succeeded, or was stopped on request; status: the daemon is running; stop: done;
     stacks: dumped
  1  run: the job failed (restart budget spent, fatal exit code, rendezvous failed)
  2  bad input: flags, config file, entrypoint, ports, paths (nothing was started); stop/stacks:
     several daemons run here and no --socket says which
  3  status/stacks: no daemon is running (LSB "program is not running")
  4  status/stop/stacks: the daemon refused or did not answer (permission, protocol, no workers)
  5  run: this node's health check failed: it did not start, or it left the job
141  status/stop/stacks: the reader of the output went away (`elasticd status | head`): quiet, as
     git (128 + SIGPIPE, what a shell shows for a command a closed pipe ended)
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import signal
import sys
import time
from pathlib import Path

from elasticd import __version__, names
from elasticd.config import ConfigError, check_value

EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_NOT_RUNNING, EXIT_CONTROL, EXIT_UNHEALTHY = 0, 1, 2, 3, 4, 5
EXIT_PIPE = 128 + signal.SIGPIPE
FINAL_STATES = ("SUCCEEDED", "FAILED", "STOPPED", "LEFT")

EPILOG = """exit codes: 0 success (status: running), 1 job failed, 2 bad input (nothing started),
3 no daemon running (status, stacks), 4 daemon refused or did not answer,
5 this node's health check failed (run: it did not start, or left the job),
141 the output's reader went away (status | head)"""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one line, exit 2
        sys.stderr.write(f"elasticd: error: {_one_line(message)} (see '{self.prog} --help')\n")
        sys.exit(EXIT_USAGE)


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


class _Instead(argparse.Action):
    """A torchrun flag elasticd covers another way: one error line saying what to use (its help),
    unless the value is one of `const`, what elasticd does anyway."""

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        if values not in (self.const or ()):
            parser.error(f"{option_string} {values}: {self.help}")


class _Static(argparse.Action):
    """torchrun's static rendezvous flags: kept as (flag, value) for config.check_static, which
    knows the node count."""

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        flag = "--" + self.dest.replace("_", "-")
        namespace.static = [*getattr(namespace, "static", []), (flag, values)]


def _add_run_flags(p: argparse.ArgumentParser) -> None:
    """`elasticd run`'s flags: one per Config field, from its declaration (config._setting), and
    the few that are the command line's own. Each is left out of the namespace unless given, so
    config.build can tell a flag from the layers below it."""
    from elasticd.config import FIELDS

    S = argparse.SUPPRESS
    p.add_argument("entrypoint", nargs="?", default=S, help=_help(FIELDS["entrypoint"]))
    p.add_argument(
        "args", nargs=argparse.REMAINDER, default=S, metavar="ARGS", help=_help(FIELDS["args"])
    )
    g = p.add_argument_group("torchrun-compatible")
    e = p.add_argument_group("elasticd")
    e.add_argument(
        "--config", dest="config_file", default=None, help="TOML config file (flags override it)"
    )
    for f in FIELDS.values():
        if f.name not in ("entrypoint", "args"):
            _add_setting(g if f.metadata["torchrun"] else e, f)
    g.add_argument(
        "-m",
        "--module",
        dest="module",
        action="store_true",
        default=S,
        help="ENTRYPOINT is a module, run as python -m (elasticd also tells by the name)",
    )
    g.add_argument(
        "--run-path",
        "--run_path",
        dest="run_path",
        action="store_true",
        default=S,
        help="ENTRYPOINT is a script path, even without .py",
    )
    g.add_argument(
        "--shutdown-timeout",
        "--shutdown_timeout",
        dest="stop_grace",
        type=float,
        default=S,
        metavar="SECONDS",
        help="the same as --stop-grace",
    )
    g.add_argument(
        "--rdzv-conf",
        "--rdzv_conf",
        dest="rdzv_conf",
        default=S,
        help="torchrun's c10d KEY=VALUE,...: join_timeout, last_call_timeout, and "
        "keep_alive_interval x keep_alive_max_attempt as --peer-timeout (read_timeout, "
        "close_timeout, is_host, use_libuv are accepted and have no effect)",
    )
    g.add_argument(
        "--master-addr",
        "--master_addr",
        dest="master_addr",
        action=_Static,
        default=S,
        help="static rendezvous: ignored on a single node or with --rdzv-endpoint; across nodes give "
        "every node --rdzv-endpoint MASTER_ADDR:MASTER_PORT instead",
    )
    g.add_argument(
        "--master-port",
        "--master_port",
        dest="master_port",
        action=_Static,
        default=S,
        help="see --master-addr",
    )
    g.add_argument(
        "--node-rank",
        "--node_rank",
        dest="node_rank",
        action=_Static,
        default=S,
        help="static rendezvous: nodes are ranked as they join (0 on a single node; ignored with "
        "--rdzv-endpoint)",
    )
    g.add_argument(
        "--start-method",
        "--start_method",
        action=_Instead,
        const=("spawn", "fork", "forkserver"),
        default=S,
        help="spawn, fork or forkserver; accepted and without effect (torchrun uses it for "
        "function entrypoints only; elasticd starts every worker its own way)",
    )
    g.add_argument(
        "--event-log-handler",
        "--event_log_handler",
        action=_Instead,
        const=("null", "console"),
        default=S,
        help="elasticd's events are structlog lines on stderr (--log-format json for "
        "machines): drop the flag",
    )
    g.add_argument(
        "--logs-specs",
        "--logs_specs",
        action=_Instead,
        default=S,
        help="elasticd writes each rank's output to <log dir>/<run>/attemptN/rankR.log: drop the flag",
    )
    g.add_argument(
        "--duplicate-stdout-filters",
        "--duplicate_stdout_filters",
        "--duplicate-stderr-filters",
        "--duplicate_stderr_filters",
        action=_Instead,
        default=S,
        metavar="FILTERS",
        help="every rank's output is in <log dir>/<run>/attemptN/rankR.log: grep those instead, and "
        "drop the flag",
    )
    g.add_argument(
        "--numa-binding",
        "--numa_binding",
        action=_Instead,
        default=S,
        help="elasticd does not bind workers to NUMA nodes: drop the flag, or bind in the script "
        "(os.sched_setaffinity) or under numactl",
    )


def _add_setting(group: argparse._ArgumentGroup, f: dataclasses.Field) -> None:
    """The flag of one Config field: --NAME-WITH-DASHES unless the field names its own (--no-NAME
    for a setting that is on by default), torchrun's --name_with_underscores beside each of a
    torchrun flag's, and a number read as the field's type."""
    default, meta = f.default, f.metadata
    flags = meta["flags"] or (
        (f"--no-{f.name}" if default is True else f"--{f.name}").replace("_", "-"),
    )
    if meta["torchrun"]:
        flags = tuple(
            dict.fromkeys(
                s
                for flag in flags
                for s in (
                    flag,
                    "--" + flag[2:].replace("-", "_") if flag.startswith("--") else flag,
                )
            )
        )
    if isinstance(default, bool):
        kind = {"action": "store_false" if default else "store_true"}
    else:
        kind = {"type": type(default)} if isinstance(default, (int, float)) else {}
    group.add_argument(
        *flags, dest=f.name, default=argparse.SUPPRESS, help=_help(f), **{**kind, **meta["parse"]}
    )


def _help(f: dataclasses.Field) -> str:
    """A Config field's help text, with its default filled in (a list as a,b,c)."""
    default = ",".join(map(str, f.default)) if isinstance(f.default, tuple) else f.default
    return f.metadata["help"].format(default=default)


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
    _add_run_flags(run)
    st = sub.add_parser(
        names.STATUS,
        help="show the daemon's state",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    st.add_argument("--json", action="store_true", help="print the status as JSON")
    st.add_argument("--socket", default=None, help="control socket path")
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
    if args.command == "run":
        given = vars(args).pop("args", None) or []  # after the entrypoint, as torchrun takes them
        return _run(args, extra or (given[1:] if given[:1] == ["--"] else given))
    if extra:
        build_parser().error("arguments after -- are only for 'run'")
    control_command = {names.STATUS: _status, names.STOP: _stop, names.STACKS: _stacks}.get(
        args.command
    )
    if control_command:
        try:
            code = control_command(args)
            sys.stdout.flush()  # a closed pipe shows here, not at exit
        except BrokenPipeError:
            return _reader_gone()
        return code
    build_parser().print_help()
    return EXIT_USAGE


def _reader_gone() -> int:
    """The reader of our output left (`elasticd status | head`): no traceback and no second try
    at exit, as git and systemctl do; what is left to print goes to /dev/null."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, sys.stdout.fileno())
    finally:
        os.close(devnull)
    return EXIT_PIPE


def _run(args: argparse.Namespace, extra: list[str]) -> int:
    from elasticd import config, logs
    from elasticd.cluster import signing
    from elasticd.daemon import systemd

    systemd.quiet_torch_cpp()  # before anything imports torch

    cli_only = ("command", "config_file", "module", "run_path", "static")
    flags = {k: v for k, v in vars(args).items() if k not in cli_only}
    if extra:
        flags["args"] = extra
    try:
        entrypoint = flags.get("entrypoint")
        if getattr(args, "run_path", False):  # as torchrun: it wins over -m and --no-python
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
        cfg = config.build(flags, args.config_file, static=getattr(args, "static", []))
        config.check_entrypoint(cfg.entrypoint, no_python=cfg.no_python)
        if cfg.health_check:
            config.check_health_check(cfg.health_check)
        if cfg.metrics_textfile:
            textfile = Path(cfg.metrics_textfile)
            if not textfile.absolute().parent.is_dir():
                raise ConfigError(
                    f"--metrics-textfile {textfile}: directory {textfile.absolute().parent} does not "
                    "exist: create it (node_exporter's textfile directory, readable by node_exporter)"
                )
            directory = config.check_log_dir(
                textfile.absolute().parent, "--metrics-textfile's directory"
            )
            cfg = dataclasses.replace(cfg, metrics_textfile=str(directory / textfile.name))
        if cfg.rdzv_secret_file:
            signing.load_secret(cfg.rdzv_secret_file)
        if cfg.etcd and cfg.etcd_password_file:
            signing.load_password(cfg.etcd_password_file)
        if (
            cfg.max_nodes == 1 and cfg.rdzv_endpoint and not cfg.etcd
        ):  # a single node hosts a c10d store
            config.check_port_free(cfg.rdzv_host, cfg.rdzv_port)
        base = config.check_log_dir(_log_base(cfg))
        checkpoints = (
            Path(cfg.checkpoint_dir) if cfg.checkpoint_dir else base / "checkpoints" / cfg.rdzv_id
        )
        cfg = dataclasses.replace(
            cfg, checkpoint_dir=str(config.check_log_dir(checkpoints, "--checkpoint-dir"))
        )
        run_dir = _run_dir(cfg, base)
    except ConfigError as e:
        sys.stderr.write(f"elasticd: error: {_one_line(e)}\n")
        return EXIT_USAGE
    logs.setup(cfg.log_format)
    from elasticd.daemon.serve import serve

    try:
        return serve(cfg, run_dir)
    except ConfigError as e:  # found only when binding (a port in use, a live socket)
        _forget_run_dir(run_dir)
        sys.stderr.write(f"elasticd: error: {_one_line(e)}\n")
        return EXIT_USAGE


def _forget_run_dir(run_dir: Path) -> None:
    """A start that failed leaves no run directory behind: nothing ran, and an empty directory
    per failed try (systemd retries every few seconds) would only bury the real runs. Removed
    only while empty (rmdir), so nothing anyone wrote there is lost."""
    try:
        os.rmdir(run_dir)
    except OSError:
        pass


def _log_base(cfg) -> Path:
    return Path(
        cfg.log_dir or os.environ.get("LOGS_DIRECTORY", "").split(":")[0] or "elasticd-runs"
    )


def _run_dir(cfg, base: Path) -> Path:
    """This run's directory under the checked base, created fresh (config.make_run_dir)."""
    from elasticd import config

    return config.make_run_dir(
        base, f"{cfg.rdzv_id}-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}"
    )


def _status(args: argparse.Namespace) -> int:
    paths = _daemons(args)
    code = EXIT_NOT_RUNNING
    for path in paths:
        reply = _ask(path, {"command": names.STATUS})
        if isinstance(reply, int):
            code = reply if code == EXIT_NOT_RUNNING else code
            continue
        status = reply["status"]
        if len(paths) > 1:
            status["socket"] = str(path)
        print(json.dumps(status, indent=2, default=str) if args.json else render_status(status))
        if status.get("state") not in FINAL_STATES:
            code = EXIT_OK
    return code


def _daemons(args: argparse.Namespace) -> list:
    """The control sockets a call means: --socket, else every daemon found (see
    control.find_daemons), else the default path (which then says nobody listens)."""
    from elasticd.control import channel as control

    if args.socket:
        return [args.socket]
    return control.find_daemons() or [control.default_socket_path()]


def _one_daemon(args: argparse.Namespace) -> str | None:
    """The one daemon stop or stacks acts on; None (the line said) when several run."""
    paths = _daemons(args)
    if len(paths) > 1:
        sys.stderr.write(
            f"elasticd: error: {len(paths)} elasticd daemons run here ("
            + ", ".join(map(str, paths))
            + "): give --socket with the one you mean\n"
        )
        return None
    return paths[0]


def _ask(path, payload: dict, timeout: float = 5.0) -> dict | int:
    """The daemon's reply to one request, or the exit code when there is none (the line said)."""
    from elasticd.control import channel as control

    try:
        reply = control.request(path, {"version": 1, **payload}, timeout=timeout)
    except control.NoDaemon as e:
        print(f"elasticd is not running ({e})")
        return EXIT_NOT_RUNNING
    except control.ControlError as e:
        sys.stderr.write(f"elasticd: error: {e}\n")
        return EXIT_CONTROL
    if not reply.get("ok"):
        from elasticd.logs import printable

        sys.stderr.write(f"elasticd: error: {printable(str(reply.get('error')))}\n")
        return EXIT_CONTROL
    return reply


def _stacks(args: argparse.Namespace) -> int:
    path = _one_daemon(args)
    if path is None:
        return EXIT_USAGE
    reply = _ask(path, {"command": names.STACKS}, timeout=15.0)
    if isinstance(reply, int):
        return reply
    if args.json:
        print(json.dumps(reply["stacks"], indent=2))
        return EXIT_OK
    from elasticd.logs import printable

    for d in reply["stacks"]:  # the workers' own dumps: escaped, their lines kept
        print(
            printable(
                f"=== rank {d['rank']} (local rank {d['local_rank']}, pid {d['pid']}; "
                f"also in {d['path']}) ==="
            )
        )
        print(
            printable(d["text"].rstrip("\n"), keep="\n")
            or "(no dump within a second: the worker may be in "
            "uninterruptible sleep or blocking the signal)"
        )
    return EXIT_OK


def _stop(args: argparse.Namespace) -> int:
    from elasticd.control import channel as control

    path = _one_daemon(args)
    if path is None:
        return EXIT_USAGE
    reply = _ask(path, {"command": names.STOP, "timeout": args.timeout})
    if isinstance(reply, int):
        return EXIT_OK if reply == EXIT_NOT_RUNNING else reply  # none running: nothing to stop
    # Wait for the daemon to finish stopping: the socket goes away when it exits.
    deadline = time.monotonic() + (args.timeout if args.timeout is not None else 30.0) + 60.0
    while time.monotonic() < deadline:
        try:
            control.request(path, {"version": 1, "command": names.STATUS}, timeout=2.0)
        except control.NoDaemon:
            print("elasticd stopped")
            return EXIT_OK
        except control.ControlError:
            pass
        time.sleep(0.2)
    sys.stderr.write(
        "elasticd: error: the daemon accepted stop but is still running; check its logs\n"
    )
    return EXIT_CONTROL


def _age(seconds) -> str:
    if seconds is None:
        return "-"
    seconds = float(seconds)
    if seconds < 120:
        return f"{seconds:.1f}s"
    return f"{seconds / 60:.1f}m" if seconds < 7200 else f"{seconds / 3600:.1f}h"


def _ms(seconds) -> str:
    if seconds is None:
        return "-"
    seconds = float(seconds)
    return f"{seconds * 1e3:.1f}ms" if seconds < 1 else f"{seconds:.2f}s"


def _figures_lines(s: dict) -> list[str]:
    """Goodput, steps, restarts by cause, checkpoint and refresh costs, health and stragglers: a
    line each at most (the table stays one screen; --json has everything)."""
    lines = []
    goodput = s.get("goodput") or {}
    ratio = goodput.get("ratio")
    lost = s.get("steps_lost") or {}
    lost_text = f"steps lost {lost.get('total', 0)}"
    if lost.get("last") is not None:
        lost_text += f" (last restart {lost['last']})"
    if lost.get("unknown"):
        lost_text += f", {lost['unknown']} restart(s) unknown"
    lines.append(
        f"  goodput {'-' if ratio is None else f'{100 * ratio:.1f}%'} (productive "
        f"{_age(goodput.get('productive_seconds'))} of {_age(goodput.get('wall_seconds'))})  step "
        f"{'-' if s.get('step') is None else s['step']} at {_ms(s.get('step_time'))}/step (own work "
        f"{_ms(s.get('work_time'))})  {lost_text}"
    )
    causes = {c: n for c, n in (s.get("restarts_by_cause") or {}).items() if n}
    if causes:
        lines.append(
            "  restarts by cause: "
            + ", ".join(f"{c.replace('_', ' ')} {n}" for c, n in causes.items())
            + f"; budget left {s.get('budget_left')}"
        )
    ckpt, mem = s.get("checkpoint_costs") or {}, s.get("memory_refresh") or {}
    costs = []
    if ckpt.get("saves"):
        costs.append(
            f"saves {ckpt['saves']}: stall {_ms(ckpt.get('last_stall_seconds'))} last, "
            f"{_ms(ckpt.get('stall_seconds_total'))} total, write {_ms(ckpt.get('last_write_seconds'))}"
        )
    if mem.get("refreshes"):
        costs.append(
            f"in-memory refresh every {mem.get('every') or '-'} step(s), {_ms(mem.get('last_seconds'))} "
            f"last, {_ms(mem.get('seconds_total'))} total"
        )
    if costs:
        lines.append("  " + "; ".join(costs))
    health = s.get("health") or {}
    if health.get("check"):
        last = health.get("last") or {}
        when = f", {_age(time.time() - last['at'])} ago" if last.get("at") else ""
        lines.append(
            f"  health check {health.get('state')}: {health.get('check')}"
            + (f" ({last.get('reason')}, {_ms(last.get('seconds'))}{when})" if last else "")
        )
    for left in (health.get("peers_left") or [])[-2:]:
        lines.append(
            f"  node {left.get('node')} left the job: health check failed: {left.get('reason')}"
        )
    for st in s.get("stragglers") or []:
        lines.append(
            f"  straggler: rank {st.get('rank')} (local {st.get('local_rank')}) on node {st.get('node')}: "
            f"{st.get('ratio'):.2f}x the node's median own work per step ({_ms(st.get('work_time'))} vs "
            f"{_ms(st.get('median'))}) for {_age(time.time() - st.get('since', time.time()))}"
        )
    return lines


def render_status(s: dict) -> str:
    """The readable form of a status snapshot, each line escaped (logs.printable): failures and
    events quote what workers wrote."""
    lines = [
        f"elasticd {s.get('state')}  run {s.get('run_id')}  node {s.get('node')} (pid {s.get('pid')})",
        f"  group rank {s.get('group_rank')} of {s.get('group_world_size')} nodes, world size {s.get('world_size')}, "
        f"round {s.get('round')}",
        f"  restarts {s.get('restarts')}/{s.get('max_restarts')}  uptime {_age(s.get('uptime'))}  "
        f"entrypoint {s.get('entrypoint')}",
        f"  logs {s.get('run_dir')}",
    ]
    if s.get("socket"):  # one of several daemons: the one to name with --socket
        lines.append(f"  socket {s['socket']}")
    ckpt = s.get("checkpoint")
    if ckpt:
        lines.append(
            f"  checkpoint step {ckpt.get('step')} epoch {ckpt.get('epoch')} age {_age(ckpt.get('age'))} "
            f"{ckpt.get('path')}"
        )
    else:
        lines.append("  checkpoint none")
    if s.get("memory_step") is not None:
        lines.append(f"  in-memory state step {s['memory_step']}")
    down = {n: p for n, p in (s.get("parts") or {}).items() if p.get("state") != "up"}
    if down:
        lines.append(
            "  parts not up: "
            + "; ".join(
                f"{n} {p.get('state')} after {p.get('restarts')} restart(s): {p.get('why')}"
                for n, p in down.items()
            )
        )
    if s.get("lost_nodes"):
        lines.append("  nodes lost when this round formed: " + ", ".join(s["lost_nodes"]))
    if s.get("peers"):
        lines.append(
            "  watched peer nodes (group rank: last beat) "
            + ", ".join(f"{r}: {_age(age)} ago" for r, age in s["peers"].items())
        )
    lines += _figures_lines(s)
    lines.append("  RANK  PID      STATE                 BEAT   STEP     TIME/STEP  OWN WORK   RSS")
    for w in s.get("workers") or []:
        rss = f"{w['rss_bytes'] / 2**20:.0f}MiB" if w.get("rss_bytes") else "-"
        step = "-" if w.get("step") is None else str(w["step"])
        beat = _age(w.get("heartbeat_age"))
        work = _ms(w.get("work_time")) + ("!" if w.get("straggler") else "")
        lines.append(
            f"  {w['rank']:<5} {w['pid']:<8} {w['state']:<21} {beat:<6} {step:<8} "
            f"{_ms(w.get('step_time')):<10} {work:<10} {rss}"
        )
    f = s.get("last_failure")
    if f:
        lines.append(
            f"  last failure: rank {f.get('rank')} {f.get('reason')}"
            + (f": {f['exception']}" if f.get("exception") else "")
            + (f" (log {f['log_path']})" if f.get("log_path") else "")
        )
        for path in f.get("stacks") or []:
            lines.append(f"    stacks {path}")
    rec = s.get("last_recovery")
    if rec:
        lines.append(
            "  last recovery (s after detection): "
            + ", ".join(f"{k.replace('_', ' ')} {v:.3f}" for k, v in rec.items())
        )
    events = s.get("events") or []
    if events:
        lines.append("  recent events:")
        for e in events[-8:]:
            extra = " ".join(f"{k}={v}" for k, v in e.items() if k not in ("time", "event"))
            lines.append(
                f"    {time.strftime('%H:%M:%S', time.localtime(e['time']))} {e['event']} {extra}"[
                    :160
                ]
            )
    from elasticd.logs import printable

    return "\n".join(printable(line) for line in lines)


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
