"""Replay as the verdict on a worker's exception (issue 44, point 3), under `elasticd run`: the
failed rank leaves a repro bundle, the daemon replays the failed step in one process before the
restart, and `elasticd replay BUNDLE` does the same by hand. The job, tests/scripts/replay_job.py,
is the README's loop with a data bug (a bad sample), a transient (one rank, first attempt only)
or a bug at step 1 (before any state is kept)."""

from __future__ import annotations

import shutil

from elasticd import exit_codes
from harness import FAST, run_cli, script

BAD_SAMPLE = ("--bad-sample", "37")  # in rank 1's batch at step 7 (seed 3, 2 ranks, batch 4)


def _job(daemons, name: str, *flags: str, args=()):
    return daemons(
        script("replay_job.py"),
        *("--nproc-per-node", "2", "--max-restarts", "3"),
        *FAST,
        *flags,
        name=name,
        args=args,
    )


def _events(d, name: str) -> list[dict]:
    return [e for e in d.events() if e.get("event") == name]


def test_a_data_bug_replays_the_same_and_ends_deterministic_after_one_failure(daemons, tmp_path):
    d = _job(daemons, "bug", "--ledger", args=BAD_SAMPLE)
    assert d.wait(180) == exit_codes.ExitCode.DETERMINISTIC, d.stderr()[-3000:]
    assert not _events(d, "recovered"), "restarted: the replay should have decided at once"
    (verdict,) = _events(d, "replay_verdict")
    assert verdict["verdict"] == "reproduced" and verdict["rank"] == 1, verdict
    # in a warm spare: the one the fork server forked after learning the workers' imports,
    # just before the failure (the teardown's sweep once killed it: cold 2 times in 3)
    assert verdict["warm"] is True, (verdict, _events(d, "replay_spare_missing"))
    assert "its replay from the repro bundle" in d.stderr(), d.stderr()[-2000:]
    attempt = d.attempt_dirs()[0]
    said = (attempt / "rank1.replay.log").read_text().splitlines()[-1]
    assert said == verdict["said"], (said, verdict)
    assert said.startswith("elasticd replay: reproduced at step 7: ValueError: sample 37"), said
    bundle = attempt / "rank1.repro"
    # by hand: the same verdict, from the same file, in one process
    r = run_cli("replay", str(bundle), timeout=120)
    assert r.returncode == 0, (r.stdout[-2000:], r.stderr[-2000:])
    line = r.stdout.strip().splitlines()[-1]
    assert line.startswith("elasticd replay: reproduced at step 7: ValueError: sample 37"), line
    assert "rank 1 of 2" in line, line
    # rank 0 died of rank 1's going: its own step replays clean, with the state's digest. Its
    # bundle is written only if the group's stop, which the verdict hastens, lets it finish
    # (test_a_transient_does_not_replay_and_the_job_restarts always has a completed step)
    if (attempt / "rank0.repro").exists():
        r = run_cli("replay", str(attempt / "rank0.repro"), timeout=120)
        assert r.returncode == 1, (r.stdout[-2000:], r.stderr[-2000:])
        assert "did not reproduce: step 7 completed (state digest " in r.stdout, r.stdout[-1000:]
    # a damaged copy: refused in one line, nothing loaded
    damaged = tmp_path / "damaged.repro"
    shutil.copy(bundle, damaged)
    data = bytearray(damaged.read_bytes())
    data[-100] ^= 0x10
    damaged.write_bytes(bytes(data))
    r = run_cli("replay", str(damaged), timeout=60)
    assert r.returncode == 2, (r.stdout, r.stderr)
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and "damaged" in lines[0] and "SHA-256" in lines[0], r.stderr


def test_a_transient_does_not_replay_and_the_job_restarts(daemons):
    """Without warm spares (--no-warm-spawn) the daemon runs `elasticd replay` itself."""
    flaky = ("--flaky-rank", "1", "--flaky-step", "5")
    d = _job(daemons, "flaky", "--ledger", "--no-warm-spawn", args=flaky)
    assert d.wait(180) == 0, d.stderr()[-3000:]
    (verdict,) = _events(d, "replay_verdict")
    assert verdict["verdict"] == "transient" and verdict["warm"] is False, verdict
    (missing,) = _events(d, "replay_spare_missing")
    assert missing["pool"] == "warm spawn is off (--no-warm-spawn)", missing
    assert "did not reproduce: step 5 completed" in verdict["said"], verdict
    assert "done" in d.stdout()


def test_no_bundle_without_the_ledger_or_a_kept_state_and_the_repeat_rule_judges(daemons):
    off = _job(daemons, "off", "--max-restarts", "0", args=BAD_SAMPLE)
    early = _job(daemons, "early", "--ledger", "--max-restarts", "0", args=("--bug-at", "1"))
    for d, why in (
        (off, "the ledger is off (elasticd run --ledger)"),
        (early, "no state kept yet"),
    ):
        assert d.wait(120) == exit_codes.ExitCode.FAILED, d.stderr()[-3000:]
        # one line per failed rank, on its stdout (the worker's log)
        skipped = [ln for ln in d.stdout().splitlines() if "repro_bundle_skipped" in ln]
        assert len(skipped) in (1, 2) and all(why in ln for ln in skipped), d.stdout()[-3000:]
        assert not list(d.attempt_dirs()[0].glob("*.repro"))
        assert not _events(d, "replay_verdict") and not _events(d, "replay_undecided")


def test_without_the_in_memory_state_the_bundle_takes_the_disk_checkpoint(daemons, tmp_path):
    flags = ("--ledger", "--no-memory-state", "--checkpoint-dir", str(tmp_path / "ckpt"))
    d = _job(daemons, "disk", *flags, args=(*BAD_SAMPLE, "--every", "2"))
    assert d.wait(180) == exit_codes.ExitCode.DETERMINISTIC, d.stderr()[-3000:]
    (verdict,) = _events(d, "replay_verdict")
    assert verdict["verdict"] == "reproduced", verdict
    assert "(disk)" in verdict["said"] and "rank 1 of 2" in verdict["said"], verdict
