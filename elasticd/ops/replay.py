"""`elasticd replay BUNDLE`: re-run a failed step from its repro bundle (elasticd/repro.py) in one
process, and say whether the failure reproduces.

The bundle is checked first without torch (its magic, format, elasticd's version, the SHA-256 of
its state): a bad one is refused in one line, exit 2. Then one process (worker/replay.py) runs the
bundle's entrypoint as a world of one: the script's CheckpointManager loads the certified state
(weights_only), the sampler deals the failed rank's samples (names.REPLAY_AS), the ledger records
into a scratch directory, and the boundary after the failed step ends it. The verdict
(daemon/replay_verdict.py `verdict`, the daemon's too) compares the error's signature
(lifecycle/triage.py: type, message with numbers masked, the innermost frame of the user's code),
never the raw text, and checks the replay's samples against the bundle's ledger record.

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
from typing import Any

from elasticd import repro
from elasticd.daemon import replay_verdict
from elasticd.daemon.replay_verdict import REFUSED, UNDECIDED


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
        code, text = replay_verdict.verdict(head, got, replay_verdict.samples(ledger_dir))
    return _say(head, code, text)


def _say(head: dict[str, Any], code: int, text: str) -> int:
    line = replay_verdict.words(head, text)
    print(line, file=sys.stdout if code != REFUSED else sys.stderr)
    return code
