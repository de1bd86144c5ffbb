"""`elasticd replay BUNDLE`: re-run a failed step from its repro bundle (elasticd/repro.py) in one
process, and say whether the failure reproduces.

The bundle is checked first without torch (its magic, format, elasticd's version, the SHA-256 of
its state): a bad one is refused in one line, exit 2. Then one process (worker/replay.py) runs the
bundle's entrypoint as a world of one: the script's CheckpointManager loads the certified state
(weights_only), the sampler deals the failed rank's samples (names.REPLAY_AS), the ledger records
into a scratch directory, and the boundary after the failed step ends it. The verdict compares
the error's signature (lifecycle/triage.py: type, message with numbers masked, the innermost frame
of the user's code), never the raw text, and checks the replay's samples against the bundle's
ledger record.

Exit: 0 reproduced (the same failure at the same step); 1 not reproduced (the step completed: a
transient, for the daemon, daemon/replay_verdict.py); 2 refused (the bundle); 3 undecided (another
error, the script ended first, the samples differ from the ledger's, the time ran out).

Faithful only where the certified state is the failed step's own pre-step state: every step
replayed before it runs at a world of one, its gradient this rank's alone (docs/replay.md).
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from elasticd import ledger, repro
from elasticd.lifecycle import triage

REPRODUCED, NOT_REPRODUCED, REFUSED, UNDECIDED = 0, 1, 2, 3


def run(bundle: str, timeout: float) -> int:
    try:
        head, _ = repro.read_header(bundle)
    except repro.BundleError as e:
        print(f"elasticd replay: refused: {e}", file=sys.stderr)
        return REFUSED
    with tempfile.TemporaryDirectory(prefix="elasticd-replay-") as tmp:
        result, ledger_dir = os.path.join(tmp, "result.json"), os.path.join(tmp, "ledger")
        os.mkdir(ledger_dir, 0o700)
        env = repro.replay_env(head, bundle, result, ledger_dir)
        cmd = [sys.executable, "-P", "-m", "elasticd.worker.replay", bundle, result]
        proc = subprocess.Popen(cmd, env=env, start_new_session=True)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            return _say(head, UNDECIDED, f"undecided: not finished in {timeout:g} s (--timeout)")
        got = repro.read_result(result)
        code, text = judge(head, got, _samples(ledger_dir))
    return _say(head, code, text)


def _samples(ledger_dir: str) -> dict[int, list[int]]:
    out: dict[int, list[int]] = {}
    for path in ledger.find([ledger_dir]):
        for step, records in ledger.read(Path(path)).steps.items():
            out.setdefault(step, []).extend(i for indices, _ in records for i in indices)
    return out


def judge(head: dict[str, Any], got: dict[str, Any], seen: dict[int, list[int]]) -> tuple[int, str]:
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


def _say(head: dict[str, Any], code: int, text: str) -> int:
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
    print(f"elasticd replay: {text} [{where}]", file=sys.stdout if code != REFUSED else sys.stderr)
    return code
