"""Heartbeat file round trip and hang verdicts, on real memory-mapped files."""

from __future__ import annotations

import time

from elasticd import health


def test_beats_are_read_back_with_steps(tmp_path):
    path = str(tmp_path / "hb")
    health.create(path)
    assert health.read(path).beats == 0
    w = health.Writer(path)
    w.beat()
    w.beat()
    b = health.read(path)
    assert (b.beats, b.step, b.exiting) == (2, 1, 0.0)
    w.beat(step=40)
    w.beat()  # once the script names its step, automatic beats keep it
    assert health.read(path).step == 40
    assert 0 < b.first <= b.last <= time.monotonic()


def test_silence_past_the_timeout_is_a_hang_and_exit_gets_its_own_limit(tmp_path):
    path = str(tmp_path / "hb")
    health.create(path)
    health.Writer(path).beat()
    b = health.read(path)
    kw = dict(expect_beats=True, heartbeat_timeout=2.0, startup_timeout=10.0)
    assert health.verdict(b, b.first, b.last + 1.0, **kw) is None
    assert "no heartbeat for 3.0s" in health.verdict(b, b.first, b.last + 3.0, **kw)
    health.mark(path, "exiting")
    b = health.read(path)
    assert b.exiting >= b.last
    assert health.verdict(b, b.first, b.exiting + health.EXIT_TIMEOUT - 1, **kw) is None
    assert "interpreter exit hung" in health.verdict(b, b.first, b.exiting + health.EXIT_TIMEOUT + 1, **kw)


def test_startup_timeout_applies_only_when_beats_are_expected(tmp_path):
    path = str(tmp_path / "hb")
    health.create(path)
    b = health.read(path)
    assert health.verdict(b, 0.0, 11.0, expect_beats=False, heartbeat_timeout=2, startup_timeout=10) is None
    assert "startup timeout" in health.verdict(b, 0.0, 11.0, expect_beats=True, heartbeat_timeout=2,
                                               startup_timeout=10)
    (tmp_path / "bad").write_bytes(b"junk" * 20)
    assert health.read(str(tmp_path / "bad")) is None
    assert health.read(str(tmp_path / "missing")) is None
