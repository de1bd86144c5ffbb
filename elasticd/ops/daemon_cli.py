"""The operator's commands to running daemons, over their control sockets: `elasticd status`,
`stacks` and `stop`. Each returns the exit code cli.py documents, with one line on error.

A call goes to `--socket`, else every daemon found (control/paths.py); `--rdzv-id` picks a job's
daemon. `status` reads each daemon's snapshot into `Snapshot`; `--json` prints one document, the
one daemon's status as it came, or a list of them, each with its `socket`, where several run.
`stop` waits for the socket to go away."""

from __future__ import annotations

import argparse
import json
import sys
import time

from elasticd import names
from elasticd.exit_codes import ExitCode
from elasticd.ops import render
from elasticd.reporting.status_snapshot import Snapshot, from_json

FINAL_STATES = ("SUCCEEDED", "FAILED", "STOPPED", "LEFT")


def status(args: argparse.Namespace) -> int:
    """Each daemon meant (`_daemons`), or the one --rdzv-id names: with --json one document, the
    status object of the one daemon, or a list of them (each with its `socket`) where several
    run; readable, each job under a line that names it."""
    paths = _daemons(args)
    code, replies = ExitCode.NOT_RUNNING, []
    for path in paths:
        reply = _ask(path, _STATUS)
        if isinstance(reply, int):
            code = reply if code == ExitCode.NOT_RUNNING else code
            continue
        replies.append((str(path), reply["status"]))  # the wire form, printed as it came by --json
    replies = _of_job(replies, getattr(args, "rdzv_id", None))
    if replies is None:
        return ExitCode.USAGE
    several = len(paths) > 1
    from elasticd.logs import printable

    if args.json and replies:  # one document: an object, or a list where several jobs run
        docs = [{**st, "socket": path} if several else st for path, st in replies]
        print(json.dumps(docs if len(docs) > 1 else docs[0], indent=2, default=str))
    elif len(replies) > 1:
        print(
            f"{len(replies)} elasticd jobs on this node: "
            + ", ".join(printable(f"{st.get('run_id')} ({path})") for path, st in replies)
        )
    for i, (path, st) in enumerate(replies):
        snapshot = from_json(Snapshot, st)
        if not args.json:
            if len(replies) > 1:
                print(("\n" if i else "") + f"== job {printable(str(snapshot.run_id))} ==")
            print(render.status(snapshot, path if several else None))
        if snapshot.state not in FINAL_STATES:
            code = ExitCode.OK
    return code


def _of_job(replies: list[tuple[str, dict]], run_id: str | None) -> list | None:
    """The replies of the job --rdzv-id names (all without it); None, the line said, when no
    daemon here runs it."""
    if run_id is None:
        return replies
    from elasticd.logs import printable

    mine = [(path, st) for path, st in replies if st.get("run_id") == run_id]
    if replies and not mine:
        sys.stderr.write(
            f"elasticd: error: no elasticd daemon here runs --rdzv-id {printable(run_id)} (jobs: "
            + ", ".join(printable(str(st.get("run_id"))) for _, st in replies)
            + ")\n"
        )
        return None
    return mine


def _daemons(args: argparse.Namespace) -> list:
    """The control sockets a call means: --socket, else every daemon found (see
    paths.find_daemons), else the default path (which then says nobody listens)."""
    from elasticd.control import paths

    if args.socket:
        return [args.socket]
    return paths.find_daemons() or [paths.default_socket_path()]


def _one_daemon(args: argparse.Namespace) -> str | None:
    """The one daemon stop or stacks acts on (of the job --rdzv-id names, if given); None (the
    line said) when several run."""
    paths = _daemons(args)
    if getattr(args, "rdzv_id", None) is not None:
        replies = [(str(p), r["status"]) for p in paths if isinstance(r := _ask(p, _STATUS), dict)]
        mine = _of_job(replies, args.rdzv_id)
        if not mine:
            return None
        paths = [path for path, _ in mine]
    if len(paths) > 1:
        sys.stderr.write(
            f"elasticd: error: {len(paths)} elasticd daemons run here ("
            + ", ".join(map(str, paths))
            + "): give --socket or --rdzv-id with the one you mean\n"
        )
        return None
    return paths[0]


_STATUS = {"command": names.STATUS}


def _ask(path, payload: dict, timeout: float = 5.0) -> dict | int:
    """The daemon's reply to one request, or the exit code when there is none (the line said)."""
    from elasticd.control.client import request
    from elasticd.control.protocol import ControlError, NoDaemon

    try:
        reply = request(path, {"version": 1, **payload}, timeout=timeout)
    except NoDaemon as e:
        print(f"elasticd is not running ({e})")
        return ExitCode.NOT_RUNNING
    except ControlError as e:
        sys.stderr.write(f"elasticd: error: {e}\n")
        return ExitCode.CONTROL
    if not reply.get("ok"):
        from elasticd.logs import printable

        sys.stderr.write(f"elasticd: error: {printable(str(reply.get('error')))}\n")
        return ExitCode.CONTROL
    return reply


def stacks(args: argparse.Namespace) -> int:
    path = _one_daemon(args)
    if path is None:
        return ExitCode.USAGE
    reply = _ask(path, {"command": names.STACKS}, timeout=15.0)
    if isinstance(reply, int):
        return reply
    if args.json:
        print(json.dumps(reply["stacks"], indent=2))
        return ExitCode.OK
    from elasticd.daemon import collective_seq
    from elasticd.logs import printable

    for d in reply["stacks"]:  # the workers' own dumps: escaped, their lines kept
        print(
            printable(
                f"=== rank {d['rank']} (local rank {d['local_rank']}, pid {d['pid']}; "
                f"also in {d['path']}) ==="
            )
        )
        if said := collective_seq.describe(d.get("collectives", "")):
            print(printable(said))
        print(
            printable(d["text"].rstrip("\n"), keep="\n")
            or "(no dump within a second: the worker may be in "
            "uninterruptible sleep or blocking the signal)"
        )
    return ExitCode.OK


def stop(args: argparse.Namespace) -> int:
    from elasticd.control.client import request
    from elasticd.control.protocol import ControlError, NoDaemon

    path = _one_daemon(args)
    if path is None:
        return ExitCode.USAGE
    reply = _ask(path, {"command": names.STOP, "timeout": args.timeout})
    if isinstance(reply, int):
        # none running: nothing to stop
        return ExitCode.OK if reply == ExitCode.NOT_RUNNING else reply
    # Wait for the daemon to finish stopping: the socket goes away when it exits.
    deadline = time.monotonic() + (args.timeout if args.timeout is not None else 30.0) + 60.0
    while time.monotonic() < deadline:
        try:
            request(path, {"version": 1, "command": names.STATUS}, timeout=2.0)
        except NoDaemon:
            print("elasticd stopped")
            return ExitCode.OK
        except ControlError:
            pass
        time.sleep(0.2)
    sys.stderr.write(
        "elasticd: error: the daemon accepted stop but is still running; check its logs\n"
    )
    return ExitCode.CONTROL
