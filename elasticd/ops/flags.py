"""`elasticd run`'s flags: one per `Config` field, made from its declaration (config._setting),
and the command line's own (ENTRYPOINT, `-m`, `--config`, torchrun's static, accepted and refused
flags). cli.py builds the parser with them; docs.py writes docs/settings.md from them.
"""

from __future__ import annotations

import argparse
import dataclasses


class _Instead(argparse.Action):
    """A torchrun flag elasticd covers another way: one error line saying what to use (its help),
    unless the value is one of `const`, what elasticd does anyway."""

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        if values not in (self.const or ()):
            parser.error(f"{option_string} {values}: {self.help}")


class _Completion(argparse.Action):
    """torchrun's --print-completion SHELL: kept for the CLI, which prints the `elasticd`
    command's completion script (made by shtab, optional as for torchrun) and exits."""

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        try:
            import shtab  # noqa: F401 - only whether it is there
        except ImportError:
            parser.error(f"{option_string} needs the shtab package: pip install shtab")
        namespace.print_completion = values


class _Static(argparse.Action):
    """torchrun's static rendezvous flags: kept as (flag, value) for config_values.check_static,
    which knows the node count."""

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        flag = "--" + self.dest.replace("_", "-")
        namespace.static = [*getattr(namespace, "static", []), (flag, values)]


def add_run_flags(p: argparse.ArgumentParser) -> None:
    """`elasticd run`'s flags: one per Config field, from its declaration (config._setting), and
    the few that are the command line's own. Each is left out of the namespace unless given, so
    config.build can tell a flag from the layers below it."""
    from elasticd.config import FIELDS

    S = argparse.SUPPRESS
    p.add_argument("entrypoint", nargs="?", default=S, help=setting_help(FIELDS["entrypoint"]))
    p.add_argument(
        "args",
        nargs=argparse.REMAINDER,
        default=S,
        metavar="ARGS",
        help=setting_help(FIELDS["args"]),
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
        help="static rendezvous: ignored on a single node or with --rdzv-endpoint; across nodes "
        "give "
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
        help="elasticd writes each rank's stdout to <log dir>/<run>/attemptN/rankR.log and its "
        "stderr to rankR.stderr.log beside it: drop the flag",
    )
    g.add_argument(
        "--duplicate-stdout-filters",
        "--duplicate_stdout_filters",
        "--duplicate-stderr-filters",
        "--duplicate_stderr_filters",
        action=_Instead,
        default=S,
        metavar="FILTERS",
        help="every rank's output is in <log dir>/<run>/attemptN/rankR.log (stdout) and "
        "rankR.stderr.log: grep those instead, and drop the flag",
    )
    g.add_argument(
        "--print-completion",
        "--print_completion",
        action=_Completion,
        choices=("bash", "zsh", "tcsh"),
        default=S,
        help="print a shell completion script for elasticd and exit (needs the shtab "
        "package), e.g. --print-completion bash > /etc/bash_completion.d/elasticd",
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
        *flags,
        dest=f.name,
        default=argparse.SUPPRESS,
        help=setting_help(f),
        **{**kind, **meta["parse"]},
    )


def setting_help(f: dataclasses.Field) -> str:
    """A Config field's help text, with its default filled in (a list as a,b,c)."""
    default = ",".join(map(str, f.default)) if isinstance(f.default, tuple) else f.default
    return f.metadata["help"].format(default=default)
