"""The replay of a failed rank's step on another node: what tells the node's hardware from the
job's code. The replay on the failed rank's own node (daemon/replay_verdict.py) tells a failure
that repeats from one that does not; one that repeats there may still be the node's (a bad GPU,
bad memory: every replay on it fails alike). So where it repeats, another node replays the same
bundle too: reproduced there as well, the code's or the data's (exit 6, as before); not there,
the node's hardware (quarantined at once, exit 7 for it; the job goes on without it).

The protocol, over the round's keys (signed like every value, cluster/signing.py):
1. the failed node's restart request names the node that replays (`replay_on`: the next member
   of the round in group order) - the restart is not delayed by anything else;
2. after its teardown the failed node copies the bundle into the checkpoint directory the nodes
   share (`<checkpoint dir>/repro/`), and writes where, with its SHA-256, to `replay_ask`;
3. the node named waits for that (its own restart's teardown done), copies the file from its own
   checkpoint directory into its attempt's and checks that copy's digest (a file someone else
   could put there is never run), removes the shared one, replays it in one of its warm spares
   and writes its verdict to `replayed`;
4. the failed node, whose own replay reproduced the failure, waits for that verdict up to
   --replay-timeout and judges (`combine`).

Anything missing (no other node, no shared checkpoint directory, a refused or undecided replay,
the time out) decides nothing more: the failed node's own verdict stands, with one line saying
why not.

The referee of two replicas (daemon/referee.py) needs both ranks' bundles in one place: with the
two ranks on two nodes, rank 1's node copies its bundle the same way (`referee_ask`), rank 0's
referees and tells the verdict (`refereed`), and both name the same odd rank (`referee_across`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from elasticd import names, repro
from elasticd.cluster import kv as kvmod
from elasticd.cluster import silence
from elasticd.cluster.errors import StoreUnreachable
from elasticd.cluster.rounds import Round
from elasticd.daemon import referee, replay_verdict
from elasticd.daemon.replay_verdict import NOT_REPRODUCED, REFUSED, REPRODUCED, UNDECIDED
from elasticd.lifecycle.states import Failure

if TYPE_CHECKING:
    from elasticd.daemon.agent import Agent

# the verdict with the other node's replay, and the replay_verdict event's fields for it
Verdict = Callable[[], tuple[str, dict[str, Any]]]

FOLDER = "repro"  # under the checkpoint directory: the bundles copied for another node
SHARED = "a replay on another node needs one --checkpoint-dir every node shares"
ASK_WAIT = 30.0  # seconds the node named waits for the failed node's copy (its teardown first)
LOOK_EVERY = 0.5  # seconds between two looks at the beat of the node a word is awaited from


def target(rnd: Round | None, node_id: str) -> str | None:
    """The node that replays this node's failure: the next member of the round in group order
    (None alone)."""
    if rnd is None or rnd.group_world_size < 2:
        return None
    ids = [m.node_id for m in rnd.members]
    return ids[(ids.index(node_id) + 1) % len(ids)] if node_id in ids else None


def source(rnd: Round | None, node_id: str) -> str | None:
    """The node whose failure this node replays (`target`'s inverse): the member before it."""
    if rnd is None or rnd.group_world_size < 2:
        return None
    ids = [m.node_id for m in rnd.members]
    return ids[(ids.index(node_id) - 1) % len(ids)] if node_id in ids else None


def copy_path(
    checkpoint_dir: str, run_id: str, rnd: Round, rank: int, suffix: str = repro.SUFFIX
) -> Path:
    return Path(checkpoint_dir) / FOLDER / f"{run_id}-r{rnd.number}-rank{rank}{suffix}"


def publish(bundle: Path, dest: Path) -> tuple[str, str]:
    """Copy `bundle` to `dest` whole (a temporary name, fsync, rename); (its SHA-256, "") or
    ("", why not)."""
    digest = hashlib.sha256()
    tmp = dest.with_name(f".{dest.name}.{os.getpid()}.tmp")
    try:
        dest.parent.mkdir(mode=0o750, parents=True, exist_ok=True)
        with open(bundle, "rb") as src, open(tmp, "xb") as out:
            while chunk := src.read(1 << 20):
                digest.update(chunk)
                out.write(chunk)
            out.flush()
            os.fsync(out.fileno())
        os.replace(tmp, dest)
    except OSError as e:
        with contextlib.suppress(OSError):
            tmp.unlink()
        return "", f"could not copy the bundle to {dest} ({e})"
    return digest.hexdigest(), ""


def serve(
    ask: dict[str, Any] | None,
    checkpoint_dir: str,
    log: Path,
    timeout: float,
    idle: Callable[[float, Callable[[], bool]], None],
    take: replay_verdict.Take,
) -> tuple[int, str, bool]:
    """On the node named: the replay `ask` (the failed node's `replay_ask`: path, sha256)
    describes, judged as `elasticd replay` would: (exit code, line, warm). The bundle is
    fetched beside `log` first."""
    if ask is None:
        return UNDECIDED, "undecided: the failed node said nothing of its bundle in time", False
    path, why = fetched(ask, checkpoint_dir, log.with_name(log.name.replace(".replay.log", "")))
    if path is None:  # "none": the failed node had no copy to give, nothing refused here
        word, code = ("undecided", UNDECIDED) if "none" in ask else ("refused", REFUSED)
        return code, f"{word}: {why}", False
    return replay_verdict.replay(path, log, timeout, idle, take)


def fetched(ask: dict[str, Any], checkpoint_dir: str, into: Path) -> tuple[Path | None, str]:
    """The bundle `ask` names, copied to `into` (this node's own directory), where it is in
    this node's checkpoint directory's FOLDER and the copy has the SHA-256 the other node wrote;
    the shared copy is removed then (it was for this replay alone). What runs is the private
    copy whose digest was checked: a file someone else puts there, before or after the check,
    never runs. (None, why not) otherwise."""
    if "none" in ask:
        return None, str(ask["none"])
    path = Path(str(ask.get("path", "")))
    ours = (Path(checkpoint_dir) / FOLDER).resolve()
    if not checkpoint_dir or path.resolve().parent != ours:
        return None, f"the bundle {path} is not in this node's {ours} ({SHARED})"
    sha, failed = publish(path, into)
    if failed:
        return None, f"{failed}; {SHARED}"
    if sha != ask.get("sha256"):
        with contextlib.suppress(OSError):
            into.unlink()
        return None, f"{path} is not the bundle the other node wrote (SHA-256)"
    with contextlib.suppress(OSError):
        path.unlink()
    return into, ""


def combine(answer: dict[str, Any] | None, why_none: str) -> tuple[str, dict[str, Any]]:
    """The verdict on a failure that reproduced on its own node, given the other node's
    `answer` (None: `why_none`): "reproduced" (there too, or nothing more decided) or "hardware"
    (there it completed); and the event's fields that say so."""
    if answer is None:
        return "reproduced", {"elsewhere": f"none: {why_none}"}
    said = f"node {answer['node']}: {answer['said']}"
    if answer["code"] == NOT_REPRODUCED:
        return "hardware", {"elsewhere": said}
    if answer["code"] == REPRODUCED:
        return "reproduced", {"elsewhere": said}
    return "reproduced", {"elsewhere": f"undecided: {said}"}


# --- in the agent's restart (Agent._restart): each a step of the protocol above


def offer(agent: Agent, why: Failure, reason: dict[str, Any]) -> None:
    """Name in the restart request `reason` the node that replays `why`'s step too (step 1),
    where this failure's replay runs at all and another node can."""
    if agent.cfg.replay_timeout <= 0 or not agent.cfg.checkpoint_dir:
        return
    spec = agent.group.spec
    if replay_verdict.bundle_of(why, spec.attempt_dir if spec is not None else None) is None:
        return
    other = target(agent.round, agent.rdzv.node_id)
    if other is not None:
        reason["replay_on"] = other


def start(agent: Agent, why: Failure, reason: dict[str, Any], bundle: Path) -> Verdict | None:
    """The failed node, its group torn down: the bundle copied and its place told (step 2); the
    verdict with the other node's replay, for replay_verdict.judge to ask once its own replay
    reproduced (step 4). None where the request names no other node."""
    other, rnd = reason.get("replay_on"), agent.round
    if not other or rnd is None or why.rank is None:
        return None
    try:
        failed = _hand_over(agent, rnd, bundle, why.rank, names.REPLAY_ASK)
    except (StoreUnreachable, kvmod.Unreachable) as e:
        failed = f"the store did not take the bundle's place ({e})"
    t0 = time.monotonic()

    def verdict() -> tuple[str, dict[str, Any]]:
        if failed:
            return combine(None, failed)
        try:
            there = agent.waits.blocking(agent.rdzv.read_restart, agent.rdzv.kv, rnd)
            if there and any(there.get(k) != reason.get(k) for k in ("at", "rank", "node")):
                return combine(None, "another node's failure came first: the request is its")
            left = agent.cfg.replay_timeout - (time.monotonic() - t0)
            answer, gone = word(agent, rnd, names.REPLAYED_ELSEWHERE, other, left)
        except (StoreUnreachable, kvmod.Unreachable) as e:
            return combine(None, f"the store did not answer ({e})")
        return combine(answer, gone or f"no word from node {other} within --replay-timeout")

    return verdict


def _hand_over(agent: Agent, rnd: Round, bundle: Path, rank: int, name: str) -> str:
    """`bundle` copied into the shared checkpoint directory and its place (or why there is
    none) told under the round's key `name`; why not, or ""."""
    cfg = agent.cfg
    suffix = "." + bundle.name.split(".", 1)[1]  # .repro, or .sdc.repro (the referee's)
    dest = copy_path(cfg.checkpoint_dir, cfg.rdzv_id, rnd, rank, suffix)
    missing = f"no {bundle.name} on the node of rank {rank}"
    sha, failed = publish(bundle, dest) if bundle.is_file() else ("", missing)
    ask = {"path": str(dest), "sha256": sha} if sha else {"none": failed}
    agent.waits.blocking(agent.rdzv.note_replay, rnd, name, ask)
    return failed


def word(
    agent: Agent, rnd: Round, name: str, writer: str | None, timeout: float
) -> tuple[dict[str, Any] | None, str]:
    """The word `name` node `writer` leaves (Rendezvous.note_replay), waited for up to
    `timeout` seconds while that node still beats: (the word, ""), or (None, why) once it has
    been silent for --peer-timeout, the rule for a node gone with no other evidence (it died
    while replaying: no word will come, and waiting out --replay-timeout would hold the whole
    job's restart); (None, "") at the time out."""
    until, heard = time.monotonic() + max(timeout, 0.0), {}
    while (left := until - time.monotonic()) > 0:
        look = left if writer is None else min(left, LOOK_EVERY)  # no writer known: one wait
        said = agent.waits.blocking(agent.rdzv.replay_noted, rnd, name, look)
        if said is not None or writer is None:
            return said, ""
        beats = agent.waits.blocking(agent.rdzv.read_beats, agent.rdzv.kv, [writer])
        heard, lost = silence.missing_lost(heard, beats, time.monotonic(), agent.cfg.peer_timeout)
        if lost:
            return None, f"node {writer} silent for {lost[writer]:.1f} s (--peer-timeout): gone"
    return None, ""


def for_peer(agent: Agent) -> None:
    """A node restarting for another's failure (told to, or its ranks died of that node's
    going): where that node's restart request names this one, its replay of the failed step,
    and the verdict told (step 3). Its wait and the replay are bounded by --replay-timeout; its
    next round waits for it, as the failed node's does."""
    rnd, timeout = agent.round, agent.cfg.replay_timeout
    if rnd is None or rnd.group_world_size < 2 or timeout <= 0 or not agent.cfg.checkpoint_dir:
        return
    t0 = time.monotonic()
    try:
        asked = agent.waits.blocking(agent.rdzv.read_restart, agent.rdzv.kv, rnd)
        if not asked or asked.get("replay_on") != agent.rdzv.node_id:
            return
        failed_node = source(rnd, agent.rdzv.node_id)
        ask, _ = word(agent, rnd, names.REPLAY_ASK, failed_node, min(ASK_WAIT, timeout))
    except (StoreUnreachable, kvmod.Unreachable):
        return  # the restart goes on; the failed node's own verdict stands
    node, rank = str(asked.get("node", "?")), asked.get("rank")
    spec = agent.group.spec
    where = spec.attempt_dir if spec is not None else Path(agent.cfg.checkpoint_dir)
    named = "".join(c if c.isalnum() or c in "-_" else "_" for c in node)[:64]  # a file's name
    log = where / f"node-{named}-rank{rank}.replay.log"
    idle = agent.waits.idle
    code, said, warm = serve(ask, agent.cfg.checkpoint_dir, log, timeout, idle, agent.spare)
    answer = {"node": agent.node, "code": code, "said": said[:1500], "warm": warm}
    with contextlib.suppress(StoreUnreachable, kvmod.Unreachable):
        agent.waits.blocking(agent.rdzv.note_replay, rnd, names.REPLAYED_ELSEWHERE, answer)
    agent.event(
        "replayed_for_node",
        level="info" if code in (REPRODUCED, NOT_REPRODUCED) else "warning",
        node=node,
        rank=rank,
        verdict=replay_verdict.VERDICTS.get(code, "undecided"),
        said=said,
        warm=warm,
        seconds=round(time.monotonic() - t0, 2),
    )


def referee_across(agent: Agent, step: int) -> referee.Call | None:
    """Two replicas on two nodes of one rank each (daemon/referee.py needs both ranks' bundles):
    rank 1's node copies its bundle as above (`referee_ask`) and waits for the verdict; rank 0's
    node referees with it and tells the verdict (`refereed`), so both nodes name the same odd
    rank. None where the job is not of that shape (the local referee decides)."""
    rnd, spec, cfg = agent.round, agent.group.spec, agent.cfg
    if rnd is None or spec is None or rnd.world_size != 2 or rnd.group_world_size != 2:
        return None
    t0, idle = time.monotonic(), agent.waits.idle
    mine = spec.attempt_dir / f"rank{rnd.rank_base}{repro.SDC_SUFFIX}"
    idle(t0 + referee.BUNDLES_WAIT, mine.is_file)  # each rank writes its own before it exits
    try:
        if rnd.rank_base == 1:
            return _to_referee(agent, rnd, mine, t0)
        other = source(rnd, agent.rdzv.node_id)
        ask, gone = word(agent, rnd, names.REFEREE_ASK, other, referee.BUNDLES_WAIT)
        theirs = spec.attempt_dir / f"rank1{repro.SDC_SUFFIX}"  # beside rank 0's, as if local
        path, why = fetched(ask, cfg.checkpoint_dir, theirs) if ask else (None, gone or "no word")
        if path is None:
            call = referee.Call(None, f"rank 1's bundle: {why}", time.monotonic() - t0)
        else:
            left = cfg.replay_timeout - (time.monotonic() - t0)
            call = referee.referee(spec.attempt_dir, step, left, idle, agent.spare)
            call = dataclasses.replace(call, seconds=time.monotonic() - t0)
        told = {"odd": call.odd, "said": call.said[:1500], "warm": call.warm}
        agent.waits.blocking(agent.rdzv.note_replay, rnd, names.REFEREED, told)
        return call
    except (StoreUnreachable, kvmod.Unreachable) as e:
        return referee.Call(None, f"the store did not answer ({e})", time.monotonic() - t0)


def _to_referee(agent: Agent, rnd: Round, mine: Path, t0: float) -> referee.Call:
    """Rank 1's node: its bundle copied for rank 0's, and the verdict that comes back."""
    failed = _hand_over(agent, rnd, mine, 1, names.REFEREE_ASK)
    if failed:
        return referee.Call(None, f"rank 1's bundle: {failed}", time.monotonic() - t0)
    wait = agent.cfg.replay_timeout + referee.BUNDLES_WAIT
    told, gone = word(agent, rnd, names.REFEREED, source(rnd, agent.rdzv.node_id), wait)
    if told is None:
        why = gone or "no word from the referee (rank 0's node) within --replay-timeout"
        return referee.Call(None, why, time.monotonic() - t0)
    return referee.Call(told["odd"], told["said"], time.monotonic() - t0, told["warm"])
