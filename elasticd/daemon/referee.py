"""The referee of two disagreeing replicas: with two DDP ranks the audit (checkpoint/audit.py)
has no majority, so this daemon replays the disputed global step from the certified pre-step
state and names the rank whose digest the replay reproduces; the other is the odd one out, and
its node takes the strike an outvoted rank's takes (daemon/sdc.py).

Why it is exact: DDP's default hook divides each rank's gradient by the world size and
all-reduces the sum; with two addends the sum is the same bits in either order, so g0/2 + g1/2
made in one process is the job's gradient (checked bit for bit against gloo, docs/replay.md).
Each rank left a bundle at the disagreement (checkpoint/bundle.py `on_sdc`: the certified state,
its RNG, its samples, both digests); two replays (each a world of one, as `elasticd replay`),
side by side: one leaves rank 1's local gradients of the step, the other replays rank 0's, waits
for them at its optimizer step, mixes them in and takes the step: its digest is the job's had no
bit flipped. Each replay runs in a warm spare where the pool has one (torch and the job's imports
loaded: a fresh interpreter's imports were most of a verdict's seconds), else in a fresh one.

The two ranks on two nodes: rank 1's node copies its bundle to rank 0's, which referees and
tells it the verdict (daemon/replay_elsewhere.py `referee_across`).

What it cannot decide (one `sdc_referee_undecided` line, the undecided rule stands): no bundles
(ledger off, no state kept, not DDP), two nodes without a shared checkpoint directory, a
certified state older than the disputed step's pre-step state, a replay that fails or outlasts
the timeout, and a replay that reproduces neither digest (a fault before the step's all-reduce
spreads to both).
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from elasticd import names, repro
from elasticd.daemon import replay_verdict, spawn
from elasticd.daemon.forkclient import Spare

BUNDLES_WAIT = 10.0  # seconds for the ranks' bundles to appear (each writes it before exiting)


@dataclasses.dataclass(frozen=True)
class Call:
    """The referee's verdict: `odd`, the rank whose digest the replay did not reproduce (None:
    undecided, `said` says why), and its seconds from the call to the verdict."""

    odd: int | None
    said: str
    seconds: float
    warm: int = 0  # replays that ran in a warm spare (of 2)


Idle = Callable[[float, Callable[[], bool]], None]
Take = Callable[[], Spare | None]  # a warm spare from the pool (spares.py `take`), or None


def referee(
    attempt_dir: Path | None, step: int, timeout: float, idle: Idle, take: Take = lambda: None
) -> Call:
    """Replay the disputed `step` from the two ranks' bundles in `attempt_dir` (one may have
    come from the other node: daemon/replay_elsewhere.py), waiting through the agent's loop
    (`idle`), at most `timeout` seconds in all, in spares `take` gives."""
    t0 = time.monotonic()
    deadline = t0 + timeout
    if attempt_dir is None:
        return Call(None, "no attempt directory", 0.0)
    paths = [attempt_dir / f"rank{r}{repro.SDC_SUFFIX}" for r in (0, 1)]
    idle(min(deadline, t0 + BUNDLES_WAIT), lambda: all(p.is_file() for p in paths))
    heads = _heads(paths, step)
    if isinstance(heads, str):
        return Call(None, heads, time.monotonic() - t0)
    digests = [int(d) for d in heads[0]["digests"]]
    with tempfile.TemporaryDirectory(prefix="elasticd-referee-") as tmp:
        grads = os.path.join(tmp, "rank1.grads")
        # side by side: the second imports and loads while the first runs; it waits for the
        # gradients only at its optimizer step
        first = _start(heads[1], paths[1], {names.REFEREE_GRADS_OUT: grads}, tmp, take)
        second = _start(heads[0], paths[0], {names.REFEREE_GRADS_IN: grads}, tmp, take)
        warm = first[2] + second[2]
        try:
            idle(deadline, lambda: first[0].poll() is not None)
            got = _finish(*first[:2])
            if got.get("outcome") != "gradients":
                said = f"rank 1's replay: {_outcome(got)}"
                return Call(None, said, time.monotonic() - t0, warm)
            idle(deadline, lambda: second[0].poll() is not None)
            got = _finish(*second[:2])
        finally:
            for proc, _, _ in (first, second):
                replay_verdict.end(proc)
    seconds = time.monotonic() - t0
    if got.get("outcome") != "completed" or not isinstance(got.get("digest"), int):
        return Call(None, f"rank 0's replay: {_outcome(got)}", seconds, warm)
    return dataclasses.replace(judge(got["digest"], digests, step, seconds), warm=warm)


def judge(replayed: int, digests: list[int], step: int, seconds: float) -> Call:
    """Pure: the rank the replay's digest names as the odd one out, or None."""
    right = [r for r, d in enumerate(digests) if d == replayed]
    if len(right) == 1:
        odd = 1 - right[0]
        return Call(
            odd,
            f"referee: the replay of step {step} from the certified state reproduced rank "
            f"{right[0]}'s digest ({replayed:016x}), not rank {odd}'s",
            seconds,
        )
    return Call(
        None,
        f"the replay of step {step} reproduced neither rank's digest ({replayed:016x}): both "
        "replicas differ from a clean step (a fault before the step's all-reduce reaches both)",
        seconds,
    )


def _heads(paths: list[Path], step: int) -> list[dict] | str:
    """The two bundles' headers, or why the referee cannot use them."""
    heads = []
    for r, path in enumerate(paths):
        if not path.is_file():
            return (
                f"no bundle of rank {r} on this node (written only under --ledger, once a state "
                "was kept, and on the node of that rank)"
            )
        try:
            head, _ = repro.read_header(path)
        except repro.BundleError as e:
            return str(e)
        if head.get("kind") != "sdc" or int(head.get("failed_step", -1)) != step:
            return f"{path.name} is not a bundle of the disagreement at step {step}"
        if int(head["certified_step"]) != step - 1:
            return (
                f"the certified state is step {head['certified_step']}'s, not the pre-step state "
                f"of step {step} (refresh the in-memory state every step to referee)"
            )
        heads.append(head)
    if heads[0].get("digests") != heads[1].get("digests") or len(heads[0]["digests"]) != 2:
        return "the two bundles disagree on the replicas' digests"
    return heads


def _start(head: dict, bundle: Path, extra: dict[str, str], tmp: str, take: Take):
    """One replay (worker/replay.py) of `bundle`, as `elasticd replay` runs it, in a warm spare
    `take` gives, else in a fresh interpreter; its output in rankR.sdc.replay.log beside the
    bundle. (process, result file, 1 if in a spare else 0)"""
    result, ledger_dir = os.path.join(tmp, f"{bundle.name}.json"), os.path.join(tmp, bundle.name)
    os.mkdir(ledger_dir, 0o700)
    env = {**repro.replay_env(head, str(bundle), result, ledger_dir), **extra}
    log = bundle.with_name(bundle.name.replace(repro.SUFFIX, ".replay.log"))
    argv = [str(bundle), result]
    spare = take() if not log.exists() else None  # a spare creates it, as a rank's log
    if spare is not None and (proc := spawn.assign(spare, env, tuple(argv), log)) is not None:
        return proc, result, 1
    cmd = [sys.executable, "-P", "-m", "elasticd.worker.replay", *argv]
    with open(log, "ab") as out:  # after an earlier replay of the bundle too
        proc = subprocess.Popen(
            cmd, env=env, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            start_new_session=True,
        )  # fmt: skip
    return proc, result, 0


def _finish(proc: subprocess.Popen, result: str) -> dict:
    """The replay's result; a process still running (past the deadline) is killed first."""
    if proc.poll() is None:
        replay_verdict.end(proc)
        return {"outcome": "timeout"}
    return repro.read_result(result)


def _outcome(got: dict) -> str:
    outcome = got.get("outcome")
    if outcome == "timeout":
        return "not finished in time (--replay-timeout)"
    if outcome == "error":
        return f"failed: {str(got.get('exception'))[:200]}"
    return f"no verdict ({outcome})"
