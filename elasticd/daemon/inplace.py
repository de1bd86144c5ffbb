"""Which recovery path a job is on (`choose`): `in_place` (a failed rank is replaced by a warm
spare, the other ranks re-form their group in their own processes through torch's reconfigure)
or `restart` (today's whole-group restart), with the reason, said once at the daemon's start as
one `recovery_path` event.

The daemon decides what it can know before any worker runs: the setting (--in-place), the
interpreter's torch (worker/reconfigure.py, feature-detected), and the job's shape. The backend
is the script's choice, made later: a worker whose group's backend cannot re-form, or that
cannot vouch for its own state, falls back to the restart with its own line.

On that path, `replace` is the agent's first answer to a local worker's crash or signal death:
the dead ranks are started again from warm spares (LocalGroup.replace) as the group's next
generation, announced in the workers' store (signed), while the others stay in their processes,
unwind their script and re-form the group with them (worker/reconfigure.py). Anything else
(a hang, a peer, every rank dead, a second fault before the last replacement stepped, the
in-place budget spent) goes the restart's way, with one `in_place_refused` line.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from elasticd import logs, names
from elasticd.config import Config, parse_nnodes
from elasticd.lifecycle.states import Failure, RestartCause
from elasticd.worker import reconfigure

if TYPE_CHECKING:
    from elasticd.daemon.agent import Agent

log = logs.get("elasticd.agent")

IN_PLACE, RESTART = "in_place", "restart"


@dataclass(frozen=True)
class Path:
    """A job's recovery path and why (one line for people)."""

    name: str
    why: str

    @property
    def in_place(self) -> bool:
        return self.name == IN_PLACE


def choose(cfg: Config, dist=None) -> Path:
    """The path of this job; `dist` is torch.distributed (imported when not given)."""
    if cfg.in_place == "off":
        return Path(RESTART, "--in-place off (the default while in-place recovery is experimental)")
    if cfg.no_python:
        return Path(RESTART, "--no-python: the entrypoint is not Python, it cannot re-enter")
    if parse_nnodes(cfg.nnodes) != (1, 1):
        return Path(RESTART, "in-place recovery across nodes is not built yet: one node only")
    found = reconfigure.support(dist)
    if not found.ok:
        return Path(RESTART, found.why)
    return Path(
        IN_PLACE,
        f"{found.why}: a gloo group re-forms in place (NCCL where this torch's NCCL group has "
        "reconfigure); another backend, or a rank that cannot vouch for its state, restarts",
    )


def announce(cfg: Config, dist=None) -> Path:
    """Choose and say it: one `recovery_path` event."""
    path = choose(cfg, dist)
    log.info("recovery_path", path=path.name, why=path.why)
    return path


def _refused(agent: Agent, why: Failure) -> str | None:
    """Why this failure cannot be recovered in place (None: it can)."""
    group = agent.group
    if not isinstance(why, Failure) or why.kind not in (RestartCause.CRASH, RestartCause.SIGNAL):
        kind = getattr(why, "kind", None)
        return f"a failure of kind {getattr(kind, 'value', 'scale')} restarts the group"
    if why.kind is RestartCause.CRASH and why.exit_code in agent.cfg.fatal_exit_codes:
        return "a fatal exit code"
    if agent.round is None or agent.round.worker_store is None:
        return "this node does not host the workers' store"
    if any(b is None or not b.beats for b in group.beats()):
        return "a rank had not stepped yet (a second fault during re-entry, or at the start)"
    if agent.in_place_used >= agent.cfg.max_restarts:
        return f"the in-place budget is spent ({agent.cfg.max_restarts}: --max-restarts)"
    if not [w for w in group.workers if w.exit_code is None]:
        return "every rank has exited"
    return None


def replace(agent: Agent, why: Failure) -> bool:
    """Recover the failed ranks in place: True when done (the loop goes on watching), False
    when the caller must restart the group (said in one line)."""
    path = agent.recovery_path
    if path is None or not path.in_place:
        return False
    refused = _refused(agent, why)
    if refused is not None:
        agent.event("in_place_refused", level="warning", why=refused, cause=why.summary())
        return False
    group = agent.group
    dead = [w for w in group.workers if w.exit_code is not None]
    agent.recovery.detected()
    agent.in_place_used += 1
    gen = group.generation + 1
    store = agent.round.worker_store
    said = f"{gen} {','.join(str(w.global_rank) for w in dead)}"  # the ranks that start
    store.set(names.in_place_key(gen), reconfigure.sign(agent.round.state_key, gen, -1, said))
    pids = group.replace(dead, agent.spares.spares)
    agent.recovery.mark("spawned")
    agent.spares.after_spawn([w.env for w in group.workers])
    agent.event(
        "replaced_in_place",
        level="warning",
        cause=why.summary(),
        generation=gen,
        ranks=[w.global_rank for w in dead],
        pids=pids,
        survivors=[w.pid for w in group.workers if w.pid not in pids],
    )
    return True
