"""`elasticd ledger check` on a directory someone else can write (security, round 4, point 5):
a FIFO or a symlink named like a ledger file, a file too large to read, and ledger files another
user forged (run as uid 65534) are each one line and exit 2, never a hang, a MemoryError or
"exactly once: yes"."""

from __future__ import annotations

import os

import pytest

from elasticd import ledger
from harness import as_user, assert_one_error, run_cli

NOBODY = 65534
root_only = pytest.mark.skipif(os.geteuid() != 0, reason="needs root to act as another uid")


def _write_ledger(directory: str, rank: int = 0, steps=((1, [0, 1]), (2, [2, 3]))) -> None:
    """A ledger of one epoch of 4 samples as rank `rank` writes it (one attempt's environment)."""
    saved = dict(os.environ)
    os.environ.update(RANK=str(rank), WORLD_SIZE="2", MASTER_PORT="1", ELASTICD_ROUND="1")
    try:
        w = ledger.Writer(directory)
        w.dataset_size(4)
        for step, samples in steps:
            w.record(0, step, samples)
        os.close(w.fd)
    finally:
        os.environ.clear()
        os.environ.update(saved)


def _forge(run: str) -> str:
    """The attacker: an attempt directory and a ledger in it, made as uid 65534."""
    attempt = os.path.join(run, "attempt9")
    os.mkdir(attempt, 0o755)
    _write_ledger(attempt)
    return attempt


def _hide(run: str) -> list[str]:
    """The attacker: the file that shows a sample trained twice removed, as uid 65534."""
    os.unlink(os.path.join(run, "rank1.ledger"))
    return sorted(os.listdir(run))


def test_a_genuine_ledger_is_still_proven(tmp_path):
    _write_ledger(str(tmp_path))
    r = run_cli("ledger", "check", str(tmp_path), timeout=60)
    assert r.returncode == 0 and "exactly once: yes" in r.stdout, (r.stdout, r.stderr)


def test_a_fifo_named_like_a_ledger_file_is_refused_at_once(tmp_path):
    """It hung the check (read_bytes blocks on a FIFO until a writer comes)."""
    _write_ledger(str(tmp_path))
    os.mkfifo(tmp_path / "rank1.ledger", 0o600)
    r = run_cli("ledger", "check", str(tmp_path), timeout=30)
    assert_one_error(r, "rank1.ledger", "not a regular file")


def test_a_symlink_to_dev_zero_is_refused(tmp_path):
    """It was read until MemoryError (it is never followed now)."""
    _write_ledger(str(tmp_path))
    (tmp_path / "rank1.ledger").symlink_to("/dev/zero")
    r = run_cli("ledger", "check", str(tmp_path), timeout=30)
    assert_one_error(r, "rank1.ledger", "a symbolic link")


def test_a_file_past_the_cap_is_refused_unread(tmp_path):
    """A sparse file a byte over the cap: refused by its size, not read into memory."""
    _write_ledger(str(tmp_path))
    with open(tmp_path / "rank1.ledger", "wb") as f:
        f.truncate(ledger.MAX_FILE + 1)
    r = run_cli("ledger", "check", str(tmp_path), timeout=30)
    assert_one_error(r, "rank1.ledger", "larger than 1024 MiB")


@root_only
def test_ledger_files_another_user_wrote_are_refused(open_dir):
    """uid 65534 adds an attempt of its own to a run (a directory of theirs inside it): the
    check said "exactly once: yes" of what they wrote."""
    run = open_dir / "run"
    run.mkdir()
    theirs = run / "theirs"
    theirs.mkdir()
    os.chown(theirs, NOBODY, NOBODY)
    assert as_user(NOBODY, _forge, str(theirs)) == str(theirs / "attempt9")
    r = run_cli("ledger", "check", str(run), timeout=60)
    assert "exactly once: yes" not in r.stdout
    assert_one_error(r, f"belongs to uid {NOBODY}", "forge its records", "chown")


@root_only
def test_a_run_directory_others_can_write_is_refused(open_dir):
    """A sample trained twice shows in rank 1's file; uid 65534 removes that file from a run
    directory everyone may write, and the check said "exactly once: yes"."""
    run = open_dir / "run"
    run.mkdir()
    _write_ledger(str(run))
    _write_ledger(str(run), rank=1, steps=((2, [3]),))  # sample 3 again in step 2
    r = run_cli("ledger", "check", str(run), timeout=60)
    assert r.returncode == 1 and "exactly once: NO" in r.stdout, (r.stdout, r.stderr)
    run.chmod(0o777)
    assert as_user(NOBODY, _hide, str(run)) == ["rank0.ledger"]
    r = run_cli("ledger", "check", str(run), timeout=60)
    assert "exactly once: yes" not in r.stdout
    assert_one_error(r, f"{run} is writable by other users", "forge its records", "chmod go-w")


@root_only
def test_a_ledger_file_of_another_user_is_refused(tmp_path):
    _write_ledger(str(tmp_path))
    os.chown(tmp_path / "rank0.ledger", NOBODY, NOBODY)
    r = run_cli("ledger", "check", str(tmp_path), timeout=60)
    assert_one_error(r, f"{tmp_path / 'rank0.ledger'} belongs to uid {NOBODY}")
