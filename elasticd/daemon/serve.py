"""The daemon process around the agent loop (`elasticd run`): the control socket and its commands
(the loop's side of the forwarded ones: `FORWARDED`), sd_notify, the death guard and the metrics
exporter, started before the loop and closed after it; the one line a failed or departed node leaves
on stderr.
"""

from __future__ import annotations

import contextlib
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from elasticd import logs, names
from elasticd.config import Config
from elasticd.daemon import inplace, processes
from elasticd.daemon.agent import Agent
from elasticd.lifecycle import supervise
from elasticd.lifecycle.states import State

if TYPE_CHECKING:
    from elasticd.control.server import ControlServer, Deferred
    from elasticd.reporting import metrics

log = logs.get("elasticd.agent")

# seconds `elasticd stacks` may wait for the loop: a rendezvous wait or teardown drains its inbox
# late, and the dump itself takes up to a second
STACKS_ANSWER = 10.0


def serve(cfg: Config, run_dir: Path) -> int:
    """Run the daemon: control socket, sd_notify, death guard, then the agent loop."""
    from elasticd.control import paths
    from elasticd.control.protocol import AlreadyRunning, ControlError
    from elasticd.control.server import ControlServer
    from elasticd.daemon import systemd

    agent = Agent(cfg, run_dir)
    agent.install_signals()
    with contextlib.ExitStack() as parts:  # closed in reverse: control socket, guard, exporter
        exporter = _metrics_exporter(cfg, agent)
        if exporter is not None:
            parts.callback(exporter.close)
        guard = supervise.Kept(
            "guard",
            lambda: processes.start_guard(agent.token),
            risk="until a new guard is up, a SIGKILLed daemon leaves its workers' children behind",
        )
        parts.callback(guard.close)

        def listen(path: Path) -> ControlServer:
            server = ControlServer(
                path,
                snapshot=lambda: agent.status.snapshot,
                command=lambda req: _accept_command(agent, req),
                operators_group=cfg.operators_group or None,
            )
            server.start()
            return server

        try:
            try:
                server = listen(Path(cfg.socket) if cfg.socket else paths.default_socket_path())
            except AlreadyRunning:
                if cfg.socket:  # a path the user chose is theirs to change
                    raise
                # another job of this user on this node holds the default: listen beside it
                default = paths.default_socket_path()
                server = listen(paths.second_socket_path(default, cfg.rdzv_id))
        except ControlError as e:
            from elasticd.config import ConfigError

            raise ConfigError(str(e)) from None
        parts.callback(server.close)
        try:
            # the fork server imports torch for the spares while this process imports it: a
            # start takes one torch import's time, not two in a row (~2 s on 2 cores)
            agent.warm_up()
            # torch loads here: the daemon hosts each round's store for the workers (cluster/
            # imports it only in tcpstore.py), and adopt_torch makes its loggers write through ours
            from elasticd.cluster import tcpstore  # noqa: F401

            logs.adopt_torch()
            agent.recovery_path = inplace.announce(cfg)
            agent.group.in_place = agent.recovery_path.in_place
        except BaseException:
            agent.spares.close()
            raise
        agent.notify = systemd
        systemd.ready(f"{agent.state.value} run {cfg.rdzv_id}")
        log.info(
            "daemon_started",
            run_dir=str(run_dir),
            socket=str(server.path),
            entrypoint=cfg.entrypoint,
            nproc_per_node=cfg.nproc_per_node,
            nnodes=cfg.nnodes,
            pid=os.getpid(),
        )
        code = agent.run()
    if agent.left_line:
        sys_err(agent.left_line)
    elif agent.state == State.FAILED and agent.first_failure:
        sys_err(
            f"elasticd: job failed after {agent.restart_count} restart(s): "
            f"{agent.first_failure.reported()}"
        )
    return code


def _metrics_exporter(cfg: Config, agent: Agent) -> metrics.Exporter | None:
    """--metrics-address / --metrics-textfile: the exporter, serving (bound) before the job starts;
    an address that cannot be bound is a ConfigError (one line, exit 2)."""
    if not (cfg.metrics_address or cfg.metrics_textfile):
        return None
    from elasticd.config import ConfigError
    from elasticd.config_values import parse_metrics_address
    from elasticd.reporting import metrics

    address = parse_metrics_address(cfg.metrics_address) if cfg.metrics_address else None
    exporter = metrics.Exporter(
        address, cfg.metrics_textfile or None, lambda: agent.status.snapshot
    )
    try:
        exporter.start()
    except OSError as e:
        raise ConfigError(
            f"--metrics-address {cfg.metrics_address} cannot be bound here ({e.strerror or e}): "
            "give a free port on one of this node's addresses"
        ) from None
    agent.metrics = exporter
    return exporter


def _accept_command(agent: Agent, req: dict) -> dict | Deferred:
    """The loop's side of the control commands the server forwards (control/commands.py's
    COMMANDS), by name."""
    handler = FORWARDED.get(req.get("command"))
    return (
        handler(agent, req)
        if handler
        else {"ok": False, "error": f"unknown command {req.get('command')!r}"}
    )


def _stop_command(agent: Agent, req: dict) -> dict:
    agent.post((names.STOP, req.get("timeout")))
    return {"ok": True, "accepted": names.STOP}


def _stacks_command(agent: Agent, req: dict) -> Deferred:
    """The loop dumps them, and answers, at its next tick."""
    from elasticd.control.server import Deferred

    reply = Deferred(timeout=STACKS_ANSWER)
    agent.post((names.STACKS, reply))
    return reply


FORWARDED = {names.STOP: _stop_command, names.STACKS: _stacks_command}


def sys_err(line: str) -> None:
    sys.stderr.write(logs.printable(line) + "\n")  # it quotes a worker's exception
    sys.stderr.flush()
