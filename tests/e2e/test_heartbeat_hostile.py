"""Issue 5: a worker's heartbeat file holds whatever the worker wrote (NaN, infinities, huge or
negative numbers, text): the daemon's reader takes only values in their range, and a daemon
whose worker writes such values keeps running and the job finishes."""

from __future__ import annotations

import json
import os
import time
import urllib.request

import pytest

from elasticd.worker import heartbeat
from harness import FAST, free_port, script, wait_until


def scrape(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
        return r.read().decode()


def events(d, name: str) -> list[dict]:
    return [e for e in d.events() if e.get("event") == name]


def no_traceback(d) -> None:
    err = d.stderr()
    assert "Traceback" not in err, err[-4000:]


def test_heartbeat_reader_keeps_only_values_in_their_range(tmp_path):
    """What a worker writes out of range (NaN, infinities, huge, negative, text bytes; a time
    ahead of the clock) is read as the last good value of that field, or as never written."""
    import math
    import struct

    path = str(tmp_path / "hb")
    heartbeat.create(path)
    w = heartbeat.Writer(path)
    w.beat(step=7)
    good = {
        "work_total": 1.5,
        "work_steps": 3.0,
        "resumed": 5.0,
        "saves": 2.0,
        "refresh_every": 4.0,
    }
    bad = {
        "save_stall_total": math.nan,
        "save_write_total": math.inf,
        "save_stall_last": -math.inf,
        "save_write_last": 1e300,
        "refreshes": -5.0,
        "refresh_total": float(2**60),
    }
    for name, value in {**good, **bad}.items():
        w.note(name, value)

    def poke(offset: int, data: bytes) -> None:
        fd = os.open(path, os.O_WRONLY)
        try:
            os.pwrite(fd, data, offset)
        finally:
            os.close(fd)

    poke(heartbeat.MARKS["pg_ready"], b"not-time")  # text where a time goes (3.8e180 as a f64)
    # ahead of the clock
    poke(heartbeat.MARKS["exiting"], struct.pack("<d", time.monotonic() + 3600))
    reader = heartbeat.Reader(path)
    b = reader.read()
    assert (b.beats, b.step, b.exiting, b.pg_ready) == (1, 7, 0.0, 0.0) and 0 < b.first <= b.last
    assert {name: b.figure(name) for name in good} == good
    assert all(b.figure(name) == 0.0 for name in bad), b.figures
    # a bad value later: the last good reading of that field stands
    w.note("saves", math.nan)
    poke(24, struct.pack("<d", math.nan))  # the latest beat's time
    again = reader.read()
    assert (again.beats, again.last, again.figure("saves")) == (1, b.last, 2.0)
    reader.close()
    # no good time ever: the rank has not beaten yet (not: silent since the host booted)
    fresh = heartbeat.Reader(path)
    assert (fresh.read().beats, fresh.read().last) == (0, 0.0)
    fresh.close()
    beat, dropped = heartbeat.sanitised(heartbeat.Beat(-3, -9, 1.0, 1.0), time.monotonic())
    assert (beat.beats, beat.step) == (0, -1) and {n for n, _ in dropped} == {"beats", "step"}


def test_hostile_heartbeat_values_leave_the_daemon_running_and_the_job_finishes(daemons):
    port = free_port()
    d = daemons(
        script("hostile_beat.py"),
        "--nproc-per-node",
        "1",
        *FAST,
        "--metrics-address",
        f"127.0.0.1:{port}",
        args=["1.5"],
    )
    wait_until(lambda: "step 5" in d.log_text(0), 60, what="the hostile worker beating")
    text = scrape(port)
    assert "elasticd_checkpoint_saves_total{" in text
    r = d.status("--json")
    assert r.returncode == 0 and json.loads(
        r.stdout, parse_constant=lambda c: pytest.fail(f"{c} in status")
    )
    assert d.wait(60) == 0, d.stderr()[-3000:]
    assert [
        e for e in events(d, "state") if e.get("new") == "RESTARTING"
    ]  # its first attempt crashed
    dropped = events(d, "heartbeat_value_dropped")
    assert dropped and len(dropped) == len(
        {(e["path"], e["field"]) for e in dropped}
    )  # once per field
    no_traceback(d)
