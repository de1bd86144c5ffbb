"""/dev/shm full as the daemon starts (security, round 4, point 4): the in-memory state was
turned off without a word (a crash then resumed from step 0) and its half-made directory and lock
file stayed. Now one `memory_state_off` warning names the problem and the fix, and nothing is
left. The daemon runs in a mount namespace of its own whose /dev/shm is a full 4 KiB tmpfs."""

from __future__ import annotations

import subprocess

import pytest

from harness import script


def _shm(size: str, fill: int) -> str:
    """The daemon's wrapper: /dev/shm a tmpfs of `size` with `fill` bytes taken, and what is
    left there once the daemon is gone written to $LISTING."""
    return (
        f"mount -t tmpfs -o size={size} tmpfs /dev/shm && head -c {fill} /dev/zero > "
        '/dev/shm/fill || exit 97; "$@"; rc=$?; ls -A /dev/shm > "$LISTING"; exit $rc'
    )


FULL_SHM = _shm("4k", 4096)


def _can_mount() -> bool:
    try:
        r = subprocess.run(
            ["unshare", "-m", "--propagation", "private", "sh", "-c", FULL_SHM.split(" >")[0]],
            capture_output=True,
            timeout=20,
        )
    except (OSError, subprocess.TimeoutExpired):
        return False
    return r.returncode == 0


@pytest.mark.skipif(not _can_mount(), reason="needs a mount namespace and tmpfs (root)")
def test_a_full_dev_shm_is_one_warning_and_leaves_nothing(daemons, tmp_path):
    listing = tmp_path / "shm-after.txt"
    d = daemons(
        script("ddp_tutorial.py"),
        "--nproc-per-node",
        "1",
        args=["--steps", "3"],
        env={"LISTING": str(listing)},
        prefix=("unshare", "-m", "--propagation", "private", "sh", "-c", FULL_SHM, "sh"),
    )
    assert d.wait(120) == 0, d.stderr()[-3000:]
    off = [e for e in d.events() if e.get("event") == "memory_state_off"]
    assert len(off) == 1, off
    assert off[0].get("level") == "warning", off
    assert "No space left on device" in off[0]["reason"], off
    assert "free space in /dev/shm" in off[0]["fix"] and "--no-memory-state" in off[0]["fix"]
    assert listing.read_text().split() == ["fill"], listing.read_text()


@pytest.mark.skipif(not _can_mount(), reason="needs a mount namespace and tmpfs (root)")
def test_room_for_the_directory_but_not_the_slots_is_the_workers_warning_with_the_fix(
    daemons, tmp_path
):
    """The daemon makes its directory (a page); the worker's first refresh cannot reserve its
    slot (64 KiB at least): one warning from the worker, naming the fix; training goes on."""
    listing = tmp_path / "shm-after.txt"
    d = daemons(
        script("ops_train.py"),
        "--nproc-per-node",
        "1",
        args=["--steps", "5", "--memory-every", "1", "--checkpoint-every", "100"],
        env={"LISTING": str(listing)},
        prefix=("unshare", "-m", "--propagation", "private", "sh", "-c", _shm("16k", 0), "sh"),
    )
    assert d.wait(120) == 0, d.stderr()[-3000:]
    assert not [e for e in d.events() if e.get("event") == "memory_state_off"]
    log = d.log_text(0)
    assert log.count("memory_state_off") == 1, log[-3000:]
    assert "No space left on device" in log and "free space in /dev/shm" in log, log[-3000:]
    assert listing.read_text().split() == ["fill"], listing.read_text()
