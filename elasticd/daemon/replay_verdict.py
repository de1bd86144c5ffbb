"""The replay's verdict on a local worker's failure, in the restart: where the failed rank left a
repro bundle (elasticd.checkpoint.bundle: a script using CheckpointManager under --ledger), the
daemon re-runs the failed step in one process on this node once the group is down, and judges it
as `elasticd replay` (ops/replay.py) does, with the same words (`verdict`, `words`). The process
is a warm spare from the pool where it has one (torch and the job's imports loaded: a fresh
interpreter's start was nearly all of a verdict's seconds), else `elasticd replay` itself.

Why: the repeat rule (lifecycle/triage.py) needs the same failure twice and guesses from the
message; a replay that fails the same way from the certified pre-step state, the same samples
and the same RNG shows the failure is the code's or the data's: the job ends as deterministic
(exit code 6) after one failure (`Failure.replayed`, which the restart request carries to the
next closing, cluster/closing.py). A replay whose step completes calls the failure transient: the
job restarts as before. Anything else (no bundle, a refused or undecided replay, the time out)
decides nothing, with one `replay_undecided` line, and the repeat rule stays the judge.

Hardware (a failure that replays on this node but not on another) takes the replay on another
node too: daemon/replay_elsewhere.py. What it cannot tell: a failure at a world of one where the
step needs the world's gradients (docs/replay.md).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from elasticd import ledger, repro
from elasticd.lifecycle import triage
from elasticd.lifecycle.states import Failure, RestartCause
from elasticd.lifecycle.triage import FailureClass

# `elasticd replay`'s exit codes: the first two decide
REPRODUCED, NOT_REPRODUCED, REFUSED, UNDECIDED = 0, 1, 2, 3
VERDICTS = {REPRODUCED: "reproduced", NOT_REPRODUCED: "transient"}
HARDWARE = "hardware"  # reproduced on its own node only (daemon/replay_elsewhere.py)
SLACK = 10.0  # seconds past the replay's own --timeout before the daemon kills it

# a warm spare from the pool (spares.py `take`: a forkclient.Spare), or None
Take = Callable[[], Any]


def bundle_of(why: Failure, attempt_dir: Path | None) -> Path | None:
    """The failed rank's bundle, where its failure is an exception of the user's code (not a
    death of another rank's going: on another node, its own replay would only delay its join)."""
    if (
        attempt_dir is None
        or why.kind is not RestartCause.CRASH
        or why.failure_class != FailureClass.USER.value
        or why.rank is None
        or not why.exception
        or triage.consequence(why.exception)  # died of another's going: its step replays clean
    ):
        return None
    path = attempt_dir / f"rank{why.rank}{repro.SUFFIX}"
    return path if path.is_file() else None


def judge(
    why: Failure,
    path: Path,
    timeout: float,
    idle: Callable[[float, Callable[[], bool]], None],
    event: Callable[..., None],
    take: Take = lambda: None,
    elsewhere: Callable[[], tuple[str, dict[str, Any]]] | None = None,
) -> Failure:
    """Run the replay of `path` (its output in rankR.replay.log beside it), in a spare `take`
    gives or else as `elasticd replay`, waiting through the agent's loop (`idle`), and return
    `why` with its verdict ("" where it decided nothing). Where it reproduced, `elsewhere()`
    (daemon/replay_elsewhere.py: the verdict with another node's replay, and the event's fields
    for it) may call it the node's hardware instead."""
    log = path.with_name(path.name.replace(repro.SUFFIX, ".replay.log"))
    t0 = time.monotonic()
    code, said, warm = replay(path, log, timeout, idle, take)
    verdict, more = VERDICTS.get(code, ""), {}
    if code == REPRODUCED and elsewhere is not None:
        verdict, more = elsewhere()
    fields = {"rank": why.rank, "bundle": str(path), "seconds": round(time.monotonic() - t0, 2),
              "warm": warm, **more}  # fmt: skip
    if verdict:
        event("replay_verdict", level="error" if code == 0 else "info", verdict=verdict,
              said=said, **fields)  # fmt: skip
    else:
        event("replay_undecided", level="warning", said=said or f"exit {code}", **fields,
              action="the repeat rule judges it")  # fmt: skip
    if verdict == HARDWARE:
        reason = (f"{why.reason}; its replay failed the same way on this node only "
                  f"({more.get('elsewhere', '')}): this node's hardware")  # fmt: skip
        return dataclasses.replace(why, replayed=verdict, reason=reason,
                                   failure_class=FailureClass.HARDWARE.value)  # fmt: skip
    return dataclasses.replace(why, replayed=verdict)


def replay(
    path: Path, log: Path, timeout: float, idle: Callable[[float, Callable[[], bool]], None],
    take: Take,
) -> tuple[int, str, bool]:  # fmt: skip
    """The replay of `path` in a spare `take` gives, or else as `elasticd replay` (its output
    in `log`): (`elasticd replay`'s exit code, its line, whether a spare ran it)."""
    warm = _in_spare(path, log, timeout, idle, take)
    code, said = warm if warm is not None else _in_cli(path, log, timeout, idle)
    return code, said, warm is not None


def _in_cli(path: Path, log: Path, timeout: float, idle) -> tuple[int, str]:
    """`elasticd replay` in a fresh interpreter (which starts another): its exit code, its line."""
    cmd = [sys.executable, "-P", "-m", "elasticd", "replay", str(path), "--timeout", f"{timeout:g}"]
    t0 = time.monotonic()
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            start_new_session=True,
        )  # fmt: skip
        idle(t0 + timeout + SLACK, lambda: proc.poll() is not None)
        end(proc)
    return proc.returncode, _last_line(log)


def _in_spare(path: Path, log: Path, timeout: float, idle, take: Take) -> tuple[int, str] | None:
    """The replay (worker/replay.py) in a warm spare, judged here as `elasticd replay` would:
    (exit code, line), the line appended to the log; None where no spare took it (or the bundle
    is bad: `elasticd replay` refuses it in its words)."""
    from elasticd.daemon import spawn  # the daemon's: `elasticd replay` needs none of it

    try:
        head, _ = repro.read_header(str(path))
    except repro.BundleError:
        return None
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="elasticd-replay-") as tmp:
        result, ledger_dir = os.path.join(tmp, "result.json"), os.path.join(tmp, "ledger")
        os.mkdir(ledger_dir, 0o700)
        env = repro.replay_env(head, str(path), result, ledger_dir)
        with contextlib.suppress(FileNotFoundError):
            log.unlink()  # the spare creates it, as a rank's log
        spare = take()
        proc = spawn.assign(spare, env, (str(path), result), log) if spare is not None else None
        if proc is None:
            return None
        idle(t0 + timeout, lambda: proc.poll() is not None)
        if end(proc):
            code, text = UNDECIDED, f"undecided: not finished in {timeout:g} s (--replay-timeout)"
        else:
            code, text = verdict(head, repro.read_result(result), samples(ledger_dir))
    line = words(head, text)
    with open(log, "a") as out:
        out.write(line + "\n")
    return code, line


def end(proc) -> bool:
    """Kill the replay's process group if it still runs (past its time, or a stop came) and reap
    it; whether it was killed."""
    running = proc.poll() is None
    if running:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    return running


def samples(ledger_dir: str) -> dict[int, list[int]]:
    """The samples the replay's ledger recorded: step -> indices."""
    out: dict[int, list[int]] = {}
    for path in ledger.find([ledger_dir]):
        for step, records in ledger.read(Path(path)).steps.items():
            out.setdefault(step, []).extend(i for indices, _ in records for i in indices)
    return out


def verdict(
    head: dict[str, Any], got: dict[str, Any], seen: dict[int, list[int]]
) -> tuple[int, str]:
    """Pure: the verdict (exit code, words) on the replay's result `got` and the samples its
    ledger recorded (`seen`, step -> indices), against the bundle's header."""
    failed = int(head["failed_step"])
    wanted = {int(s): v for s, v in (head.get("samples") or {}).items()}
    for step, indices in sorted(wanted.items()):
        if seen.get(step) != indices:
            return UNDECIDED, (
                f"undecided: not a replay of the failed step: step {step}'s samples differ from "
                "the ledger's (the script deals its own, not through elasticd.sampler's state?)"
            )
    outcome = got.get("outcome")
    if outcome == "refused":
        return REFUSED, str(got.get("why"))
    if outcome == "completed":
        digest = got.get("digest")
        return NOT_REPRODUCED, f"did not reproduce: step {got.get('step')} completed" + (
            f" (state digest {digest:016x})" if isinstance(digest, int) else ""
        )
    if outcome == "error":
        error = head.get("error") or {}
        before = triage.signature(None, error.get("exception"), error.get("callstack"))
        now = triage.signature(None, got.get("exception"), got.get("callstack"))
        if before == now:
            return REPRODUCED, f"reproduced at step {failed}: {_short(got.get('exception'))}"
        return UNDECIDED, f"undecided: another error: {_short(got.get('exception'))}"
    if outcome == "ended":
        return UNDECIDED, (
            f"undecided: the script ended (exit {got.get('code')}) before step {failed} "
            "completed (does it call CheckpointManager.maybe_save every step?)"
        )
    return UNDECIDED, "undecided: the replay process died without a result"


def _short(text: Any) -> str:
    line = str(text or "").splitlines()[0] if text else ""
    return line if len(line) <= 200 else line[:197] + "..."


def words(head: dict[str, Any], text: str) -> str:
    """The verdict's one line, `elasticd replay: TEXT [where it replayed from]`."""
    certified, failed = int(head["certified_step"]), int(head["failed_step"])
    between = failed - certified - 1
    where = (
        f"rank {head['rank']} of {head['world']}, step {failed} from the certified state of "
        f"step {certified} ({head.get('certified_from')})"
    )
    if between > 0:
        where += (
            f"; {between} step(s) replayed before it at a world of one (their gradients this "
            "rank's alone: an approximate replay)"
        )
    return f"elasticd replay: {text} [{where}]"


def _last_line(log: Path) -> str:
    """The replay's verdict line (`elasticd replay: ...`), the last one it printed."""
    try:
        with open(log, "rb") as f:
            f.seek(max(0, f.seek(0, os.SEEK_END) - 8192))
            lines = f.read().decode(errors="replace").splitlines()
    except OSError:
        return ""
    found = [line for line in lines if line.startswith("elasticd replay:")]
    return found[-1][:500] if found else ""
