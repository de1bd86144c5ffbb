"""Heartbeat file round trip and hang verdicts, on real memory-mapped files."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import psutil

from elasticd.worker import heartbeat
from harness import ROOT, wait_until


def test_beats_are_read_back_with_steps(tmp_path):
    path = str(tmp_path / "hb")
    heartbeat.create(path)
    assert heartbeat.read(path).beats == 0
    w = heartbeat.Writer(path)
    w.beat()
    w.beat()
    b = heartbeat.read(path)
    assert (b.beats, b.step, b.exiting) == (2, 1, 0.0)
    w.beat(step=40)
    w.beat()  # once the script names its step, automatic beats keep it
    assert heartbeat.read(path).step == 40
    assert 0 < b.first <= b.last <= time.monotonic()


def test_the_daemon_s_word_to_regroup_leaves_the_beats_and_figures_alone(tmp_path):
    """daemon/grow.py asks a rank to re-form as generation G at its next step boundary; the
    worker reads G (0: none asked), and neither side's fields move."""
    path = str(tmp_path / "hb")
    heartbeat.create(path)
    assert heartbeat.regroup_asked(path) == 0 and heartbeat.regroup_asked(None) == 0
    w = heartbeat.Writer(path)
    w.beat(step=7)
    w.note("saves", 3.0)
    heartbeat.ask_regroup(path, 5)
    w.beat(step=8)
    b = heartbeat.read(path)
    assert heartbeat.regroup_asked(path) == 5 and (b.beats, b.step) == (2, 8)
    assert b.figure("saves") == 3.0
    assert not heartbeat.marked(path, "returned")
    heartbeat.mark(path, "returned")  # the mark beside it
    assert heartbeat.regroup_asked(path) == 5 and heartbeat.marked(path, "returned")


def test_silence_past_the_timeout_is_a_hang_and_exit_gets_its_own_limit(tmp_path):
    path = str(tmp_path / "hb")
    heartbeat.create(path)
    heartbeat.Writer(path).beat()
    b = heartbeat.read(path)
    kw = dict(expect_beats=True, heartbeat_timeout=2.0, startup_timeout=10.0)
    assert heartbeat.verdict(b, b.first, b.last + 1.0, **kw) is None
    assert "no heartbeat for 3.0s" in heartbeat.verdict(b, b.first, b.last + 3.0, **kw)
    heartbeat.mark(path, "exiting")
    b = heartbeat.read(path)
    assert b.exiting >= b.last
    assert heartbeat.verdict(b, b.first, b.exiting + heartbeat.EXIT_TIMEOUT - 1, **kw) is None
    assert "interpreter exit hung" in heartbeat.verdict(
        b, b.first, b.exiting + heartbeat.EXIT_TIMEOUT + 1, **kw
    )


def test_startup_timeout_applies_only_when_beats_are_expected(tmp_path):
    path = str(tmp_path / "hb")
    heartbeat.create(path)
    b = heartbeat.read(path)
    assert (
        heartbeat.verdict(b, 0.0, 11.0, expect_beats=False, heartbeat_timeout=2, startup_timeout=10)
        is None
    )
    assert "startup timeout" in heartbeat.verdict(
        b, 0.0, 11.0, expect_beats=True, heartbeat_timeout=2, startup_timeout=10
    )
    (tmp_path / "bad").write_bytes(b"junk" * 20)
    assert heartbeat.read(str(tmp_path / "bad")) is None
    assert heartbeat.read(str(tmp_path / "missing")) is None


def test_reads_never_see_a_beat_half_written(tmp_path):
    """A rank beating flat out while the daemon reads: every read after the first beat has a
    step count and a last-beat time (struct.pack_into zero-filled the fields mid-beat, which the
    daemon read as "silent for hours" and restarted a healthy job)."""
    path = str(tmp_path / "hb")
    heartbeat.create(path)
    prog = (
        f"from elasticd.worker import heartbeat\nw = heartbeat.Writer({path!r})\n"
        "while True: w.beat()\n"
    )
    p = subprocess.Popen([sys.executable, "-c", prog], cwd=ROOT)
    reader = heartbeat.Reader(path)
    try:
        wait_until(lambda: (b := reader.read()) and b.beats, 30, what="the first beat")
        deadline = time.monotonic() + 1.0
        while time.monotonic() < deadline:
            b = reader.read()
            assert (
                b.beats > 0 and b.last > 0.0 and b.first > 0.0 and b.step in (b.beats - 1, b.beats)
            ), b
    finally:
        p.kill()
        p.wait()
        reader.close()


def test_process_watch_sees_a_zombie_not_a_stop_and_nothing_once_reaped():
    p = subprocess.Popen(
        [sys.executable, "-c", "import time; print('up', flush=True); time.sleep(60)"],
        stdout=subprocess.PIPE,
    )
    watch = heartbeat.ProcessWatch(p.pid)
    try:
        assert p.stdout.readline() == b"up\n"  # started: its size no longer changes
        assert watch.verdict() is None
        assert watch.rss() == psutil.Process(p.pid).memory_info().rss
        os.kill(p.pid, signal.SIGSTOP)
        wait_until(
            lambda: psutil.Process(p.pid).status() == psutil.STATUS_STOPPED, 5, what="state T"
        )
        assert (
            watch.verdict() is heartbeat.process_verdict(p.pid) is None
        )  # judged by its silence only
        os.kill(p.pid, signal.SIGKILL)
        wait_until(lambda: watch.verdict() == "process is a zombie", 5, what="the zombie")
        p.wait()
        assert (
            watch.verdict() is None and watch.rss() is None
        )  # never a process that reuses the pid
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
        p.stdout.close()
        watch.close()
