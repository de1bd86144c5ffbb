"""bench/sdc.py end to end at its smallest: the audit on and off side by side, one flip found
within the audit interval, no false alarm on the clean steps."""

from __future__ import annotations

import json

from harness import bench


def test_sdc_bench_times_the_audit_and_finds_a_flip():
    r = bench("sdc.py", "--steps", "80", "--trials", "1", "--json", timeout=180)
    lines = r.stdout.splitlines()
    got = json.loads(lines[-1])
    assert got["audits"] > 0 and got["false_alarms"] == 0, got
    (latency,) = got["latencies"]
    assert latency is not None and 0 < latency <= 2 * got["every_on"], got
    assert any(ln.startswith("| audit on (default) |") for ln in lines), lines
