"""bench/detection.py end to end at its smallest: one crash under `elasticd run`, found and put on
the rank killed; the table lists every fault kind, those not run said so."""

from __future__ import annotations

import json

from harness import bench


def test_detection_bench_times_a_crash_and_prints_every_kind():
    args = ("--kinds", "crash", "--launchers", "elasticd", "--trials", "1", "--warmup", "0.5")
    r = bench("detection.py", *args, "--bound", "5", "--start-timeout", "25", "--json", timeout=40)
    lines = r.stdout.splitlines()
    (trial,) = json.loads(lines[-1])["crash"]["elasticd"]
    assert 0 < trial["seconds"] < 5 and trial["named"] == "rank 1" and trial["right"], trial
    rows = [ln for ln in lines if ln.startswith("| ")]
    assert rows[0].startswith("| fault | elasticd (defaults, --in-place off): detected after"), rows
    kinds = (
        "crash (",
        "hang in compute",
        "hang in a collective",
        "desync",
        "node kill (",
        "node kill, nodes in network namespaces",
        "partition",
    )
    assert [k for k in kinds if any(ln.startswith(f"| {k}") for ln in rows)] == list(kinds), rows
    assert sum("not run (--kinds)" in ln for ln in rows) == 6, rows


def test_overhead_times_the_flight_recorder_on_and_off():
    """--overhead at its smallest: both runs done, each with a time per op; the recorder's ring
    dumped where it is on (what answering the daemon's ask costs), empty where it is off."""
    r = bench("detection.py", "--overhead", "300", "--rounds", "1", timeout=120)
    got = json.loads(r.stdout.splitlines()[-1])
    assert got["us_per_op_recorder_on"] > 0 and got["us_per_op_recorder_off"] > 0, got
    assert got["entries_dumped"] > 0 and got["ask_answered_ms"] > 0, got
    assert "off: {" in r.stderr and "'entries': 0" in r.stderr, r.stderr
